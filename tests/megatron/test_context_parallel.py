"""Context parallelism, the project's part: token split (Megatron's and TE's layouts) and the autograd-aware
all-reduce of per-sequence sums. Pure index tests, then one spawn of two gloo ranks (CP = 2) compared with
the unsplit computation (``routing_workers.context_parallel_checks``)."""
import pytest
import torch

from gspo_megatron.megatron import context_parallel as cp
from gspo_megatron.megatron.spawn import run_distributed
from tests.megatron.routing_workers import context_parallel_checks

ALGORITHMS = ["gspo", "gspo_token", "grpo"]


def test_chunk_indices_pair_early_and_late_chunks():
    assert cp.cp_chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp.cp_chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp.cp_chunk_indices(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cp.cp_chunk_indices(6, 1, 0).tolist() == list(range(6))
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size = 4"):
        cp.cp_chunk_indices(6, 2, 0)
    with pytest.raises(ValueError, match="cp_rank < cp_size"):
        cp.cp_chunk_indices(8, 2, 2)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_split_partitions_and_unsplit_inverts(cp_size):
    seq = 8 * cp_size
    x = torch.randn(3, seq, 5)
    shards = [cp.split_for_cp(x, 1, cp_size, r) for r in range(cp_size)]
    covered = torch.cat([cp.cp_chunk_indices(seq, cp_size, r) for r in range(cp_size)]).sort().values
    assert covered.tolist() == list(range(seq))  # every position exactly once
    assert torch.equal(cp.unsplit_from_cp(shards, 1), x)


def test_packed_split_follows_the_thd_rule():
    cu = torch.tensor([0, 3, 8, 9])
    cu_padded = cp.pad_cu_seqlens_for_cp(cu, 2)
    assert cu_padded.tolist() == [0, 4, 12, 16]  # lengths 3, 5, 1 rounded up to multiples of 4
    stream = cp.pad_packed(torch.arange(9), 0, cu, cu_padded, fill=-1)
    assert stream.tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1, -1, 8, -1, -1, -1]
    # per sequence, rank r holds chunks r and 2CP-1-r of length L_i / 4
    assert cp.packed_cp_indices(cu_padded, 2, 0).tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert cp.packed_cp_indices(cu_padded, 2, 1).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]
    shards = [cp.split_for_cp(stream, 0, 2, r, cu_seqlens_padded=cu_padded) for r in range(2)]
    assert torch.equal(cp.unsplit_from_cp(shards, 0, cu_seqlens_padded=cu_padded), stream)
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        cp.packed_cp_indices(cu, 2, 0)


@pytest.fixture(scope="module")
def runs():
    return run_distributed(context_parallel_checks, 2, ())


@pytest.mark.distributed
def test_split_equals_megatrons_get_batch_on_this_cp_rank(runs):
    for out in runs:
        assert out["cp_size"] == 2
        assert out["split_matches_megatron"] == {k: True for k in out["split_matches_megatron"]}
        assert out["gather_restores"] and out["packed"]["tokens_restored"]
    assert {out["cp_rank"] for out in runs} == {0, 1}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cp_loss_and_token_gradients_equal_unsplit(runs, layout, algorithm):
    for out in runs:
        r = out[layout][algorithm]
        torch.testing.assert_close(r["loss_sum"], r["ref_loss"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["grad"], r["ref_grad_split"], rtol=1e-5, atol=1e-8)
    # the gradient is not trivially zero on either rank
    assert all(out[layout][algorithm]["grad"].abs().sum() > 0 for out in runs)


@pytest.mark.distributed
def test_gathered_gradient_is_the_full_gradient(runs):
    for out in runs:
        r = out["padded"]["gspo"]
        torch.testing.assert_close(r["grad_gathered"], r["ref_grad"], rtol=1e-5, atol=1e-8)


@pytest.mark.distributed
def test_identity_backward_would_be_wrong(runs):
    """With share-weighted per-rank losses the adjoint of the all-reduce must be an all-reduce: an
    identity backward scales each rank's GSPO gradient by its share of the sequence's tokens."""
    for out in runs:
        r = out["padded"]["gspo"]
        assert (r["identity_backward_grad"] - r["ref_grad_split"]).abs().max() > 1e-4


@pytest.mark.distributed
def test_parameter_gradient_summed_over_cp_equals_unsplit(runs):
    for out in runs:
        p = out["param"]
        assert p["ref"].abs().sum() > 0
        torch.testing.assert_close(p["summed"], p["ref"], rtol=1e-5, atol=1e-7)
        assert (p["local"] - p["ref"]).abs().max() > 1e-4  # one rank alone holds only part of it


def test_cp_attention_mask_is_the_causal_mask_at_the_gathered_positions():
    """CP rank r's mask is the causal mask's rows at its query positions (the gathered keys, in rank order
    at ``gathered_positions``, are put back in position order), for the default (None) and for a given
    whole-sequence mask; a block reads its rows and the first keys."""
    from gspo_megatron.megatron.cp_attention import cp_attention_mask, gathered_positions

    full = torch.ones(12, 12, dtype=torch.bool).triu(1)
    keys = gathered_positions(6, 2)
    assert keys.tolist() == [0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8]
    for rank in range(2):
        rows = cp.cp_chunk_indices(12, 2, rank)
        want = full[rows]  # the keys are put in position order after the gather
        assert torch.equal(cp_attention_mask(None, 6, 2, rank)[0, 0], want)
        assert torch.equal(cp_attention_mask(full[None, None], 6, 2, rank)[0, 0], want)
        assert torch.equal(cp_attention_mask(None, 6, 2, rank, rows=slice(2, 5), keys=7)[0, 0], want[2:5, :7])
    with pytest.raises(ValueError, match="covers the whole sequence"):
        cp_attention_mask(full[:6, :6], 6, 2, 0)


def test_microbatch_split_cuts_positions_and_keeps_rows():
    mb = {"input_ids": torch.arange(16).view(2, 8), "advantages": torch.tensor([1.0, -1.0]), "indices": [3, 5],
          "routed_experts": torch.arange(2 * 8 * 3).view(2, 8, 3, 1)}
    part = cp.split_microbatch(mb, 2, 1)
    assert part["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(part["advantages"], mb["advantages"]) and part["indices"] == [3, 5]
    assert torch.equal(part["routed_experts"], mb["routed_experts"][:, 2:6])
    assert cp.cp_pad_multiple(2, 2) == 8 and cp.cp_pad_multiple(1, 2) == 2


def test_cp_config_is_accepted_and_what_has_not_run_is_refused_by_name():
    from pathlib import Path

    from gspo_megatron.megatron.model import transformer_config
    from gspo_megatron.megatron.parallel import ParallelConfig
    from gspo_megatron.testing.models import tiny_moe_config
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.typed_config import ConfigError

    demo = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
    assert load_config(demo, ["parallel.context_parallel=2"]).parallel.context_parallel == 2
    with pytest.raises(ConfigError, match=r"^model\.recompute: must be none with parallel\.context_parallel=2"):
        load_config(demo, ["parallel.context_parallel=2", "model.recompute=selective"])
    with pytest.raises(ConfigError, match=r"^parallel\.context_parallel: must be 1 for multi-latent attention"):
        load_config(demo, ["parallel.context_parallel=2", "model.config.architecture=deepseek_v3",
                           "model.config.kv_lora_rank=16", "model.config.qk_rope_head_dim=8", "model.config.num_key_value_heads=4",
                           "model.config.v_head_dim=16"])
    with pytest.raises(ConfigError, match=r"^parallel\.cp_comm_type: must be one of p2p, all_gather, a2a"):
        load_config(demo, ["parallel.context_parallel=2", "parallel.cp_comm_type=a2a+p2p"])
    # Transformer Engine's CP algorithm reaches Megatron's config (GPU); unused, and unset, at CP 1
    assert transformer_config(tiny_moe_config(), ParallelConfig(context_parallel=2, cp_comm_type="a2a")).cp_comm_type == "a2a"
    assert transformer_config(tiny_moe_config(), ParallelConfig()).cp_comm_type is None


@pytest.mark.distributed
def test_cp_attention_runs_without_the_torch_213_collective_names():
    """The lent GPU machines run torch 2.11 and setup.py admits 2.6: ``all_gather_single`` /
    ``reduce_scatter_single`` first appear in 2.13. With them removed from ``torch.distributed`` the CP = 2
    attention still runs, equal to the one-process attention, gradients included (the backward is the
    reduce-scatter)."""
    from tests.megatron.cp_workers import cp_attention_without_torch_213_names

    for out in run_distributed(cp_attention_without_torch_213_names, 2, ()):
        assert out["names_present"] == [False, False]
        torch.testing.assert_close(out["out"], out["ref_out"], rtol=1e-5, atol=1e-6)
        for got, want in zip(out["grads"], out["ref_grads"]):
            assert want.abs().sum() > 0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a2a_cp_needs_heads_per_tp_rank_divisible_by_cp():
    """Transformer Engine's all-to-all CP splits each TP rank's query heads and key/value groups over the CP
    ranks and asserts both divide (``attn_forward_func_with_cp``, A2A branch): refused at start-up by name.
    The demo has 4 query heads and 2 key/value groups."""
    from pathlib import Path

    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.typed_config import ConfigError

    demo = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
    a2a = "parallel.cp_comm_type=a2a"
    assert load_config(demo, ["parallel.context_parallel=2", a2a]).parallel.cp_comm_type == "a2a"  # 4 / 2, 2 / 2
    with pytest.raises(ConfigError, match=r"^parallel\.cp_comm_type: a2a needs .*parallel\.context_parallel=4, .*"
                                          r"model\.config\.num_key_value_heads=2 / parallel\.tensor_parallel=1"):
        load_config(demo, ["parallel.context_parallel=4", a2a])
    with pytest.raises(ConfigError, match=r"^parallel\.cp_comm_type: a2a needs .*parallel\.context_parallel=2, .*"
                                          r"num_key_value_heads=2 / parallel\.tensor_parallel=2 = 1"):
        load_config(demo, ["parallel.context_parallel=2", "parallel.tensor_parallel=2", a2a])
    # the other algorithms do not split heads
    assert load_config(demo, ["parallel.context_parallel=4"]).parallel.cp_comm_type == "p2p"
    assert load_config(demo, ["parallel.context_parallel=4", "parallel.cp_comm_type=all_gather"]).parallel.context_parallel == 4
