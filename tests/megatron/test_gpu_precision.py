"""Mixed precision, activation recomputation and the layer-spec choice (model.precision / model.recompute /
model.layer_spec), on CPU with Megatron-Core 0.16.1's own mixed-precision optimizer and recompute.

bf16 runs on CPU as it does on a GPU: bf16 parameters, fp32 gradient buffers (grad_reduce_in_fp32) and
fp32 main weights in Megatron's Float16OptimizerWithFloat16Params; no CPU shim was needed.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_megatron.megatron.model import ModelRuntime, recompute_settings, resolve_layer_spec
from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import canonical_weights, tiny_moe_config


def _policy(config, runtime, lr=1e-2):
    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig
    from gspo_megatron.megatron.policy_model import PolicyModel

    policy = PolicyModel(config, ParallelConfig(), OptimizerConfig(lr=lr, clip_grad=0.0), LossConfig(),
                         runtime=runtime)
    sharding.load_full_state_dict(policy.module, canonical_weights(config, seed=1))
    # the optimizer's fp32 main weights were copied at construction: start them from the loaded weights
    policy.reload_main_weights()
    return policy


def _gradients(policy, seqs) -> dict:
    from gspo_megatron.megatron import sharding

    for q, o in zip(seqs, policy.compute_logprobs(seqs)):
        q.old_logprobs = o["logprobs"] + 1e-3  # ratios != 1
    policy.forward_backward(seqs)
    return sharding.full_state_dict(policy.ddp, policy.model_config.vocab_size, grads=True)


def gradients_worker(rank, world_size, config):
    """Gradients of one GSPO mini-batch at fp32, bf16 and with each recompute mode, same weights."""
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from tests.megatron.train_workers import make_sequences

    initialize_model_parallel(ParallelConfig(), seed=0)
    out = {}
    for name, runtime in {"fp32": ModelRuntime(), "bf16": ModelRuntime(precision="bf16"),
                          "selective": ModelRuntime(recompute="selective"),
                          "full": ModelRuntime(recompute="full")}.items():
        policy = _policy(config, runtime)
        out[name] = {"grads": _gradients(policy, make_sequences(config, count=6)),
                     "param_dtype": str(next(policy.module.parameters()).dtype),
                     "recompute": policy.module.config.recompute_granularity,
                     "logprob_dtype": str(policy.compute_logprobs(make_sequences(config, 1))[0]["logprobs"].dtype)}
    return out


@pytest.fixture(scope="module")
def gradients():
    return run_distributed(gradients_worker, 1, (tiny_moe_config(),))[0]


def test_bf16_parameters_with_fp32_logprobs(gradients):
    assert gradients["bf16"]["param_dtype"] == "torch.bfloat16" and gradients["fp32"]["param_dtype"] == "torch.float32"
    assert gradients["bf16"]["logprob_dtype"] == "torch.float32"


def test_bf16_gradients_agree_with_fp32_within_bf16_tolerance(gradients):
    fp32, bf16 = gradients["fp32"]["grads"], gradients["bf16"]["grads"]
    num = sum(float((bf16[k].float() - fp32[k]).norm()) ** 2 for k in fp32) ** 0.5
    den = sum(float(fp32[k].norm()) ** 2 for k in fp32) ** 0.5
    assert den > 0
    # bf16 keeps 8 bits of mantissa (relative step 2^-8 = 0.4%); activations round in every layer
    assert num / den < 0.05, num / den
    assert num > 0  # it did run in bf16


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_identical_gradients(gradients, mode):
    assert gradients[mode]["recompute"] == mode
    for name, grad in gradients["fp32"]["grads"].items():
        torch.testing.assert_close(gradients[mode]["grads"][name], grad, rtol=0, atol=0, msg=name)


def learning_and_resume_worker(rank, world_size, config, tmp):
    """bf16 learns (supervised steps on fixed sequences lower their NLL) and a bf16 checkpoint (model,
    fp32 main weights, Adam state, schedule) resumes exactly: the next step matches bit for bit."""
    from gspo_megatron.megatron import checkpoint
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from tests.megatron.train_workers import make_sequences

    initialize_model_parallel(ParallelConfig(), seed=0)
    runtime = ModelRuntime(precision="bf16")
    policy = _policy(config, runtime, lr=3e-3)
    seqs = make_sequences(config, count=6)
    losses = [float(policy.sft_forward_backward(seqs)["loss"]) for _ in range(1)]
    for _ in range(15):
        policy.optimizer_step()
        losses.append(float(policy.sft_forward_backward(seqs)["loss"]))
    checkpoint.save(policy.sharded_state_dict(), f"{tmp}/ckpt")
    policy.optimizer_step()
    after = {k: v.clone() for k, v in policy.module.state_dict().items() if isinstance(v, torch.Tensor)}

    resumed = _policy(config, runtime, lr=3e-3)
    resumed.load_sharded_state_dict(checkpoint.load(resumed.sharded_state_dict(is_loading=True), f"{tmp}/ckpt"))
    resumed.sft_forward_backward(seqs)
    resumed.optimizer_step()
    same = all(torch.equal(after[k], v) for k, v in resumed.module.state_dict().items() if k in after)
    return {"losses": losses, "resumed_exactly": same, "dtype": str(next(resumed.module.parameters()).dtype)}


def test_bf16_learns_and_resumes_exactly(tmp_path):
    out = run_distributed(learning_and_resume_worker, 1, (tiny_moe_config(), str(tmp_path)))[0]
    losses = out["losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert out["resumed_exactly"] and out["dtype"] == "torch.bfloat16"


def weights_written_outside_the_optimizer_worker(rank, world_size, config, tmp, distributed_optimizer):
    """bf16 (fp32 main weights built with the optimizer): weights written without the optimizer (the canonical
    initialisation; a weights-only checkpoint, ``--init-from``; a Hugging Face folder takes the same
    ``reload_main_weights``), then one optimizer step at lr 1e-10, which moves no weight by a bf16 unit."""
    from types import SimpleNamespace

    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.megatron import checkpoint, sharding
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import PolicyModel
    from gspo_megatron.trainer import checkpointing
    from tests.megatron.train_workers import make_sequences

    initialize_model_parallel(ParallelConfig(), seed=0)
    parallel = ParallelConfig(distributed_optimizer=distributed_optimizer)
    source = _policy(config, ModelRuntime(precision="bf16"))
    checkpoint.save({"model": sharding.sharded_state_dict(source.module, prefix="model.")}, f"{tmp}/weights")

    def params(policy):
        return {k: v.detach().clone() for k, v in policy.module.state_dict().items() if isinstance(v, torch.Tensor)}

    out = {}
    loads = {"canonical": lambda p: checkpointing.initialise_weights(p, config, SimpleNamespace(hf_dir=None, init_seed=7)),
             "init_from": lambda p: checkpointing.load_weights_only(p, Path(f"{tmp}/weights"))}
    for name, load in loads.items():
        policy = PolicyModel(config, parallel, OptimizerConfig(lr=1e-10, clip_grad=0.0), LossConfig(),
                             runtime=ModelRuntime(precision="bf16"))
        built = params(policy)
        load(policy)
        loaded = params(policy)
        policy.sft_forward_backward(make_sequences(config, count=4))
        policy.optimizer_step()
        after = params(policy)
        out[name] = {"load_changed": any(not torch.equal(built[k], v) for k, v in loaded.items()),
                     "kept": sorted(k for k in loaded if torch.equal(after[k], loaded[k])), "keys": sorted(loaded)}
    return out


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_weights_written_outside_the_optimizer_survive_its_first_step(tmp_path, distributed_optimizer):
    """Without ``reload_main_weights`` Megatron's mixed-precision optimizer writes its construction-time fp32
    copies back at the first step: a bf16 run from ``--init-from`` or ``model.hf_dir`` (the GPU path) trained
    the weights the model was built with. Found by the drift map's zero-update control: 75 % of the experts
    changed at a bf16 step of lr 1e-10."""
    out = run_distributed(weights_written_outside_the_optimizer_worker, 1,
                          (tiny_moe_config(), str(tmp_path), distributed_optimizer))[0]
    for name, result in out.items():
        assert result["load_changed"], name  # the load wrote other weights than those built
        assert result["kept"] == result["keys"], (name, sorted(set(result["keys"]) - set(result["kept"])))


# ---- choices --------------------------------------------------------------------------------------


def test_layer_spec_choice():
    assert resolve_layer_spec("auto", cuda=True, te_installed=True) == "te"
    assert resolve_layer_spec("auto", cuda=True, te_installed=False) == "local"  # a GPU without TE still trains
    assert resolve_layer_spec("auto", cuda=False, te_installed=True) == "local"
    assert resolve_layer_spec("local", cuda=True, te_installed=True) == "local"
    with pytest.raises(ValueError, match="model.layer_spec: te needs CUDA and Transformer Engine; transformer_engine"):
        resolve_layer_spec("te", cuda=True, te_installed=False)


def test_auto_asks_megatron_core_whether_transformer_engine_works(tmp_path):
    """A ``transformer_engine`` that is on the path but does not import (a broken install: here a stand-in
    package whose import raises ModuleNotFoundError, as a missing compiled extension does) leaves
    megatron-core 0.16.1 with ``HAVE_TE = False`` and a MagicMock ``te``
    (``megatron/core/extensions/transformer_engine.py``): ``auto`` must then pick the local spec and ``te``
    must be refused by name, on a GPU too (``cuda=True``). Run in a fresh interpreter: megatron-core reads
    the flag once, at import."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    fake = tmp_path / "transformer_engine"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ModuleNotFoundError("No module named transformer_engine_torch")\n')
    probe = ("import importlib.util, warnings; warnings.simplefilter('ignore')\n"
             "from gspo_megatron.megatron.model import resolve_layer_spec\n"
             "import megatron.core.extensions.transformer_engine as te_ext\n"
             "print(importlib.util.find_spec('transformer_engine') is not None, te_ext.HAVE_TE,"
             " resolve_layer_spec('auto', cuda=True))\n"
             "try:\n    resolve_layer_spec('te', cuda=True)\nexcept ValueError as err:\n    print(err)\n")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repo), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "True False local"  # importable by name, not by megatron-core
    assert lines[1].startswith("model.layer_spec: te needs CUDA and Transformer Engine; transformer_engine")


def test_recompute_settings_use_megatron_names():
    assert recompute_settings("none", grouped_gemm=False) == {}
    assert recompute_settings("full", grouped_gemm=False) == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    assert recompute_settings("selective", grouped_gemm=True)["recompute_modules"] == ["core_attn", "moe_act"]


def grad_buffer_worker(rank, world_size, config):
    """model.grad_reduce_in_fp32: the DDP gradient buffers are fp32 by default, bf16 when off; both step."""
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from tests.megatron.train_workers import make_sequences

    initialize_model_parallel(ParallelConfig(), seed=0)
    out = {}
    for fp32 in (True, False):
        policy = _policy(config, ModelRuntime(precision="bf16", grad_reduce_in_fp32=fp32), lr=3e-3)
        seqs = make_sequences(config, count=4)
        first = float(policy.sft_forward_backward(seqs)["loss"])
        grad_dtype = str(next(p for p in policy.module.parameters() if p.requires_grad).main_grad.dtype)
        for _ in range(5):
            policy.optimizer_step()
            last = float(policy.sft_forward_backward(seqs)["loss"])
        out[fp32] = {"grad_dtype": grad_dtype, "first": first, "last": last}
    return out


def test_gradient_reduce_precision_is_a_setting():
    out = run_distributed(grad_buffer_worker, 1, (tiny_moe_config(),))[0]
    assert out[True]["grad_dtype"] == "torch.float32" and out[False]["grad_dtype"] == "torch.bfloat16"
    assert all(o["last"] < o["first"] for o in out.values()), out
