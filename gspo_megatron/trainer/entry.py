"""`gspo-megatron train`: one process, torchrun, or srun (the launch environment decides)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def add_train_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    parser.add_argument("--config", required=config_required, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=10")
    parser.add_argument("--run-dir", default=None, help="output folder (default: runs/<config name>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --run-dir from its newest checkpoint; refused when the folder holds "
                             "no run (a mistyped --run-dir)")
    parser.add_argument("--resume-or-start", action="store_true",
                        help="continue the run in --run-dir if it holds one, else start it there (a Slurm job's line: "
                             "its first start and every requeue)")
    parser.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                        help="start from this checkpoint's policy weights (a training or converted checkpoint): "
                             "step 0, a fresh optimizer, no warm start; --resume still takes the run's own newest")
    parser.add_argument("--nproc", type=_positive_int, default=1,
                        help="start this many local processes with torchrun (ignored under torchrun/srun)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _relaunch_with_torchrun(argv: list[str], nproc: int) -> int:
    """Re-run this command under torchrun on this machine with ``nproc`` processes. torchrun and its
    ranks die with this command (SIGKILL included); SIGTERM / SIGINT / SIGHUP reach the ranks past torchrun
    (they save a checkpoint and exit 0, trainer/preemption.py), so torchrun's 30 s kill never starts."""
    from gspo_megatron.processes import DIE_WITH_PARENT_ENV, run_forwarding_signals

    args = [a for i, a in enumerate(argv) if not (a.startswith("--nproc") or (i and argv[i - 1] == "--nproc"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "gspo_megatron.cli", *args]
    return run_forwarding_signals(cmd, env={**torchrun_environment(os.environ, nproc), DIE_WITH_PARENT_ENV: "1"},
                                  to_ranks=True)


def torchrun_environment(environ: dict[str, str], nproc: int) -> dict[str, str]:
    """``environ`` for our torchrun of ``nproc`` ranks, with ``OMP_NUM_THREADS`` set: the user's value, else the
    machine's cores shared among the ranks (what each CPU rank gives torch in ``run_training``). Set, it also
    keeps torchrun from printing its "Setting OMP_NUM_THREADS ... to be 1" banner."""
    threads = environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    return {**environ, "OMP_NUM_THREADS": threads}


def run_training(args: argparse.Namespace, argv: list[str]) -> int:
    from gspo_megatron.trainer.launch_env import export_for_torch, resolve_launch

    from gspo_megatron import processes
    from gspo_megatron.reporting import EXIT_INTERRUPTED

    from gspo_megatron.trainer.config import check_model_folders, check_world_size, load_config

    launch = resolve_launch(os.environ)
    # every bad setting is named here, once, before torchrun or any rank starts
    config = load_config(args.config, args.overrides)
    check_model_folders(config, args.config)
    local = launch.launcher == "single"
    check_world_size(config.parallel, args.nproc if local else launch.world_size, local=local)
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    if args.resume and not args.resume_or_start:
        from gspo_megatron.trainer.run_dir import check_resume_target

        check_resume_target(run_dir)  # a mistyped folder must not start a new run
    args.resume = args.resume or args.resume_or_start
    if args.resume:
        from gspo_megatron.trainer.resume import check_before_start
        from gspo_megatron.typed_config import to_dict

        check_before_start(to_dict(config), run_dir)  # a refused change: one line, no model built first
    if launch.launcher == "single" and args.nproc > 1:
        return _relaunch_with_torchrun(argv, args.nproc)
    if os.environ.get(processes.DIE_WITH_PARENT_ENV) == "1":
        processes.die_with_parent(processes.STARTED_BY)  # a rank of our own torchrun launch
    processes.kill_forked_children_with_parent()
    os.environ.update(export_for_torch(launch, os.environ))

    import torch

    from gspo_megatron.megatron import parallel
    from gspo_megatron.trainer.loop import Trainer

    from gspo_megatron.megatron.device import cuda_present

    if not cuda_present():  # device branch: intra-op threads drive CPU compute only; ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(launch.local_world_size, 1)))
    if args.init_from is not None and config.sft.steps and launch.rank == 0:
        print(f"--init-from {args.init_from}: training starts from its weights; the warm start (sft.steps="
              f"{config.sft.steps}) is skipped (--init-from wins; pass sft.steps=0 to silence this)", flush=True)
    parallel.init_process_group(launch.rank, launch.world_size, launch.master_addr, launch.master_port)
    started = time.monotonic()
    trainer = Trainer(config, run_dir, resume=args.resume, init_checkpoint=args.init_from)
    try:
        trainer.run()
        stopped_by = trainer.preemption.signal_name
    finally:
        trainer.close()
        parallel.destroy()
    if launch.rank == 0:
        # a stopped run says how to continue it (our own torchrun launch: with the --nproc it was given)
        own_launch = os.environ.get(processes.DIE_WITH_PARENT_ENV) == "1" and launch.launcher == "torchrun"
        resume = resume_command(argv, launch.world_size if own_launch else 1) if stopped_by else None
        print(run_summary(run_dir, time.monotonic() - started, resume), flush=True)
    # a stop signal saves and exits 0 (Slurm's requeue reads that), Ctrl-C 130 like any interrupted command
    return EXIT_INTERRUPTED if stopped_by == "SIGINT" else 0


def resume_command(argv: list[str], nproc: int) -> str:
    """The command line that continues this run, typed as it runs in a new shell (``reporting.cli_command``):
    ``argv`` (this command's arguments, ``train ... --run-dir RUN``) with ``--nproc nproc`` (when > 1) and
    ``--resume``."""
    import shlex

    from gspo_megatron.reporting import cli_command

    args = [a for i, a in enumerate(argv) if not (a.startswith("--nproc") or (i and argv[i - 1] == "--nproc"))]
    args += (["--nproc", str(nproc)] if nproc > 1 else []) + ([] if "--resume" in args else ["--resume"])
    return f"{cli_command()} {shlex.join(args)}"


def run_summary(run_dir: Path, seconds: float, resume: str | None = None) -> str:
    """The closing paragraph: held-out accuracy at the first and the last evaluation, time, where things are;
    ``resume``: the command that continues a stopped run."""
    from gspo_megatron.reporting import cli_command
    from gspo_megatron.trainer.metrics_log import metrics_path, read_metrics

    records = read_metrics(metrics_path(run_dir)) if metrics_path(run_dir).exists() else []
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    if len(evals) >= 2:
        (s0, a0), (s1, a1) = evals[0], evals[-1]
        accuracy = (f"held-out greedy accuracy {a0:.3f} at step {s0} -> {a1:.3f} at step {s1} "
                    f"({a1 - a0:+.3f}, best {max(a for _, a in evals):.3f})")
    else:
        accuracy = "fewer than two held-out evaluations"
    return (f"summary: {accuracy}; {seconds:.0f} s in this command. Run folder {run_dir}: metrics.jsonl, "
            f"completions.jsonl, checkpoints/, tensorboard/; charts: {cli_command()} plot {run_dir} "
            f"(PNGs in {run_dir}/plots)" + (f"\nresume: {resume}" if resume else ""))
