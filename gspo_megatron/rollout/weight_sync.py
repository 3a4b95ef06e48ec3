"""Weight sync: the live, sharded Megatron policy -> a rollout engine, in bounded buckets.

Every rank calls ``sync_weights`` (the export is a collective: TP/EP gathers, PP broadcasts) and
receives the same HF-named buckets; each rank then feeds its own colocated engine. No disk is touched.
"""
from __future__ import annotations

import time

from gspo_megatron.conversion.export import export_hf_buckets
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.rollout.base import RolloutEngine

# The transformers engine's bucket size: fastest on CPU (benchmarks/bench_weight_sync.py). The SGLang
# engine takes its own rollout.sglang.bucket_bytes instead (one HTTP post per bucket; docs/rollout.md).
DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024


def sync_weights(model, model_config: ModelConfig, engine: RolloutEngine,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Push every weight of ``model`` to ``engine`` in buckets of at most ``bucket_bytes``; the last
    bucket carries ``final=True`` (which bumps the engine's weight version). No bucket is held back to
    learn which is the last (``export_hf_buckets`` says so), so an engine that drops a bucket once it is
    loaded keeps the sync's extra memory to its own buckets in flight. Returns timing and volume for the
    step metrics."""
    start = time.perf_counter()
    total = 0
    sent = False
    for bucket, is_last in export_hf_buckets(model, model_config, bucket_bytes):
        total += sum(t.numel() * t.element_size() for _, t in bucket)
        engine.update_weights(bucket, final=is_last)
        sent = True
    if not sent:
        raise ValueError("sync_weights: the model exported no tensors")
    elapsed = time.perf_counter() - start
    return {"sync_bytes": float(total), "sync_s": elapsed, "sync_bytes_per_s": total / max(elapsed, 1e-9)}
