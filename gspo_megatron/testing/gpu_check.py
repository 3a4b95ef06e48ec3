"""The project's GPU check (``tools/gpu_check.sh``; docs/gpu.md, "The project's GPU check").

Seven independent steps, each run by a driver in its own process with its own timeout. Every step ends in
exactly one JSON line, printed as ``GPU_CHECK {...}`` and appended to a results file, whatever the other
steps do: a step that raises, dies or times out gets a line from the driver (``"ok": false`` and the
error). The steps:

    a_versions     torch, CUDA, the device, bf16, megatron-core and its HAVE_TE, transformers
    b_gspo_step    a GSPO step in bf16 with selective and with full recomputation: tokens/s, peak memory,
                   and the on-policy audit (first mini-batch at equal weights: sequence ratios and clip
                   fractions; two log-prob passes compared against the 3e-4 clip)
    c_logprob_gap  the transformers engine generating on the device with Megatron's weights, against
                   Megatron's recomputed log-probs of the same tokens
    d_memory_sync  memory through an update and a tensor-mode sync (export_hf_tensors, the tensor sync's
                   payloads, a local receiving process): reserved before / after empty_cache, the sync's
                   peak against the model's bytes, the sender dropping each bucket once acknowledged and
                   holding every bucket to the end
    e_cuda_ipc     a payload of ``serialize_named_tensors`` unpickled in a second process with SGLang
                   0.5.23's allowlist (``SafeUnpickler``), checksums compared; a blocked global refused
    f_checkpoint   the distributed optimizer: save, load into a fresh model and optimizer, parameters and
                   Adam state equal
    g_offload      the same round trip with half the optimizer offloaded to the host
                   (``optimizer.cpu_offload_fraction``), and its peak memory against f's; on the CPU it is
                   built only (its step copies gradients from CUDA parameters)

``--cpu`` runs every step on the CPU (gloo, shared memory instead of CUDA IPC) at ``--size tiny``: the
CPU test of the plumbing (tests/megatron/test_gpu_check.py). ``GSPO_GPU_CHECK_INJECT=b_gspo_step:raise``
(or ``:hang``; comma-separated, step names or letters) makes a step fail, to test the driver.

    python -m gspo_megatron.testing.gpu_check [--cpu] [--size tiny|gpu] [--results PATH] [--steps a,b,...]
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import faulthandler
import gc
import io
import json
import math
import os
import pickle
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gspo_megatron.algorithms.config import PAPER_CLIP

PREFIX = "GPU_CHECK "
INJECT_ENV = "GSPO_GPU_CHECK_INJECT"
GSPO_CLIP = PAPER_CLIP["gspo"][0]  # GSPO's clip_low, 3e-4: the scale GPU non-determinism must stay well under


# ------------------------------------------------------------------------------------------------ sizes

@dataclasses.dataclass(frozen=True)
class Size:
    """Model and batch sizes of one check run."""

    model: dict
    seqs: int  # training sequences per GSPO step
    prompt: int  # prompt tokens of each training sequence
    length: int  # tokens of each training sequence
    microbatch_tokens: int
    gen_prompts: int  # (c): prompts, samples per prompt, new tokens
    gen_samples: int
    gen_new_tokens: int
    bucket_bytes: int  # (d): the sync's bucket size
    ipc_bytes: int  # (e): bytes of the largest tensor of the IPC payload


SIZES = {
    # ~0.49 B parameters: 8 layers of 16 experts (top-2, 1024 wide) at hidden 1024, 32k vocabulary; a
    # 64 x 512-token step. Sized so the whole check stays well inside the lent H200's 9 minutes.
    "gpu": Size(model=dict(architecture="qwen3_moe", vocab_size=32000, hidden_size=1024, num_layers=8,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16,
                           moe_ffn_hidden_size=1024, moe_router_topk=2, norm_topk_prob=True,
                           rope_theta=1_000_000.0, max_position_embeddings=4096),
                seqs=64, prompt=128, length=512, microbatch_tokens=8192, gen_prompts=32, gen_samples=4,
                gen_new_tokens=128, bucket_bytes=128 << 20, ipc_bytes=256 << 20),
    # the CPU dry run: the test model of tests/ (2 layers, 64 wide, 4 experts top-2)
    "tiny": Size(model=dict(architecture="qwen3_moe", vocab_size=96, hidden_size=64, num_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            moe_ffn_hidden_size=32, moe_router_topk=2, norm_topk_prob=True, rope_theta=10000.0,
                            max_position_embeddings=256),
                 seqs=4, prompt=8, length=24, microbatch_tokens=64, gen_prompts=2, gen_samples=2,
                 gen_new_tokens=8, bucket_bytes=16 << 10, ipc_bytes=1 << 20),
}


@dataclasses.dataclass(frozen=True)
class Context:
    """What every step is told: the device to use, the sizes and the precision."""

    cpu: bool
    size: Size
    precision: str  # bf16 on both: the CPU runs Megatron's bf16 path too (docs/gpu.md, CPU notes)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.cpu else "cuda")


def model_config(size: Size):
    from gspo_megatron.megatron.model_config import ModelConfig

    config = ModelConfig(**size.model)
    config.validate("gpu_check")
    return config


def parameter_count(config) -> int:
    """Parameters of a Qwen3-MoE-shaped ``config`` without norms (the canonical tensors' elements)."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (config.num_attention_heads + 2 * config.num_key_value_heads) + config.num_attention_heads * d * h
    experts = config.num_experts * 3 * h * config.moe_ffn_hidden_size + config.num_experts * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * (attention + experts) + embeddings


# ------------------------------------------------------------------------------------------- helpers

def _gib(n: int | float) -> float:
    return round(n / 2**30, 4)


def _sync(ctx: Context) -> None:
    # the CPU runs kernels synchronously; on CUDA a timer or memory reading must wait for the queue
    if not ctx.cpu:
        torch.cuda.synchronize()


def _memory(ctx: Context) -> dict[str, float | None]:
    """Allocated, reserved and peak allocated GiB on the device (None on the CPU, which has no
    caching allocator to read)."""
    if ctx.cpu:
        return {"allocated_gib": None, "reserved_gib": None, "peak_gib": None}
    return {"allocated_gib": _gib(torch.cuda.memory_allocated()), "reserved_gib": _gib(torch.cuda.memory_reserved()),
            "peak_gib": _gib(torch.cuda.max_memory_allocated())}


def _reset_peak(ctx: Context) -> None:
    if not ctx.cpu:  # the CPU has no peak counter (see _memory)
        torch.cuda.reset_peak_memory_stats()


def _start_distributed(ctx: Context, parallel) -> None:
    """World size 1 through the project's own initialisation (NCCL + gloo on CUDA, gloo on the CPU)."""
    from gspo_megatron.megatron import parallel as par
    from gspo_megatron.megatron.spawn import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    par.init_process_group(0, 1, master_port=free_port())
    par.initialize_model_parallel(parallel, seed=0)


def _policy(ctx: Context, parallel, recompute: str = "selective", seed: int = 0, optim=None):
    """A PolicyModel (GSPO loss) of ``ctx``'s model on the local spec (no Transformer Engine travels);
    ``optim`` defaults to Adam at lr 1e-5."""
    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.megatron import parallel as par
    from gspo_megatron.megatron.model import ModelRuntime
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.policy_model import PolicyModel

    par.initialize_model_parallel(parallel, seed=seed)  # re-seeds: a fresh model of another seed differs
    return PolicyModel(model_config(ctx.size), parallel, optim or OptimizerConfig(lr=1e-5), LossConfig(algorithm="gspo"),
                       max_tokens_per_microbatch=ctx.size.microbatch_tokens,
                       runtime=ModelRuntime(precision=ctx.precision, recompute=recompute, layer_spec="local"))


def _sequences(ctx: Context, seed: int):
    """``size.seqs`` random sequences with random advantages (the update's numbers, not a task's)."""
    from gspo_megatron.batching import TrainSequence

    vocab = ctx.size.model["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(ctx.size.seqs):
        q = TrainSequence(torch.randint(0, vocab, (ctx.size.length,), generator=gen), ctx.size.prompt)
        q.advantage = float(torch.randn((), generator=gen))
        seqs.append(q)
    return seqs


def _logprobs(policy, seqs) -> list[torch.Tensor]:
    return [out["logprobs"].float().cpu() for out in policy.compute_logprobs(seqs)]


def _finite(metrics: dict[str, float], where: str) -> None:
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
        raise RuntimeError(f"{where}: non-finite metrics {bad}")


# --------------------------------------------------------------------------------------------- steps

def step_versions(ctx: Context) -> dict:
    """(a) What the machine and the carried packages are."""
    import megatron.core
    import transformers
    from megatron.core.extensions import transformer_engine as mcore_te

    from gspo_megatron.megatron.model import resolve_layer_spec

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "megatron_core": megatron.core.__version__,
           "megatron_core_path": str(Path(megatron.core.__file__).parent),
           # megatron-core 0.16.1 extensions/transformer_engine.py: HAVE_TE is False when TE does not import
           "mcore_have_te": bool(mcore_te.HAVE_TE), "transformers": transformers.__version__,
           "layer_spec_auto": resolve_layer_spec("auto")}
    if ctx.cpu:
        out.update(device="cpu", bf16=True)  # Megatron's bf16 path runs on the CPU (docs/gpu.md, CPU notes)
    else:
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                   total_gib=_gib(props.total_memory), bf16=torch.cuda.is_bf16_supported(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())), device_count=torch.cuda.device_count())
    return out


def _audit(policy, seqs) -> dict:
    """The on-policy audit of a mini-batch at equal weights: two log-prob passes (GPU non-determinism,
    as the GSPO sequence ratio sees it), then the first mini-batch's ratios and clip fractions, with
    old log-probs from the first pass (the weights have not moved, so every s_i should be 1)."""
    first, second = _logprobs(policy, seqs), _logprobs(policy, seqs)
    token_diff = max(float((a - b).abs().max()) for a, b in zip(first, second))
    # GSPO's s_i = exp(mean token log-ratio): how far two passes alone move it
    seq_dev = max(abs(math.expm1(float((b - a).mean()))) for a, b in zip(first, second))
    for q, old in zip(seqs, first):
        q.old_logprobs = old
    metrics = policy.train_minibatch(seqs)
    _finite(metrics, "b_gspo_step")
    keys = ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max", "clip_frac_seq", "clip_frac_token",
            "clip_frac_low_seq", "clip_frac_high_seq")
    return {"passes_max_token_logprob_diff": token_diff, "passes_max_seq_ratio_dev": seq_dev,
            "passes_within_clip": seq_dev < GSPO_CLIP, "clip": GSPO_CLIP,
            **{f"first_{k}": metrics[k] for k in keys},
            "first_seq_ratio_max_dev": max(abs(metrics["seq_ratio_max"] - 1), abs(metrics["seq_ratio_min"] - 1))}


def step_gspo(ctx: Context) -> dict:
    """(b) One warm-up GSPO step (with the audit), then a timed one, at each recomputation."""
    from gspo_megatron.megatron import parallel as par

    parallel = par.ParallelConfig()
    _start_distributed(ctx, parallel)
    tokens = ctx.size.seqs * ctx.size.length
    out: dict[str, Any] = {"params": parameter_count(model_config(ctx.size)), "precision": ctx.precision,
                           "tokens": tokens}
    for recompute in ("selective", "full"):
        policy = _policy(ctx, parallel, recompute)
        audit = _audit(policy, _sequences(ctx, 0))  # the warm-up (allocator, kernels) is the audited step
        seqs = _sequences(ctx, 1)
        _sync(ctx)
        _reset_peak(ctx)
        start = time.perf_counter()
        for q, old in zip(seqs, policy.compute_logprobs(seqs)):
            q.old_logprobs = old["logprobs"]
        metrics = policy.train_minibatch(seqs)
        _sync(ctx)
        elapsed = time.perf_counter() - start
        _finite(metrics, f"b_gspo_step ({recompute})")
        out[recompute] = {"seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1),
                          "peak_gib": _memory(ctx)["peak_gib"], "grad_norm": metrics["grad_norm"], "audit": audit}
        del policy
        gc.collect()  # the next recomputation's peak must not count this model
        if not ctx.cpu:
            torch.cuda.empty_cache()
    return out


def _sync_peak(ctx: Context, policy, receiver: "ReceiverProcess", hold: bool) -> tuple[dict, list[str]]:
    """One sync through ``export_hf_tensors`` and the tensor sync's payloads into ``receiver`` (a second
    process). ``hold``: the sender keeps every bucket until the sync ends (what a sender that frees
    nothing before the last acknowledgement holds); else it drops each bucket once the receiver
    acknowledged it and lets CUDA free what the IPC handle pinned (``ipc_collect``). The peak is this
    process's allocation above what it held before the sync."""
    from gspo_megatron.conversion.export import export_hf_tensors

    held, names, nbytes, buckets = [], [], 0, 0
    _sync(ctx)
    before = 0 if ctx.cpu else torch.cuda.memory_allocated()
    _reset_peak(ctx)
    start = time.perf_counter()
    for bucket in export_hf_tensors(policy.ddp, policy.model_config, ctx.size.bucket_bytes):
        receiver.send(bucket)
        names += [n for n, _ in bucket]
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        buckets += 1
        if hold:
            held.append(bucket)
        del bucket
        if not hold and not ctx.cpu:  # CUDA only: the handles' pinned blocks (no such thing on the CPU)
            torch.cuda.ipc_collect()
    _sync(ctx)
    elapsed = time.perf_counter() - start
    peak = None if ctx.cpu else torch.cuda.max_memory_allocated() - before
    held.clear()
    if not ctx.cpu:
        torch.cuda.ipc_collect()
    return {"seconds": round(elapsed, 3), "buckets": buckets, "tensors": len(names), "bytes": nbytes,
            "extra_peak_gib": None if peak is None else _gib(peak),
            "extra_peak_over_model": None if peak is None else round(peak / nbytes, 4)}, names


def served_weight_names(config) -> list[str]:
    """Every weight name the transformers model of ``config`` loads (the rollout engine's own list), read
    off a model built on the meta device (no memory)."""
    import transformers

    from gspo_megatron.rollout.hf_engine import weight_slots

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config.to_hf_config())
    return sorted(weight_slots(model)[1])


def step_memory_sync(ctx: Context) -> dict:
    """(d) An update, empty_cache, then the same model synced twice through the tensor sync's export and
    payloads into a receiving process: the sender dropping each bucket once acknowledged, then holding all
    until the end."""
    from gspo_megatron.megatron import parallel as par

    # the served model's names first (a meta-device transformers model; see step_logprob_gap for the order)
    expected = served_weight_names(model_config(ctx.size))
    parallel = par.ParallelConfig()
    _start_distributed(ctx, parallel)
    policy = _policy(ctx, parallel)
    seqs = _sequences(ctx, 0)
    for q, old in zip(seqs, policy.compute_logprobs(seqs)):
        q.old_logprobs = old["logprobs"]
    _finite(policy.train_minibatch(seqs), "d_memory_sync")
    _sync(ctx)
    after_update = _memory(ctx)
    if not ctx.cpu:  # the CPU allocator has no cache to empty
        torch.cuda.empty_cache()
    after_empty = _memory(ctx)
    with ReceiverProcess() as receiver:
        released, names = _sync_peak(ctx, policy, receiver, hold=False)
        held, _ = _sync_peak(ctx, policy, receiver, hold=True)
    if sorted(names) != expected:
        raise RuntimeError(f"d_memory_sync: the sync sent {len(names)} tensors, the served model "
                           f"needs {len(expected)}; differing: {sorted(set(names) ^ set(expected))[:5]}")
    _sync(ctx)
    after_sync = _memory(ctx)
    if not ctx.cpu:
        torch.cuda.empty_cache()
    return {"model_bytes": released["bytes"], "model_gib": _gib(released["bytes"]),
            "bucket_bytes": ctx.size.bucket_bytes, "after_update": after_update,
            "after_update_empty_cache": after_empty, "sync_release_each_bucket": released,
            "sync_hold_all_buckets": held, "after_sync": after_sync,
            "after_sync_empty_cache": _memory(ctx)}


def step_logprob_gap(ctx: Context) -> dict:
    """(c) The transformers engine, given Megatron's weights through the weight sync, samples on the device;
    Megatron recomputes the log-probs of the same tokens at the same temperature."""
    from gspo_megatron.batching import TrainSequence
    from gspo_megatron.megatron import parallel as par
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.hf_engine import HFRolloutEngine
    from gspo_megatron.rollout.weight_sync import sync_weights

    config = model_config(ctx.size)
    # the engine first, as a launch starts its servers before the trainer (and on the CPU before the CPU
    # runtime replaces torch.cuda.Stream, which transformers' generation modules read at import)
    engine = HFRolloutEngine(config.to_hf_config(), dtype=torch.bfloat16, device=ctx.device, init_seed=1)
    parallel = par.ParallelConfig()
    _start_distributed(ctx, parallel)
    policy = _policy(ctx, parallel)
    sync_weights(policy.ddp, config, engine, bucket_bytes=ctx.size.bucket_bytes)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (ctx.size.prompt,), generator=gen).tolist()
               for _ in range(ctx.size.gen_prompts)]
    params = SamplingParams(max_new_tokens=ctx.size.gen_new_tokens, temperature=1.0, seed=3)
    engine.generate(prompts, ctx.size.gen_samples, params)  # warm-up
    _sync(ctx)
    start = time.perf_counter()
    samples = engine.generate(prompts, ctx.size.gen_samples, params)
    _sync(ctx)
    elapsed = time.perf_counter() - start
    samples = [s for s in samples if s.response_ids]
    seqs = [TrainSequence(torch.tensor(prompts[s.prompt_index] + s.response_ids), len(prompts[s.prompt_index]))
            for s in samples]
    trainer = _logprobs(policy, seqs)
    diffs = [t - torch.tensor(s.logprobs, dtype=torch.float32) for t, s in zip(trainer, samples)]
    token = torch.cat(diffs)
    tokens = int(token.numel())
    return {"samples": len(samples), "tokens": tokens, "generate_seconds": round(elapsed, 3),
            "generate_tokens_per_s": round(tokens / elapsed, 1), "engine_dtype": "bf16",
            "trainer_precision": ctx.precision, "token_abs_gap_mean": float(token.abs().mean()),
            "token_abs_gap_max": float(token.abs().max()), "token_gap_mean": float(token.mean()),
            # the gap as GSPO's sequence ratio pi_old / pi_rollout sees it
            "seq_ratio_dev_max": max(abs(math.expm1(float(d.mean()))) for d in diffs),
            "peak_gib": _memory(ctx)["peak_gib"]}


# ---- (e) CUDA IPC under SGLang's unpickling rules

# The globals a ``serialize_named_tensors`` payload may name, each one in SGLang 0.5.23's
# ``SafeUnpickler.ALLOWED_GLOBALS`` (python/sglang/srt/utils/common.py), which refuses every other global:
# the torch rebuild functions (CUDA IPC handles, shared-memory CPU storages), storages, dtypes, devices and
# SGLang's UUID rebuild (utils/patch_torch.py, used when sglang patches the trainer's reductions).
SGLANG_TENSOR_GLOBALS = frozenset({
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "dtype"),
    ("torch.nn.parameter", "Parameter"),
    ("copyreg", "__newobj__"),
    ("collections", "OrderedDict"),
    ("multiprocessing.resource_sharer", "DupFd"),
} | {("torch", name) for name in ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32",
                                  "int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2")})


class AllowlistUnpickler(pickle.Unpickler):
    """Unpickles like SGLang 0.5.23's ``MultiprocessingSerializer.deserialize`` (a ``pickle.Unpickler``
    whose ``find_class`` refuses any global outside an allowlist), with the allowlist above."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in SGLANG_TENSOR_GLOBALS:
            raise pickle.UnpicklingError(f"blocked global {module}.{name}: not in SGLang 0.5.23's allowlist")
        return super().find_class(module, name)


def safe_deserialize(payload: str) -> list:
    """A base64 ``serialize_named_tensors`` payload -> [(name, tensor)], under ``AllowlistUnpickler``."""
    return AllowlistUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()


def _checksum(t: torch.Tensor) -> float:
    """float64 sum of ``t`` on its own device, in 1 Mi-element chunks (a bounded temporary: (d) measures
    the sync's peak, which a float64 copy of a whole tensor would inflate)."""
    return float(sum(float(c.double().sum()) for c in t.reshape(-1).split(1 << 20))) if t.numel() else 0.0


def _checksums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """name -> [checksum, dtype, shape, device type]."""
    return {n: [_checksum(t), str(t.dtype), list(t.shape), t.device.type] for n, t in named}


def receive_main() -> None:
    """The receiving process of (d) and (e): one request a line on stdin, one JSON answer a line.
    ``tensors PAYLOAD``: unpickle under the allowlist, answer the checksums, drop the tensors (their IPC
    handles close) before answering; ``blocked PAYLOAD``: answer the refusal (or null if accepted)."""
    for line in sys.stdin:
        kind, _, payload = line.strip().partition(" ")
        start = time.perf_counter()
        if kind == "tensors":
            named = safe_deserialize(payload)
            answer = {"checksums": _checksums(named)}
            del named
        elif kind == "blocked":
            try:
                safe_deserialize(payload)
                answer = {"refusal": None}
            except pickle.UnpicklingError as err:  # the refusal is the answer here
                answer = {"refusal": str(err)}
        else:
            raise SystemExit(f"gpu_check --receive: unknown request {kind!r}")
        print(json.dumps({**answer, "seconds": time.perf_counter() - start}), flush=True)


class ReceiverProcess:
    """A second process that takes ``serialize_named_tensors`` payloads as SGLang does (``receive_main``)."""

    def __enter__(self) -> "ReceiverProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "gspo_megatron.testing.gpu_check", "--receive"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def ask(self, kind: str, payload: str) -> dict:
        self.proc.stdin.write(f"{kind} {payload}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiving process ended (exit status {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def send(self, bucket) -> float:
        """The bucket through the tensor sync's payload; its checksums compared; the receiver's seconds."""
        from gspo_megatron.rollout.sglang.weight_sync import serialize_named_tensors

        answer = self.ask("tensors", serialize_named_tensors(bucket))
        sent = _checksums(bucket)
        if answer["checksums"] != sent:
            raise RuntimeError(f"the receiver read other tensors than were sent: {answer['checksums']} != {sent}")
        return answer["seconds"]

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        if self.proc.wait(timeout=60) != 0 and exc[0] is None:
            raise RuntimeError(f"the receiving process exited with status {self.proc.returncode}")


def step_cuda_ipc(ctx: Context) -> dict:
    """(e) A bucket of the dtypes a sync sends, with a view, on the device, to a second process and back
    (checksums), and a payload naming another global, which the receiver must refuse."""
    gen = torch.Generator().manual_seed(0)
    big = ctx.size.ipc_bytes // 2
    bucket = [("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(big, generator=gen).to(torch.bfloat16)),
              ("model.norm.weight", torch.rand(1000, generator=gen)),
              ("model.embed_tokens.weight", torch.randn(64, 32, generator=gen).half()),
              ("counter", torch.arange(7, dtype=torch.int64))]
    bucket = [(n, t.to(ctx.device)) for n, t in bucket]
    bucket.append(("a_view", bucket[0][1][10:20]))  # a view: an offset into a shared storage
    start = time.perf_counter()
    with ReceiverProcess() as receiver:
        started = time.perf_counter() - start
        start = time.perf_counter()
        receiver_s = receiver.send(bucket)
        round_trip = time.perf_counter() - start
        refusal = receiver.ask("blocked", base64.b64encode(pickle.dumps(os.getcwd)).decode("ascii"))["refusal"]
    if not refusal:
        raise RuntimeError("e_cuda_ipc: the receiver accepted a payload naming os.getcwd")
    return {"tensors": len(bucket), "bytes": sum(t.numel() * t.element_size() for _, t in bucket),
            "receiver_start_seconds": round(started, 3), "round_trip_seconds": round(round_trip, 4),
            "receiver_seconds": round(receiver_s, 4), "devices": sorted({t.device.type for _, t in bucket}),
            "blocked_global_refused": refusal}


# ---- (f) checkpoint

def _optimizer_tensors(optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every main parameter and Adam state tensor of a Megatron optimizer (chained or not), in order."""
    from gspo_megatron.megatron.optimizer import chained_parts

    parts = chained_parts(optimizer)
    out = []
    for i, part in enumerate(parts):
        inner = part.optimizer  # the torch Adam on the (sharded) fp32 main parameters
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                out.append((f"{i}.{g}.{j}.param", p.detach()))
                for key, value in sorted(inner.state.get(p, {}).items()):
                    out.append((f"{i}.{g}.{j}.{key}", value if torch.is_tensor(value) else torch.tensor(value)))
    return out


def _max_diff(a: Sequence[tuple[str, torch.Tensor]], b: Sequence[tuple[str, torch.Tensor]], what: str) -> float:
    if [n for n, _ in a] != [n for n, _ in b]:
        raise RuntimeError(f"f_checkpoint: the {what} differ in their entries: {len(a)} against {len(b)}")
    return max((float((x.double() - y.double()).abs().max()) if x.numel() else 0.0) for (_, x), (_, y) in zip(a, b))


def _round_trip(ctx: Context, directory: Path, step: str, optim) -> dict:
    """Two updates with the distributed optimizer, save, a fresh model and optimizer (another seed),
    load, compare; then one more update on both (the loaded Adam state and step count drive it)."""
    from gspo_megatron.megatron import checkpoint as ckpt
    from gspo_megatron.megatron import parallel as par

    parallel = par.ParallelConfig(distributed_optimizer=True)
    _start_distributed(ctx, parallel)
    _reset_peak(ctx)
    policy = _policy(ctx, parallel, seed=0, optim=optim)
    for seed in (0, 1):
        seqs = _sequences(ctx, seed)
        for q, old in zip(seqs, policy.compute_logprobs(seqs)):
            q.old_logprobs = old["logprobs"]
        _finite(policy.train_minibatch(seqs), step)
    peak = _memory(ctx)["peak_gib"]
    start = time.perf_counter()
    path = ckpt.save(policy.sharded_state_dict(), directory / "step_2")
    save_s = time.perf_counter() - start
    fresh = _policy(ctx, parallel, seed=7, optim=optim)
    params = lambda p: [(n, t.detach()) for n, t in p.module.named_parameters()]  # noqa: E731
    before = _max_diff(params(policy), params(fresh), "parameters")
    if before == 0.0:
        raise RuntimeError(f"{step}: the fresh model equals the trained one before the load (seeds)")
    start = time.perf_counter()
    fresh.load_sharded_state_dict(ckpt.load(fresh.sharded_state_dict(is_loading=True), path))
    load_s = time.perf_counter() - start
    out = {"training_peak_gib": peak, "save_seconds": round(save_s, 3), "load_seconds": round(load_s, 3),
           "bytes_on_disk": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
           "param_diff_before_load": before,
           "param_max_diff": _max_diff(params(policy), params(fresh), "parameters"),
           "optimizer_max_diff": _max_diff(_optimizer_tensors(policy.optimizer), _optimizer_tensors(fresh.optimizer),
                                           "optimizer states"),
           "optimizer_tensors": len(_optimizer_tensors(policy.optimizer)),
           "lr_equal": policy.current_lr() == fresh.current_lr()}
    if out["param_max_diff"] != 0.0 or out["optimizer_max_diff"] != 0.0 or not out["lr_equal"]:
        raise RuntimeError(f"{step}: the loaded state differs from the saved one: {out}")
    seqs = _sequences(ctx, 2)
    for model in (policy, fresh):
        for q, old in zip(seqs, model.compute_logprobs(seqs)):
            q.old_logprobs = old["logprobs"]
        model.train_minibatch(seqs)
    # equal up to the device's non-determinism (atomics in the backward); exactly equal on the CPU
    out["param_max_diff_after_next_update"] = _max_diff(params(policy), params(fresh), "parameters")
    return out


def step_checkpoint(ctx: Context, directory: Path) -> dict:
    """(f) The distributed optimizer's checkpoint round trip (``_round_trip``)."""
    return _round_trip(ctx, directory, "f_checkpoint", None)


OFFLOAD_FRACTION = 0.5


def step_offload(ctx: Context, directory: Path) -> dict:
    """(g) Half the optimizer on the host (megatron-core's HybridDeviceOptimizer): the same round trip as
    (f), whose ``training_peak_gib`` to compare is in f's line. On the CPU the offloaded optimizer is built
    only: its step copies gradients from CUDA parameters to their host copies (megatron-core 0.16.1
    ``hybrid_optimizer.py`` ~101), and a CPU run has none."""
    from gspo_megatron.megatron.optimizer import OptimizerConfig

    optim = OptimizerConfig(lr=1e-5, cpu_offload_fraction=OFFLOAD_FRACTION)
    if ctx.cpu:
        from gspo_megatron.megatron import parallel as par

        parallel = par.ParallelConfig(distributed_optimizer=True)
        _start_distributed(ctx, parallel)
        inner = _policy(ctx, parallel, optim=optim).optimizer.chained_optimizers[0].optimizer
        return {"offload_fraction": OFFLOAD_FRACTION, "inner_optimizer": type(inner).__name__, "stepped": False}
    return {"offload_fraction": OFFLOAD_FRACTION, **_round_trip(ctx, directory, "g_offload", optim)}


STEPS: dict[str, Callable[..., dict]] = {
    "a_versions": step_versions, "b_gspo_step": step_gspo, "c_logprob_gap": step_logprob_gap,
    "d_memory_sync": step_memory_sync, "e_cuda_ipc": step_cuda_ipc, "f_checkpoint": step_checkpoint,
    "g_offload": step_offload,
}
# seconds each step may take on the GPU (imports included); the CPU run scales them (--timeout-scale)
TIMEOUTS = {"a_versions": 40, "b_gspo_step": 130, "c_logprob_gap": 70, "d_memory_sync": 70, "e_cuda_ipc": 40,
            "f_checkpoint": 70, "g_offload": 70}


def resolve_steps(spec: str | None) -> list[str]:
    """'a,c' or 'a_versions,c_logprob_gap' -> step names, in the check's order; None: all."""
    if not spec:
        return list(STEPS)
    wanted = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        match = [name for name in STEPS if name == item or name.split("_", 1)[0] == item]
        if not match:
            raise SystemExit(f"gpu_check: unknown step {item!r}; steps: {', '.join(STEPS)} (or their letters)")
        wanted += match
    return [name for name in STEPS if name in wanted]


def injected(step: str, environ=os.environ) -> str | None:
    """The failure ``GSPO_GPU_CHECK_INJECT`` asks of ``step`` ('raise' or 'hang'), else None."""
    for item in filter(None, (s.strip() for s in environ.get(INJECT_ENV, "").split(","))):
        name, _, how = item.partition(":")
        if how not in ("raise", "hang"):
            raise SystemExit(f"{INJECT_ENV}: {item!r} must be STEP:raise or STEP:hang")
        if resolve_steps(name) == [step]:
            return how
    return None


def run_step(name: str, ctx: Context, workdir: Path) -> dict:
    """Run one step in this process; returns its figures (raises on failure)."""
    how = injected(name)
    if how == "raise":
        raise RuntimeError(f"{name}: failure injected by {INJECT_ENV}")
    if how == "hang":
        time.sleep(10**6)
    if not ctx.cpu and not torch.cuda.is_available():
        raise RuntimeError(f"{name}: no CUDA device (use --cpu for the CPU dry run)")
    if name in ("f_checkpoint", "g_offload"):
        return STEPS[name](ctx, workdir)
    return STEPS[name](ctx)


# ---------------------------------------------------------------------------------------------- driver

def default_results_path(environ=os.environ) -> Path:
    """$OUT/gpu_check.jsonl on the lent machine (what comes back), else build/gpu_check.jsonl."""
    if environ.get("OUT"):
        return Path(environ["OUT"]) / "gpu_check.jsonl"
    return Path(__file__).resolve().parents[2] / "build" / "gpu_check.jsonl"


def emit(record: dict, results: Path) -> None:
    """Print the step's line and append it to the results file (one JSON object a line)."""
    line = json.dumps(record, sort_keys=True)
    print(PREFIX + line, flush=True)
    with results.open("a") as f:
        f.write(line + "\n")


def parse_result(stdout: str) -> dict | None:
    lines = [ln[len(PREFIX):] for ln in stdout.splitlines() if ln.startswith(PREFIX)]
    return json.loads(lines[-1]) if lines else None


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-2000:]


def drive_step(name: str, args: argparse.Namespace, timeout_s: float, workdir: Path) -> dict:
    """One step in its own process (a new session, so a timeout ends its helpers too); the record."""
    cmd = [sys.executable, "-m", "gspo_megatron.testing.gpu_check", "--run-step", name, "--size", args.size,
           "--precision", args.precision, "--workdir", str(workdir),
           # a hung step writes where each of its threads is, shortly before it is killed
           "--traceback-after-s", str(max(1.0, timeout_s - 3))] + (["--cpu"] if args.cpu else [])
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    seconds = round(time.perf_counter() - start, 2)
    base = {"step": name, "seconds": seconds, "cpu": args.cpu, "size": args.size}
    result = parse_result(stdout)
    if timed_out or proc.returncode != 0 or result is None:  # the whole log of a failed step, for its reader
        sys.stderr.write(f"---- {name} failed after {seconds} s; its output: ----\n{stdout}{stderr}\n")
    if timed_out:
        return {**base, "ok": False, "error": f"timed out after {timeout_s:g} s (killed)", "log_tail": _tail(stderr)}
    if proc.returncode != 0 or result is None:
        return {**base, "ok": False, "error": f"exit status {proc.returncode}: {_tail(stderr, 3)}",
                "log_tail": _tail(stderr)}
    return {**base, **result}


def drive(args: argparse.Namespace) -> int:
    """All the chosen steps, each bounded by its timeout and by what is left of ``--budget-s``."""
    results = Path(args.results) if args.results else default_results_path()
    results.parent.mkdir(parents=True, exist_ok=True)
    steps = resolve_steps(args.steps)
    deadline = time.monotonic() + args.budget_s
    failed = []
    with tempfile.TemporaryDirectory(prefix="gspo-gpu-check-") as tmp:
        for name in steps:
            left = deadline - time.monotonic()
            if left < 5:
                record = {"step": name, "ok": False, "seconds": 0.0, "cpu": args.cpu, "size": args.size,
                          "error": f"not started: the check's budget of {args.budget_s:g} s is spent"}
            else:
                workdir = Path(tmp) / name
                workdir.mkdir()
                record = drive_step(name, args, min(TIMEOUTS[name] * args.timeout_scale, left), workdir)
            emit(record, results)
            if not record["ok"]:
                failed.append(name)
    print(f"gpu_check: {len(steps) - len(failed)}/{len(steps)} steps ok"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; results in {results}", flush=True)
    return 1 if failed else 0


def child(args: argparse.Namespace) -> None:
    """The step process: run the step, print its one line (the driver writes the results file)."""
    ctx = Context(cpu=args.cpu, size=SIZES[args.size], precision=args.precision)
    if args.traceback_after_s:
        faulthandler.dump_traceback_later(args.traceback_after_s)
    figures = run_step(args.run_step, ctx, Path(args.workdir))
    print(PREFIX + json.dumps({"ok": True, **figures}, sort_keys=True, default=str), flush=True)
    sys.stdout.flush()
    # skip interpreter teardown: NCCL / gloo groups and Megatron's checkpoint workers can hang in it,
    # and the step's result is already out
    os._exit(0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run every step on the CPU (gloo, shared memory)")
    p.add_argument("--size", choices=sorted(SIZES), help="model and batch sizes (default: gpu; tiny with --cpu)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--results", help="the results file (JSON lines; default $OUT/gpu_check.jsonl or build/)")
    p.add_argument("--steps", help="comma-separated steps or letters (default: all)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="the whole check's bound in seconds (default 420: the lent machine's 9 minutes, with room)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every step's timeout")
    p.add_argument("--run-step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--traceback-after-s", type=float, help=argparse.SUPPRESS)
    p.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size = args.size or ("tiny" if args.cpu else "gpu")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.receive:
        receive_main()
        return 0
    if args.run_step:
        child(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
