"""The GPU path as far as the CPU can show it: device placement through one helper, the collective rule,
Transformer Engine names and spec-neutral checkpoints. GPU-only checks are marked ``gpu``.

What cannot run here is Transformer Engine itself: ``get_gpt_layer_with_transformer_engine_spec`` needs
``TESpecProvider``, which megatron-core 0.16.1 only defines when transformer_engine imports. The TE names
below are therefore a key list recorded from the megatron-core 0.16.1 sources (``gpt_layer_specs.py``
``get_gpt_layer_with_transformer_engine_spec``; ``extensions/transformer_engine.py``
``TELayerNormColumnParallelLinear`` holds ``layer_norm_weight``; ``TEGroupedLinear`` names expert i's
weight ``weight{i}``; MoE layers get ``pre_mlp_layernorm = TENorm``; dense ones ``IdentityOp``), and the
checkpoint test builds the TE MoE layer's *key naming* (a separate ``pre_mlp_layernorm``) from Megatron's
local modules, then runs real dist_checkpointing saves and loads between the two.
"""
from __future__ import annotations

import copy

import pytest
import torch

from gspo_megatron.megatron import device
from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import canonical_shapes, tiny_moe_config


# ---- device placement -----------------------------------------------------------------------------


def test_to_device_and_to_host_move_every_nested_tensor():
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "indices": [0, 1],
             "nested": {"x": torch.ones(1)}, "pair": (torch.ones(1), 2)}
    moved = device.to_device(batch)
    assert moved["indices"] == [0, 1] and moved["pair"][1] == 2
    for t in (moved["input_ids"], moved["nested"]["x"], moved["pair"][0]):
        assert t.device == device.compute_device()
    assert device.to_host(moved)["nested"]["x"].device.type == "cpu"


def test_compute_device_is_the_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only statement")
    assert device.compute_device() == torch.device("cpu")


def placement_worker(rank, world_size, model_config, tmp):
    """PolicyModel's three forward paths with ``to_device`` replaced by a copying spy: every tensor of
    every micro-batch the model and the loss read must be one the spy returned (a path that feeds the
    collated host tensors directly, or builds its own, fails)."""
    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.megatron import policy_model as pm
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from tests.megatron.train_workers import make_sequences

    initialize_model_parallel(ParallelConfig(), seed=0)
    moved: set[int] = set()
    real = pm.to_device

    def spy(batch):
        out = real({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        moved.update(id(v) for v in out.values() if isinstance(v, torch.Tensor))
        return out

    checked = {"forwards": 0, "tensors": 0, "masks": []}
    policy = pm.PolicyModel(model_config, ParallelConfig(), OptimizerConfig(lr=1e-3), LossConfig())
    forward = policy._forward

    def guarded(model, mb, router_replay=None):
        for key, value in mb.items():
            if isinstance(value, torch.Tensor):
                assert id(value) in moved, f"micro-batch field {key} did not pass through device.to_device"
                checked["tensors"] += 1
        checked["forwards"] += 1
        return forward(model, mb, router_replay)

    pm.to_device = spy
    policy._forward = guarded
    try:
        seqs = make_sequences(model_config)
        olds = policy.compute_logprobs(seqs)
        for q, old in zip(seqs, olds):
            q.old_logprobs = old["logprobs"]
        policy.forward_backward(seqs)
        policy.sft_forward_backward(seqs)
    finally:
        pm.to_device = real

    # the mask rule: the local spec gets [1, 1, s, s], TE none (its causal type); both get the batch's padding
    # mask on the batch's device (the routers keep padding out of their aux / z losses; the local spec's MoE
    # layers also skip it)
    class Recorder(torch.nn.Module):
        def forward(self, ids, positions, mask, padding_mask=None):
            checked["masks"].append((None if mask is None else (tuple(mask.shape), mask.device.type),
                                     None if padding_mask is None else (tuple(padding_mask.shape),
                                                                        padding_mask.device.type)))
            return ids

    mb = device.to_device({"input_ids": torch.zeros(2, 5, dtype=torch.long),
                           "position_ids": torch.zeros(2, 5, dtype=torch.long),
                           "padding_mask": torch.zeros(2, 5, dtype=torch.bool)})
    forward(Recorder(), mb)
    policy.layer_spec = "te"
    forward(Recorder(), mb)
    return {**checked, "old_on_host": all(o["logprobs"].device.type == "cpu" for o in olds)}


@pytest.fixture(scope="module")
def placement(tmp_path_factory):
    return run_distributed(placement_worker, 1, (tiny_moe_config(), str(tmp_path_factory.mktemp("p"))))[0]


def test_every_microbatch_tensor_reaches_the_model_through_to_device(placement):
    # 3 paths x >= 1 micro-batch, each with input_ids, labels, loss_mask, positions at least
    assert placement["forwards"] >= 3 and placement["tensors"] >= 4 * placement["forwards"]
    assert placement["old_on_host"]


def test_te_spec_gets_no_square_mask(placement):
    local, te = placement["masks"]
    assert local == (((1, 1, 5, 5), device.compute_device().type), ((2, 5), device.compute_device().type))
    assert te == (None, ((2, 5), device.compute_device().type))


# ---- collectives ----------------------------------------------------------------------------------


def test_gpu_default_group_carries_host_tensors_over_gloo():
    assert device.process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl"
    assert device.process_group_backend(cuda=False) == "gloo"


def groups_worker(rank, world_size):
    """Megatron's groups inherit the default group's per-device backend string (torch passes
    ``backend=None`` groups the default's), so a ``cpu:...`` entry reaches every group our code uses;
    host tensors then all-reduce on each of them. Run with the device-keyed form ``cpu:gloo``: the same
    parsing and inheritance path ``cpu:gloo,cuda:nccl`` takes on a GPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel

    from gspo_megatron.megatron.spawn import free_port

    box = [free_port()]  # a fresh rendezvous for the second default group
    dist.broadcast_object_list(box, src=0)
    dist.destroy_process_group()
    dist.init_process_group("cpu:gloo", init_method=f"tcp://127.0.0.1:{box[0]}", rank=rank, world_size=world_size)
    initialize_model_parallel(ParallelConfig(expert_parallel=2))
    groups = {"world": None, "dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group(),
              "pp": ps.get_pipeline_model_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
              "mp": ps.get_model_parallel_group()}
    out = {}
    for name, group in groups.items():
        flag = torch.tensor([float(rank + 1)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        out[name] = (dist.get_backend_config(group), float(flag))
    return out


def test_megatron_groups_inherit_the_cpu_backend():
    for rank_out in run_distributed(groups_worker, 2):
        for name, (config, value) in rank_out.items():
            assert config == "cpu:gloo", f"{name}: {config}"
        assert rank_out["world"][1] == 2.0 and rank_out["dp"][1] == 2.0


def test_pipeline_results_travel_as_host_tensors():
    """``_from_last_stage`` pickles what ``to_host`` returns: no tensor in it stays on a device."""
    obj = [{"logprobs": torch.ones(2, device=device.compute_device())}, {"loss": torch.zeros(())}]
    host = device.to_host(obj)
    assert all(v.device.type == "cpu" for d in host for v in d.values())


# ---- Transformer Engine names and spec-neutral checkpoints ---------------------------------------


def te_parameter_names(config) -> list[str]:
    """The parameter names of a megatron-core 0.16.1 TE-spec GPTModel of ``config`` at TP=PP=EP=1
    (recorded from the sources, see the module doc)."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not config.tie_word_embeddings:
        names.append("output_layer.weight")
    for layer in range(config.num_layers):
        p = f"decoder.layers.{layer}."
        names += [p + "self_attention.linear_qkv.layer_norm_weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight"]
        if config.qk_layernorm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        if config.is_moe:
            names += [p + "pre_mlp_layernorm.weight", p + "mlp.router.weight"]
            names += [f"{p}mlp.experts.linear_fc{j}.weight{e}" for j in (1, 2) for e in range(config.num_experts)]
        else:
            names += [p + "mlp.linear_fc1.layer_norm_weight", p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    return names


def te_names_worker(rank, world_size, config):
    """TE names through the same translation ``shard_infos`` applies, on a real model's layer numbering."""
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=0)
    model = build_model(config, ParallelConfig())
    local = sorted(info.canonical_name for info, _ in sharding.shard_infos(model))
    translated = sorted(sharding._spec_canonical(name, model) for name in te_parameter_names(config))
    return {"local": local, "te": translated}


@pytest.mark.parametrize("moe", [True, False])
def test_te_parameter_names_translate_to_the_local_canonical_names(moe):
    config = tiny_moe_config() if moe else tiny_moe_config(architecture="qwen3", num_experts=0, ffn_hidden_size=96)
    out = run_distributed(te_names_worker, 1, (config,))[0]
    assert out["te"] == out["local"] == sorted(canonical_shapes(config))


def _te_moe_named_model(config, keys_map: bool):
    """A GPTModel of Megatron's local modules whose MoE layers name their checkpoint keys as the TE MoE
    layer does (``pre_mlp_layernorm.*`` unmapped), with our ``with_moe_keys_map`` when ``keys_map``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from gspo_megatron.megatron import cpu_runtime
    from gspo_megatron.megatron.model import local_layer_spec, transformer_config, with_moe_keys_map
    from gspo_megatron.megatron.parallel import ParallelConfig

    spec = copy.deepcopy(local_layer_spec(config))
    spec.submodules.sharded_state_dict_keys_map = {
        k: v for k, v in spec.submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
    if keys_map:
        spec = with_moe_keys_map(spec)
    tc = transformer_config(config, ParallelConfig())
    return GPTModel(config=tc, transformer_layer_spec=TransformerBlockSubmodules(
        layer_specs=[spec] * config.num_layers, layer_norm=cpu_runtime.local_norm_class()),
        vocab_size=config.padded_vocab_size(1), max_sequence_length=64, position_embedding_type="rope",
        share_embeddings_and_output_weights=config.tie_word_embeddings)


def _same_parameters(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def checkpoint_worker(rank, world_size, config, tmp):
    """Save with one spec's naming, load with the other's, both ways; and the control without the map."""
    from gspo_megatron.megatron import checkpoint, sharding
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=0)
    local = build_model(config, ParallelConfig())
    te_named = _te_moe_named_model(config, keys_map=True)
    sharding.load_full_state_dict(local, {k: torch.randn(v) for k, v in canonical_shapes(config).items()})
    def stored(model) -> list[str]:  # the keys a checkpoint stores (ShardedTensor.key, keys maps applied)
        return sorted(v.key for v in sharding.sharded_state_dict(model).values())

    out = {"keys_local": stored(local), "keys_te": stored(te_named),
           "keys_te_unmapped": stored(_te_moe_named_model(config, keys_map=False))}
    checkpoint.save_model(local, f"{tmp}/from_local")
    checkpoint.load_model(te_named, f"{tmp}/from_local")
    out["local_to_te"] = _same_parameters(local, te_named)
    with torch.no_grad():
        for p in te_named.parameters():
            p.add_(1.0)
    checkpoint.save_model(te_named, f"{tmp}/from_te")
    checkpoint.load_model(local, f"{tmp}/from_te")
    out["te_to_local"] = _same_parameters(local, te_named)
    try:
        checkpoint.load_model(_te_moe_named_model(config, keys_map=False), f"{tmp}/from_local")
        out["unmapped_error"] = None
    except checkpoint.CheckpointError as err:  # the control: the load must fail, naming what is missing
        out["unmapped_error"] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return run_distributed(checkpoint_worker, 1, (tiny_moe_config(), str(tmp_path_factory.mktemp("ckpt"))))[0]


def test_te_moe_keys_map_gives_the_local_checkpoint_keys(checkpoints):
    assert checkpoints["keys_te"] == checkpoints["keys_local"]
    assert any(k.endswith("mlp.linear_fc1.layer_norm_weight") for k in checkpoints["keys_local"])
    # the control: TE MoE naming without the map asks for keys a local checkpoint does not have
    assert any(k.endswith("pre_mlp_layernorm.weight") for k in checkpoints["keys_te_unmapped"])


def test_checkpoints_load_into_either_spec_naming(checkpoints):
    assert checkpoints["local_to_te"] and checkpoints["te_to_local"]
    assert checkpoints["unmapped_error"] is not None and "pre_mlp_layernorm" in checkpoints["unmapped_error"]


def test_extra_state_is_neither_saved_nor_required():
    from gspo_megatron.megatron.sharding import drop_extra_state

    recorded = {"model.decoder.layers.0.self_attention.linear_qkv._extra_state": 0,
                "model.decoder.layers.0.mlp.experts.linear_fc1._extra_state3": 0,
                "model.decoder.layers.0.self_attention.linear_qkv.weight": 1,
                "optimizer": {"x._extra_state": 0, "y": 1}}
    assert drop_extra_state(recorded) == {"model.decoder.layers.0.self_attention.linear_qkv.weight": 1,
                                          "optimizer": {"y": 1}}


# ---- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_policy_model_trains_on_cuda_with_host_sequences():
    """One GSPO step on the GPU at world size 1 (NCCL for device tensors, gloo for host ones)."""
    out = run_distributed(gpu_step_worker, 1, (tiny_moe_config(),))[0]
    assert out["device"] == "cuda" and out["finite"] and out["old_on_host"]


def gpu_step_worker(rank, world_size, config):
    import torch.distributed as dist

    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.megatron.model import ModelRuntime
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import PolicyModel
    from tests.megatron.train_workers import make_sequences

    assert dist.get_backend_config() == "cpu:gloo,cuda:nccl"
    initialize_model_parallel(ParallelConfig(), seed=0)
    policy = PolicyModel(config, ParallelConfig(), OptimizerConfig(lr=1e-3), LossConfig(),
                         runtime=ModelRuntime(precision="bf16", layer_spec="local"))
    seqs = make_sequences(config)
    olds = policy.compute_logprobs(seqs)
    for q, old in zip(seqs, olds):
        q.old_logprobs = old["logprobs"]
    metrics = policy.train_minibatch(seqs)
    return {"device": next(policy.module.parameters()).device.type, "old_on_host": olds[0]["logprobs"].is_cpu,
            "finite": all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))}
