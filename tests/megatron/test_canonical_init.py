"""Canonical random initialisation (``megatron/canonical_init.py``): the same seed gives the same full
weights at every layout (TP=2 with sequence parallelism, PP=2, EP=2, and TP=2 with a padded vocabulary
and tied embeddings), bit for bit, and the weights have Megatron's distributions. Megatron's own
initialisation, the control, differs between layouts."""
import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config

SEED = 11
LAYOUTS = {"tp2": dict(tensor_parallel=2, sequence_parallel=True), "pp2": dict(pipeline_parallel=2),
           "ep2": dict(expert_parallel=2)}
TIED = dict(vocab_size=97, tie_word_embeddings=True)  # 97: padded rows at TP=2


def _weights(rank, world_size, cases):
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.canonical_init import initialise_canonical
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel

    out = {}
    for name, layout, overrides, canonical in cases:
        config = tiny_moe_config(**overrides)
        parallel = ParallelConfig(**layout)
        initialize_model_parallel(parallel, seed=SEED)
        model = build_model(config, parallel)
        if canonical:
            initialise_canonical(model, config, SEED)
        out[name] = sharding.full_state_dict(model, config.vocab_size)
    return out


@pytest.fixture(scope="module")
def runs():
    single = run_distributed(_weights, 1, ([("single", {}, {}, True), ("tied", {}, TIED, True),
                                            ("megatron", {}, {}, False)],))[0]
    cases = [(name, layout, {}, True) for name, layout in LAYOUTS.items()]
    cases += [("tied_tp2", LAYOUTS["tp2"], TIED, True), ("megatron_pp2", LAYOUTS["pp2"], {}, False)]
    return single, run_distributed(_weights, 2, (cases,))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS) + ["tied_tp2"])
def test_every_layout_holds_the_same_weights(runs, layout):
    single, parallel = runs
    want = single["tied" if layout == "tied_tp2" else "single"]
    for rank in range(2):
        got = parallel[rank][layout]
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (layout, rank, name)


@pytest.mark.distributed
def test_megatron_initialisation_is_not_layout_independent(runs):
    """The control: without canonical init, PP=2 holds other weights than one process (same seed)."""
    single, parallel = runs
    differing = [n for n, t in single["megatron"].items() if not torch.equal(parallel[0]["megatron_pp2"][n], t)]
    assert differing


def test_distributions_are_megatrons():
    from gspo_megatron.megatron.canonical_init import canonical_tensor

    kw = dict(init_method_std=0.02, num_layers=8)
    big = canonical_tensor("decoder.layers.3.self_attention.linear_qkv.weight", (512, 256), seed=1, **kw)
    assert big.std().item() == pytest.approx(0.02, rel=0.02) and abs(big.mean().item()) < 1e-3
    proj = canonical_tensor("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight", (512, 256), seed=1, **kw)
    assert proj.std().item() == pytest.approx(0.02 / 4.0, rel=0.02)  # 0.02 / sqrt(2 * 8)
    assert torch.equal(canonical_tensor("decoder.final_layernorm.weight", (7,), seed=1, **kw), torch.ones(7))
    assert torch.equal(canonical_tensor("decoder.layers.0.self_attention.linear_qkv.bias", (7,), seed=1, **kw),
                       torch.zeros(7))
    again = canonical_tensor("decoder.layers.3.self_attention.linear_qkv.weight", (512, 256), seed=1, **kw)
    other_seed = canonical_tensor("decoder.layers.3.self_attention.linear_qkv.weight", (512, 256), seed=2, **kw)
    other_layer = canonical_tensor("decoder.layers.4.self_attention.linear_qkv.weight", (512, 256), seed=1, **kw)
    assert torch.equal(big, again) and not torch.equal(big, other_seed) and not torch.equal(big, other_layer)
