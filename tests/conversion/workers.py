"""Functions run on spawned ranks by the conversion tests (module-level so spawn can import them)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gspo_megatron.conversion.check import compare_layouts, model_config_for_check
from gspo_megatron.conversion.export import export_hf_tensors
from gspo_megatron.megatron import checkpoint
from gspo_megatron.megatron.model import build_model
from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
from tests.conversion.hf_models import read_all

LAYOUTS = {
    "tp2": ParallelConfig(tensor_parallel=2),
    "pp2": ParallelConfig(pipeline_parallel=2),
    "ep2": ParallelConfig(expert_parallel=2),
}
EXPORT_BUCKET_BYTES = 16 * 1024


def _export(hf_dir: str, megatron_dir: str, layout: str) -> dict:
    """Load the converted checkpoint at ``layout`` and export it live; compare with the HF tensors."""
    config = model_config_for_check(Path(hf_dir), Path(megatron_dir))
    initialize_model_parallel(LAYOUTS[layout])
    model = build_model(config, LAYOUTS[layout])
    checkpoint.load_model(model, megatron_dir)
    buckets = list(export_hf_tensors(model, config, bucket_bytes=EXPORT_BUCKET_BYTES))
    exported = {name: t for bucket in buckets for name, t in bucket}
    reference = read_all(Path(hf_dir))
    return {
        "bucket_names": [[name for name, _ in bucket] for bucket in buckets],
        "bucket_bytes": [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets],
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in exported.values()),
        "names": sorted(exported),
        "reference_names": sorted(reference),
        "different": sorted(n for n in reference if n in exported and not torch.equal(exported[n], reference[n])),
    }


def conversion_checks(rank: int, world_size: int, cases: list[tuple[str, str, str, list[str]]],
                      resave: tuple[str, str, str, str, list[str]]) -> dict:
    """One spawn for every distributed conversion check.

    ``cases``: (label, HF folder, converted Megatron folder, layouts): logits vs transformers
    (check.compare_layouts, what `convert check` runs) and the live export at each layout.
    ``resave``: (HF folder, converted folder, save layout, output folder, load layouts): load the
    converted checkpoint at the save layout, save it from there (chunks split the way training saves
    them), then check the logits of that checkpoint loaded at each load layout.
    """
    results: dict = {}
    for label, hf_dir, megatron_dir, layouts in cases:
        results[label] = {"logits": compare_layouts(rank, world_size, hf_dir, megatron_dir,
                                                    {name: LAYOUTS[name] for name in layouts}),
                          "export": {name: _export(hf_dir, megatron_dir, name) for name in layouts}}
    hf_dir, megatron_dir, save_layout, out_dir, load_layouts = resave
    config = model_config_for_check(Path(hf_dir), Path(megatron_dir))
    initialize_model_parallel(LAYOUTS[save_layout])
    model = build_model(config, LAYOUTS[save_layout])
    checkpoint.load_model(model, megatron_dir)
    checkpoint.save_model(model, out_dir, common={"model_config": dataclasses.asdict(config)})
    results["resaved"] = compare_layouts(rank, world_size, hf_dir, out_dir, {n: LAYOUTS[n] for n in load_layouts})
    return results
