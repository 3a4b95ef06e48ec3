"""Shared helpers for tests that run the trainer as a user does (``gspo-megatron train`` in a subprocess):
the demo config, the command line, a run to its end, and a run killed right after a checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "cpu_demo.yaml"


def command(run_dir, *overrides, resume=False):
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir", str(run_dir),
           "logging.console=false", "logging.tensorboard=false", *overrides]
    return cmd + (["--resume"] if resume else [])


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(run_dir, *overrides, resume=False):
    proc = subprocess.run(command(run_dir, *overrides, resume=resume), capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def kill_after_checkpoint(run_dir, step, *overrides):
    """Start a run and SIGKILL it as soon as the checkpoint of ``step`` is complete."""
    proc = subprocess.Popen(command(run_dir, *overrides), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "gspo_meta.json"
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert proc.poll() is None, "the run ended before its checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.returncode


# ---- runs at several parallel layouts (tests/distributed/test_layout_runs.py and the modes' DP=2 tests) ----
# tiny and quick: 8 prompts x 4 samples, 2 mini-batches, a short warm start so rewards are not all zero
LAYOUT_COMMON = ["sft.steps=40", "sft.batch_size=32", "train.prompts_per_step=8", "rollout.samples_per_prompt=4",
          "train.minibatches_per_step=2", "eval.every_steps=2", "eval.num_prompts=8", "eval.pass_k=1",
          "checkpoint.every_steps=0", "logging.console=false", "logging.tensorboard=false",
          "rollout.temperature=0.8"]
# Float32 sums in another order, amplified by the warm start's 40 Adam steps (a gradient element near
# Adam's eps moves its weight by up to a whole step): measured on this config at 2 processes, grad norms
# agree to <= 1e-3 relative, losses (~3e-4) to <= 1.3e-6 absolute, sequence ratios to <= 1.7e-4.
# Different weights or responses (Megatron's own initialisation, a rank-dependent sampling seed) move
# the rewards themselves, which must be identical.
TOL = {"grad_norm": dict(rel=3e-3, abs=0.0), "pg_loss": dict(rel=0.0, abs=5e-6), "loss": dict(rel=0.0, abs=5e-6),
       "seq_ratio_mean": dict(rel=0.0, abs=5e-4), "clip_frac_seq": dict(rel=0.0, abs=0.02)}
# dynamic sampling and partial rollouts change the loss normalisers by whole groups: losses agree less closely
LOSS_TOL = {"pg_loss": dict(rel=3e-2, abs=0.0), "loss": dict(rel=3e-2, abs=0.0)}


def train_layouts(rank, world_size, base_dir, layouts, steps, config=str(DEMO)):
    """Train every layout of ``layouts`` in turn (``config`` with COMMON and the layout's overrides); rank 0
    returns each run's metrics.jsonl records."""
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    out = {}
    for name, overrides in layouts.items():
        run_dir = Path(base_dir) / name
        trainer = Trainer(load_config(config, LAYOUT_COMMON + [f"train.steps={steps}"] + overrides), run_dir)
        try:
            trainer.run()
        finally:
            trainer.close()
        if rank == 0:
            out[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out


def sglang_standin_overrides(urls: list, disk_dir: str, *extra: str) -> list[str]:
    """The demo on stand-in servers with disk sync, 4 prompts of 4 tokens per step, one prompt per request."""
    return ["sft.steps=0", "logging.console=false", "logging.tensorboard=false", "train.prompts_per_step=4",
            "rollout.max_new_tokens=4", "rollout.engine=sglang", f"rollout.sglang.urls=[{','.join(urls)}]",
            "rollout.sglang.weight_sync=disk", f"rollout.sglang.disk_dir={disk_dir}",
            "rollout.sglang.prompts_per_request=1", "rollout.sglang.backoff_s=0.01", *extra]


def rerun_then_report(driver, argv, results: Path, tmp_path: Path) -> str:
    """An experiment script (examples/experiments/) whose results file holds every run: ``run`` again runs and
    rewrites nothing; then ``report`` into a scratch page, whose text is returned."""
    stamp = results.stat().st_mtime_ns
    driver.main(argv)
    assert results.stat().st_mtime_ns == stamp
    doc = tmp_path / "page.md"
    doc.write_text(f"before\n{driver.BEGIN}\nold\n{driver.END}\nafter\n")
    driver.main(["report", "--results", str(results), "--figures", str(tmp_path / "fig"), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text
    return text
