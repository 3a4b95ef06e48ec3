"""Partial rollouts (rollout/partial.py, issue #30) against a real SGLang 0.5.23 server on CPU: the pool drives
``SGLangEngine.generate`` over steps whose weights the engine's own tensor sync changes, and the CPU demo
trains with ``rollout.partial`` on the same server (sglang leg of tools/run_tests.sh; skipped elsewhere).

One server for the file (35-170 s, ~3.7 GB): a random Qwen3-MoE of the demo's shape (examples/
cpu_demo_sglang.yaml's ``model.config``), so that the engine-level test can sync its own weight versions
into it and the trainer, attached by URL, can sync the demo's. The tests run in file order; the last one
stops the server.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from gspo_megatron.rollout.sglang import engine as sglang_engine
from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.partial import PartialRollouts

from tests.rollout.sglang_cpu_models import launch_engine, needs_sglang, server_processes

pytestmark = needs_sglang

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu_demo_sglang.yaml"
VERSIONS = 4  # weight versions the engine-level test serves, one per step
BUDGET, MAX_NEW = 3, 8  # a response runs over ceil(8 / 3) = 3 steps: 3 + 3 + 2 tokens
TOLERANCE = 1e-4  # |server - transformers| of a segment's log-probs, fp32 both sides (measured: <= 1.9e-6)
OTHER_WEIGHTS_GAP = 1e-3  # the least any segment must differ from another version's log-probs (measured: >= 3.8e-2)


def _demo_model_config():
    from gspo_megatron.trainer.config import load_config

    return load_config(DEMO, []).model.config


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> list[Path]:
    """HF folders of the weight versions 0..3 of the demo's model: version 0 random with lm_head x 8 (the
    random init's head is near uniform; a larger one gives peaked, distinguishable log-probs), each next
    one the previous with every parameter moved by 0.02 * N(0, 1): the init's own scale, so that no
    segment's log-probs could pass for another version's."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf_config = _demo_model_config().to_hf_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    folders = []
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for v in range(VERSIONS):
            if v:
                gen = torch.Generator().manual_seed(v)
                for p in model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=gen))
            folder = tmp_path_factory.mktemp(f"demo-moe-v{v}")
            model.save_pretrained(folder)
            GenerationConfig().save_pretrained(folder)  # no EOS: only the test's stop tokens end a response
            folders.append(folder)
    return folders


@pytest.fixture(scope="module")
def server(versions, tmp_path_factory):
    """One CPU server of version 0 (the demo's context, 128 positions: no --context-length), labelled "0":
    its answers then name the version they came from (meta_info.weight_version; SGLang's own is "default")."""
    engine = launch_engine(versions[0], tmp_path_factory.mktemp("partial"),
                           launch={"extra_args": ["--weight-version", "0"]}, bucket_bytes=1 << 20)
    yield engine
    engine.shutdown()


def _teacher_forced(model, context: list[int], tokens: list[int]) -> torch.Tensor:
    """[n] log pi(tokens | context + the tokens before each), one fp32 forward of transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([context + tokens])).logits[0, len(context) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_partial_responses_continue_on_the_server_under_each_synced_version(server, versions, monkeypatch):
    """Four steps of budget 3 on max_new_tokens 8 (the prompts of steps 0 and 1 each finish two steps
    later), the served weights replaced by the engine's tensor sync after every step. Every segment's
    log-probs are the teacher-forced log-probs of its own version's weights given the prompt and the
    earlier segments, and not those of any other version: a server that kept old weights, or reused a
    prefix's KV cache computed under them, fails here. Each continuation was sent as prompt + response so
    far in ``input_ids``."""
    from transformers import AutoModelForCausalLM

    stops = list(range(3, 100, 17))  # 6 of 100 tokens: most responses run to 8 tokens, some stop
    prompts = [SimpleNamespace(index=i, prompt_ids=p)
               for i, p in enumerate([[5, 17, 3], [40, 41, 42, 43], [9], [60, 61, 62], [70, 8]])]
    pool = PartialRollouts(samples_per_prompt=3, budget=BUDGET, max_new_tokens=MAX_NEW, max_staleness=2)
    sent, answers = [], []  # every /generate row: (input_ids, max_new_tokens); the server's meta_info
    real = sglang_engine.request

    def recording(url, method, path, body=None, **kwargs):
        response = real(url, method, path, body, **kwargs)
        if path == "/generate":
            sent.extend((tuple(ids), sp["max_new_tokens"])
                        for ids, sp in zip(body["input_ids"], body["sampling_params"]))
            answers.extend(out["meta_info"] for out in response)
        return response

    def generate(prompt_ids, g, params):  # like Trainer._generate: a round's empty call reaches no engine
        return server.generate(prompt_ids, g, params) if prompt_ids else []

    monkeypatch.setattr(sglang_engine, "request", recording)
    trained = []
    for step in range(VERSIONS):
        assert server.weight_version == step and set(server.server_states().values()) == {"ready"}
        if step < 2:
            pool.add(prompts[:3] if step == 0 else prompts[3:], first_slot=3 * step, step=step)
        params = SamplingParams(max_new_tokens=MAX_NEW, seed=100 + step, stop_token_ids=stops, prompt_offset=3 * step)
        pool.generate_round(generate, params, version=server.weight_version, round_index=0)
        finished, _, oldest = pool.take_finished(version=server.weight_version)
        assert oldest <= 2
        trained += finished
        if step + 1 < VERSIONS:  # the next version, every tensor, 1 MiB buckets: the real sync
            server.update_weights(sorted(load_file(versions[step + 1] / "model.safetensors").items()), final=True)
    monkeypatch.setattr(sglang_engine, "request", real)
    assert not pool.groups and len(trained) == len(prompts)
    responses = [(g, r) for g in trained for r in g.responses]
    spans = [len({s.version for s in r.segments}) for _, r in responses]
    assert max(spans) == 3, spans  # some response was written by three weight versions

    expected_rows = collections.Counter()
    for g, r in responses:
        ids = list(g.prompt.prompt_ids)
        if r.finish_reason == "stop":  # the stop token is kept, and none came before it
            assert r.token_ids[-1] in stops and len(r) <= MAX_NEW, r.token_ids
        else:
            assert r.finish_reason == "length" and len(r) == MAX_NEW, (r.finish_reason, r.token_ids)
        assert not set(stops) & set(r.token_ids[:-1]), r.token_ids
        expected_rows[(tuple(ids), BUDGET)] += 1  # the fresh sample
        for s in r.segments[:-1]:  # every later segment: a row of prompt + the response so far
            ids += s.token_ids
            expected_rows[(tuple(ids), min(BUDGET, MAX_NEW - (len(ids) - len(g.prompt.prompt_ids))))] += 1
    assert collections.Counter(sent) == expected_rows
    # the server's own account of the weights each answer came from (meta_info.weight_version, the label the
    # tensor sync's final bucket set), over the answers in order: versions only ever rise, all four served
    served = [int(m["weight_version"]) for m in answers]
    assert served == sorted(served) and set(served) == set(range(VERSIONS)), served

    models = [AutoModelForCausalLM.from_pretrained(v, dtype=torch.float32).eval() for v in versions]
    gaps, others = [], []
    for g, r in responses:
        context = list(g.prompt.prompt_ids)
        for s in r.segments:
            got = torch.tensor(s.logprobs)
            by_version = [_teacher_forced(m, context, list(s.token_ids)) for m in models]
            gaps.append((got - by_version[s.version]).abs().max().item())
            others.append(min((got - lp).abs().max().item() for v, lp in enumerate(by_version) if v != s.version))
            context += s.token_ids
    print(f"segments {len(gaps)}: max |server - own version| {max(gaps):.2e}, "
          f"min over segments of min |server - other version| {min(others):.2e}")
    assert max(gaps) < TOLERANCE, max(gaps)
    assert min(others) > OTHER_WEIGHTS_GAP, min(others)


def test_the_demo_trains_with_partial_rollouts_on_the_server(server, versions, tmp_path):
    """examples/cpu_demo_sglang.yaml with rollout.partial (budget 4 of 8 tokens), 3 GSPO steps, the trainer
    attached by URL to this file's server (its model has the demo's shape; the trainer syncs its own
    weights before the first rollout). Launching and stopping a server from the trainer is
    tests/trainer/test_sglang_cpu_train.py's; here the partial responses are the point.

    The demo's tensor sync: the trainer shares CPU tensors with a server that outlives it, so torch's
    torch_shm_manager lives on after the trainer; this subprocess.run returning shows it no longer holds
    the trainer's stderr (it used to, until the server stopped: docs/rollout.md, "SGLang on CPU")."""
    url = server.slots[0].url
    overrides = ["rollout.sglang.launch=null", f"rollout.sglang.urls=[{url}]", "rollout.partial=true", "rollout.partial_token_budget=4", "rollout.logprobs_from=engine",
                 "train.steps=3", "sft.steps=20", "eval.every_steps=0", "checkpoint.every_steps=0",
                 "logging.console=false", "logging.tensorboard=false"]
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO),
           "--run-dir", str(tmp_path / "run"), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    steps = metrics[1:]
    print([{k: m[k] for k in m if k.startswith("partial/")} for m in steps])
    # the sort task's answers are 7 tokens: a budget of 4 carries nearly every response into the next step,
    # where it finishes under the weights of one more update
    assert all(m["partial/carried_responses"] > 0 for m in steps)
    assert max(m["partial/multi_version_responses"] for m in steps) > 0
    assert max(m["partial/max_token_age"] for m in steps) == 1.0
    assert all(m["staleness"] == m["partial/max_token_age"] for m in steps)
    assert server.healthy()  # the trainer's engine does not stop a server it attached to


def test_shutdown_leaves_no_server_process(server):
    port = server.slots[0].url.rsplit(":", 1)[1]
    server.shutdown()
    # SIGKILLed children are reparented and reaped by init, not by us: give that a few seconds
    deadline = time.monotonic() + 15.0
    while (left := server_processes(port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"server processes left after shutdown: {left}"
