"""`gspo-megatron eval --checkpoint DIR --dataset FILE`: pass@1 (greedy) and pass@k (sampled) of a
training checkpoint on held-out prompts, with the run's own model, tokenizer and reward settings."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from gspo_megatron.megatron import checkpoint as ckpt
from gspo_megatron.typed_config import build


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder: RUN_DIR/checkpoints/step_NNNNNN")
    parser.add_argument("--dataset", required=True, help="JSONL / Parquet / saved HF dataset of held-out prompts")
    parser.add_argument("--k", type=int, default=4, help="samples per prompt for pass@k (default 4)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="evaluate at most this many prompts")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def eval_config(checkpoint_dir: Path, dataset: str, k: int, num_prompts: int):
    """The training run's config (saved in the checkpoint) pointed at ``dataset``, without warm start."""
    from gspo_megatron.trainer.config import TrainConfig

    config = ckpt.read_meta(checkpoint_dir)["config"]
    config["data"].update(train_files=[str(Path(dataset).resolve())], eval_files=[str(Path(dataset).resolve())],
                          eval_holdout=0)
    config["sft"]["steps"] = 0
    config["eval"].update(num_prompts=num_prompts, pass_k=k)
    config["logging"].update(console=False, tensorboard=False, wandb_project=None)
    return build(TrainConfig, config, "")


def run_eval(args: argparse.Namespace) -> dict:
    from gspo_megatron.megatron import parallel
    from gspo_megatron.trainer.launch_env import export_for_torch, resolve_launch
    from gspo_megatron.trainer.loop import Trainer

    checkpoint_dir = Path(args.checkpoint)
    config = eval_config(checkpoint_dir, args.dataset, args.k, args.num_prompts)
    launch = resolve_launch(os.environ)
    os.environ.update(export_for_torch(launch, os.environ))
    parallel.init_process_group(launch.rank, launch.world_size, launch.master_addr, launch.master_port)
    with tempfile.TemporaryDirectory(prefix="gspo-eval-") as scratch:
        trainer = Trainer(config, scratch, init_checkpoint=checkpoint_dir)
        try:
            results = trainer.evaluate()
        finally:
            trainer.close()
            parallel.destroy()
    results = {"checkpoint": str(checkpoint_dir), "dataset": args.dataset, "num_prompts":
               min(args.num_prompts, len(trainer.eval_data or trainer.train_data)), **results}
    if launch.rank == 0:
        text = json.dumps(results, indent=2)
        print(text)
        if args.out:
            out = Path(args.out)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(out)
    return results
