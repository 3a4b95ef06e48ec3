"""What the experiment scripts (examples/experiments/) share: one ``gspo-megatron train`` run in a subprocess
and the metrics it logged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence


def train_run(config: Path, run_dir: Path, overrides: list[str], env: dict, cwd: Path,
              init_from: Path | None = None) -> float:
    """One ``gspo-megatron train --resume-or-start`` run of ``config`` (a run cut short continues from its
    newest checkpoint, or starts again where it has none); returns its wall time in seconds. A failure raises,
    with the end of its stderr."""
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(config), "--run-dir", str(run_dir),
           "--resume-or-start", *overrides]
    if init_from is not None:
        cmd += ["--init-from", str(init_from)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def read_metrics(run_dir: Path, keys: Sequence[str]) -> dict:
    """{"steps": [...], key: [value per logged step (None where absent)]} from RUN_DIR/metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r["step"] for r in records], **{k: [r.get(k) for r in records] for k in keys}}


def write_json(path: Path, data: dict) -> None:
    """``data`` to ``path`` through a temporary file renamed at the end (a results file is never half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
