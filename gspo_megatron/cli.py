"""`gspo-megatron` command line: train, demo, convert, eval, plot, prepare, smoke.

Errors print one line: ``gspo-megatron COMMAND: error: ...``. Exit status 2: bad input (our own error
types and OS errors, which name the file, key or field); 1: an unexpected error (the line names the
exception type and the file holding its traceback). ``--debug`` (anywhere on the line) prints the full
traceback instead. ``convert check`` adds 3: logits differ (docs/conversion.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from gspo_megatron import processes  # noqa: F401 - first: records the parent pid (processes.STARTED_BY)
from gspo_megatron.reporting import DEBUG_ENV, run_reporting_errors
from gspo_megatron.reporting import quiet_known_warnings as _quiet_known_warnings


def fresh_run_dir(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... when earlier runs hold the previous ones: the demo may be run
    again and again, while a fresh ``train`` never reuses a run's folder (docs/failures.md)."""
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def _run_progress(folder: Path) -> tuple[int | None, int | None]:
    """(newest saved step, the run's train.steps) of a run folder; None where unknown."""
    import yaml

    config = folder / "config.yaml"
    steps = None
    if config.is_file():
        loaded = yaml.safe_load(config.read_text()) or {}
        steps = (loaded.get("train") or {}).get("steps")
    saved = [int(p.name.removeprefix("step_")) for p in (folder / "checkpoints").glob("step_*")
             if p.name.removeprefix("step_").isdigit() and (p / "gspo_meta.json").is_file()]
    return (max(saved) if saved else None), steps


def _unfinished(folder: Path) -> tuple[float, int | None, int | None] | None:
    """(last change, newest saved step, train.steps) of an unfinished run folder; None when it is finished
    (its newest checkpoint at its train.steps) or holds no run."""
    if not ((folder / "config.yaml").is_file() or (folder / "checkpoints").is_dir()):
        return None
    saved, steps = _run_progress(folder)
    if steps is not None and saved is not None and saved >= steps:
        return None
    return max([folder.stat().st_mtime] + [p.stat().st_mtime for p in folder.iterdir()]), saved, steps


def _progress(saved: int | None, steps: int | None) -> str:
    return f"saved at step {saved} of {steps}" if saved is not None else "no checkpoint yet: starts over"


def resume_run_dir(base: Path) -> tuple[Path, str]:
    """The demo run ``--resume`` continues, and why: the newest (last modified) unfinished one of ``base``,
    ``base-2``, ... (a run is finished when its newest checkpoint is at its train.steps); a new folder
    (``fresh_run_dir``) when every run is finished or there is none. The why names the unfinished runs it
    leaves alone: older demo runs, and runs in other folders beside them (``--run-dir`` continues those)."""
    beside = [p for p in base.parent.iterdir() if p.is_dir()] if base.parent.is_dir() else []
    demo_runs = [p for p in beside if p == base or p.name.removeprefix(f"{base.name}-").isdigit()]
    unfinished = sorted(((u, p) for p in demo_runs if (u := _unfinished(p)) is not None),
                        key=lambda x: x[0][0], reverse=True)
    others = sorted(p for p in beside if p not in demo_runs and _unfinished(p) is not None)
    elsewhere = (f"; not demo folders, left alone (continue one with demo --resume --run-dir DIR): "
                 f"{', '.join(str(p) for p in others)}" if others else "")
    if not unfinished:
        why = (f"every demo run under {base.parent} is finished" if demo_runs
               else f"no earlier demo run under {base.parent}")
        return fresh_run_dir(base), why + "; starting a new run" + elsewhere
    (_, saved, steps), folder = unfinished[0]
    older = "".join(f"; older unfinished run left alone: {p} ({_progress(s, n)})" for (_, s, n), p in unfinished[1:])
    return folder, f"continuing the newest unfinished run ({_progress(saved, steps)})" + older + elsewhere


def build_parser() -> argparse.ArgumentParser:
    """The command line; its modules import no torch (``--help`` answers at once: tests/test_cli_startup.py)."""
    parser = argparse.ArgumentParser(prog="gspo-megatron", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="print full tracebacks (may go anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True)
    from gspo_megatron.trainer.entry import add_train_arguments

    sub.add_parser("smoke", help="tiny MoE forward/backward at EP=2 on two processes vs one process (a check "
                                 "that Megatron-Core runs here)",
                   description="Build a tiny MoE, run forward/backward on two processes with the experts split "
                               "(EP=2) and on one, and compare logits and gradients.")
    add_train_arguments(sub.add_parser("train", help="GSPO training (one process, torchrun or srun)"))
    demo = sub.add_parser("demo", help="the CPU demo: train --config examples/cpu_demo.yaml in runs/cpu_demo[-N]",
                          description="train --config examples/cpu_demo.yaml in a fresh runs/cpu_demo[-N] folder; "
                                      "--resume continues the newest unfinished one (and says which)")
    add_train_arguments(demo, config_required=False)
    sub.add_parser("plot", help="PNG charts from run folders' metrics", add_help=False)
    from gspo_megatron.trainer import evaluate

    evaluate.add_arguments(sub.add_parser("eval", help="pass@1 / pass@k of a checkpoint on held-out prompts"))
    sub.add_parser("convert", help="checkpoint conversion (see `gspo-megatron convert -h`)", add_help=False)
    from gspo_megatron.trainer import prepare

    prepare.add_arguments(sub.add_parser(
        "prepare", help="a GSM8K/MATH-like dataset (JSONL, Parquet, save_to_disk folder) as prompt JSONL",
        description=prepare.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_known_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    from gspo_megatron.trainer.entry import REPO_EXAMPLES

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "smoke":
        from gspo_megatron import smoke

        smoke.run()
        return 0
    if args.command in ("train", "demo"):
        from gspo_megatron.trainer.entry import run_training

        # argparse takes the positional overrides once: those after a later flag (`a=1 --resume b=2`) come back
        # unparsed, and would be dropped silently
        unknown = [a for a in rest if a.startswith("-") or "=" not in a]
        if unknown:
            parser.error(f"{args.command}: unrecognized arguments: {' '.join(unknown)}")
        args.overrides = [*args.overrides, *rest]

        if args.command == "demo":
            args.config = args.config or str(REPO_EXAMPLES / "cpu_demo.yaml")
            argv = ["train", "--config", args.config, *argv[1:]]
            if args.run_dir is None and not args.resume:
                args.run_dir = str(fresh_run_dir(Path("runs") / Path(args.config).stem))
                argv += ["--run-dir", args.run_dir]
                print(f"gspo-megatron demo: run folder {args.run_dir}", flush=True)
            elif args.run_dir is None:
                folder, why = resume_run_dir(Path("runs") / Path(args.config).stem)
                args.run_dir, args.resume_or_start = str(folder), True  # nothing to continue: a new run
                argv += ["--run-dir", args.run_dir, "--resume-or-start"]
                print(f"gspo-megatron demo --resume: {args.run_dir}: {why}", flush=True)
        return run_reporting_errors(args.command, lambda: run_training(args, argv))
    if args.command == "eval":
        from gspo_megatron.trainer import evaluate

        def run_eval() -> int:
            evaluate.run_eval(args)
            return 0

        return run_reporting_errors("eval", run_eval)
    if args.command == "plot":
        from gspo_megatron.trainer import plot

        return plot.main(rest)
    if args.command == "prepare":
        from gspo_megatron.trainer import prepare

        return run_reporting_errors("prepare", lambda: prepare.run(args))
    if args.command == "convert":
        from gspo_megatron.conversion import cli as convert_cli

        return convert_cli.main(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
