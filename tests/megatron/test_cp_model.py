"""Context parallelism through the real model and the trainer's policy: at CP = 2 on two gloo ranks the
logits, log-probs, gradients, GSPO metrics, optimizer steps and checkpoints equal the one-process ones
(``cp_workers.cp_suite``, one spawn). The pieces alone: test_context_parallel.py."""
import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config
from tests.megatron.cp_workers import cp_suite

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(cp_suite, 2, (tiny_moe_config(), str(tmp_path_factory.mktemp("cp_ckpt"))), timeout_s=880)


@pytest.mark.parametrize("layout", ["padded", "packed", "padded_blocks", "packed_blocks"])
def test_logits_and_gradients_at_cp2_equal_one_process(runs, layout):
    """Odd lengths crossing the chunk boundaries: padded rows under the causal mask by global position, and
    three sequences packed into one row (boundaries inside chunks) under their block-diagonal mask; both
    also with the queries in checkpointed blocks of 3 rows (``cp_attention.SCORE_BLOCK_BYTES``)."""
    for out in runs:
        ref, got = out["model"][layout]["ref"], out["model"][layout]["cp2"]
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=1e-5)
        assert set(got["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            assert g.abs().sum() > 0, name
            # fp32 sums in another order: measured |diff| <= 1e-6 of the tensor's largest element and
            # ||diff|| / ||g|| <= 1e-6; a missing K/V gradient reduce-scatter is off by O(1)
            scale = float(g.abs().max())
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=4e-6 * scale, msg=f"{layout} {name}")
            assert float((got["grads"][name] - g).norm() / g.norm()) < 1e-5, (layout, name)
    assert runs[0]["model"]["packed_differs"] > 1e-2  # the packed mask matters: attention stops at boundaries


@pytest.mark.parametrize("case", ["policy", "policy_entropy"])
def test_policy_logprobs_gradient_and_gspo_metrics_at_cp2(runs, case):
    """PolicyModel at CP = 2 (the trainer's path: padding to 2 CP chunks, split, per-sequence sums over CP,
    log-probs gathered back) against the same mini-batch on data-parallel ranks (== one process,
    test_policy_update.py)."""
    for out in runs:
        got, ref = out[case]["cp2"], out[case]["dp2"]
        for a, b in zip(got["old"], ref["old"]):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
        for a, b in zip(got["entropy"], ref["entropy"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-3, atol=1e-6, msg=f"{case} {name}")
        assert ref["metrics"]["clip_low_seqs"] + ref["metrics"]["clip_high_seqs"] > 0  # the clip is active
        for key in ("seqs", "tokens", "loss", "pg_loss", "clip_low_seqs", "clip_high_seqs", "seq_ratio_sum"):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), (case, key)


def test_optimizer_steps_at_cp2_equal_one_process(runs):
    got, ref = runs[0]["policy"]["cp2"], runs[0]["policy"]["dp2"]
    assert [s["update_skipped"] for s in got["steps"]] == [0.0, 0.0]
    for a, b in zip(got["steps"], ref["steps"]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("pair", [("cp2", "dp2"), ("dp2", "cp2")])
def test_training_state_checkpoint_moves_between_cp2_and_cp1(runs, pair):
    """Model + Adam state + LR schedule saved at CP = 2 continue at CP = 1 (DP = 2), and the other way."""
    for out in runs:
        r = out["checkpoint"][pair]
        assert r["lr"][0] == r["lr"][1]
        for name, w in r["expected"].items():
            torch.testing.assert_close(r["got"][name], w, rtol=1e-4, atol=1e-5, msg=f"{pair} {name}")


def test_routing_replay_r2_maps_positions_through_the_cp_chunks(runs):
    """R2 at CP = 2: the recorder puts every rank's chunks back in position order, the replay cuts the
    stored experts into the chunks again, and the update forward routes exactly as recorded."""
    from tests.megatron.test_policy_update import _per_sequence

    for out in runs:
        r = out["replay"]
        before, free, replayed = (_per_sequence(r[k], r["plan"], r["lengths"], last=True)
                                  for k in ("before", "free", "replayed"))
        assert any(not torch.equal(f, b) for f, b in zip(free, before))  # without replay, routing moved
        for got, want in zip(replayed, before):
            assert torch.equal(got, want)
