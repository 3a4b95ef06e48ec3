"""Weight sync from the live, sharded Megatron policy into the transformers rollout engine, on two gloo ranks.

Each rank builds the policy with canonical weights at EP=2, TP=2, PP=2 or TP=2+EP=2 (ETP=1) and an engine
with its *own* random weights; after ``sync_weights`` every rank's engine gives the Megatron model's per-token log-probs
(teacher forced, and for samples drawn by the engine's decode loop) at fp32 tolerance. Before the sync the
engine's log-probs are far from Megatron's, so the comparison can fail.
"""
import pytest
import torch

from gspo_megatron.megatron.parallel import ParallelConfig
from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config
from tests.conversion.hf_models import family_config

from tests.rollout.weight_sync_workers import SMALL_BUCKET_BYTES, SyncCase, sync_cases

FP32_ATOL = 1e-5
DEFAULT_BUCKET_BYTES = 64 * 1024  # a few buckets for these tiny models

CASES = [
    SyncCase("qwen3_moe_ep2", tiny_moe_config(), ParallelConfig(expert_parallel=2), DEFAULT_BUCKET_BYTES),
    SyncCase("qwen3_moe_tp2", tiny_moe_config(), ParallelConfig(tensor_parallel=2), DEFAULT_BUCKET_BYTES),
    SyncCase("qwen3_moe_pp2", tiny_moe_config(), ParallelConfig(pipeline_parallel=2), DEFAULT_BUCKET_BYTES),
    # dense weights gathered over TP2, whole experts (ETP1) broadcast from their EP rank of the same two ranks
    SyncCase("qwen3_moe_tp2_ep2_etp1", tiny_moe_config(),
             ParallelConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1), DEFAULT_BUCKET_BYTES),
    # dense family; vocab 95 is not a multiple of TP, so the padding row must be dropped on export
    SyncCase("qwen3_dense_tp2", tiny_moe_config(architecture="qwen3", num_experts=0, ffn_hidden_size=48,
                                                vocab_size=95), ParallelConfig(tensor_parallel=2),
             DEFAULT_BUCKET_BYTES),
    # tied embeddings split over two pipeline stages (embedding on the first, output layer on the last)
    SyncCase("llama_tied_pp2", tiny_moe_config(architecture="llama", num_experts=0, ffn_hidden_size=48,
                                               qk_layernorm=False, tie_word_embeddings=True),
             ParallelConfig(pipeline_parallel=2), DEFAULT_BUCKET_BYTES),
    # Qwen2-MoE: q/k/v biases, top-3 of 6 experts without renormalisation, a shared expert with its gate
    SyncCase("qwen2_moe_ep2", family_config("qwen2_moe"), ParallelConfig(expert_parallel=2), DEFAULT_BUCKET_BYTES),
    SyncCase("qwen2_moe_tp2", family_config("qwen2_moe"), ParallelConfig(tensor_parallel=2), DEFAULT_BUCKET_BYTES),
    # GLM-4.5: a dense first layer, sigmoid router with expert bias (a Megatron buffer, synced as HF's
    # e_score_correction_bias), shared expert, half-rotary heads; PP=2 splits dense and MoE layers unevenly
    SyncCase("glm4_moe_ep2", family_config("glm4_moe"), ParallelConfig(expert_parallel=2), DEFAULT_BUCKET_BYTES),
    SyncCase("glm4_moe_pp2", family_config("glm4_moe"), ParallelConfig(pipeline_parallel=2), DEFAULT_BUCKET_BYTES),
    # DeepSeek-V3: multi-latent attention (q latent, interleaved rope dims), dense first layer, sigmoid router
    # with expert bias, two shared experts; TP=2 splits the latent down-projections' rows
    SyncCase("deepseek_v3_tp2", family_config("deepseek_v3"), ParallelConfig(tensor_parallel=2), DEFAULT_BUCKET_BYTES),
    SyncCase("deepseek_v3_ep2", family_config("deepseek_v3"), ParallelConfig(expert_parallel=2), DEFAULT_BUCKET_BYTES),
    # YaRN RoPE (the engine runs transformers' own YaRN cos/sin and softmax scale)
    SyncCase("deepseek_v3_yarn_tp2", family_config("deepseek_v3_yarn"), ParallelConfig(tensor_parallel=2),
             DEFAULT_BUCKET_BYTES),
]
NAMES = [c.name for c in CASES]


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(sync_cases, 2, (CASES,))


def _max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_engine_matches_megatron_after_sync_only(ranks, name):
    for rank in range(2):
        out = ranks[rank][name]
        assert _max_gap(out["before"], out["megatron"]) > 0.1, "the random engine already matched Megatron"
        gap = _max_gap(out["after"], out["megatron"])
        assert gap <= FP32_ATOL, f"rank {rank}: teacher-forced gap {gap:.2e} after sync"
    # the engines started from different weights on the two ranks and end with the same ones
    assert _max_gap(ranks[0][name]["before"], ranks[1][name]["before"]) > 0.01
    for key, value in ranks[0][name]["state_first"].items():
        assert torch.equal(value, ranks[1][name]["state_first"][key]), key


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_sampled_logprobs_match_megatron_recomputation(ranks, name):
    """The engine's decode loop (KV cache, batched rows) reports what Megatron recomputes for the same
    tokens: the train/rollout log-prob gap is numerics only."""
    for rank in range(2):
        out = ranks[rank][name]
        assert len(out["sample_logprobs"]) == 6 and all(lp.numel() == 6 for lp in out["sample_logprobs"])
        gap = _max_gap(out["sample_logprobs"], out["recomputed"])
        assert gap <= FP32_ATOL, f"rank {rank}: sampled-token gap {gap:.2e}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_bucketing(ranks, name):
    """Buckets respect the bound (a larger tensor travels alone), only the last is final, every required
    checkpoint name is sent exactly once, and tiny buckets give the same weights bit for bit."""
    out = ranks[0][name]
    for calls, bound in ((out["calls"], DEFAULT_BUCKET_BYTES), (out["calls_small"], SMALL_BUCKET_BYTES)):
        assert [c["final"] for c in calls] == [False] * (len(calls) - 1) + [True]
        assert all(c["bytes"] <= bound or len(c["names"]) == 1 for c in calls)
        sent = [n for c in calls for n in c["names"]]
        assert len(sent) == len(set(sent))
        assert set(sent) == set(out["required_names"])
    assert len(out["calls"]) >= 2
    assert len(out["calls_small"]) > 4 * len(out["calls"])
    assert any(c["bytes"] > SMALL_BUCKET_BYTES and len(c["names"]) == 1 for c in out["calls_small"])
    for key, value in out["state_first"].items():
        assert torch.equal(value, out["state_small"][key]), key
    # the same names in the same order on both ranks (the export is a collective)
    assert ranks[1][name]["calls"] == out["calls"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_weight_version_bumps_once_per_sync(ranks, name):
    for rank in range(2):
        out = ranks[rank][name]
        assert out["version_after_first"] == 1
        assert out["version_small"] == 1  # many buckets, still one version
        assert out["version_after_second"] == 2
        assert out["states_equal_after_second"]
        assert len(out["calls_second"]) == len(out["calls"])


@pytest.mark.slow
@pytest.mark.distributed
def test_sync_metrics(ranks):
    out = ranks[0]["qwen3_moe_ep2"]
    stats = out["stats"]
    assert stats["sync_bytes"] == sum(c["bytes"] for c in out["calls"])
    assert stats["sync_bytes"] == sum(v.numel() * v.element_size() for v in out["state_first"].values())
    assert stats["sync_s"] > 0 and stats["sync_bytes_per_s"] == pytest.approx(stats["sync_bytes"] / stats["sync_s"])
