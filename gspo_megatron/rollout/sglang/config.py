"""Configuration of the SGLang rollout engine (the ``rollout.sglang`` section).

Two ways to get servers: ``urls`` attaches to servers someone else started (one per node or DP
replica); ``launch`` starts ``python -m sglang.launch_server`` processes on this node and owns them
(restarts them when they die, stops them on shutdown). Exactly one of the two is set.

Flag names and defaults follow SGLang's ``docs/advanced_features/server_arguments.md`` and
``docs/advanced_features/sglang_for_rl.md`` (read in the search index, see docs/rollout.md).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal, Sequence

from gspo_megatron.typed_config import check

WeightSyncMode = Literal["tensor", "distributed", "disk"]
LaunchDevice = Literal["cuda", "cpu"]
RouterKind = Literal["round_robin", "least_loaded"]

# SGLang's memory-occupation tags (python/sglang/srt/constants.py: GPU_MEMORY_TYPE_*).
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
# launch.device: cpu. The flags SGLang 0.5.23's CPU server ran with here (docs/rollout.md, "SGLang on CPU"):
# torch-native attention (the CPU kernels need AMX), no CUDA graphs. Without a token budget the CPU server
# reserves 5.5 GB of KV cache; 8192 tokens are plenty for small models on a laptop.
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph")
CPU_MAX_TOTAL_TOKENS = 8192


# Why tensor / distributed sync refuses a quantized served model: SGLang 0.5.23 loads those updates with
# model.load_weights and skips post-load when the session ends (scheduler_components/weight_updater.py,
# end_weight_update: run_post_load = not loaded_weights), so bf16 values would be copied into the FP8
# parameters beside their old scales. Quantizing on the trainer side is not implemented.
QUANTIZED_SYNC_REFUSAL = ("SGLang 0.5.23 copies tensor and distributed updates into the quantized parameters without "
                          "re-running post-load, so the old scales would stay; serve the bf16 model (a config.json "
                          "without quantization_config, no --quantization) for live sync")


def served_quantization(model_dir: str, extra_args: Sequence[str] = ()) -> str | None:
    """What makes a served model quantized, or None: ``quantization_config`` in ``model_dir``/config.json
    (a folder on this machine; a hub id or a missing folder says nothing) or ``--quantization`` among the
    server's extra flags."""
    for i, arg in enumerate(extra_args):
        if arg == "--quantization" or arg.startswith("--quantization="):
            value = arg.partition("=")[2] or (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            return f"--quantization {value}".strip()
    config = Path(model_dir) / "config.json" if model_dir else None
    if config is None or not config.is_file():
        return None
    quant = json.loads(config.read_text()).get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    return f"quantization_config (quant_method {method}) in {config}"


@dataclasses.dataclass
class SGLangLaunchConfig:
    """Servers this process starts on its own node: ``servers`` of them, server ``i`` on GPUs
    ``base_gpu_id + i*tp_size*dp_size ...`` and port ``base_port + i``."""

    model_path: str = ""
    servers: int = 1
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    base_gpu_id: int = 0
    host: str = "127.0.0.1"
    base_port: int = 30000
    mem_fraction_static: float = 0.8
    # cpu: SGLang's CPU server (SGLANG_USE_CPU_ENGINE, torch-native attention, the stand-in libcuda.so.1
    # of rollout/sglang/cpu.py); what that server cannot do is refused by validate, naming the setting.
    device: LaunchDevice = "cuda"
    # The KV cache's size in tokens (--max-total-tokens); 0: SGLang's own on cuda, CPU_MAX_TOTAL_TOKENS on cpu.
    max_total_tokens: int = 0
    dtype: str = "auto"
    # 'dummy' starts from random weights: right when the trainer pushes weights before the first rollout.
    load_format: str = "auto"
    # Needed by release_memory / resume_memory (colocated mode); None: on with device cuda, off with cpu.
    enable_memory_saver: bool | None = None
    # We send and receive token ids only; no tokenizer work in the server.
    skip_tokenizer_init: bool = True
    enable_return_routed_experts: bool = False
    # SGLang honours per-request sampling seeds only with this flag.
    enable_deterministic_inference: bool = False
    # SGLang returns log-probs after temperature scaling by default; this env switch returns them before.
    return_original_logprob: bool = False
    random_seed: int | None = None
    log_level: str = "warning"
    extra_args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    python: str = ""  # interpreter for the server; "" means the one running the trainer
    log_dir: str = "sglang_logs"
    startup_timeout_s: float = 1200.0
    health_poll_s: float = 2.0

    def gpus_per_server(self) -> int:
        return self.tp_size * self.dp_size

    def memory_saver(self) -> bool:
        """Whether the servers start with --enable-memory-saver (see enable_memory_saver)."""
        return self.device == "cuda" if self.enable_memory_saver is None else self.enable_memory_saver

    def kv_tokens(self) -> int:
        """--max-total-tokens to pass, 0 for none (see max_total_tokens)."""
        return self.max_total_tokens or (CPU_MAX_TOTAL_TOKENS if self.device == "cpu" else 0)

    def validate(self, path: str) -> None:
        check(bool(self.model_path), f"{path}.model_path", "must name a HF model folder")
        for name in ("servers", "tp_size", "dp_size", "ep_size"):
            check(getattr(self, name) >= 1, f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}")
        check(self.base_gpu_id >= 0, f"{path}.base_gpu_id", f"must be >= 0, got {self.base_gpu_id}")
        check(0 < self.base_port < 65536 - self.servers, f"{path}.base_port", f"out of range: {self.base_port}")
        check(0.0 < self.mem_fraction_static < 1.0, f"{path}.mem_fraction_static",
              f"must be in (0, 1), got {self.mem_fraction_static}")
        check(self.startup_timeout_s > 0, f"{path}.startup_timeout_s", "must be > 0")
        check(self.health_poll_s > 0, f"{path}.health_poll_s", "must be > 0")
        check(self.max_total_tokens >= 0, f"{path}.max_total_tokens", f"must be >= 0, got {self.max_total_tokens}")
        if self.device == "cpu":
            # Each fails inside SGLang 0.5.23's CPU server (measured, docs/rollout.md "SGLang on CPU").
            cpu = f"with {path}.device: cpu"
            check(self.enable_memory_saver is not True, f"{path}.enable_memory_saver",
                  f"must be false or unset {cpu}: torch_memory_saver goes through CUDA and the server dies at start-up")
            check(not self.enable_return_routed_experts, f"{path}.enable_return_routed_experts",
                  f"must be false {cpu}: the server dies at start-up (its host-pool allocator has no CPU entry), "
                  "so routing replay r3 needs GPU servers; r2 works with any engine")
            check(self.tp_size == 1 and self.dp_size == 1, f"{path}.tp_size",
                  f"tp_size and dp_size must be 1 {cpu} (one process per server; SGLang binds each CPU rank to a "
                  f"NUMA node of its own); got {self.tp_size} x {self.dp_size}, start more servers instead")
            check(not self.enable_deterministic_inference, f"{path}.enable_deterministic_inference",
                  f"must be false {cpu}: SGLang refuses it for the torch_native attention backend")


@dataclasses.dataclass
class SGLangDistributedSyncConfig:
    """The NCCL group between trainer rank 0 (group rank 0, hosts the TCPStore) and every server GPU."""

    master_address: str = ""  # an address of the trainer's node that the servers can reach
    master_port: int = 0
    group_name: str = "gspo_weight_sync"
    backend: str = "nccl"
    timeout_s: float = 600.0


@dataclasses.dataclass
class SGLangConfig:
    urls: list[str] = dataclasses.field(default_factory=list)
    launch: SGLangLaunchConfig | None = None
    weight_sync: WeightSyncMode = "tensor"
    # Bytes per weight-sync post: the trainer exports in buckets of this size (one post each, see
    # docs/rollout.md "Bucket size").
    bucket_bytes: int = 512 * 1024 * 1024
    # Tensor sync: buckets a rank keeps alive at most (each dropped once its post has been answered).
    tensor_buckets_in_flight: int = 2
    disk_dir: str = ""  # weight_sync == 'disk': shared folder the trainer writes and the servers read
    disk_config_dir: str = ""  # where config.json comes from for disk checkpoints; "" = launch.model_path
    distributed: SGLangDistributedSyncConfig = dataclasses.field(default_factory=SGLangDistributedSyncConfig)
    request_timeout_s: float = 1800.0
    admin_timeout_s: float = 600.0
    health_timeout_s: float = 10.0
    attach_timeout_s: float = 600.0
    max_retries: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    retry_deadline_s: float = 3600.0
    max_restarts: int = 2
    prompts_per_request: int = 16
    concurrent_requests_per_server: int = 8
    router: RouterKind = "least_loaded"
    # Tensor (colocated) sync only: release the servers' weights, KV cache and CUDA graphs while the
    # trainer updates on the same GPUs; needs servers started with --enable-memory-saver.
    release_memory: bool = True
    # Routed experts (R3): [layers, top_k] of SGLang's capture (layers = num_hidden_layers: SGLang indexes them
    # by global layer) and how many first layers are dense (not replayed); 0 = read config.json of the model.
    routed_experts_layers: int = 0
    routed_experts_top_k: int = 0
    routed_experts_first_dense_layers: int = 0

    def validate(self, path: str) -> None:
        check(bool(self.urls) != (self.launch is not None), f"{path}.urls",
              "set exactly one of 'urls' (attach to running servers) and 'launch' (start them here)")
        for i, url in enumerate(self.urls):
            check(url.startswith(("http://", "https://")), f"{path}.urls[{i}]", f"must be an http(s) URL, got {url!r}")
        check(self.bucket_bytes >= 1 << 20, f"{path}.bucket_bytes", f"must be >= 1 MiB, got {self.bucket_bytes}")
        check(self.tensor_buckets_in_flight >= 1, f"{path}.tensor_buckets_in_flight",
              f"must be >= 1, got {self.tensor_buckets_in_flight}")
        if self.weight_sync == "disk":
            check(bool(self.disk_dir), f"{path}.disk_dir", "required when weight_sync is 'disk'")
        if self.weight_sync == "distributed":
            check(bool(self.distributed.master_address), f"{path}.distributed.master_address",
                  "required when weight_sync is 'distributed'")
            check(0 < self.distributed.master_port < 65536, f"{path}.distributed.master_port",
                  f"required when weight_sync is 'distributed', got {self.distributed.master_port}")
        if self.weight_sync in ("tensor", "distributed") and self.launch is not None:
            # tensor: serialized_named_tensors has one entry per TP rank; DP replicas inside one server
            # would need payloads from GPUs the TP index cannot name. distributed: SGLang 0.5.23 asserts
            # dp_size == 1 (tokenizer_control_mixin.py:451) and 0.5.9 joins only tp_size ranks per server.
            check(self.launch.dp_size == 1, f"{path}.launch.dp_size",
                  f"must be 1 with weight_sync '{self.weight_sync}' (start more servers instead of DP inside one)")
        if self.weight_sync in ("tensor", "distributed"):
            served = [(self.launch.model_path, self.launch.extra_args)] if self.launch is not None else []
            for model_dir, extra in served + [(self.disk_config_dir, ())]:
                quantized = served_quantization(model_dir, extra)
                check(quantized is None, f"{path}.weight_sync",
                      f"'{self.weight_sync}' cannot update a quantized served model ({quantized}): "
                      f"{QUANTIZED_SYNC_REFUSAL}")
        if self.launch is not None and self.launch.device == "cpu":
            cpu = f"with {path}.launch.device: cpu"
            check(not (self.weight_sync == "tensor" and self.release_memory), f"{path}.release_memory",
                  f"must be false {cpu}: /release_memory_occupation crashes the CPU server (it synchronizes a CUDA "
                  "device)")
            check(self.weight_sync != "distributed", f"{path}.weight_sync",
                  f"'distributed' is not supported {cpu} (the weight-update group is NCCL, GPU to GPU); use 'tensor' "
                  "(shared memory on one machine) or 'disk'")
        for name in ("request_timeout_s", "admin_timeout_s", "health_timeout_s", "attach_timeout_s",
                     "backoff_max_s", "retry_deadline_s"):
            check(getattr(self, name) > 0, f"{path}.{name}", f"must be > 0, got {getattr(self, name)}")
        check(self.backoff_s >= 0, f"{path}.backoff_s", f"must be >= 0, got {self.backoff_s}")
        check(self.max_retries >= 0, f"{path}.max_retries", f"must be >= 0, got {self.max_retries}")
        check(self.max_restarts >= 0, f"{path}.max_restarts", f"must be >= 0, got {self.max_restarts}")
        check(self.prompts_per_request >= 1, f"{path}.prompts_per_request", "must be >= 1")
        check(self.concurrent_requests_per_server >= 1, f"{path}.concurrent_requests_per_server", "must be >= 1")
        check(self.routed_experts_layers >= 0, f"{path}.routed_experts_layers", "must be >= 0")
        check(self.routed_experts_top_k >= 0, f"{path}.routed_experts_top_k", "must be >= 0")
        check(self.routed_experts_first_dense_layers >= 0, f"{path}.routed_experts_first_dense_layers", "must be >= 0")


__all__ = ["CPU_FLAGS", "CPU_MAX_TOTAL_TOKENS", "LaunchDevice", "MEMORY_TAGS", "QUANTIZED_SYNC_REFUSAL", "SGLangConfig", "SGLangDistributedSyncConfig", "SGLangLaunchConfig",
           "RouterKind", "WeightSyncMode", "served_quantization"]
