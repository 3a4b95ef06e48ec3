"""Weight sync: the live, sharded Megatron policy -> a rollout engine, in bounded buckets.

Every rank calls ``sync_weights`` (the export is a collective: TP/EP gathers, PP broadcasts) and
receives the same HF-named buckets; each rank then feeds its own colocated engine. No disk is touched.
"""
from __future__ import annotations

import time

from gspo_megatron.conversion.export import export_hf_tensors
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.rollout.base import RolloutEngine

DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024  # fastest on CPU (benchmarks/bench_weight_sync.py); SGLang re-buckets itself


def sync_weights(model, model_config: ModelConfig, engine: RolloutEngine,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Push every weight of ``model`` to ``engine``; the last bucket carries ``final=True`` (which bumps
    the engine's weight version). Returns timing and volume for the step metrics."""
    start = time.perf_counter()
    total = 0
    pending = None
    for bucket in export_hf_tensors(model, model_config, bucket_bytes):
        if pending is not None:
            engine.update_weights(pending, final=False)
        pending = bucket
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    if pending is None:
        raise ValueError("sync_weights: the model exported no tensors")
    engine.update_weights(pending, final=True)
    elapsed = time.perf_counter() - start
    return {"sync_bytes": float(total), "sync_s": elapsed, "sync_bytes_per_s": total / max(elapsed, 1e-9)}
