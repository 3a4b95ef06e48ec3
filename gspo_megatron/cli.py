"""`gspo-megatron` command line: train, demo, convert, eval, plot, smoke.

Errors print one line: ``gspo-megatron COMMAND: error: ...``. Exit status 2: bad input (our own error
types and OS errors, which name the file, key or field); 1: an unexpected error (the line names the
exception type and the file holding its traceback). ``--debug`` (anywhere on the line) prints the full
traceback instead. ``convert check`` adds 3: logits differ (docs/conversion.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Callable

from gspo_megatron import processes  # noqa: F401 - first: records the parent pid (processes.STARTED_BY)

EXIT_CRASH, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
DEBUG_ENV = "GSPO_DEBUG"  # set from --debug, so torchrun's ranks inherit it


def is_bad_input(err: BaseException) -> bool:
    """Our own error types (each names the file, key or field) and OS errors on the user's paths; the rest
    are crashes."""
    own = isinstance(err, ValueError) and type(err).__module__.startswith("gspo_megatron")
    return own or isinstance(err, OSError)


def _save_traceback(command: str, text: str) -> Path:
    folder = Path(tempfile.gettempdir()) / "gspo-megatron-errors"
    folder.mkdir(exist_ok=True)
    path = folder / f"{command}-{os.getpid()}.log"
    path.write_text(text)
    return path


def run_reporting_errors(command: str, fn: Callable[[], int]) -> int:
    """``fn()``, with any error reported in one line (see the module docstring) instead of a traceback."""
    try:
        return fn()
    except KeyboardInterrupt:
        print(f"gspo-megatron {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - the one place every error is reported, then the exit status
        text = traceback.format_exc()
        rank = os.environ.get("RANK")
        prefix = f"gspo-megatron {command}" + (f" (rank {rank})" if rank not in (None, "0") else "")
        if os.environ.get(DEBUG_ENV) == "1":
            sys.stderr.write(text)
        if is_bad_input(err):
            print(f"{prefix}: error: {err}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        hint = ("" if os.environ.get(DEBUG_ENV) == "1"
                else f" (traceback: {_save_traceback(command, text)}; --debug prints it)")
        print(f"{prefix}: error: {type(err).__name__}: {err}{hint}", file=sys.stderr, flush=True)
        return EXIT_CRASH


def _quiet_known_warnings() -> None:
    """Megatron warns at import about every optional CUDA library it does not find (apex, Transformer
    Engine); on CPU that is expected and drowns the training output. Other warnings stay visible."""
    warnings.filterwarnings("ignore", message=r".*(Apex|apex|Transformer Engine).*not installed.*")
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")


def main(argv: list[str] | None = None) -> int:
    _quiet_known_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    parser = argparse.ArgumentParser(prog="gspo-megatron", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="print full tracebacks (may go anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True)
    from gspo_megatron.trainer.entry import REPO_EXAMPLES, add_train_arguments

    sub.add_parser("smoke", help="tiny MoE forward/backward at EP=2 on two processes vs one process")
    add_train_arguments(sub.add_parser("train", help="GSPO training (one process, torchrun or srun)"))
    demo = sub.add_parser("demo", help="the CPU demo: train --config examples/cpu_demo.yaml")
    add_train_arguments(demo, config_required=False)
    sub.add_parser("plot", help="PNG charts from run folders' metrics", add_help=False)
    from gspo_megatron.trainer import evaluate

    evaluate.add_arguments(sub.add_parser("eval", help="pass@1 / pass@k of a checkpoint on held-out prompts"))
    sub.add_parser("convert", help="checkpoint conversion (see `gspo-megatron convert -h`)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "smoke":
        from gspo_megatron import smoke

        smoke.run()
        return 0
    if args.command in ("train", "demo"):
        from gspo_megatron.trainer.entry import run_training

        if args.command == "demo":
            args.config = args.config or str(REPO_EXAMPLES / "cpu_demo.yaml")
            argv = ["train", "--config", args.config, *argv[1:]]
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
    if args.command == "convert":
        from gspo_megatron.conversion import cli as convert_cli

        return convert_cli.main(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
