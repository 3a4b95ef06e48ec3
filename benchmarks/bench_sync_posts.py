"""Tensor weight sync into one real SGLang 0.5.23 CPU server: HTTP posts and time per sync at two bucket sizes.

The trainer exports its weights in buckets of ``rollout.sglang.bucket_bytes`` and posts each bucket once
(``/update_weights_from_tensor``); this measures what the bucket size costs on the server's side of a
sync. The tensors are the served model's own (read from its safetensors, so the served weights do not
change), cloned afresh for every sync as the trainer's export does, bucketed with the export's rule
(``bucket_named_tensors_marked``) and passed to ``SGLangEngine.update_weights`` bucket by bucket, the
last one ``final``. Not measured here: the Megatron export itself (the same for both sizes but for the
buckets' allocation), CUDA IPC (on CPU the payloads are shared-memory file names), GPUs.

    python benchmarks/bench_sync_posts.py --repeats 3    # writes benchmarks/results/sync_posts.json

The SGLang interpreter comes from ``--sglang-python`` or GSPO_SGLANG_PYTHON (tools/setup_env.sh sglang).
``--standin`` measures against the HTTP stand-in of tests/rollout/sglang_standin.py instead (NOT SGLang:
it decodes nothing), which isolates the client's per-post cost.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import save_bench_model  # noqa: E402  (this folder)

# benchmarks/bench_weight_sync.py's model: 115.4 M parameters, 462 MB in fp32
MODEL = ["model.config.vocab_size=8192", "model.config.hidden_size=512", "model.config.num_layers=8",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "model.config.head_dim=64",
         "model.config.num_experts=16", "model.config.moe_ffn_hidden_size=512", "model.config.moe_router_topk=2",
         "model.config.max_position_embeddings=1024"]
MIB = 1 << 20


def served_tensors(folder: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    out = []
    for shard in sorted(folder.glob("*.safetensors")):
        out.extend(load_file(str(shard)).items())
    return out


def engine_for(folder: Path, log_dir: Path, python: str | None, standin_url: str | None, bucket_bytes: int):
    from gspo_megatron.rollout.sglang.config import SGLangConfig
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.rollout.sglang.server import port_is_free
    from gspo_megatron.typed_config import build

    if standin_url is not None:
        settings = {"urls": [standin_url]}
    else:
        port = next(p for p in range(31000, 32000) if port_is_free("127.0.0.1", p))
        settings = {"launch": {"model_path": str(folder), "device": "cpu", "python": python, "dtype": "float32",
                               "base_port": port, "log_dir": str(log_dir), "startup_timeout_s": 900.0}}
    return SGLangEngine.from_config(build(SGLangConfig, {**settings, "release_memory": False,
                                                         "bucket_bytes": bucket_bytes}, "rollout.sglang"))


def one_sync(engine, tensors, bucket_bytes: int, posts: list[str]) -> dict:
    """Clone (as the export does), bucket and post every tensor once; -> posts, seconds."""
    from gspo_megatron.conversion.export import bucket_named_tensors_marked

    before = len(posts)
    start = time.perf_counter()
    fresh = ((name, t.clone()) for name, t in tensors)
    for bucket, is_last in bucket_named_tensors_marked(fresh, bucket_bytes):
        engine.update_weights(bucket, final=is_last)
    return {"posts": sum(p == "/update_weights_from_tensor" for p in posts[before:]),
            "sync_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--sglang-python", default=os.environ.get("GSPO_SGLANG_PYTHON", ""))
    parser.add_argument("--standin", action="store_true", help="the HTTP stand-in instead of SGLang (not SGLang)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sync_posts.json"))
    args = parser.parse_args()
    if not args.standin and not args.sglang_python:
        parser.error("name the SGLang interpreter (--sglang-python or GSPO_SGLANG_PYTHON), or pass --standin")

    from gspo_megatron.rollout.sglang import engine as sglang_engine

    posts: list[str] = []
    real_request = sglang_engine.request

    def counting(url, method, path, body=None, **kwargs):
        posts.append(path)
        return real_request(url, method, path, body, **kwargs)

    sglang_engine.request = counting  # every call the engine makes goes through this name
    with tempfile.TemporaryDirectory(prefix="bench_sync_posts_") as tmp:
        folder = Path(tmp) / "model"
        what, _ = save_bench_model(MODEL, folder)
        tensors = served_tensors(folder)
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        standin = None
        if args.standin:
            from tests.rollout.sglang_standin import StandinServer

            standin = StandinServer().__enter__()
        start = time.perf_counter()
        # one server for every size: the engine's bucket_bytes only splits what it is handed, and each
        # update_weights call here is handed one bucket of the size under test
        engine = engine_for(folder, Path(tmp) / "logs", args.sglang_python, standin.url if standin else None,
                            max(args.sizes_mib) * MIB)
        startup_s = time.perf_counter() - start
        rows = {size: [] for size in args.sizes_mib}
        try:
            for repeat in range(args.repeats + 1):  # the first round warms up
                for size in args.sizes_mib:
                    result = one_sync(engine, tensors, size * MIB, posts)
                    if repeat > 0:
                        rows[size].append(result)
        finally:
            engine.shutdown()
            if standin is not None:
                standin.__exit__(None, None, None)
    report = {
        "command": "python benchmarks/bench_sync_posts.py " + " ".join(sys.argv[1:]),
        "server": "HTTP stand-in (tests/rollout/sglang_standin.py, NOT SGLang)" if args.standin
        else "SGLang 0.5.23 on CPU (launch.device: cpu), one server, tp 1",
        "note": "CPU figures on a shared 2-core machine: payloads are shared-memory file names, not CUDA IPC",
        "model": what, "bytes_per_sync": total, "tensors": len(tensors), "repeats": args.repeats,
        "server_startup_s": startup_s,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "cpu_count": os.cpu_count(), "loadavg_at_end": list(os.getloadavg()),
                        "sglang_python": args.sglang_python or None},
        "rows": [{"bucket_mib": size, "posts_per_sync": r[0]["posts"],
                  "sync_s_median": statistics.median(x["sync_s"] for x in r),
                  "sync_s": [x["sync_s"] for x in r],
                  "ms_per_post": 1e3 * statistics.median(x["sync_s"] for x in r) / r[0]["posts"]}
                 for size, r in rows.items()],
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for row in report["rows"]:
        print(f"{row['bucket_mib']:>5} MiB: {row['posts_per_sync']:>4} posts, {row['sync_s_median']:.3f} s a sync "
              f"({row['ms_per_post']:.1f} ms a post)")


if __name__ == "__main__":
    main()
