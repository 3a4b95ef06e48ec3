"""Build Megatron-Core GPTModels from a ``ModelConfig``: the local spec on CPU, Transformer Engine on GPU."""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch
import torch.nn.functional as F

from gspo_megatron.megatron import cpu_runtime
from gspo_megatron.megatron.device import compute_device, cuda_present
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.parallel import ParallelConfig
from gspo_megatron.typed_config import check

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class ModelRuntime:
    """How the model runs, as opposed to what it is (``ModelConfig``).

    precision: parameter dtype of the model. bf16/fp16 train through Megatron's mixed-precision optimizer
        with fp32 main weights and fp32 gradient buffers (fp16 adds dynamic loss scaling); log-probs and
        the loss are computed in fp32 either way. fp32 is the CPU demo's default.
    recompute: Megatron's activation recomputation: ``selective`` recomputes core attention (and the MoE
        activation with grouped GEMM), ``full`` every layer's forward (uniform, one layer per unit).
    layer_spec: ``te`` (Transformer Engine modules), ``local`` (Megatron's own modules; on CPU the
        project's CPU spec), ``auto``: TE when CUDA is there and megatron-core imports Transformer Engine
        (its ``HAVE_TE``), else local.
    """

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    recompute: Literal["none", "selective", "full"] = "none"
    layer_spec: Literal["auto", "te", "local"] = "auto"
    # Megatron DDP's main-grad buffers (and their all-reduce) in fp32 (default) or, when false, in the
    # parameter dtype: bf16 gradients halve their memory (tools/slurm/memory_plan.py --grad-dtype bf16)
    grad_reduce_in_fp32: bool = True

    def validate(self, path: str) -> None:
        check(self.precision in PRECISIONS, f"{path}.precision", f"must be fp32, bf16 or fp16, got {self.precision!r}")
        check(self.recompute in ("none", "selective", "full"), f"{path}.recompute",
              f"must be none, selective or full, got {self.recompute!r}")
        check(self.layer_spec in ("auto", "te", "local"), f"{path}.layer_spec",
              f"must be auto, te or local, got {self.layer_spec!r}")

    @property
    def params_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]


def transformer_engine_available() -> bool:
    """megatron-core's own verdict on Transformer Engine: ``HAVE_TE`` of
    ``megatron/core/extensions/transformer_engine.py`` (0.16.1), where the TE modules of the spec live. A
    ``transformer_engine`` that is on the path but fails to import leaves it False and ``te`` a MagicMock,
    so being importable by name (``find_spec``) is not enough. The import costs nothing extra: megatron.core's
    own ``__init__`` already imports that module (through ``tensor_parallel``)."""
    from megatron.core.extensions import transformer_engine as te_extension

    return bool(te_extension.HAVE_TE)


def resolve_layer_spec(choice: str, cuda: bool | None = None, te_installed: bool | None = None) -> str:
    """``te`` or ``local`` for ``model.layer_spec`` ``choice`` on this machine; ``te`` where it cannot run
    is an error naming the field."""
    cuda = cuda_present() if cuda is None else cuda  # device branch: Transformer Engine needs CUDA
    te_installed = transformer_engine_available() if te_installed is None else te_installed
    if choice == "auto":
        return "te" if cuda and te_installed else "local"
    if choice == "te" and not (cuda and te_installed):
        missing = "CUDA" if not cuda else "transformer_engine"
        raise ValueError(f"model.layer_spec: te needs CUDA and Transformer Engine; {missing} is not available "
                         "(use auto or local)")
    if choice not in ("te", "local"):
        raise ValueError(f"model.layer_spec: must be auto, te or local, got {choice!r}")
    return choice


def recompute_settings(recompute: str, grouped_gemm: bool) -> dict:
    """TransformerConfig fields for ``model.recompute`` (Megatron-Core 0.16.1 names)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective",
                    recompute_modules=["core_attn"] + (["moe_act"] if grouped_gemm else []))
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise ValueError(f"model.recompute: must be none, selective or full, got {recompute!r}")


def transformer_config(model: ModelConfig, parallel: ParallelConfig, params_dtype: torch.dtype = torch.float32,
                       runtime: ModelRuntime | None = None):
    """Megatron's TransformerConfig for ``model`` under ``parallel``.

    Dropout is off (RL fine-tuning; and it must be off for log-prob recomputation to match rollouts).
    The router: Qwen3-MoE/Mixtral take a softmax over all experts, then the top-k; with
    ``norm_topk_prob`` the k probabilities are renormalised, which equals a softmax over the top-k logits
    (Megatron's ``moe_router_pre_softmax=False``); without it the raw probabilities are kept
    (``pre_softmax=True``).
    ``runtime`` (when given) sets the parameter dtype, the recomputation and the spec-dependent fusions;
    without it: ``params_dtype``, no recomputation, the spec ``auto`` resolves to.
    """
    # device branch: CPU initialisation and the jit bias-dropout fusion need CUDA's absence / presence
    on_gpu = cuda_present()
    runtime = runtime or ModelRuntime(precision={v: k for k, v in PRECISIONS.items()}[params_dtype])
    params_dtype = runtime.params_dtype
    te = resolve_layer_spec(runtime.layer_spec) == "te"
    moe = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_router_topk=model.moe_router_topk,
            moe_router_pre_softmax=not model.norm_topk_prob,
            moe_router_score_function=model.moe_router_score_function,
            moe_router_enable_expert_bias=model.moe_router_expert_bias,
            moe_router_bias_update_rate=0.0,  # the expert bias is frozen during RL (docs/conversion.md)
            moe_router_topk_scaling_factor=(model.moe_router_topk_scaling_factor
                                            if model.moe_router_topk_scaling_factor != 1.0 else None),
            moe_router_num_groups=model.moe_router_num_groups if model.group_limited else None,
            moe_router_group_topk=model.moe_router_group_topk if model.group_limited else None,
            moe_layer_freq=model.moe_layer_freq,  # a list keys every layer separately in checkpoints
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            # the GPU's dispatcher on both devices (the CPU runtime's host stream stands in for its CUDA stream)
            moe_token_dispatcher_type="alltoall",
            # grouped experts are TE's TEGroupedMLP; the local spec keeps SequentialMLP
            moe_grouped_gemm=te,
            moe_router_dtype="fp32",
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or None,
            moe_shared_expert_gate=model.moe_shared_expert_gate,
        )
    config_class, mla = mla_settings(model)
    return config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        context_parallel_size=parallel.context_parallel,
        # Transformer Engine's CP algorithm (GPU); the CPU spec's CP attention always all-gathers
        cp_comm_type=parallel.cp_comm_type if parallel.context_parallel > 1 else None,
        sequence_parallel=parallel.use_sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=te,  # the local spec's softmax has no fused kernel without TE/apex
        persist_layer_norm=False,
        **recompute_settings(runtime.recompute, grouped_gemm=te and model.is_moe),
        **moe,
        **mla,
    )


def mla_settings(model: ModelConfig) -> tuple[type, dict]:
    """(TransformerConfig class, its extra fields) for ``model``: Megatron's ``MLATransformerConfig`` for
    multi-latent attention, else the plain TransformerConfig. RoPE: plain (mscale 1, softmax scale
    1/sqrt(head_dim), as transformers) or YaRN with the model's factor and mscales."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if not model.is_mla:
        return TransformerConfig, {}
    check_mla_supported()
    return MLATransformerConfig, dict(
        multi_latent_attention=True, q_lora_rank=model.q_lora_rank or None, kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.head_dim - model.qk_rope_head_dim, qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim, rotary_base=model.rope_theta, rotary_percent=1.0, **yarn_settings(model))


MLA_MEGATRON_CORE = ("0.16.1",)


def check_mla_supported() -> None:
    """Multi-latent attention is built on the local spec and tested with megatron-core 0.16.1 only. 0.19.2
    resolves MLA's q/kv norms and projections through its backend (``mla_qk_norm_config``): with q/k norms on
    it asks for a fused norm+linear (Transformer Engine) for a plain q projection, which the local spec has
    not, and the rest of that path has not been verified here."""
    from gspo_megatron.megatron.cpu_runtime import megatron_core_version

    version = megatron_core_version()
    if version not in MLA_MEGATRON_CORE:
        raise ValueError(f"model.kv_lora_rank: multi-latent attention (deepseek_v3) is supported with megatron-core "
                         f"{', '.join(MLA_MEGATRON_CORE)}, this is {version} (its MLA asks for Transformer Engine's "
                         "fused norm+linear); use megatron-core 0.16.1")


def yarn_settings(model: ModelConfig) -> dict:
    """MLATransformerConfig's RoPE fields: YaRN when ``rope_yarn_factor`` > 0, else plain RoPE."""
    if not model.rope_yarn_factor:
        return dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return dict(rope_type="yarn", rotary_scaling_factor=model.rope_yarn_factor,
                original_max_position_embeddings=model.rope_yarn_original_max_position_embeddings,
                beta_fast=model.rope_yarn_beta_fast, beta_slow=model.rope_yarn_beta_slow,
                mscale=model.rope_yarn_mscale, mscale_all_dim=model.rope_yarn_mscale_all_dim)


def _replace_in_spec(spec, old: type, new: type):
    """Swap every reference to module class ``old`` inside a ModuleSpec tree for ``new`` (in place)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        if spec.module is old:
            spec.module = new
        _replace_in_spec(spec.submodules, old, new)
        return spec
    if isinstance(spec, functools.partial):  # megatron-core 0.19: partial(MoELayer, submodules=MoESubmodules(...))
        for value in spec.keywords.values():
            _replace_in_spec(value, old, new)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if value is old:
                setattr(spec, field.name, new)
            elif isinstance(value, functools.partial) and value.func is old:  # 0.19: partial(SequentialMLP, ...)
                setattr(spec, field.name, _replace_in_spec(functools.partial(new, *value.args, **value.keywords),
                                                           old, new))
            else:
                _replace_in_spec(value, old, new)
    return spec


def local_layer_spec(model: ModelConfig, fast_modules: bool = True, moe: bool | None = None, context_parallel: int = 1):
    """One decoder layer of Megatron's local (non-TE) spec for ``model``, as used on CPU.

    Every norm slot holds the sequence-parallel-capable RMSNorm (``cpu_runtime``). With ``fast_modules``
    the core attention is ``cpu_modules.SDPAttention`` and the experts ``cpu_modules.FunctionalSequentialMLP``:
    subclasses of Megatron's ``DotProductAttention`` / ``SequentialMLP`` with the same parameters and state
    dict and a cheaper forward; ``build_model`` then makes the MoE layers ``cpu_modules.PaddingFreeMoELayer``
    (``docs/cpu-runtime.md``). ``fast_modules=False`` keeps Megatron's own modules (the reference in tests and benchmarks). ``moe`` picks the MoE or the dense-MLP layer (default:
    the model's kind; models with ``first_dense_layers`` have both). ``context_parallel`` > 1: the core
    attention is ``cpu_runtime.context_parallel_attention_class()`` (all-gather of keys and values over the
    CP group), with or without ``fast_modules``, since Megatron's local attention refuses CP.
    """
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from gspo_megatron.megatron import cpu_modules

    moe = model.is_moe if moe is None else moe
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts if moe else None, moe_grouped_gemm=False,
        qk_layernorm=model.qk_layernorm, normalization="RMSNorm", multi_latent_attention=model.is_mla)
    spec = _replace_in_spec(spec, WrappedTorchNorm, cpu_runtime.local_norm_class())
    if model.is_mla:
        spec = local_mla_spec(spec, model)
    if fast_modules:
        spec = _replace_in_spec(spec, DotProductAttention, cpu_modules.SDPAttention)
        spec = _replace_in_spec(spec, SequentialMLP, cpu_modules.FunctionalSequentialMLP)
    if context_parallel > 1:
        cp_attention = cpu_runtime.context_parallel_attention_class()
        spec = _replace_in_spec(_replace_in_spec(spec, cpu_modules.SDPAttention, cp_attention), DotProductAttention,
                                cp_attention)
    return spec


def local_mla_spec(spec, model: ModelConfig):
    """The local layer ``spec`` made to run multi-latent attention: Megatron's local DotProductAttention
    cannot take MLA's separate key/value widths (``cpu_modules.SDPAttention`` can), and a plain q projection
    (``q_lora_rank`` 0) has no latent to normalise: 0.16.1 skips building that norm, 0.19.2 refuses a
    non-trivial ``q_layernorm`` then (``mla_qk_norm_config``), so it is an identity for both."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp

    from gspo_megatron.megatron import cpu_modules

    cpu_modules.enable_local_mla()
    spec = _replace_in_spec(spec, DotProductAttention, cpu_modules.SDPAttention)
    if not model.q_lora_rank:
        spec.submodules.self_attention.submodules.q_layernorm = IdentityOp
    return spec


def with_moe_keys_map(spec):
    """``spec`` (a TransformerLayer ModuleSpec with a separate ``pre_mlp_layernorm``) saving and loading
    that norm under the local spec's key (``sharding.TE_MOE_KEYS_MAP``); its other mappings stay."""
    from gspo_megatron.megatron.sharding import TE_MOE_KEYS_MAP

    submodules = spec.submodules
    submodules.sharded_state_dict_keys_map = {**(submodules.sharded_state_dict_keys_map or {}), **TE_MOE_KEYS_MAP}
    return spec


def te_layer_spec(model: ModelConfig, moe: bool | None = None):
    """Megatron's Transformer Engine layer spec (grouped experts for MoE); MoE layers keep checkpoints
    compatible with the local spec's (``with_moe_keys_map``). ``moe`` as in ``local_layer_spec``."""
    from megatron.core.models.gpt import gpt_layer_specs

    moe = model.is_moe if moe is None else moe
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        num_experts=model.num_experts if moe else None, moe_grouped_gemm=moe, qk_layernorm=model.qk_layernorm)
    return with_moe_keys_map(spec) if moe else spec


def layer_spec(model: ModelConfig, config, fast_cpu_modules: bool = True, choice: str = "auto"):
    """The decoder spec for ``model.layer_spec`` ``choice`` (``resolve_layer_spec``): Transformer Engine
    modules (``te_layer_spec``), or ``local_layer_spec`` in every layer with the sequence-parallel-capable
    RMSNorm as the final norm (given as a TransformerBlockSubmodules, since the block otherwise picks its
    final norm from a module global); the local spec is pure torch and runs on CPU and GPU alike.
    ``fast_cpu_modules=False`` builds the local spec with Megatron's own attention and experts (reference
    for tests and benchmarks)."""
    if resolve_layer_spec(choice) == "te":
        if model.is_mla:
            raise ValueError("model.layer_spec: multi-latent attention (kv_lora_rank > 0) runs on the local spec "
                             "only (the TE MLA spec's fused norm names are not mapped yet); set layer_spec: local")
        if not model.first_dense_layers:
            return te_layer_spec(model)
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        specs = {moe: te_layer_spec(model, moe) for moe in (True, False)}
        return TransformerBlockSubmodules(layer_specs=stage_layer_specs(model, config, specs), layer_norm=TENorm)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    specs = {moe: local_layer_spec(model, fast_cpu_modules, moe, config.context_parallel_size)
             for moe in {model.is_moe, model.is_moe_layer(0)}}
    return TransformerBlockSubmodules(layer_specs=stage_layer_specs(model, config, specs),
                                      layer_norm=cpu_runtime.local_norm_class())


def stage_layer_specs(model: ModelConfig, config, specs: dict) -> list:
    """The layer specs of this pipeline stage's layers, ``specs[True]`` for MoE layers and ``specs[False]``
    for dense ones (``ModelConfig.is_moe_layer`` of the global layer number)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    return [specs[model.is_moe_layer(offset + i)] for i in range(get_num_layers_to_build(config))]


# megatron-core releases whose unfused token permutation sizes its output from the routing map
# (masked_select), so rows PaddingFreeMoELayer empties shrink what the dispatcher sends. From 0.19 the
# dropless permutation is fixed-shape for CUDA graphs (``num_tokens x topk`` rows, moe_utils.permute), and
# emptied rows would leave the alltoall dispatcher's split sizes short of what it permuted.
PADDING_FREE_DISPATCH_IN = ("0.16.1",)


def padding_free_applies() -> bool:
    """Whether ``cpu_modules.skip_padding_in_moe_layers`` can make MoE layers padding-free on this
    megatron-core (elsewhere padded tokens are computed and discarded: the same outputs)."""
    return cpu_runtime.megatron_core_version() in PADDING_FREE_DISPATCH_IN


def build_model(model: ModelConfig, parallel: ParallelConfig, params_dtype: torch.dtype = torch.float32,
                max_sequence_length: int | None = None, fast_cpu_modules: bool = True,
                runtime: ModelRuntime | None = None):
    """One GPTModel for this rank's pipeline stage (Megatron parallel state must be initialised).

    Returns the bare GPTModel; wrap it with Megatron DDP for training (``megatron/policy_model.py``).
    Logits come out vocab-parallel ([s, b, padded_vocab / TP]) so log-probs never gather the vocabulary.
    ``fast_cpu_modules=False`` uses Megatron's own core attention, experts and MoE layer on CPU (``layer_spec``);
    parameter names, shapes and state dicts are the same either way.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    cpu_runtime.activate()
    config = transformer_config(model, parallel, params_dtype, runtime)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(model, config, fast_cpu_modules, runtime.layer_spec if runtime else "auto"),
        vocab_size=model.padded_vocab_size(parallel.tensor_parallel),
        max_sequence_length=max_sequence_length or model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        rotary_percent=model.rotary_percent,
        rope_scaling=model.rope_llama3_factor > 0,
        rope_scaling_factor=model.rope_llama3_factor or 8.0,
    )
    if (fast_cpu_modules and resolve_layer_spec(runtime.layer_spec if runtime else "auto") == "local"
            and padding_free_applies()):
        from gspo_megatron.megatron import cpu_modules

        cpu_modules.skip_padding_in_moe_layers(gpt)
    return gpt.to(compute_device())


def wrap_ddp(model, parallel: ParallelConfig, grad_reduce_in_fp32: bool = True):
    """Megatron DDP around ``model``, with grads reduced in fp32 (or in the parameter dtype) and
    ``finalize_model_grads`` installed in the model config (it all-reduces SP norm and tied-embedding grads
    and scales expert grads)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
                                               use_distributed_optimizer=parallel.distributed_optimizer)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp
