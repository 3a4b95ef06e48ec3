"""tools/slurm/memory_plan.py: parameter counts against the published model sizes, sharding arithmetic."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.slurm.cluster import REPO_ROOT

_PATH = REPO_ROOT / "tools" / "slurm" / "memory_plan.py"
_spec = importlib.util.spec_from_file_location("memory_plan", _PATH)
mp = importlib.util.module_from_spec(_spec)
sys.modules["memory_plan"] = mp  # dataclasses look their module up by name
_spec.loader.exec_module(mp)

GIB = 1024**3
PLAN_DEFAULTS = dict(tokens_per_microbatch=8192, recompute="full", gpu_mem_gib=80.0, sglang_tp=8,
                     sglang_mem_fraction=0.4)


@pytest.mark.parametrize("key, total_b, active_b", [
    ("qwen3-30b-a3b", 30.5, 3.3),      # the model card: 30.5B total, 3.3B activated
    ("qwen3-235b-a22b", 235.0, 22.0),  # 235B total, 22B activated
    ("qwen1.5-moe-a2.7b", 14.3, 2.7),  # 14.3B total, 2.7B activated (shared expert, q/k/v biases)
    ("moonlight-16b-a3b", 16.0, 3.0),  # "16B total, 3B activated" (MLA, a first dense layer, two shared experts)
])
def test_parameter_counts_match_the_model_cards(key: str, total_b: float, active_b: float) -> None:
    m = mp.MODELS[key]
    assert mp.total_params(m) / 1e9 == pytest.approx(total_b, abs=0.15)
    assert mp.active_params(m) / 1e9 == pytest.approx(active_b, abs=0.25)


def test_glm_4_5_air_counts() -> None:
    """GLM-4.5-Air: "106B total, 12B active"; the shapes give 106.85B without the MTP layer and 13.42B
    active, 12.18B of it outside the embedding and output (which the 12B appears to leave out)."""
    m = mp.MODELS["glm-4.5-air"]
    p = mp.param_counts(m)
    assert mp.total_params(m) / 1e9 == pytest.approx(106.0, abs=1.0)
    assert (mp.active_params(m) - p.embedding - p.output) / 1e9 == pytest.approx(12.0, abs=0.25)
    # by hand: 45 MoE layers of 128 experts, one dense layer of FFN 10944, one shared expert of 1408
    assert p.expert_total(m.moe_layers) == 45 * 128 * 3 * 4096 * 1408
    assert p.dense_mlp_per_layer == 3 * 4096 * 10944 and p.shared_per_layer == 3 * 4096 * 1408
    assert p.attention_per_layer == 4096 * 12288 + 12288 + 2 * (4096 * 1024 + 1024) + 12288 * 4096


def test_mla_attention_and_kv_cache_by_hand() -> None:
    m = mp.MODELS["moonlight-16b-a3b"]
    p = mp.param_counts(m)
    # q 2048 -> 16 x 192; kv down 2048 -> 512 + 64; kv up 512 -> 16 x (128 + 128); o 16 x 128 -> 2048
    assert p.attention_per_layer == 2048 * 3072 + 2048 * 576 + 512 * 4096 + 2048 * 2048
    assert p.kv_per_layer == 0 and p.replicated_per_layer == 2 * 2048 + 512
    # the latent and the rope key per layer, on every SGLang TP rank
    assert mp.kv_cache_bytes_per_token(m, 8) == 27 * 576 * 2


def test_tiny_shape_by_hand() -> None:
    m = mp.MoEShape("tiny", layers=2, hidden=8, q_heads=4, kv_heads=2, head_dim=2, experts=4, top_k=2,
                    expert_ffn=3, vocab=10)
    p = mp.param_counts(m)
    assert p.embedding == p.output == 80
    assert p.attention_per_layer == 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k+v, o
    assert p.kv_per_layer == 2 * 8 * 4
    assert p.replicated_per_layer == 2 * 8 + 2 * 2  # norms, q/k norms
    assert p.router_per_layer == 8 * 4
    assert p.experts_per_layer == 4 * 3 * 8 * 3
    assert mp.active_params(m) == p.dense_total(2) + 2 * 2 * 3 * 8 * 3


def test_one_gpu_holds_everything_with_18_bytes_per_param() -> None:
    m = mp.MODELS["qwen3-30b-a3b"]
    total = mp.total_params(m)
    pl = mp.plan(m, mp.Layout(gpus=1), **PLAN_DEFAULTS)
    assert pl.dense_params_per_gpu + pl.expert_params_per_gpu == pytest.approx(total)
    assert pl.states_gib * GIB == pytest.approx(18 * total)


def test_sharding_divides_each_part_by_its_group() -> None:
    m = mp.MODELS["qwen3-30b-a3b"]
    p = mp.param_counts(m)
    one = mp.plan(m, mp.Layout(gpus=1), **PLAN_DEFAULTS)
    pl = mp.plan(m, mp.Layout(gpus=32, tp=4, ep=8), **PLAN_DEFAULTS)
    assert pl.expert_params_per_gpu == pytest.approx(one.expert_params_per_gpu / 8)
    replicated = m.layers * (p.replicated_per_layer + p.router_per_layer) + p.final_norm
    assert pl.dense_params_per_gpu == pytest.approx((one.dense_params_per_gpu - replicated) / 4 + replicated)
    # distributed optimizer: dense shards over DP=8, experts over expert-DP=4
    expected_opt = 12 * pl.dense_params_per_gpu / 8 + 12 * pl.expert_params_per_gpu / 4
    assert pl.optimizer_gib * GIB == pytest.approx(expected_opt)


def test_pipeline_stage_holds_a_share_of_layers_and_one_of_embedding_or_output() -> None:
    m = mp.MODELS["qwen3-235b-a22b"]
    p = mp.param_counts(m)
    pl = mp.plan(m, mp.Layout(gpus=4, pp=4), **PLAN_DEFAULTS)
    assert pl.expert_params_per_gpu == 24 * p.experts_per_layer  # ceil(94 / 4) = 24 layers
    assert pl.dense_params_per_gpu == 24 * (p.attention_per_layer + p.replicated_per_layer + p.router_per_layer) \
        + p.embedding + p.final_norm


def test_the_worst_stage_holds_the_most_moe_layers() -> None:
    """GLM-4.5-Air at PP2: 23 layers a stage, the first holding the dense layer; the second (23 MoE) is worst."""
    m = mp.MODELS["glm-4.5-air"]
    p = mp.param_counts(m)
    pl = mp.plan(m, mp.Layout(gpus=2, pp=2), **PLAN_DEFAULTS)
    assert pl.expert_params_per_gpu == 23 * p.experts_per_layer
    assert pl.dense_params_per_gpu == 23 * (p.attention_per_layer + p.replicated_per_layer + p.router_per_layer
                                            + p.shared_per_layer) + p.embedding + p.final_norm


def test_tp_above_the_kv_groups_replicates_them() -> None:
    """TP=8 with 4 KV groups is allowed (each KV head on 2 ranks); the layout is accepted."""
    m = mp.MODELS["qwen3-30b-a3b"]
    p = mp.param_counts(m)
    tp4 = mp.plan(m, mp.Layout(gpus=8, tp=4, ep=8), **PLAN_DEFAULTS)
    tp8 = mp.plan(m, mp.Layout(gpus=8, tp=8, ep=8), **PLAN_DEFAULTS)
    kv = 2 * m.hidden * m.kv_heads * m.head_dim
    # q, o and the embeddings halve from TP=4 to TP=8; k, v stay at one KV group per rank.
    split_at_tp4 = m.layers * (p.attention_per_layer - kv) + p.embedding + p.output
    assert tp4.dense_params_per_gpu - tp8.dense_params_per_gpu == pytest.approx(split_at_tp4 / 4 - split_at_tp4 / 8)


def test_full_recompute_needs_less_than_none() -> None:
    m = mp.MODELS["qwen3-30b-a3b"]
    layout = mp.Layout(gpus=32, tp=4, ep=8)
    full = mp.plan(m, layout, **PLAN_DEFAULTS)
    none = mp.plan(m, layout, **{**PLAN_DEFAULTS, "recompute": "none"})
    assert none.activations_gib > 10 * full.activations_gib


@pytest.mark.parametrize("layout, message", [
    (dict(gpus=12, tp=8), "not a multiple of tp*pp*cp=8"),
    (dict(gpus=12, tp=6), "tp=6: Megatron-Core needs"),
    (dict(gpus=18, tp=3), "tp=3: Megatron-Core needs the 4 KV groups to be a multiple or a divisor of TP"),
    (dict(gpus=16, ep=3), "ep=3 does not divide the 128 experts"),
    (dict(gpus=8, ep=16), "not a multiple of ep*etp*pp=16"),
    (dict(gpus=8, tp=4, ep=8, etp=4), "gpus=8 is not a multiple of ep*etp*pp=32"),
])
def test_impossible_layouts_are_rejected(layout: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        mp.plan(mp.MODELS["qwen3-30b-a3b"], mp.Layout(**layout), **PLAN_DEFAULTS)


def test_cli_prints_the_table() -> None:
    run = subprocess.run([sys.executable, str(_PATH), "--model", "qwen3-30b-a3b", "--gpus", "32", "--tp", "4",
                          "--ep", "8", "--sglang-tp", "4"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "DP=8, expert-DP=4" in run.stdout and "30.53B params" in run.stdout
    bad = subprocess.run([sys.executable, str(_PATH), "--model", "qwen3-30b-a3b", "--gpus", "3", "--tp", "2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a multiple" in bad.stderr


def _qwen3_one_node(**kw):
    return mp.plan(mp.MODELS["qwen3-30b-a3b"], mp.Layout(8, tp=4, ep=8), **{**PLAN_DEFAULTS, "sglang_tp": 4, **kw})


def test_weight_sync_phase_holds_the_buckets_in_flight_beside_sglangs_weights() -> None:
    """Tensor sync: N buckets of the engine's bucket size alive on each trainer GPU (defaults 2 x 512 MiB,
    rollout.sglang.tensor_buckets_in_flight / bucket_bytes) while SGLang holds its weights (not its KV)."""
    pl = _qwen3_one_node()
    assert pl.sync_buckets_gib == pytest.approx(1.0)
    overhead = 4.0
    assert pl.sync_phase_gib == pytest.approx(pl.states_gib + pl.sglang_weights_gib + 1.0 + overhead)
    four = _qwen3_one_node(sync_buckets=4, sync_bucket_bytes=1024**3)
    assert four.sync_phase_gib - pl.sync_phase_gib == pytest.approx(3.0)
    assert pl.gpu_peak_gib == max(pl.train_phase_gib, pl.sync_phase_gib, pl.rollout_phase_gib)


def test_the_update_and_the_sync_peak_apart_when_the_cache_is_emptied() -> None:
    """The caching allocator keeps the update's activation peak reserved unless emptied: the trainer empties
    it after the update and after the sync, so the sync and rollout phases do not carry the activations
    (peak of the phases, not their sum); a trainer that never empties pays them in both."""
    emptied, kept = _qwen3_one_node(recompute="none"), _qwen3_one_node(recompute="none", empty_cache=False)
    cached = emptied.activations_gib + emptied.logits_gib
    assert cached > 10  # no recompute: a large update peak
    assert kept.sync_phase_gib == pytest.approx(emptied.sync_phase_gib + cached)
    assert kept.rollout_phase_gib == pytest.approx(emptied.rollout_phase_gib + cached)
    assert kept.train_phase_gib == emptied.train_phase_gib


def test_cpu_offload_moves_the_optimizer_share_to_the_host() -> None:
    """optimizer.cpu_offload_fraction f: f of the 12 B/param sharded master weights and moments leave the
    GPU; the host holds them and fp32 gradient copies (16 B per offloaded parameter)."""
    none, half, all_ = (_qwen3_one_node(cpu_offload_fraction=f) for f in (0.0, 0.5, 1.0))
    assert half.optimizer_gib == pytest.approx(none.optimizer_gib / 2)
    assert all_.optimizer_gib == 0 and none.optimizer_host_gib == 0
    assert all_.optimizer_host_gib == pytest.approx(none.optimizer_gib * 16 / 12)
    assert none.states_gib - all_.states_gib == pytest.approx(none.optimizer_gib)
    with pytest.raises(ValueError, match="cpu_offload_fraction"):
        _qwen3_one_node(cpu_offload_fraction=1.5)


def test_checkpoint_host_peak_is_every_held_parameters_states_per_rank() -> None:
    """fully_reshardable gathers, on every DP rank, the fp32 master weights and Adam moments of all the
    parameters that rank holds (12 B each, not divided by DP), beside its bf16 weights (2 B): Qwen3-30B-A3B
    on one node (TP4 EP8) holds ~4B parameters per GPU, ~52 GiB per rank, ~420 GiB per node."""
    pl = _qwen3_one_node()
    held = pl.dense_params_per_gpu + pl.expert_params_per_gpu
    assert pl.checkpoint_host_gib == pytest.approx(14 * held / GIB)
    assert 45 < pl.checkpoint_host_gib < 60 and pl.host_per_node_gib == pytest.approx(8 * pl.checkpoint_host_gib)
    offloaded = _qwen3_one_node(cpu_offload_fraction=0.75)
    assert offloaded.host_per_node_gib == pytest.approx(8 * (offloaded.optimizer_host_gib + offloaded.checkpoint_host_gib))


def test_cli_prints_the_sync_and_host_rows() -> None:
    out = subprocess.run([sys.executable, str(_PATH), "--model", "qwen3-30b-a3b", "--gpus", "8", "--tp", "4", "--ep", "8",
                          "--sglang-tp", "4", "--gpu-mem-gib", "74.5", "--cpu-offload-fraction", "0.75"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "peak, weight sync (2 x 512 MiB buckets" in out.stdout and "host per node (8 GPUs)" in out.stdout
