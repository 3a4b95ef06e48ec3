"""A reward model and a judge served by SGLang (``reward_model.server``, ``judge.server``): the reward-model term
posts the token ids it builds to the server's ``/classify`` and applies ``normalize`` to the logits it answers;
the judge term sends its prompts' ids to ``/generate`` and parses the greedy verdicts.

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


# ---- a generative judge served by SGLang (judge.server) --------------------------------------------------

JUDGE = {"template": "Is {response} the sorted digits of {prompt}?", "chat_template": False,
         "pattern": "([0-9])", "test_verdict": "7", "max_new_tokens": 6, "batch_size": 4}


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    """A tiny random Qwen3 causal LM on the demo tokenizer, its head sharpened so that greedy decoding has no
    near ties (a tie could be broken differently by two correct engines)."""
    folder = tmp_path_factory.mktemp("served_judge")
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_tokenizer_path())
    torch.manual_seed(1)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _judged(folder, **extra):
    """(verdict texts of the batch, its (rewards, metrics) through the pool) with the judge in ``folder``."""
    from gspo_megatron.rewards.config import JudgeConfig
    from gspo_megatron.rewards.scoring_models import JudgeTerm, judge_prompt_ids

    judge = {"path": str(folder), **JUDGE, **extra}
    term = JudgeTerm(build(JudgeConfig, judge, "judge"), "judge")
    texts = term.verdicts([judge_prompt_ids(term.tokenizer, term.cfg, s, r) for s, r in BATCH])
    with RewardPool(_judge_rewards(folder, **extra)) as pool:
        return texts, pool.score(BATCH)


def _judge_rewards(folder, **extra):
    judge = {"path": str(folder), **JUDGE, **extra}
    return build(RewardConfig, {"terms": [{"name": "judge", "range": [0, 9], "judge": judge}], "num_workers": 0,
                                "timeout_s": 120}, "rewards")


def test_a_judge_server_that_is_down_fails_the_batch_counted(judge_model):
    from tests.rollout.sglang_standin import free_port

    config = _judge_rewards(judge_model, server=f"http://127.0.0.1:{free_port()}", server_timeout_s=5.0)
    with RewardPool(config) as pool:
        rewards, metrics = pool.score(BATCH)
    assert rewards == [0.0] * len(BATCH)
    assert metrics["rewards/judge/errors"] == len(BATCH)


def test_a_malformed_judge_server_url_is_refused_by_name(judge_model):
    with pytest.raises(ConfigError, match=r"rewards.terms\[0\].judge.server: must be an http\(s\) URL"):
        _judge_rewards(judge_model, server="localhost:30000")


@_needs_sglang
def test_served_verdicts_are_the_in_process_judges(judge_model, tmp_path):
    """The same judge folder served by a real SGLang 0.5.23 CPU server: the same greedy verdict texts as the
    in-process engine, batch for batch, and the same scores and failure counts through the pool."""
    from gspo_megatron.rollout.sglang.config import SGLangConfig
    from gspo_megatron.rollout.sglang.engine import launch_servers
    from tests.rollout.sglang_cpu_models import cpu_launch

    local_texts, (local, local_metrics) = _judged(judge_model)
    assert len(set(local_texts)) > 1  # verdicts that differ: equal ones would prove little
    (slot,) = launch_servers(build(SGLangConfig, {"launch": cpu_launch(judge_model, tmp_path), "release_memory": False},
                                   "rollout.sglang"))
    try:
        texts, (served, metrics) = _judged(judge_model, server=slot.url)
    finally:
        slot.process.stop()
    assert texts == local_texts
    assert served == local and metrics["rewards/judge/errors"] == local_metrics["rewards/judge/errors"]
