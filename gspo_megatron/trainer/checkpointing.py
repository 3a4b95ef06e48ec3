"""Weights in and out of a run: the initial weights, finding the checkpoint to resume (verified), and the
Hugging Face export of a saved checkpoint. The trainer's own ``save_checkpoint`` / ``load_checkpoint``
put its progress (step, data position, faults, the schedule's state) beside the weights."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from gspo_megatron.megatron import checkpoint as ckpt
from gspo_megatron.megatron import sharding
from gspo_megatron.trainer.resume import saved_checkpoints
from gspo_megatron.trainer.run_dir import on_main_rank


def initialise_weights(policy, model_config, model_section) -> None:
    """Load HF weights when ``model.hf_dir`` is given; otherwise the canonical random initialisation of
    ``model.init_seed`` (the same weights at every parallel layout: megatron/canonical_init.py)."""
    if model_section.hf_dir is None:
        from gspo_megatron.megatron.canonical_init import initialise_canonical

        initialise_canonical(policy.module, model_config, model_section.init_seed)
        policy.reload_main_weights()
        return
    load_hf_weights(policy, model_config, model_section.hf_dir)


def load_hf_weights(policy, model_config, hf_dir) -> None:
    """``policy``'s weights from the Hugging Face folder ``hf_dir`` (through the family's conversion table)."""
    from gspo_megatron.conversion.safetensors_io import HFCheckpoint, check_declared_dtype
    from gspo_megatron.conversion.tables import expand

    with HFCheckpoint(hf_dir) as hf:
        check_declared_dtype(hf)
        canonical = {e.megatron: e.transform.to_megatron([hf.read(n) for n in e.hf]) for e in expand(model_config)}
    sharding.load_full_state_dict(policy.module, canonical)
    policy.reload_main_weights()


def copy_weights(src, dst) -> None:
    """``dst``'s parameters := ``src``'s (two PolicyModels of one layout)."""
    with torch.no_grad():
        for p_dst, p_src in zip(dst.module.parameters(), src.module.parameters()):
            p_dst.copy_(p_src)


def load_weights_only(policy, path: Path) -> None:
    """The policy weights of a checkpoint folder (a training checkpoint or a converted one)."""
    state = ckpt.load({"model": sharding.sharded_state_dict(policy.module, prefix="model.",
                                                            per_layer=ckpt.per_layer_keys(path))}, path)
    sharding.load_module_state(policy.module, state["model"], prefix="model.")
    policy.reload_main_weights()


def latest_checkpoint(run_dir: Path, is_main: bool) -> Path | None:
    """The newest checkpoint of ``run_dir`` that verifies (ckpt.verify: files, sizes, metadata). Newer damaged
    ones are skipped with a warning naming each and why; none at all is None; only damaged ones is an error."""
    root = run_dir / "checkpoints"
    skipped = []
    for path in saved_checkpoints(root):
        try:
            ckpt.verify(path)
        except ckpt.CheckpointError as err:
            skipped.append(str(err))
            if is_main:
                print(f"warning: skipping damaged checkpoint {path.name}: {err}", flush=True)
            continue
        if skipped and is_main:
            print(f"warning: resuming from {path.name}, the newest complete checkpoint", flush=True)
        return path
    if skipped:
        raise ckpt.CheckpointError(f"{root}: no complete checkpoint to resume from ({'; '.join(skipped)})")
    return None


def export_hf(run_dir: Path, checkpoint: Path, is_main: bool) -> Path:
    """checkpoint.export_hf: ``convert megatron-to-hf`` of a saved checkpoint into RUN_DIR/hf/<step>, in its
    own process (offline conversion needs a process without our process groups); the other ranks wait."""
    out = run_dir / "hf" / checkpoint.name

    def export() -> None:
        cmd = [sys.executable, "-m", "gspo_megatron.cli", "convert", "megatron-to-hf", "--megatron-dir",
               str(checkpoint), "--out", str(out), "--overwrite", "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise ValueError(f"checkpoint.export_hf: {' '.join(cmd[2:])} failed: "
                             f"{lines[-1] if lines else f'exit {proc.returncode}'}")
        print(f"exported {out} (Hugging Face folder; {proc.stdout.strip().splitlines()[0]})", flush=True)

    on_main_rank(export, is_main)
    return out
