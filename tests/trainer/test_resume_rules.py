"""trainer/resume.py: which settings a resume applies (and logs) and which it refuses, naming the field and
both values (a pure function of the saved and the new config)."""
import json
import subprocess
import sys

import pytest

from gspo_megatron.trainer.config import load_config
from gspo_megatron.trainer.resume import check_before_start, resume_changes
from gspo_megatron.typed_config import ConfigError, to_dict
from tests.reliability.helpers import DEMO, REPO, TINY, train_command


def _pair(saved: list[str], now: list[str]):
    return to_dict(load_config(DEMO, saved)), to_dict(load_config(DEMO, now))


def test_changed_settings_are_listed_to_be_applied():
    saved, now = _pair([], ["optimizer.lr=1e-3", "train.steps=99", "rollout.temperature=0.7"])
    assert resume_changes(saved, now) == [("optimizer.lr", 3e-4, 1e-3), ("rollout.temperature", 1.0, 0.7),
                                          ("train.steps", 60, 99)]
    assert resume_changes(saved, saved) == []
    # a field the checkpoint does not know (added since it was saved) is not compared
    del saved["optimizer"]["adam_eps"]
    assert resume_changes(saved, now)[0][0] == "optimizer.lr"
    # sync mode: the rollout batch size may change; kl_coef between two values > 0 too
    saved, now = _pair(["loss.kl_coef=0.1"], ["loss.kl_coef=0.2", "rollout.samples_per_prompt=4"])
    assert [f for f, _, _ in resume_changes(saved, now)] == ["loss.kl_coef", "rollout.samples_per_prompt"]


@pytest.mark.parametrize("saved, now, message", [
    ([], ["loss.kl_coef=0.1"], r"loss.kl_coef: cannot change on resume \(0.0 in the checkpoint, 0.1 now\): the frozen "
                               r"reference model exists only with kl_coef > 0"),
    (["loss.kl_coef=0.1"], ["loss.kl_coef=0"], r"loss.kl_coef: cannot change on resume \(0.1 in the checkpoint, 0.0"),
    ([], ["model.precision=bf16"], r"model.precision: cannot change on resume \('fp32' in the checkpoint, 'bf16' now\)"),
    (["train.rollout_mode=overlap"], ["train.rollout_mode=overlap", "rollout.samples_per_prompt=4"],
     r"rollout.samples_per_prompt: cannot change on resume \(8 in the checkpoint, 4 now\): the batches generated ahead"),
    (["train.rollout_mode=overlap"], [], r"train.rollout_mode: cannot change on resume \('overlap' in the checkpoint, "
                                         r"'sync' now\)"),
])
def test_settings_the_checkpoint_depends_on_are_refused_by_name(saved, now, message):
    with pytest.raises(ConfigError, match=message):
        resume_changes(*_pair(saved, now))


def test_sync_to_overlap_is_applied():
    assert resume_changes(*_pair([], ["train.rollout_mode=overlap"])) == [("train.rollout_mode", "sync", "overlap")]


def _saved_run(run_dir, overrides: list[str], steps=(1, 2)):
    """A run folder whose checkpoints hold only their gspo_meta.json (what the check before start reads)."""
    for step in steps:
        folder = run_dir / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "gspo_meta.json").write_text(json.dumps({"step": step, "config": to_dict(load_config(DEMO, TINY + overrides))}))
    return run_dir


def test_a_refused_resume_is_found_before_any_rank_starts(tmp_path):
    """The newest checkpoint's config against this run's, before torchrun or a model: an overlap run resumed in
    sync mode is one line, exit 2, in the seconds the command line takes (it used to build the trainer first)."""
    run_dir = _saved_run(tmp_path / "run", ["train.rollout_mode=overlap"])
    with pytest.raises(ConfigError, match=r"^train.rollout_mode: cannot change on resume \('overlap' in the checkpoint"):
        check_before_start(to_dict(load_config(DEMO, TINY)), run_dir)
    check_before_start(to_dict(load_config(DEMO, TINY + ["train.rollout_mode=overlap", "train.steps=99"])), run_dir)
    check_before_start(to_dict(load_config(DEMO)), tmp_path / "empty")  # nothing saved yet: nothing to refuse
    (run_dir / "checkpoints" / "step_000003.incomplete").mkdir()  # a save in progress is not a checkpoint
    ((run_dir / "checkpoints" / "step_000003.incomplete") / "gspo_meta.json").write_text("{}")
    proc = subprocess.run(train_command(run_dir, "--nproc", "2", resume=True), capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if "error:" in line] == [
        "gspo-megatron train: error: train.rollout_mode: cannot change on resume ('overlap' in the checkpoint, 'sync' "
        "now): an overlap checkpoint holds the batches generated ahead; resume it with train.rollout_mode=overlap. "
        "Resume with train.rollout_mode=overlap, or start a new run (--init-from takes the weights)"]
    assert "torch.distributed.run" not in proc.stderr and not (run_dir / "config.yaml").exists()
