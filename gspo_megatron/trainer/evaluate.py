"""`gspo-megatron eval --checkpoint DIR --dataset FILE`: pass@1 (greedy) and pass@k (sampled) of a
training checkpoint on held-out prompts, with the run's own model, tokenizer and reward settings.

A converted checkpoint (``convert hf-to-megatron``) holds the model but no training config: ``--config``
(the training YAML) then gives the reward and rollout settings; the model and its tokenizer (the
checkpoint's ``hf/`` folder) come from the checkpoint."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from gspo_megatron.typed_config import ConfigError, build, to_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder: RUN_DIR/checkpoints/step_NNNNNN")
    parser.add_argument("--dataset", required=True, help="JSONL / Parquet / saved HF dataset of held-out prompts")
    parser.add_argument("--k", type=int, default=4, help="samples per prompt for pass@k (default 4)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="evaluate at most this many prompts")
    parser.add_argument("--out", default=None, help="write the results as JSON here (a file; not an existing folder)")
    parser.add_argument("--outputs", default=None, metavar="FILE.jsonl",
                        help="write each prompt's outputs here: prompt, answer, greedy response and reward, the pass@k "
                             "samples and their rewards")
    parser.add_argument("--config", default=None,
                        help="training YAML for reward/rollout settings (default: the one a training checkpoint holds; "
                             "required for a converted checkpoint)")


def saved_checkpoints(run_or_checkpoints: Path) -> list[Path]:
    """The complete checkpoints (``step_*`` folders holding gspo_meta.json) of a run folder or of its
    ``checkpoints/`` folder, oldest first."""
    folder = run_or_checkpoints / "checkpoints" if (run_or_checkpoints / "checkpoints").is_dir() else run_or_checkpoints
    return sorted(p for p in folder.glob("step_*") if (p / "gspo_meta.json").is_file())


def check_checkpoint_path(checkpoint: Path) -> None:
    """Refuse a ``--checkpoint`` that is no checkpoint folder, naming the checkpoints that exist nearby: of
    the run folder given instead of a checkpoint, or beside a mistyped step (its nearest existing folder)."""
    if (checkpoint / "gspo_meta.json").is_file():
        return
    near = checkpoint
    while not near.is_dir() and near != near.parent:
        near = near.parent
    found = saved_checkpoints(near)
    listed = ", ".join(str(p) for p in found[-5:]) + (f" (and {len(found) - 5} older)" if len(found) > 5 else "")
    there = f"; the checkpoints in {near}: {listed}" if found else ""
    if not checkpoint.exists():
        none = f" (and no checkpoint in {near})"
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no such folder{there or none}")
    if found:
        raise FileNotFoundError(f"--checkpoint {checkpoint}: a run folder, not a checkpoint{there}")
    raise FileNotFoundError(f"--checkpoint {checkpoint}: no gspo_meta.json: not a checkpoint folder "
                            "(RUN_DIR/checkpoints/step_NNNNNN, or a converted one), or an incomplete one")


def check_out_path(out: Path) -> None:
    """Refuse an unusable ``--out`` before spending the evaluation on it."""
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a folder; give a file name, e.g. {out / 'eval.json'}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")
    try:  # a real write: permission bits say nothing for root, and nothing about a read-only mount
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.probe-"):
            pass
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot write into {out.parent} ({err.strerror})") from None


def _converted_model_section(checkpoint_dir: Path, meta: dict, tokenizer_dir: str | None) -> dict:
    """The model section for a converted checkpoint: its stored model config, its hf/ tokenizer."""
    from gspo_megatron.conversion.offline import HF_FILES_DIR

    hf_files = checkpoint_dir / HF_FILES_DIR
    has_tokenizer = any(hf_files.glob("tokenizer*"))
    return {"hf_dir": None, "config": meta["model_config"],
            "tokenizer_dir": str(hf_files.resolve()) if has_tokenizer else tokenizer_dir}


def eval_config(checkpoint_dir: Path, dataset: str, k: int, num_prompts: int, config_file: str | None = None):
    """The training run's config (saved in a training checkpoint, or ``config_file``) pointed at ``dataset``,
    without warm start; a converted checkpoint's own model."""
    from gspo_megatron.trainer.config import TrainConfig, load_config

    from gspo_megatron.megatron import checkpoint as ckpt  # torch: imported when evaluating, not for --help

    meta = ckpt.read_meta(checkpoint_dir)
    if config_file is not None:
        config = to_dict(load_config(config_file))
    elif "config" in meta:
        config = meta["config"]
    else:
        raise ConfigError(f"{checkpoint_dir}: a converted checkpoint holds no training config (rewards, rollout); "
                          f"pass --config with the training YAML")
    if "config" not in meta:
        if "model_config" not in meta:
            raise ConfigError(f"{checkpoint_dir / 'gspo_meta.json'}: neither a training config nor a model_config")
        config["model"] = _converted_model_section(checkpoint_dir, meta, config["model"].get("tokenizer_dir"))
    config["data"].update(train_files=[str(Path(dataset).resolve())], eval_files=[str(Path(dataset).resolve())],
                          eval_holdout=0)
    config["sft"]["steps"] = 0
    config["eval"].update(num_prompts=num_prompts, pass_k=k)
    config["logging"].update(console=False, tensorboard=False, wandb_project=None)
    return build(TrainConfig, config, "")


def evaluate_checkpoint(config, checkpoint_dir: Path) -> tuple[dict[str, float], list, int]:
    """pass@1 / pass@k of ``checkpoint_dir``'s policy weights: a forward-only model (no optimizer, no signal
    handlers, no run folder), the run's engine and rewards (trainer/components.py). Every rank calls it.
    Returns (metrics, per-prompt rows on rank 0, prompts evaluated)."""
    import torch.distributed as dist

    from gspo_megatron.data.dataset import load_prompt_datasets
    from gspo_megatron.megatron import checkpoint as ckpt
    from gspo_megatron.megatron.parallel import initialize_model_parallel
    from gspo_megatron.rewards.pool import build_reward_pool
    from gspo_megatron.trainer import checkpointing
    from gspo_megatron.trainer import components as parts
    from gspo_megatron.trainer.schedule.rollouts import Rollouts

    rank = dist.get_rank()
    initialize_model_parallel(config.parallel, seed=config.model.init_seed)
    tokenizer = parts.load_tokenizer(config.model)
    model_config = parts.model_config_of(config.model)
    policy = parts.policy_model(config, model_config, frozen=True)
    ckpt.verify(checkpoint_dir)  # a missing or cut checkpoint is named, not a DCP traceback
    checkpointing.load_weights_only(policy, checkpoint_dir)
    supervisor = parts.engine_supervisor(config, model_config, tokenizer, policy, {"engine_restarts": 0}, rank)
    train_data, eval_data = load_prompt_datasets(config.data, tokenizer)
    data = eval_data if eval_data is not None else train_data
    rewards = build_reward_pool(config.rewards)
    try:
        score = parts.reward_scorer(tokenizer, rewards, lambda samples: samples, model_config.num_experts)
        rollouts = Rollouts(supervisor, iter(()), train_data, parts.sampling_rule(config, tokenizer), score,
                            policy.groups.data_parallel, policy.groups.dp_size, policy.groups.dp_rank)
        supervisor.sync_weights(0)
        metrics, rows = parts.evaluate(rollouts, config, data, 0, tokenizer, rank == 0)
    finally:
        rewards.close()
        supervisor.shutdown()
    return metrics, rows, min(config.eval.num_prompts, len(data))


def run_eval(args: argparse.Namespace) -> dict:
    check_checkpoint_path(Path(args.checkpoint))  # before torch's import: a typo is answered at once
    from gspo_megatron import processes
    from gspo_megatron.megatron import parallel
    from gspo_megatron.trainer.launch_env import export_for_torch, resolve_launch

    processes.kill_forked_children_with_parent()
    checkpoint_dir = Path(args.checkpoint)
    for out in (args.out, args.outputs):
        if out:
            check_out_path(Path(out))
    config = eval_config(checkpoint_dir, args.dataset, args.k, args.num_prompts, args.config)
    launch = resolve_launch(os.environ)
    os.environ.update(export_for_torch(launch, os.environ))
    parallel.init_process_group(launch.rank, launch.world_size, launch.master_addr, launch.master_port)
    try:
        results, rows, evaluated = evaluate_checkpoint(config, checkpoint_dir)
    finally:
        parallel.destroy()
    results = {"checkpoint": str(checkpoint_dir), "dataset": args.dataset, "num_prompts": evaluated, **results}
    if launch.rank == 0:
        text = json.dumps(results, indent=2)
        print(text)
        if args.out:
            out = Path(args.out)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(out)
        if args.outputs:
            out = Path(args.outputs)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
            tmp.replace(out)
            print(f"per-prompt outputs: {out}", flush=True)
    return results
