"""The CPU layer-spec modules (``megatron/cpu_modules.py``) against the Megatron modules they replace, on the
same weights and inputs, fp32: core attention (GQA / MHA / MQA, causal, default and padding masks, fully
masked rows, query-key layer scaling, dropout, refusals), the experts (outputs and gradients into the same
parameters, a single local expert, an expert with no tokens, fall-back settings), and whole GPTModels built
with the new and the old spec (state dicts, logits, DDP ``main_grad``), in one process and at EP=2 / TP=2+SP.

Spawned workers are at the bottom of this file (module level, so ``spawn`` can import them).
"""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config

ATTENTION_HEADS = {"gqa": 2, "mha": 4, "mqa": 1}  # 4 query heads, this many key/value groups
MASKS = ["causal", "default", "padding", "random"]


@pytest.fixture(scope="module")
def single():
    return run_distributed(single_process_checks, 1, (tiny_moe_config(),))[0]


@pytest.fixture(scope="module")
def parallel():
    return run_distributed(parallel_checks, 2, (tiny_moe_config(),))


# ---- core attention --------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", ATTENTION_HEADS)
@pytest.mark.parametrize("mask", MASKS)
def test_sdpa_attention_matches_dot_product_attention(single, heads, mask):
    case = single["attention"][(heads, mask)]
    assert case["new_output"].shape == case["ref_output"].shape == (9, 3, 4 * 16)
    torch.testing.assert_close(case["new_output"], case["ref_output"], rtol=0, atol=2e-6)
    for name in ("query", "key", "value"):
        assert case["ref_grads"][name].abs().sum() > 0
        torch.testing.assert_close(case["new_grads"][name], case["ref_grads"][name], rtol=0, atol=5e-6, msg=name)


def test_only_the_exact_causal_mask_takes_the_is_causal_path():
    from gspo_megatron.megatron.cpu_modules import is_plain_causal_mask

    s = 6
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    assert is_plain_causal_mask(causal, s, s) and is_plain_causal_mask(causal[None, None], s, s)
    assert not is_plain_causal_mask(causal[None, None].expand(2, 1, s, s), s, s)  # per-row masks: general path
    assert not is_plain_causal_mask(torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=2), s, s)
    padded = causal.clone()
    padded[:, 0] = True
    assert not is_plain_causal_mask(padded, s, s)
    assert not is_plain_causal_mask(causal[:4], 4, s)


def test_padding_mask_has_fully_masked_rows(single):
    """The padding case exercises the rows Megatron turns into a uniform mean (and SDPA alone into zeros)."""
    assert single["padding_dead_rows"] > 0
    case = single["attention"][("gqa", "padding")]
    assert case["sdpa_alone_differs"]


def test_query_key_layer_scaling(single):
    case = single["layer_scaling"]
    torch.testing.assert_close(case["new_output"], case["ref_output"], rtol=0, atol=2e-6)
    torch.testing.assert_close(case["new_grads"]["query"], case["ref_grads"]["query"], rtol=0, atol=5e-6)


def test_attention_dropout_in_training_mode_only(single):
    d = single["dropout"]
    torch.testing.assert_close(d["eval"], d["no_dropout"], rtol=0, atol=0)
    assert not torch.allclose(d["train_1"], d["no_dropout"])  # dropout applied in training mode
    assert not torch.allclose(d["train_1"], d["train_2"])  # a fresh pattern per call
    assert torch.isfinite(d["train_1"]).all()
    assert d["global_rng_untouched"]  # drawn under Megatron's RNG tracker fork, as the parent does


def test_attention_refuses_what_it_does_not_support(single):
    refused = single["refused"]
    assert "packed sequences" in refused["packed_seq_params"]
    assert "attention_bias" in refused["attention_bias"]
    assert "must be bool" in refused["float_mask"]
    assert "context_parallel_size=2" in refused["context_parallel"]
    assert "softmax_type" in refused["softmax_type"]
    for message in refused.values():
        assert "cpu_modules.py" in message


# ---- experts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["four_experts", "one_expert"])
def test_functional_experts_match_sequential_mlp(single, case):
    out = single["experts"][case]
    assert out["functional_path"]  # the fast path ran, not the parent's forward
    torch.testing.assert_close(out["new_output"], out["ref_output"], rtol=0, atol=1e-6)
    assert set(out["new_grads"]) == set(out["ref_grads"])
    for name, ref in out["ref_grads"].items():
        torch.testing.assert_close(out["new_grads"][name], ref, rtol=0, atol=1e-6, msg=name)
    assert out["ref_grads"]["hidden"].abs().sum() > 0 and out["ref_grads"]["probs"].abs().sum() > 0


def test_expert_without_tokens_gets_a_zero_gradient(single):
    out = single["experts"]["four_experts"]
    assert out["tokens_per_expert"][1] == 0
    grad = out["new_grads"]["local_experts.1.linear_fc1.weight"]
    assert grad is not None and grad.abs().sum() == 0
    assert out["new_grads"]["local_experts.0.linear_fc1.weight"].abs().sum() > 0


def test_experts_fall_back_to_the_parent_forward_for_other_settings(single):
    fallback = single["experts_fallback"]
    assert fallback["blockers"] == ["add_bias_linear"]
    assert not fallback["functional_path"]
    torch.testing.assert_close(fallback["new_output"], fallback["ref_output"], rtol=0, atol=0)


# ---- whole model ---------------------------------------------------------------------------------------
def test_new_spec_keeps_parameter_names_shapes_and_sharded_state_dict(single):
    from gspo_megatron.megatron.model import padding_free_applies

    m = single["model"]
    moe = "PaddingFreeMoELayer" if padding_free_applies() else "MoELayer"
    assert m["new_types"] == ["SDPAttention", "FunctionalSequentialMLP", moe]
    assert m["ref_types"] == ["DotProductAttention", "SequentialMLP", "MoELayer"]
    assert m["new_state_dict"] == m["ref_state_dict"]
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in m["new_state_dict"]
    assert m["new_sharded_keys"] == m["ref_sharded_keys"]


@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_gpt_model_logits_and_ddp_grads_match_the_old_spec(single, mask):
    run = single["model"][mask]
    torch.testing.assert_close(run["new"]["logits"], run["ref"]["logits"], rtol=0, atol=1e-5)
    assert set(run["new"]["grads"]) == set(run["ref"]["grads"])
    for name, ref in run["ref"]["grads"].items():
        assert ref.abs().sum() > 0, name  # every parameter got a gradient through DDP's main_grad
        torch.testing.assert_close(run["new"]["grads"][name], ref, rtol=1e-4, atol=1e-7, msg=name)


def _check_right_padding(run, top_k: int, msg: str = "") -> int:
    real = ~run["padding"]  # [b, s]
    # logits [b, s, V/TP]: equal at every real position (padded ones hold whatever the residual stream gives)
    new, ref = run["new"]["logits"][real], run["ref"]["logits"][real]
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-5, msg=msg)
    for name, grad in run["ref"]["grads"].items():
        torch.testing.assert_close(run["new"]["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=f"{msg} {name}")
    return int(real.sum())


def test_padded_positions_reach_no_expert_and_change_nothing_real(single):
    """PaddingFreeMoELayer: with the padding mask the experts compute only real tokens (top_k per real token
    per layer, against every token for Megatron's MoELayer), and logits at real positions and every
    gradient of a loss over real positions equal Megatron's own layer's."""
    from gspo_megatron.testing.models import tiny_moe_config

    config = tiny_moe_config()
    run = single["model"]["right_padding"]
    real = _check_right_padding(run, config.moe_router_topk)
    b, s = run["padding"].shape
    assert 0 < real < b * s
    from gspo_megatron.megatron.model import padding_free_applies

    computed = real if padding_free_applies() else b * s  # 0.19's fixed-shape permutation: every token
    assert run["new"]["expert_tokens"] == computed * config.moe_router_topk * config.num_layers
    assert run["ref"]["expert_tokens"] == b * s * config.moe_router_topk * config.num_layers


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "tp2_sp"])
def test_parallel_layouts_match_the_old_spec(parallel, layout):
    """EP=2 (the dispatcher hands each rank 2 local experts) and TP=2 with sequence parallelism (heads split
    over TP in attention; expert tensor parallelism 2): logits and gradients equal the old spec's."""
    for rank in range(2):
        run = parallel[rank][layout]
        assert run["num_local_experts"] == (2 if layout == "ep2" else 4)
        torch.testing.assert_close(run["new"]["logits"], run["ref"]["logits"], rtol=0, atol=1e-5)
        for name, ref in run["ref"]["grads"].items():
            assert ref.abs().sum() > 0, name
            torch.testing.assert_close(run["new"]["grads"][name], ref, rtol=1e-4, atol=1e-7, msg=f"{layout} {name}")
        _check_right_padding(run["right_padding"], tiny_moe_config().moe_router_topk, msg=f"{layout} right padding")


# ======================================================================================================
# Spawned workers
# ======================================================================================================
def _transformer_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                ffn_hidden_size=32, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                apply_rope_fusion=False, bias_activation_fusion=False, params_dtype=torch.float32,
                num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
    base.update(overrides)
    return TransformerConfig(**base)


def _attention_masks(s: int, b: int) -> dict:
    """[1, 1, s, s] causal; None (the default causal mask); [b, 1, s, s] causal + key padding (row 0 full,
    row 1 left-padded by 3: its first 3 queries see only padding, row 2 right-padded by 4); random."""
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    is_pad = torch.zeros(b, s, dtype=torch.bool)
    is_pad[1, :3] = True
    is_pad[2, s - 4:] = True
    padding = causal | is_pad[:, None, None, :]
    gen = torch.Generator().manual_seed(3)
    random = torch.rand(b, 1, s, s, generator=gen) > 0.6
    random[0, 0, 2] = True  # one fully masked row
    return {"causal": causal, "default": None, "padding": padding, "random": random}


def _run_attention(module, q, k, v, mask, upstream):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(upstream)
    return out.detach(), {"query": q.grad, "key": k.grad, "value": v.grad}


def _attention_pair(config, layer_number: int = 1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.megatron.cpu_modules import SDPAttention

    args = (config, layer_number, AttnMaskType.causal, "self")
    return DotProductAttention(*args), SDPAttention(*args)


def _attention_checks() -> dict:
    import torch.nn.functional as F

    from gspo_megatron.megatron.cpu_modules import sdpa_core_attention

    s, b, n, d = 9, 3, 4, 16
    gen = torch.Generator().manual_seed(0)
    masks = _attention_masks(s, b)
    out: dict = {"attention": {}}
    for heads, groups in ATTENTION_HEADS.items():
        ref, new = _attention_pair(_transformer_config(num_query_groups=groups))
        q = torch.randn(s, b, n, d, generator=gen)
        k, v = torch.randn(s, b, groups, d, generator=gen), torch.randn(s, b, groups, d, generator=gen)
        upstream = torch.randn(s, b, n * d, generator=gen)
        for name, mask in masks.items():
            ref_out, ref_grads = _run_attention(ref, q, k, v, mask, upstream)
            new_out, new_grads = _run_attention(new, q, k, v, mask, upstream)
            case = {"ref_output": ref_out, "new_output": new_out, "ref_grads": ref_grads, "new_grads": new_grads}
            if name == "padding":
                # what SDPA gives without the fully-masked-row handling: zeros there, so not Megatron's mean
                kk, vv = (t.repeat_interleave(n // groups, dim=2).permute(1, 2, 0, 3) for t in (k, v))
                plain = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), kk, vv, attn_mask=~mask,
                                                       scale=new.sdpa_scale).permute(2, 0, 1, 3).reshape(s, b, n * d)
                case["sdpa_alone_differs"] = not torch.allclose(plain, ref_out, atol=1e-3)
            out["attention"][(heads, name)] = case
    out["padding_dead_rows"] = int(masks["padding"].all(dim=-1).sum())

    # query-key layer scaling at layer 3: Megatron scales by 1/3 in baddbmm and by 3 in the softmax
    ref, new = _attention_pair(_transformer_config(apply_query_key_layer_scaling=True), layer_number=3)
    q, k, v = torch.randn(s, b, n, d, generator=gen), torch.randn(s, b, 2, d, generator=gen), torch.randn(s, b, 2, d, generator=gen)
    upstream = torch.randn(s, b, n * d, generator=gen)
    ref_out, ref_grads = _run_attention(ref, q, k, v, masks["causal"], upstream)
    new_out, new_grads = _run_attention(new, q, k, v, masks["causal"], upstream)
    out["layer_scaling"] = {"ref_output": ref_out, "new_output": new_out, "ref_grads": ref_grads, "new_grads": new_grads}

    # dropout: applied in training mode only, drawn under the RNG tracker's fork
    _, dropped = _attention_pair(_transformer_config(attention_dropout=0.5))
    with torch.no_grad():
        no_dropout = sdpa_core_attention(q, k, v, masks["causal"], True, dropped.sdpa_scale)
        dropped.eval()
        evaluated = dropped(q, k, v, masks["causal"])
        dropped.train()
        state = torch.get_rng_state()
        train_1, train_2 = dropped(q, k, v, masks["causal"]), dropped(q, k, v, masks["causal"])
    out["dropout"] = {"no_dropout": no_dropout, "eval": evaluated, "train_1": train_1, "train_2": train_2,
                      "global_rng_untouched": torch.equal(state, torch.get_rng_state())}
    out["refused"] = _attention_refusals(q, k, v, masks["causal"])
    return out


def _refusal(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def _attention_refusals(q, k, v, mask) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.megatron.cpu_modules import SDPAttention

    _, new = _attention_pair(_transformer_config())
    return {
        "packed_seq_params": _refusal(lambda: new(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))),
        "attention_bias": _refusal(lambda: new(q, k, v, mask, attention_bias=torch.zeros(1))),
        "float_mask": _refusal(lambda: new(q, k, v, mask.float())),
        "context_parallel": _refusal(lambda: SDPAttention(_transformer_config(context_parallel_size=2), 1,
                                                          AttnMaskType.causal, "self")),
        "softmax_type": _refusal(lambda: SDPAttention(_transformer_config(softmax_type="off-by-one"), 1,
                                                      AttnMaskType.causal, "self")),
    }


def _experts_pair(config, num_local_experts: int):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from gspo_megatron.megatron.cpu_modules import FunctionalSequentialMLP

    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    ref = SequentialMLP(num_local_experts, config, submodules, pg_collection=groups)
    new = FunctionalSequentialMLP(num_local_experts, config, submodules, pg_collection=groups)
    new.load_state_dict(ref.state_dict())
    return ref, new


def _run_experts(module, hidden, counts, probs):
    hidden, probs = hidden.detach().clone().requires_grad_(True), probs.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out, bias = module(hidden, torch.tensor(counts), probs)
    assert bias is None
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {"hidden": hidden.grad, "probs": probs.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out.detach(), grads


def _expert_checks() -> dict:
    from gspo_megatron.megatron.cpu_modules import functional_path_blockers

    gen = torch.Generator().manual_seed(1)
    out: dict = {"experts": {}}
    for case, counts in (("four_experts", [5, 0, 7, 3]), ("one_expert", [11])):
        ref, new = _experts_pair(_transformer_config(), len(counts))
        with torch.no_grad():
            for p in ref.parameters():  # larger than the init, so the activations are not near-linear
                p.normal_(0, 0.2, generator=gen)
        new.load_state_dict(ref.state_dict())
        hidden, probs = torch.randn(sum(counts), 64, generator=gen), torch.rand(sum(counts), generator=gen)
        ref_out, ref_grads = _run_experts(ref, hidden, counts, probs)
        new_out, new_grads = _run_experts(new, hidden, counts, probs)
        out["experts"][case] = {"functional_path": new.functional_path, "tokens_per_expert": counts,
                                "ref_output": ref_out, "new_output": new_out, "ref_grads": ref_grads,
                                "new_grads": new_grads}
    config = _transformer_config(add_bias_linear=True)
    ref, new = _experts_pair(config, 2)
    hidden, probs = torch.randn(6, 64, generator=gen), torch.rand(6, generator=gen)
    with torch.no_grad():
        out["experts_fallback"] = {"blockers": functional_path_blockers(new.config),
                                   "functional_path": new.functional_path,
                                   "ref_output": ref(hidden, torch.tensor([2, 4]), probs)[0],
                                   "new_output": new(hidden, torch.tensor([2, 4]), probs)[0]}
    return out


def _model_run(model_config, parallel_config, fast: bool, tokens, mask, weights, padding=None) -> dict:
    """Logits ([b, s, V/TP], this rank's) and full gradients (DDP main_grad) of a cross-entropy loss; with
    ``padding`` ([b, s] bool, True = padded) the model gets it as ``padding_mask`` and the loss skips those
    positions. Also the tokens the experts of every layer computed, summed."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.model import build_model, wrap_ddp

    model = build_model(model_config, parallel_config, fast_cpu_modules=fast)
    sharding.load_full_state_dict(model, weights)
    ddp = wrap_ddp(model, parallel_config)
    ddp.zero_grad_buffer()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    logits_out = []
    expert_tokens = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, args: expert_tokens.append(int(args[1].sum())))
             for layer in model.decoder.layers]
    kwargs = {} if padding is None else {"padding_mask": padding}
    weight = torch.ones_like(labels, dtype=torch.float32) if padding is None else (~padding).float()

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        output = chunk(inputs, positions, mask, **kwargs)

        def loss_func(logits):
            logits_out.append(logits.detach().clone())
            ce = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                              labels.transpose(0, 1).contiguous())
            loss = (ce * weight.t()).sum() / weight.sum()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([0]), model=[ddp],
                                num_microbatches=1, seq_length=inputs.shape[1], micro_batch_size=inputs.shape[0],
                                forward_only=False)
    for hook in hooks:
        hook.remove()
    return {"logits": logits_out[0], "grads": sharding.full_state_dict(ddp, model_config.vocab_size, grads=True),
            "expert_tokens": sum(expert_tokens)}


def _model_checks(model_config) -> dict:
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig
    from gspo_megatron.testing.models import canonical_weights, random_tokens

    weights = canonical_weights(model_config, seed=2)
    out: dict = {}
    for fast, tag in ((True, "new"), (False, "ref")):
        model = build_model(model_config, ParallelConfig(), fast_cpu_modules=fast)
        layer = model.decoder.layers[0]
        out[f"{tag}_types"] = [type(layer.self_attention.core_attention).__name__, type(layer.mlp.experts).__name__,
                               type(layer.mlp).__name__]
        out[f"{tag}_state_dict"] = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                                    for k, v in model.state_dict().items()}
        out[f"{tag}_sharded_keys"] = sorted(model.sharded_state_dict(prefix="model.").keys())
    b, s = 4, 12
    tokens = random_tokens(model_config, b, s + 1, seed=5)
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    is_pad = torch.zeros(b, s, dtype=torch.bool)
    is_pad[1, :4] = True  # left padding: fully masked query rows
    is_pad[3, s - 5:] = True
    for name, mask in (("causal", causal), ("padding", causal | is_pad[:, None, None, :])):
        out[name] = {tag: _model_run(model_config, ParallelConfig(), fast, tokens, mask, weights)
                     for fast, tag in ((True, "new"), (False, "ref"))}
    out["right_padding"] = _right_padding_runs(model_config, ParallelConfig(), tokens, causal, weights)
    return out


def right_padding(b: int, s: int) -> torch.Tensor:
    """[b, s] True = padded: rows end after 12, 7, 3 (+ fully padded rows), as collate pads RL batches."""
    ends = [12, 7, 3, 0, 9, 12][:b]
    return torch.arange(s)[None, :] >= torch.tensor(ends + [s] * (b - len(ends)))[:, None]


def _right_padding_runs(model_config, parallel_config, tokens, causal, weights) -> dict:
    padding = right_padding(tokens.shape[0], tokens.shape[1] - 1)
    return {"padding": padding, **{tag: _model_run(model_config, parallel_config, fast, tokens, causal, weights, padding)
                                   for fast, tag in ((True, "new"), (False, "ref"))}}


def single_process_checks(rank: int, world_size: int, model_config) -> dict:
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=0)
    out = _attention_checks()
    out.update(_expert_checks())
    out["model"] = _model_checks(model_config)
    return out


def parallel_checks(rank: int, world_size: int, model_config) -> dict:
    """New vs old spec at EP=2 and at TP=2 + SP, every rank the same batch (the allgather dispatcher needs
    equal token counts; with DP=2 at EP=2 the averaged gradient is then that batch's)."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.testing.models import canonical_weights, random_tokens

    weights = canonical_weights(model_config, seed=4)
    tokens = random_tokens(model_config, 4, 13, seed=6)
    causal = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), diagonal=1)
    out = {}
    for name, layout in (("ep2", ParallelConfig(expert_parallel=2)), ("tp2_sp", ParallelConfig(tensor_parallel=2))):
        initialize_model_parallel(layout, seed=0)
        out[name] = {tag: _model_run(model_config, layout, fast, tokens, causal, weights)
                     for fast, tag in ((True, "new"), (False, "ref"))}
        out[name]["right_padding"] = _right_padding_runs(model_config, layout, tokens, causal, weights)
        out[name]["num_local_experts"] = model_config.num_experts // ps.get_expert_model_parallel_world_size()
    return out


def test_a_whole_sequence_padding_mask_is_cut_to_this_ranks_chunk():
    """Later pipeline stages get GPTModel's padding mask unscattered under sequence parallelism: each
    tensor-parallel rank takes its contiguous chunk; a length that fits no chunking is named."""
    from gspo_megatron.megatron.cpu_modules import sequence_parallel_slice

    class Group:
        def __init__(self, rank, size):
            self._rank, self._size = rank, size

        def rank(self):
            return self._rank

        def size(self):
            return self._size

    mask = torch.arange(12).reshape(6, 2) % 3 == 0
    assert torch.equal(sequence_parallel_slice(mask, 3, Group(1, 2)), mask[3:6])
    assert torch.equal(sequence_parallel_slice(mask, 2, Group(0, 3)), mask[0:2])
    with pytest.raises(ValueError, match="padding_mask covers 6 positions"):
        sequence_parallel_slice(mask, 4, Group(0, 2))
