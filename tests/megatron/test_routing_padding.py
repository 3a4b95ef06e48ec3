"""Padding and the MoE routers: ``GPTModel.forward(padding_mask=...)`` reaches the routers on every layer spec,
and keeps padded tokens out of the load-balancing (aux) loss (megatron-core 0.16.1, transformer/moe/router.py).

The aux-loss check runs the real local-spec model in one spawned gloo process; the Transformer Engine spec
cannot be built without CUDA, so its call into the model is checked with a recording stand-in for the chunk."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config


class _RecordingChunk:
    """Stands for the model chunk the schedule hands ``forward_step``: keeps the arguments of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return None


def _policy_stub(layer_spec: str, expert_bias: bool, *, pp_size=1, pp_rank=0, tp_size=1, tp_rank=0):
    """The attributes ``PolicyModel._forward`` / ``_padding_mask`` read, for a model built on ``layer_spec``."""
    from gspo_megatron.megatron.policy_model import PolicyModel

    groups = SimpleNamespace(cp_size=1, pp_size=pp_size, pipeline=None, tp_size=tp_size, tp_rank=tp_rank,
                             sequence_parallel="tp" if tp_size > 1 else None)
    stub = SimpleNamespace(layer_spec=layer_spec, groups=groups,
                           module=SimpleNamespace(config=SimpleNamespace(moe_router_enable_expert_bias=expert_bias)))
    stub._padding_mask = lambda mask: PolicyModel._padding_mask(stub, mask)
    return stub


def _microbatch(b=2, s=8):
    from gspo_megatron.batching import TrainSequence, collate

    seqs = [TrainSequence(tokens=torch.arange(1, 6), prompt_len=2), TrainSequence(tokens=torch.arange(1, 9), prompt_len=3)]
    return collate(seqs, min_len=s, rows=b)


@pytest.mark.parametrize("layer_spec", ["te", "local"])
def test_padding_mask_reaches_gpt_model_forward_on_every_spec(layer_spec):
    from gspo_megatron.megatron.policy_model import PolicyModel

    mb = _microbatch()
    chunk = _RecordingChunk()
    PolicyModel._forward(_policy_stub(layer_spec, expert_bias=False), chunk, mb)
    (_, kwargs), = chunk.calls
    assert kwargs.get("padding_mask") is not None and torch.equal(kwargs["padding_mask"], mb["padding_mask"])
    assert bool(mb["padding_mask"][0, 5:].all()) and not bool(mb["padding_mask"][0, :5].any())


def test_expert_bias_routers_get_no_padding_mask_on_the_te_spec():
    """0.16.1's TopKRouter._apply_expert_bias computes routing_map [tokens, experts] & ~padding_mask [tokens]:
    with the expert bias on (DeepSeek-V3, GLM-4.5) the TE spec's plain MoELayer must not hand it the mask. The
    local spec's layer keeps the mask (it skips dispatching padded tokens) and withholds it from such routers."""
    from gspo_megatron.megatron.policy_model import PolicyModel

    mb = _microbatch()
    for spec, expected_none in (("te", True), ("local", False)):
        chunk = _RecordingChunk()
        PolicyModel._forward(_policy_stub(spec, expert_bias=True), chunk, mb)
        assert (chunk.calls[0][1]["padding_mask"] is None) == expected_none, spec


def test_later_pipeline_stages_get_their_sequence_parallel_slice(monkeypatch):
    """GPTModel scatters the padding mask over SP ranks only under ``pre_process`` (the first stage)."""
    import torch.distributed as dist

    from gspo_megatron.megatron.policy_model import PolicyModel

    mb = _microbatch()
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)  # pipeline rank 1: a later stage
    stub = _policy_stub("te", expert_bias=False, pp_size=2, tp_size=2, tp_rank=1)
    assert torch.equal(PolicyModel._padding_mask(stub, mb["padding_mask"]), mb["padding_mask"][:, 4:])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)  # the first stage: GPTModel scatters it
    assert torch.equal(PolicyModel._padding_mask(stub, mb["padding_mask"]), mb["padding_mask"])


def aux_loss_checks(rank: int, world_size: int, model_config) -> dict:
    """Per-layer load-balancing loss of one training forward: a 5-token sequence right-padded to 9 with the
    padding mask, and the same 5 tokens alone."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import causal_mask
    from gspo_megatron.testing.models import canonical_weights, random_tokens

    initialize_model_parallel(ParallelConfig(), seed=0)
    model = build_model(model_config, ParallelConfig())
    sharding.load_full_state_dict(model, canonical_weights(model_config, seed=3))
    model.train()
    tokens = random_tokens(model_config, 1, 9, seed=7)
    real = 5

    def aux(ids, padding):
        clear_aux_losses_tracker()
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        kwargs = {} if padding is None else {"padding_mask": padding}
        model(ids, positions, causal_mask(ids.shape[1]), **kwargs)
        return get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()

    padding = torch.arange(9).unsqueeze(0) >= real
    return {"padded": aux(tokens, padding), "unpadded": aux(tokens[:, :real], None), "no_mask": aux(tokens, None)}


def test_aux_loss_with_padding_equals_the_aux_loss_without_the_padded_tokens():
    config = tiny_moe_config(moe_aux_loss_coeff=0.01)
    out = run_distributed(aux_loss_checks, 1, (config,))[0]
    assert out["unpadded"].abs().sum() > 0
    torch.testing.assert_close(out["padded"], out["unpadded"], rtol=1e-5, atol=1e-7)
    # the check can fail: counting the padded tokens gives another loss
    assert not torch.allclose(out["no_mask"], out["unpadded"], rtol=1e-4, atol=1e-6)
