"""The SGLang engine against real SGLang 0.5.23 servers on CPU (``rollout.sglang.launch.device: cpu``).

Runs in the ``sglang`` leg of tools/run_tests.sh (GSPO_SGLANG_PYTHON names the SGLang venv's
interpreter) and skips elsewhere. Servers start once per class (35-170 s each, ~3.7 GB), at most two at
a time; every test that changes the served weights puts the originals back before it ends.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from gspo_megatron.rollout.sglang import engine as sglang_engine, weight_sync as sglang_weight_sync
from gspo_megatron.rollout.ahead import ThreadedEngine
from gspo_megatron.rollout.base import RolloutInputError, SamplingParams
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine, SGLangEngineError
from gspo_megatron.typed_config import build

from tests.rollout.sglang_conformance import SAME_TEXT, assert_same_shape, conformance_calls, raw_call
from tests.rollout.sglang_standin import StandinServer, StandinState
from tests.rollout.sglang_cpu_models import CONTEXT, EOS, VOCAB, hf_logprobs, launch_engine, needs_sglang, save_model

pytestmark = needs_sglang

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19], [20, 21, 22, 23, 24], [25]]
HEAD = "lm_head.weight"


def _max_gap(model_dir, prompts, samples, **kwargs) -> float:
    return max((torch.tensor(s.logprobs) - hf_logprobs(model_dir, prompts[s.prompt_index], s.response_ids,
                                                         **kwargs)).abs().max().item() for s in samples)


def _uniform(samples) -> bool:
    return all(abs(lp + math.log(VOCAB)) < 1e-4 for s in samples for lp in s.logprobs)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def _generate_urls(monkeypatch):
    """The server URL of every /generate the engine sends, in order."""
    urls: list[str] = []
    real = sglang_engine.request

    def recording(url, method, path, body=None, **kwargs):
        if path == "/generate":
            urls.append(url)
        return real(url, method, path, body, **kwargs)

    monkeypatch.setattr(sglang_engine, "request", recording)
    yield urls
    monkeypatch.setattr(sglang_engine, "request", real)


@pytest.fixture(scope="class")
def dense(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("tiny-qwen3"), moe=False)


@pytest.fixture(scope="class")
def pair(dense, tmp_path_factory):
    """Two CPU servers of the dense model behind one engine (tensor sync, 1 MiB buckets, one prompt per
    request so that a batch spreads over both)."""
    engine = launch_engine(dense, tmp_path_factory.mktemp("pair"), servers=2, bucket_bytes=1 << 20,
                           prompts_per_request=1, concurrent_requests_per_server=2)
    yield engine
    engine.shutdown()


class TestTwoDenseServers:
    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_logprobs_equal_transformers(self, pair, dense, temperature):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=0, top_p=1.0)
        samples = pair.generate(PROMPTS[:3], 2, params)
        assert [len(s.response_ids) for s in samples] == [len(s.logprobs) for s in samples]
        # SGLang reports log_softmax(logits / T) before top-k/top-p: the trainer's distribution (fp32 both sides)
        assert _max_gap(dense, PROMPTS, samples, temperature=temperature) < 1e-4

    def test_groups_stay_together_over_two_servers(self, pair, dense, monkeypatch):
        with _generate_urls(monkeypatch) as urls:
            samples = pair.generate(PROMPTS, 3, SamplingParams(max_new_tokens=6))
        assert [s.prompt_index for s in samples] == [i for i in range(len(PROMPTS)) for _ in range(3)]
        assert len(urls) == len(PROMPTS) and set(urls) == {s.url for s in pair.slots}  # one request per prompt, both used
        # the log-probs are those of each sample's own prompt: it was not mixed up with another group's
        assert _max_gap(dense, PROMPTS, samples) < 1e-4

    def test_stop_tokens_and_finish_reasons(self, pair):
        # a tenth of the vocabulary, near-uniform random model: a sample ends on a stop within 10 tokens
        # with p ~ 0.65, so 24 samples show both reasons (a third of it made all 24 stop in one run)
        stops = list(range(2, VOCAB, 10))
        samples = pair.generate(PROMPTS, 4, SamplingParams(max_new_tokens=10, stop_token_ids=stops, seed=0))
        reasons = {s.finish_reason for s in samples}
        assert reasons == {"stop", "length"}, reasons  # 24 samples: both happen
        for s in samples:
            ends = set(stops) | {EOS}  # the model's own EOS stops as well (ignore_eos is never sent)
            assert not ends & set(s.response_ids[:-1])
            if s.finish_reason == "stop":
                assert s.response_ids[-1] in ends  # the matched stop token is kept
            else:
                assert len(s.response_ids) == 10 and s.response_ids[-1] not in ends

    def test_over_long_prompt_is_refused_and_the_servers_stay_in_service(self, pair):
        # an input error (exit 2 in the trainer, no restart) naming both lengths, in SGLang's words
        with pytest.raises(RolloutInputError, match=rf"does not fit its context length: The input \({CONTEXT + 10} "
                                                    rf"tokens\) is longer than the model's context length \({CONTEXT} "
                                                    rf"tokens\)\. \(the longest prompt of the request has {CONTEXT + 10}"):
            pair.generate([[7] * (CONTEXT + 10)], 1, SamplingParams(max_new_tokens=4))
        with pytest.raises(RolloutInputError, match=rf"maximum context length of {CONTEXT} tokens\. You requested a "
                                                    rf"total of {CONTEXT + 2} tokens"):
            pair.generate([[7] * (CONTEXT - 2)], 1, SamplingParams(max_new_tokens=4))
        assert pair.healthy() and len(pair.generate(PROMPTS[:2], 1, SamplingParams(max_new_tokens=2))) == 2

    def test_tensor_sync_of_cpu_tensors_changes_the_served_weights_and_back(self, pair, dense):
        original = load_file(dense / "model.safetensors")
        params = SamplingParams(max_new_tokens=6)
        pair.update_weights([(HEAD, torch.zeros_like(original[HEAD]))], final=True)
        assert _uniform(pair.generate(PROMPTS[:2], 2, params))  # a zero head: every token has log-prob -log V
        pair.update_weights(sorted(original.items()), final=True)  # every tensor, 1 MiB buckets
        assert _max_gap(dense, PROMPTS, pair.generate(PROMPTS[:2], 2, params)) < 1e-4
        assert set(pair.server_states().values()) == {"ready"}

    def test_disk_sync_through_an_attached_engine(self, pair, dense, tmp_path):
        original = load_file(dense / "model.safetensors")
        cfg = build(SGLangConfig, {"urls": [s.url for s in pair.slots], "weight_sync": "disk",
                                   "disk_dir": str(tmp_path / "sync"), "disk_config_dir": str(dense)}, "rollout.sglang")
        with SGLangEngine.from_config(cfg) as disk:
            disk.update_weights([(n, torch.zeros_like(t) if n == HEAD else t) for n, t in original.items()], final=True)
            assert _uniform(disk.generate(PROMPTS[:2], 2, SamplingParams(max_new_tokens=4)))
            disk.update_weights(original.items(), final=True)
            assert _max_gap(dense, PROMPTS, disk.generate(PROMPTS[:2], 2, SamplingParams(max_new_tokens=4))) < 1e-4
            assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["weights-v2"]  # the older one removed

    def test_submitted_generation_finishes_on_the_old_weights_before_a_sync(self, pair, dense):
        head = load_file(dense / "model.safetensors")[HEAD]
        threaded = ThreadedEngine(pair)  # what the overlapped schedule drives (not shut down: pair is shared)
        ahead = threaded.submit(PROMPTS, 2, SamplingParams(max_new_tokens=16))
        threaded.update_weights([(HEAD, torch.zeros_like(head))], final=True)  # waits for the submitted generation
        early = threaded.result(ahead)
        assert _max_gap(dense, PROMPTS, early.samples) < 1e-4  # sampled entirely from the weights before the sync
        assert _uniform(pair.generate(PROMPTS[:2], 1, SamplingParams(max_new_tokens=4)))
        pair.update_weights([(HEAD, head)], final=True)

    def test_the_stand_in_answers_like_the_real_server(self, pair):
        """Conformance: the same calls to the stand-in and to a real server give the same status codes, and
        every field the stand-in answers is one the real server answers too (same JSON type)."""
        real_url = pair.slots[0].url
        differences = []  # every call is made, so one run lists all of them
        with StandinServer(StandinState(vocab=VOCAB, memory_saver=False, context_length=CONTEXT)) as standin:
            for what, method, path, body in conformance_calls(CONTEXT):
                real, fake = raw_call(real_url, method, path, body), raw_call(standin.url, method, path, body)
                if real[0] != fake[0] or (what in SAME_TEXT and real[1] != fake[1]):
                    differences.append(f"{what}: real server {real[0]} {real[1]!r:.300}, stand-in {fake[0]} {fake[1]!r:.300}")
                    continue
                try:
                    assert_same_shape(fake[1], real[1], what)
                except AssertionError as err:
                    differences.append(str(err))
        assert not differences, "\n".join(differences)
        assert pair.healthy()

    def test_a_killed_server_is_restarted_stale_and_back_after_a_full_sync(self, pair, dense, monkeypatch):
        original = load_file(dense / "model.safetensors")
        pair.update_weights(sorted(original.items()), final=True)  # weights v>0: a fresh server is stale
        victim, survivor = pair.slots
        pid = victim.process.pid
        threaded = ThreadedEngine(pair)
        ahead = threaded.submit(PROMPTS * 4, 2, SamplingParams(max_new_tokens=48))
        time.sleep(1.0)
        os.killpg(pid, signal.SIGKILL)  # the server and its scheduler / detokenizer, mid-rollout
        samples = threaded.result(ahead).samples  # the lost requests are retried on the survivor
        assert len(samples) == len(PROMPTS) * 4 * 2 and _max_gap(dense, PROMPTS * 4, samples[:6]) < 1e-4
        assert victim.process.pid != pid and victim.process.alive() and victim.restarts == 1
        assert pair.server_states()[victim.url].startswith("stale")
        with _generate_urls(monkeypatch) as urls:
            pair.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))
        assert set(urls) == {survivor.url}  # the restarted server holds the launch weights: no rollouts
        pair.update_weights(sorted(original.items()), final=True)
        assert set(pair.server_states().values()) == {"ready"}
        with _generate_urls(monkeypatch) as urls:
            samples = pair.generate(PROMPTS, 1, SamplingParams(max_new_tokens=4))
        assert set(urls) == {victim.url, survivor.url} and _max_gap(dense, PROMPTS, samples) < 1e-4

    def test_shutdown_leaves_no_server_process(self, pair):
        groups = [s.process.pid for s in pair.slots]
        pair.shutdown()
        for pgid in groups:
            # SIGKILLed children (scheduler, detokenizer) are reparented and reaped by init, not by us: give
            # that a few seconds, then no process of the server's group may be left
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and _group_exists(pgid):
                time.sleep(0.5)
            assert not _group_exists(pgid), f"processes of server group {pgid} outlived shutdown"


class TestMoEServer:
    def test_moe_logprobs_and_a_full_tensor_sync_from_other_weights(self, tmp_path_factory):
        first = save_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), moe=True, seed=0)
        other = save_model(tmp_path_factory.mktemp("tiny-qwen3-moe-b"), moe=True, seed=1)
        with launch_engine(first, tmp_path_factory.mktemp("moe"), bucket_bytes=1 << 20) as engine:
            params = SamplingParams(max_new_tokens=8, temperature=0.7)
            assert _max_gap(first, PROMPTS, engine.generate(PROMPTS[:3], 2, params), temperature=0.7) < 1e-4
            # every tensor of another model (experts, router, norms) by tensor sync: the server now computes it
            engine.update_weights(sorted(load_file(other / "model.safetensors").items()), final=True)
            assert _max_gap(other, PROMPTS, engine.generate(PROMPTS[:3], 2, params), temperature=0.7) < 1e-4
