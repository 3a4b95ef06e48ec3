"""Which settings may change when a run is resumed, in one table.

    gspo-megatron train --config run.yaml --run-dir runs/x --resume optimizer.lr=1e-3

A resume either applies a changed setting (and logs it: ``resume: optimizer.lr 0.0001 -> 0.001
(applied)``) or refuses it, naming the field and both values. Nothing in between: ``RUN_DIR/config.yaml``
always holds what is in effect. The rule is ``resume_changes``, a pure function of the saved and the new
config (``to_dict`` form); the model identity and the expert-parallel size have their own messages
(``config.check_resumable``, which runs first).

Applied on resume (everything not refused below), for instance: the optimizer and its schedule
(``optimizer.*``: the scheduler is built with Megatron's ``override_opt_param_scheduler``, so the new
values replace the checkpoint's; Adam's betas and eps are set on the loaded parameter groups), the loss
(``loss.*`` except below), rollout sampling, rewards, evaluation, logging, checkpointing, ``train.steps``,
the data files (the prompt iterator refuses a dataset whose content or order differs, by fingerprint).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from gspo_megatron.typed_config import ConfigError

Flat = dict[str, Any]


def flatten(tree: dict, prefix: str = "") -> Flat:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and None are leaves."""
    out: Flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def _always(saved: Flat, old: Any, new: Any) -> bool:
    return True


def _crosses_zero(saved: Flat, old: Any, new: Any) -> bool:
    return (old == 0) != (new == 0)


def _was_overlap(saved: Flat, old: Any, new: Any) -> bool:
    return saved.get("train.rollout_mode") == "overlap"


def _holds_groups(saved: Flat, old: Any, new: Any) -> bool:
    """The checkpoint may hold whole groups of responses: batches generated ahead or partial responses."""
    return saved.get("train.rollout_mode") == "overlap" or bool(saved.get("rollout.partial"))


def _overlap_to_sync(saved: Flat, old: Any, new: Any) -> bool:
    return old == "overlap" and new != "overlap"


# field -> (refused when(saved, old, new), why). A field that is not here is applied on resume.
REFUSED: dict[str, tuple[Callable[[Flat, Any, Any], bool], str]] = {
    "model.precision": (_always, "the checkpoint's optimizer state (fp32 main weights, loss scale) belongs to "
                                 "its precision"),
    "model.tokenizer_dir": (_always, "the checkpoint's token ids and data position belong to its tokenizer"),
    "loss.kl_coef": (_crosses_zero, "the frozen reference model exists only with kl_coef > 0: the checkpoint "
                                    "holds one exactly when its kl_coef was > 0 (a change between two values "
                                    "> 0 is applied)"),
    "train.rollout_mode": (_overlap_to_sync, "an overlap checkpoint holds the batches generated ahead; "
                                             "resume it with train.rollout_mode=overlap"),
    "rollout.samples_per_prompt": (_holds_groups, "the batches generated ahead (train.rollout_mode: overlap) "
                                                  "or the partial responses in flight (rollout.partial) hold the "
                                                  "saved number of samples"),
    "train.prompts_per_step": (_was_overlap, "the batches generated ahead (train.rollout_mode: overlap) hold "
                                             "the saved number of prompts"),
    "train.max_staleness": (_was_overlap, "the checkpoint holds that many batches generated ahead"),
}


def resume_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """The settings that differ between ``saved`` (the checkpoint's config) and ``current`` (this run's), as
    (dotted field, saved value, new value), sorted by field; all of them are applied. Raises ``ConfigError``
    naming the first refused field (``REFUSED``) and both values. A field the checkpoint does not know
    (added since) is not compared. Model identity (``model.hf_dir``, ``model.config``) and
    ``parallel.expert_parallel`` are ``check_resumable``'s."""
    old, new = flatten(saved), flatten(current)
    changes = []
    for field in sorted(new):
        if field not in old or old[field] == new[field]:
            continue
        if field.startswith(("model.config", "model.hf_dir")) or field == "parallel.expert_parallel":
            continue  # check_resumable
        rule = REFUSED.get(field)
        if rule is not None and rule[0](old, old[field], new[field]):
            raise ConfigError(f"{field}: cannot change on resume ({old[field]!r} in the checkpoint, "
                              f"{new[field]!r} now): {rule[1]}. Resume with {field}={old[field]}, or start a new run "
                              f"(--init-from takes the weights)")
        changes.append((field, old[field], new[field]))
    return changes


def saved_checkpoints(root: Path) -> list[Path]:
    """The checkpoint folders under ``root`` that finished saving (``step_N`` with its gspo_meta.json, not a
    staging ``.incomplete`` or a replaced ``.old`` one), newest first; whether each verifies is the caller's."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step_") and (p / "gspo_meta.json").is_file()
                   and not p.name.endswith((".incomplete", ".old"))), reverse=True)


def check_before_start(current: dict, run_dir: Path) -> None:
    """``--resume`` before torchrun or any rank starts: ``check_resumable`` and ``resume_changes`` against the
    config saved in the run's newest checkpoint (``current``: to_dict of this run's config), so a refused change
    is one line, exit 2, without a model built first. The trainer checks again against the checkpoint it
    resumes from (the newest that verifies; a damaged one is skipped there, with a warning, not here)."""
    from gspo_megatron.trainer.config import check_resumable

    done = saved_checkpoints(run_dir / "checkpoints")
    if not done:
        return  # nothing to resume yet: the run starts from the beginning
    try:
        saved = json.loads((done[0] / "gspo_meta.json").read_text()).get("config", {})
    except json.JSONDecodeError:
        return  # a damaged newest checkpoint: the trainer names it and falls back to an older one
    check_resumable(saved, current, done[0])
    resume_changes(saved, current)


__all__ = ["REFUSED", "check_before_start", "flatten", "resume_changes", "saved_checkpoints"]
