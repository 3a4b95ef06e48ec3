"""A reward model served by SGLang (``reward_model.server``): the term posts the token ids it builds to the
server's ``/classify`` and applies ``normalize`` to the logits it answers.

The real server (SGLang 0.5.23 on CPU, a tiny random ``Qwen3ForSequenceClassification`` saved by
transformers) runs in the ``sglang`` leg; its scores must equal the in-process term's on the same folder up to
the one constant an upstream defect adds (the test says which).
Here in every leg: a server that is down fails the batch, counted by the pool, and the run's config refuses a
malformed URL by name.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from gspo_megatron.data.tokenizer import demo_tokenizer_path
from gspo_megatron.rewards import RewardConfig, RewardPool
from gspo_megatron.typed_config import ConfigError, build

SAMPLES = [{"prompt": "sort 8 4 2", "answer": "2 4 8"}, {"prompt": "sort 3 1 2", "answer": "1 2 3"}]
RESPONSES = ["2 4 8", "8 4 2", "1 2 3", "a longer response that pads the batch 1 2 3", "", "3 2"]
BATCH = [(SAMPLES[i % 2], r) for i, r in enumerate(RESPONSES)]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served_rm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_tokenizer_path())
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    with torch.no_grad():  # a random head scores near 0 for everything: spread the scores so that a mix-up shows
        model.score.weight.mul_(20.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _scores(folder, **extra):
    rm = {"path": str(folder), "chat_template": False, "max_length": 64, "batch_size": 4, **extra}
    config = build(RewardConfig, {"terms": [{"name": "reward_model", "range": [-100, 100], "reward_model": rm}],
                                  "num_workers": 0, "timeout_s": 120}, "rewards")
    with RewardPool(config) as pool:
        return pool.score(BATCH)


def test_a_server_that_is_down_fails_the_batch_counted(reward_model):
    from tests.rollout.sglang_standin import free_port

    rewards, metrics = _scores(reward_model, server=f"http://127.0.0.1:{free_port()}", server_timeout_s=5.0)
    assert rewards == [0.0] * len(BATCH)
    assert metrics["rewards/reward_model/errors"] == len(BATCH)


@pytest.mark.parametrize("url", ["localhost:30000", "http://", "ftp://host:1", "http://host:1 x"])
def test_a_malformed_server_url_is_refused_by_name(reward_model, url):
    with pytest.raises(ConfigError, match=r"rewards.terms\[0\].reward_model.server: must be an http\(s\) URL"):
        _scores(reward_model, server=url)


def _served_scores(folder, tmp):
    """(rewards, metrics) of the batch scored by a real SGLang CPU server of ``folder``, stopped afterwards."""
    from gspo_megatron.rollout.sglang.config import SGLangConfig
    from gspo_megatron.rollout.sglang.engine import launch_servers
    from tests.rollout.sglang_cpu_models import cpu_launch

    (slot,) = launch_servers(build(SGLangConfig, {"launch": cpu_launch(folder, tmp), "release_memory": False},
                                   "rollout.sglang"))
    try:
        return _scores(folder, server=slot.url)
    finally:
        slot.process.stop()


def _needs_sglang(test):
    from tests.rollout.sglang_cpu_models import needs_sglang

    for mark in needs_sglang:
        test = mark(test)
    return test


@_needs_sglang
def test_served_scores_are_the_in_process_models_up_to_sglangs_random_score_bias(reward_model, tmp_path):
    """The served scores equal the in-process term's on the same folder up to one constant. The constant is an
    upstream defect pinned here: SGLang 0.5.23's ``Qwen3ForSequenceClassification``
    (``srt/models/qwen3_classification.py``) builds its head as ``nn.Linear(hidden, num_labels)`` with a
    bias, which transformers' head (``bias=False``) has not; the checkpoint holds no ``score.bias``, so the
    server keeps its random initial bias (|b| <= 1/sqrt(hidden)): every score is shifted by one constant per
    server start. If SGLang fixes it, the constant is 0 and this test still passes."""
    served, metrics = _served_scores(reward_model, tmp_path)
    local, _ = _scores(reward_model)
    assert metrics["rewards/reward_model/errors"] == 0
    assert max(local) - min(local) > 0.1  # the responses score differently: equal scores would prove nothing
    shift = [s - x for s, x in zip(served, local)]
    assert max(shift) - min(shift) < 1e-4, shift  # the same model and ids: only the constant differs
    assert abs(shift[0]) <= 1 / 64 ** 0.5 + 1e-4  # within nn.Linear's initial bias bound for hidden 64


@_needs_sglang
def test_a_zero_score_bias_in_the_checkpoint_removes_the_constant(reward_model, tmp_path):
    """The remedy docs/rewards.md gives: a ``score.bias`` of zeros saved in the checkpoint is loaded by the
    server, and the served scores then equal the in-process term's."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "with_bias"
    shutil.copytree(reward_model, folder)
    weights = load_file(folder / "model.safetensors")
    weights["score.bias"] = torch.zeros(weights["score.weight"].shape[0])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    served, _ = _served_scores(folder, tmp_path)
    local, _ = _scores(reward_model)
    assert served == pytest.approx(local, abs=1e-4)
