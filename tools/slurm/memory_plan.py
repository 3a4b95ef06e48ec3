#!/usr/bin/env python3
"""Per-GPU memory of GSPO training on Megatron-Core with colocated SGLang, for the MoE models of
the examples: Qwen3-MoE, Qwen1.5-MoE, GLM-4.5-Air and Moonlight (shared experts, first dense layers, MLA).

    python tools/slurm/memory_plan.py --model qwen3-30b-a3b --gpus 32 --tp 4 --pp 1 --ep 8
    python tools/slurm/memory_plan.py --model qwen3-235b-a22b --gpus 256 --tp 4 --pp 4 --ep 32 --sglang-tp 16

Arithmetic, not measurement (nothing here ran on a GPU); docs/slurm.md shows it for the layouts it
suggests. What is counted:

- Parameters from the shapes (q/k/v biases and q/k RMSNorm where the model has them; untied embeddings;
  MLA: q, kv down- and up-projections and the latent norm). Shared experts and a first dense layer's MLP
  count as dense parameters, split over TP like attention.
- Training states with Megatron's distributed optimizer (its docs, "distrib_optimizer"): bf16 weights
  (2 B/param) + fp32 main grads (4 B; Megatron-LM accumulates bf16 grads in fp32) + fp32 master weights
  and Adam m, v (12 B) sharded over the data-parallel ranks holding the same shard: dense parameters over
  DP x CP = gpus / (TP x PP), expert parameters over expert-DP = gpus / (EP x ETP x PP). Dense weights
  split over TP, experts over EP x ETP; norms and the router are replicated over TP. The worst pipeline
  stage holds ceil(layers / PP) layers, as many of them MoE as there are, plus the embedding or the
  output layer (both when PP = 1). With TP above the number of KV groups, Megatron replicates each KV
  head, so k and v split only that far.
- Activations, roughly, per micro-batch of T tokens with sequence parallelism (each TP x CP rank holds
  T / (TP x CP) tokens): per layer and token 17h bytes outside the experts (Korthikanti et al. 2022's
  15h for attention and norms with flash attention, + 2h router input) and top_k x (2h + 6F) for the
  routed copies (expert input, gate/up output, SwiGLU output, bf16), + 6 F_shared for a shared expert's
  outputs. Full recompute keeps only each layer's 2h-byte input plus one layer's working set. 1F1B keeps
  up to PP micro-batches alive on the first stage. The last stage also holds the logits: T / CP x vocab /
  TP x 6 B (bf16 + fp32 for the log-softmax of the GSPO log-probs).
- SGLang, colocated: while it holds memory it takes mem_fraction_static x GPU memory for its weights
  (all parameters / SGLang TP, bf16) and KV cache (layers x 2 x max(1, kv_heads / TP) x head_dim x 2 B
  per token; MLA: layers x (kv latent + rope key) x 2 B); while the trainer trains it has released both
  (--enable-memory-saver).
- Weight sync (tensor mode): at most N buckets of the engine's bucket size alive on each trainer GPU
  (``rollout.sglang.tensor_buckets_in_flight`` x ``rollout.sglang.bucket_bytes``, defaults 2 x 512 MiB),
  while SGLang has its weights back (it receives them) but not yet its KV cache.
- The caching allocator: after the update its activation peak stays reserved unless emptied. The trainer
  empties the cache after the update and after the sync (``torch.cuda.empty_cache``), so the update's
  activations and the sync's buckets are never resident together: the plan takes the peak of the update
  phase and the sync phase, not their sum. ``empty_cache=False`` plans for a trainer that does not empty
  it: the update's activations then stay in every later phase.
- Optimizer CPU offload (``optimizer.cpu_offload_fraction`` f, megatron-core's HybridDeviceOptimizer):
  f of the sharded fp32 master weights and Adam moments leave the GPU; the host holds them plus fp32
  copies of their gradients (16 B per offloaded parameter).
- Host memory per node: the offloaded optimizer, plus a checkpoint save's peak. The distributed optimizer
  saves ``fully_reshardable`` (megatron/policy_model.py): every DP rank gathers the fp32 master weights and
  both Adam moments of all the parameters it holds (12 B each, not divided by DP) into host memory before
  writing, beside a host copy of its bf16 weights (2 B).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int  # the query/key head width (MLA: nope + rope dims)
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    qk_norm: bool = True  # q/k RMSNorm of head_dim (Qwen3)
    qkv_bias: bool = False  # q/k/v biases (Qwen1.5-MoE, GLM-4.5)
    shared_ffn: int = 0  # width of the shared expert(s) every token passes through (split over TP)
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert (hidden -> 1)
    dense_layers: int = 0  # leading layers with a dense MLP instead of experts (first_dense_layers)
    dense_ffn: int = 0
    kv_lora_rank: int = 0  # > 0: multi-latent attention (DeepSeek-V3 / Moonlight), q projection without a latent
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


MODELS = {
    "qwen3-30b-a3b": MoEShape("Qwen3-30B-A3B", layers=48, hidden=2048, q_heads=32, kv_heads=4, head_dim=128,
                              experts=128, top_k=8, expert_ffn=768, vocab=151936),
    "qwen3-235b-a22b": MoEShape("Qwen3-235B-A22B", layers=94, hidden=4096, q_heads=64, kv_heads=4, head_dim=128,
                                experts=128, top_k=8, expert_ffn=1536, vocab=151936),
    # the config.json of each (the HF model cards' shapes); MTP layers are left out, as the conversion does
    "qwen1.5-moe-a2.7b": MoEShape("Qwen1.5-MoE-A2.7B", layers=24, hidden=2048, q_heads=16, kv_heads=16, head_dim=128,
                                  experts=60, top_k=4, expert_ffn=1408, vocab=151936, qk_norm=False, qkv_bias=True,
                                  shared_ffn=5632, shared_gate=True),
    "glm-4.5-air": MoEShape("GLM-4.5-Air", layers=46, hidden=4096, q_heads=96, kv_heads=8, head_dim=128, experts=128,
                            top_k=8, expert_ffn=1408, vocab=151552, qk_norm=False, qkv_bias=True, shared_ffn=1408,
                            dense_layers=1, dense_ffn=10944),
    "moonlight-16b-a3b": MoEShape("Moonlight-16B-A3B", layers=27, hidden=2048, q_heads=16, kv_heads=16, head_dim=192,
                                  experts=64, top_k=6, expert_ffn=1408, vocab=163840, qk_norm=False, shared_ffn=2816,
                                  dense_layers=1, dense_ffn=11264, kv_lora_rank=512, qk_rope_dim=64, v_head_dim=128),
}


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    embedding: int
    output: int
    attention_per_layer: int  # q, k, v, o projections (MLA: q, kv down, kv up, o): split over TP
    kv_per_layer: int  # the k, v part: split over at most kv_heads ranks (replicated beyond); 0 for MLA
    replicated_per_layer: int  # two RMSNorms, q/k norms (MLA: the kv latent norm): replicated over TP
    router_per_layer: int  # MoE layers: router weights, replicated over TP
    shared_per_layer: int  # MoE layers: the shared expert(s) and their gate, split over TP
    dense_mlp_per_layer: int  # dense layers: the MLP, split over TP
    experts_per_layer: int
    final_norm: int

    def dense_total(self, layers: int, moe_layers: int | None = None) -> int:
        """Everything but the routed experts: ``layers`` layers, ``moe_layers`` (default all) of them MoE."""
        moe_layers = layers if moe_layers is None else moe_layers
        per_layer = self.attention_per_layer + self.replicated_per_layer
        return (self.embedding + self.output + self.final_norm + layers * per_layer
                + moe_layers * (self.router_per_layer + self.shared_per_layer)
                + (layers - moe_layers) * self.dense_mlp_per_layer)

    def expert_total(self, moe_layers: int) -> int:
        return moe_layers * self.experts_per_layer


def _attention(m: MoEShape) -> tuple[int, int, int]:
    """(all attention projection weights and biases, the k/v part of them, attention norms) of one layer."""
    h, d = m.hidden, m.head_dim
    if m.kv_lora_rank:
        # q: h -> heads x d; kv down: h -> latent + rope key; kv up: latent -> heads x (nope + v); o: heads x v -> h
        nope = d - m.qk_rope_dim
        weights = (h * m.q_heads * d + h * (m.kv_lora_rank + m.qk_rope_dim)
                   + m.kv_lora_rank * m.q_heads * (nope + m.v_head_dim) + m.q_heads * m.v_head_dim * h)
        return weights, 0, m.kv_lora_rank
    kv = 2 * h * m.kv_heads * d + (2 * m.kv_heads * d if m.qkv_bias else 0)
    q = h * m.q_heads * d + (m.q_heads * d if m.qkv_bias else 0)
    return q + kv + m.q_heads * d * h, kv, 2 * d if m.qk_norm else 0


def param_counts(m: MoEShape) -> ParamCounts:
    h = m.hidden
    attention, kv, attention_norms = _attention(m)
    return ParamCounts(
        embedding=m.vocab * h,
        output=m.vocab * h,
        attention_per_layer=attention,
        kv_per_layer=kv,
        replicated_per_layer=2 * h + attention_norms,
        router_per_layer=h * m.experts,
        shared_per_layer=3 * h * m.shared_ffn + (h if m.shared_gate else 0),
        dense_mlp_per_layer=3 * h * m.dense_ffn,
        experts_per_layer=m.experts * 3 * h * m.expert_ffn,
        final_norm=h,
    )


def total_params(m: MoEShape) -> int:
    p = param_counts(m)
    return p.dense_total(m.layers, m.moe_layers) + p.expert_total(m.moe_layers)


def active_params(m: MoEShape) -> int:
    """Parameters one token touches: everything dense + top_k experts per MoE layer."""
    p = param_counts(m)
    return p.dense_total(m.layers, m.moe_layers) + m.moe_layers * m.top_k * 3 * m.hidden * m.expert_ffn


def kv_cache_bytes_per_token(m: MoEShape, sglang_tp: int) -> int:
    """SGLang's bf16 KV cache per token on one GPU: k and v per KV head (a head is replicated when TP exceeds
    the KV heads); MLA caches the latent and the rope key, the same on every TP rank."""
    if m.kv_lora_rank:
        return m.layers * (m.kv_lora_rank + m.qk_rope_dim) * 2
    return m.layers * 2 * max(1, m.kv_heads // sglang_tp) * m.head_dim * 2


@dataclasses.dataclass(frozen=True)
class Layout:
    gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1

    def check(self, m: MoEShape) -> None:
        problems = []
        if self.gpus % (self.tp * self.pp * self.cp):
            problems.append(f"gpus={self.gpus} is not a multiple of tp*pp*cp={self.tp * self.pp * self.cp}")
        if self.gpus % (self.ep * self.etp * self.pp):
            problems.append(f"gpus={self.gpus} is not a multiple of ep*etp*pp={self.ep * self.etp * self.pp}")
        if m.experts % self.ep:
            problems.append(f"ep={self.ep} does not divide the {m.experts} experts")
        if m.expert_ffn % self.etp:
            problems.append(f"etp={self.etp} does not divide the expert FFN width {m.expert_ffn}")
        if m.kv_heads % self.tp and self.tp % m.kv_heads:
            problems.append(f"tp={self.tp}: Megatron-Core needs the {m.kv_heads} KV groups to be a multiple or "
                            "a divisor of TP")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.ep * self.etp * self.pp)


@dataclasses.dataclass(frozen=True)
class Plan:
    dense_params_per_gpu: float
    expert_params_per_gpu: float
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    sglang_weights_gib: float
    sglang_budget_gib: float
    sglang_kv_tokens: int
    train_phase_gib: float
    rollout_phase_gib: float
    sync_buckets_gib: float = 0.0
    sync_phase_gib: float = 0.0
    optimizer_host_gib: float = 0.0  # per GPU: the offloaded optimizer share and its fp32 gradient copies
    checkpoint_host_gib: float = 0.0  # per GPU: a checkpoint save's host buffers
    host_per_node_gib: float = 0.0  # gpus_per_node x (optimizer_host + checkpoint_host)

    @property
    def gpu_peak_gib(self) -> float:
        """The largest of the three phases (update, weight sync, rollout)."""
        return max(self.train_phase_gib, self.sync_phase_gib, self.rollout_phase_gib)

    @property
    def states_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib


SYNC_BUCKETS = 2  # rollout.sglang.tensor_buckets_in_flight's default
SYNC_BUCKET_BYTES = 512 * 1024**2  # rollout.sglang.bucket_bytes's default


def plan(m: MoEShape, layout: Layout, *, tokens_per_microbatch: int, recompute: str, gpu_mem_gib: float,
         sglang_tp: int, sglang_mem_fraction: float, grad_bytes: int = 4, overhead_gib: float = 4.0,
         sync_buckets: int = SYNC_BUCKETS, sync_bucket_bytes: int = SYNC_BUCKET_BYTES,
         cpu_offload_fraction: float = 0.0, empty_cache: bool = True, gpus_per_node: int = 8) -> Plan:
    """Per-GPU bytes on the worst pipeline stage (see the module docstring for every term)."""
    layout.check(m)
    if not 0.0 <= cpu_offload_fraction <= 1.0:
        raise ValueError(f"cpu_offload_fraction must be in [0, 1], got {cpu_offload_fraction}")
    p = param_counts(m)
    stage_layers = math.ceil(m.layers / layout.pp)
    # the worst stage holds the most MoE layers: the dense ones come first, on the first stage
    stage_moe = min(stage_layers, m.moe_layers)
    stage_dense_mlp = min(m.dense_layers, stage_layers - stage_moe)
    embed_and_output = p.embedding + p.output if layout.pp == 1 else max(p.embedding, p.output)
    tp_split = (stage_layers * (p.attention_per_layer - p.kv_per_layer) + stage_moe * p.shared_per_layer
                + stage_dense_mlp * p.dense_mlp_per_layer + embed_and_output)
    dense = tp_split / layout.tp + stage_layers * p.kv_per_layer / min(layout.tp, m.kv_heads) \
        + stage_layers * p.replicated_per_layer + stage_moe * p.router_per_layer + p.final_norm
    experts = stage_moe * p.experts_per_layer / (layout.ep * layout.etp)
    weights = 2 * (dense + experts)
    grads = grad_bytes * (dense + experts)
    sharded = dense / (layout.dp * layout.cp) + experts / layout.expert_dp  # parameters whose states this GPU owns
    optimizer = 12 * sharded * (1 - cpu_offload_fraction)
    optimizer_host = 16 * sharded * cpu_offload_fraction
    checkpoint_host = (12 + 2) * (dense + experts)

    h, f = m.hidden, m.expert_ffn
    tokens_per_rank = tokens_per_microbatch / (layout.tp * layout.cp)
    # a shared expert's gate/up and SwiGLU outputs for every token, split over TP with the tokens gathered
    per_layer = tokens_per_rank * (17 * h + m.top_k * (2 * h + 6 * f) + 6 * m.shared_ffn)
    in_flight = layout.pp  # 1F1B: the first stage holds up to PP micro-batches
    if recompute == "full":
        activations = in_flight * stage_layers * tokens_per_rank * 2 * h + per_layer
    elif recompute == "none":
        activations = in_flight * stage_layers * per_layer
    else:
        raise ValueError(f"recompute must be 'full' or 'none', got {recompute!r}")
    logits = tokens_per_microbatch / layout.cp * m.vocab / layout.tp * 6

    sglang_weights = 2 * total_params(m) / sglang_tp
    sglang_budget = sglang_mem_fraction * gpu_mem_gib * GIB
    kv_per_token = kv_cache_bytes_per_token(m, sglang_tp)
    kv_tokens = max(0, int((sglang_budget - sglang_weights) // kv_per_token))
    states = weights + grads + optimizer
    overhead = overhead_gib * GIB
    cached = 0.0 if empty_cache else activations + logits  # the update's peak, kept by the caching allocator
    buckets = sync_buckets * sync_bucket_bytes
    return Plan(
        dense_params_per_gpu=dense,
        expert_params_per_gpu=experts,
        weights_gib=weights / GIB,
        grads_gib=grads / GIB,
        optimizer_gib=optimizer / GIB,
        activations_gib=activations / GIB,
        logits_gib=logits / GIB,
        sglang_weights_gib=sglang_weights / GIB,
        sglang_budget_gib=sglang_budget / GIB,
        sglang_kv_tokens=kv_tokens,
        train_phase_gib=(states + activations + logits + overhead) / GIB,
        rollout_phase_gib=(states + sglang_budget + overhead + cached) / GIB,
        sync_buckets_gib=buckets / GIB,
        sync_phase_gib=(states + sglang_weights + buckets + overhead + cached) / GIB,
        optimizer_host_gib=optimizer_host / GIB,
        checkpoint_host_gib=checkpoint_host / GIB,
        host_per_node_gib=gpus_per_node * (optimizer_host + checkpoint_host) / GIB,
    )


def microbatch_tokens(config: dict) -> int:
    """The largest micro-batch a training config runs: ``train.max_tokens_per_microbatch``, or the longest
    sequence (``data.max_prompt_tokens + rollout.max_new_tokens``) when that is longer, since the trainer
    gives such a sequence a micro-batch of its own (``batching.pack_microbatches``). The defaults are the
    trainer's."""
    budget = config.get("train", {}).get("max_tokens_per_microbatch", 2048)
    longest = (config.get("data", {}).get("max_prompt_tokens", 1024)
               + config.get("rollout", {}).get("max_new_tokens", 32))
    return max(budget, longest)


def example_plan(config: dict, model: str, gpus: int, gpu_mem_gib: float, sglang_tp: int | None = None,
                 sglang_mem_fraction: float | None = None) -> Plan:
    """The plan of a training config (examples/*.yaml, as a dict) on ``gpus`` GPUs of ``gpu_mem_gib``: its
    layout, micro-batch tokens, recomputation, gradient dtype, optimizer CPU offload, weight-sync buckets
    and colocated SGLang settings (``sglang_*`` where the servers are started outside the config, e.g. by
    an sbatch script); nodes of 8 GPUs. The plan assumes bf16.
    ``parallel.expert_tensor_parallel`` null is Megatron's default, the tensor-parallel size."""
    m, par, mod = MODELS[model], config.get("parallel", {}), config.get("model", {})
    if mod.get("precision", "fp32") != "bf16":
        raise ValueError(f"model.precision: {mod.get('precision', 'fp32')}; the plan (and a GPU run) assumes bf16")
    sglang = config.get("rollout", {}).get("sglang") or {}
    launch = sglang.get("launch") or {}
    tp = par.get("tensor_parallel", 1)
    etp = par.get("expert_tensor_parallel")
    layout = Layout(gpus, tp, par.get("pipeline_parallel", 1), par.get("expert_parallel", 1),
                    etp=tp if etp is None else etp, cp=par.get("context_parallel", 1))
    return plan(m, layout, tokens_per_microbatch=microbatch_tokens(config),
                recompute=mod.get("recompute", "none"), gpu_mem_gib=gpu_mem_gib,
                sglang_tp=sglang_tp or launch["tp_size"],
                sglang_mem_fraction=sglang_mem_fraction or launch["mem_fraction_static"],
                grad_bytes=4 if mod.get("grad_reduce_in_fp32", True) else 2,
                sync_buckets=sglang.get("tensor_buckets_in_flight", SYNC_BUCKETS),
                sync_bucket_bytes=sglang.get("bucket_bytes", SYNC_BUCKET_BYTES),
                cpu_offload_fraction=config.get("optimizer", {}).get("cpu_offload_fraction", 0.0),
                gpus_per_node=min(gpus, 8))


def _table(m: MoEShape, layout: Layout, pl: Plan, args: argparse.Namespace) -> str:
    total, experts = total_params(m), param_counts(m).expert_total(m.moe_layers)
    mem = args.gpu_mem_gib
    rows = [
        ("model", f"{m.name}: {total / 1e9:.2f}B params ({experts / 1e9:.2f}B in experts), "
                  f"{active_params(m) / 1e9:.2f}B active"),
        ("layout", f"{layout.gpus} GPUs: TP={layout.tp} PP={layout.pp} EP={layout.ep} ETP={layout.etp} "
                   f"CP={layout.cp} -> DP={layout.dp}, expert-DP={layout.expert_dp}"),
        ("params per GPU", f"{pl.dense_params_per_gpu / 1e9:.3f}B dense + "
                           f"{pl.expert_params_per_gpu / 1e9:.3f}B expert"),
        ("bf16 weights", f"{pl.weights_gib:.1f} GiB"),
        (f"{args.grad_dtype} grads", f"{pl.grads_gib:.1f} GiB"),
        (f"fp32 master + Adam (sharded, {args.cpu_offload_fraction:g} on the host)", f"{pl.optimizer_gib:.1f} GiB"),
        ("training states", f"{pl.states_gib:.1f} GiB"),
        (f"activations ({args.recompute} recompute, {args.tokens_per_microbatch} tokens/micro-batch)",
         f"{pl.activations_gib:.1f} GiB + logits {pl.logits_gib:.1f} GiB"),
        (f"SGLang (TP={args.sglang_tp}, mem_fraction_static={args.sglang_mem_fraction})",
         f"{pl.sglang_budget_gib:.1f} GiB: weights {pl.sglang_weights_gib:.1f} GiB, "
         f"KV room for {pl.sglang_kv_tokens:,} tokens"),
        (f"peak, training phase (+{args.overhead_gib} GiB overhead)", f"{pl.train_phase_gib:.1f} of {mem} GiB"),
        (f"peak, weight sync ({args.sync_buckets} x {args.sync_bucket_mib} MiB buckets + SGLang weights)",
         f"{pl.sync_phase_gib:.1f} of {mem} GiB"),
        (f"peak, rollout phase (+{args.overhead_gib} GiB overhead)", f"{pl.rollout_phase_gib:.1f} of {mem} GiB"),
        ("host per GPU: offloaded optimizer + checkpoint save",
         f"{pl.optimizer_host_gib:.1f} + {pl.checkpoint_host_gib:.1f} GiB"),
        (f"host per node ({args.gpus_per_node} GPUs)", f"{pl.host_per_node_gib:.0f} GiB"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--gpus", type=int, required=True)
    for name in ("tp", "pp", "ep", "cp"):
        ap.add_argument(f"--{name}", type=int, default=1)
    ap.add_argument("--etp", type=int, default=1, help="expert tensor parallel (default 1: whole experts, the "
                    "trainer's parallel.expert_tensor_parallel: 1; Megatron's own default is the TP size)")
    ap.add_argument("--tokens-per-microbatch", type=int, default=8192)
    ap.add_argument("--recompute", choices=["full", "none"], default="full")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0)
    ap.add_argument("--sglang-tp", type=int, default=8)
    ap.add_argument("--sglang-mem-fraction", type=float, default=0.4)
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="main-grad buffer dtype (Megatron DDP grad_reduce_in_fp32 on or off)")
    ap.add_argument("--overhead-gib", type=float, default=4.0, help="CUDA contexts, NCCL buffers, fragmentation")
    ap.add_argument("--sync-buckets", type=int, default=SYNC_BUCKETS,
                    help="weight-sync buckets alive at once (rollout.sglang.tensor_buckets_in_flight)")
    ap.add_argument("--sync-bucket-mib", type=int, default=SYNC_BUCKET_BYTES // 1024**2,
                    help="weight-sync bucket size (rollout.sglang.bucket_bytes)")
    ap.add_argument("--cpu-offload-fraction", type=float, default=0.0,
                    help="share of the optimizer states on the host (optimizer.cpu_offload_fraction)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="plan for a trainer that never empties the CUDA cache (the update's activations stay)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    args = ap.parse_args(argv)
    m = MODELS[args.model]
    layout = Layout(args.gpus, args.tp, args.pp, args.ep, args.etp, args.cp)
    try:
        pl = plan(m, layout, tokens_per_microbatch=args.tokens_per_microbatch, recompute=args.recompute,
                  gpu_mem_gib=args.gpu_mem_gib, sglang_tp=args.sglang_tp, sglang_mem_fraction=args.sglang_mem_fraction,
                  grad_bytes={"fp32": 4, "bf16": 2}[args.grad_dtype], overhead_gib=args.overhead_gib,
                  sync_buckets=args.sync_buckets, sync_bucket_bytes=args.sync_bucket_mib * 1024**2,
                  cpu_offload_fraction=args.cpu_offload_fraction, empty_cache=not args.keep_cache,
                  gpus_per_node=args.gpus_per_node)
    except ValueError as err:
        print(f"memory_plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(pl), indent=2) if args.json else _table(m, layout, pl, args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
