"""Build Megatron-Core GPTModels from a ``ModelConfig``: the local spec on CPU, Transformer Engine on GPU."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from gspo_megatron.megatron import cpu_runtime
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.parallel import ParallelConfig


def transformer_config(model: ModelConfig, parallel: ParallelConfig, params_dtype: torch.dtype = torch.float32):
    """Megatron's TransformerConfig for ``model`` under ``parallel``.

    Dropout is off (RL fine-tuning; and it must be off for log-prob recomputation to match rollouts).
    The router: Qwen3-MoE/Mixtral take a softmax over all experts, then the top-k; with
    ``norm_topk_prob`` the k probabilities are renormalised, which equals a softmax over the top-k logits
    (Megatron's ``moe_router_pre_softmax=False``); without it the raw probabilities are kept
    (``pre_softmax=True``).
    """
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
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
            # a list makes Megatron key every layer separately in checkpoints: only when layers differ
            moe_layer_freq=model.moe_layer_pattern() if model.first_dense_layers else 1,
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            # alltoall creates a CUDA stream in its constructor; allgather is exact and fine at small scale.
            moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
            moe_grouped_gemm=on_gpu,
            moe_router_dtype="fp32",
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or None,
            moe_shared_expert_gate=model.moe_shared_expert_gate,
        )
    return TransformerConfig(
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
        context_parallel_size=parallel.context_parallel,
        sequence_parallel=parallel.use_sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=on_gpu,
        persist_layer_norm=False,
        **moe,
    )


def _replace_in_spec(spec, old: type, new: type):
    """Swap every reference to module class ``old`` inside a ModuleSpec tree for ``new`` (in place)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        if spec.module is old:
            spec.module = new
        _replace_in_spec(spec.submodules, old, new)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if value is old:
                setattr(spec, field.name, new)
            else:
                _replace_in_spec(value, old, new)
    return spec


def local_layer_spec(model: ModelConfig, fast_modules: bool = True, moe: bool | None = None):
    """One decoder layer of Megatron's local (non-TE) spec for ``model``, as used on CPU.

    Every norm slot holds the sequence-parallel-capable RMSNorm (``cpu_runtime``). With ``fast_modules``
    the core attention is ``cpu_modules.SDPAttention`` and the experts ``cpu_modules.FunctionalSequentialMLP``:
    subclasses of Megatron's ``DotProductAttention`` / ``SequentialMLP`` with the same parameters and state
    dict and a cheaper forward (``docs/cpu-runtime.md``). ``fast_modules=False`` keeps Megatron's own
    modules (the reference in tests and benchmarks). ``moe`` picks the MoE or the dense-MLP layer (default:
    the model's kind; models with ``first_dense_layers`` have both).
    """
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from gspo_megatron.megatron import cpu_modules

    moe = model.is_moe if moe is None else moe
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts if moe else None, moe_grouped_gemm=False,
        qk_layernorm=model.qk_layernorm, normalization="RMSNorm")
    spec = _replace_in_spec(spec, WrappedTorchNorm, cpu_runtime.local_norm_class())
    if fast_modules:
        spec = _replace_in_spec(spec, DotProductAttention, cpu_modules.SDPAttention)
        spec = _replace_in_spec(spec, SequentialMLP, cpu_modules.FunctionalSequentialMLP)
    return spec


def layer_spec(model: ModelConfig, config, fast_cpu_modules: bool = True):
    """The decoder spec: Transformer Engine modules on GPU; on CPU ``local_layer_spec`` in every layer and
    the sequence-parallel-capable RMSNorm as the final norm (given as a TransformerBlockSubmodules, since
    the block otherwise picks its final norm from a module global). ``fast_cpu_modules=False`` builds the
    CPU spec with Megatron's own attention and experts (reference for tests and benchmarks)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if torch.cuda.is_available():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts if model.is_moe else None, moe_grouped_gemm=model.is_moe,
            qk_layernorm=model.qk_layernorm)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    specs = {moe: local_layer_spec(model, fast_cpu_modules, moe) for moe in {model.is_moe, model.is_moe_layer(0)}}
    return TransformerBlockSubmodules(layer_specs=stage_layer_specs(model, config, specs),
                                      layer_norm=cpu_runtime.local_norm_class())


def stage_layer_specs(model: ModelConfig, config, specs: dict) -> list:
    """The layer specs of this pipeline stage's layers, ``specs[True]`` for MoE layers and ``specs[False]``
    for dense ones (``ModelConfig.is_moe_layer`` of the global layer number)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    return [specs[model.is_moe_layer(offset + i)] for i in range(get_num_layers_to_build(config))]


def build_model(model: ModelConfig, parallel: ParallelConfig, params_dtype: torch.dtype = torch.float32,
                max_sequence_length: int | None = None, fast_cpu_modules: bool = True):
    """One GPTModel for this rank's pipeline stage (Megatron parallel state must be initialised).

    Returns the bare GPTModel; wrap it with Megatron DDP for training (``megatron/train.py``).
    Logits come out vocab-parallel ([s, b, padded_vocab / TP]) so log-probs never gather the vocabulary.
    ``fast_cpu_modules=False`` uses Megatron's own core attention and experts on CPU (``layer_spec``);
    parameter names, shapes and state dicts are the same either way.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    cpu_runtime.activate()
    config = transformer_config(model, parallel, params_dtype)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(model, config, fast_cpu_modules),
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
    if torch.cuda.is_available():
        gpt = gpt.cuda()
    return gpt


def wrap_ddp(model, parallel: ParallelConfig):
    """Megatron DDP around ``model``, with grads reduced in fp32 and ``finalize_model_grads`` installed
    in the model config (it all-reduces SP norm and tied-embedding grads and scales expert grads)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=parallel.distributed_optimizer)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp
