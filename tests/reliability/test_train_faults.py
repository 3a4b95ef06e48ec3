"""`gspo-megatron train / eval / convert` end to end on one tiny run: the run directory belongs to one run,
a failed start or resume keeps config.yaml, a damaged newest checkpoint is skipped, a full disk is
reported as such, training checkpoints convert and converted ones evaluate, reward failures are counted."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.conversion import cli as convert_cli
from tests.reliability.helpers import DEMO, REPO, tagged_env, train_command

pytestmark = pytest.mark.slow
FAILING_TERM = ("rewards.terms=[{name: synthetic}, "
                "{name: 'tests.reliability.failing_reward:always_raises', weight: 0.0}]")
RUN = ["train.steps=2", "sft.steps=2", "checkpoint.every_steps=1", "eval.every_steps=0"]


def _run(cmd, timeout=600):
    env, _ = tagged_env()
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "run"
    proc = _run(train_command(path, *RUN, FAILING_TERM))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def test_reward_failures_are_counted(run_dir):
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step, first_eval = 2 * 8, 2  # prompts x samples per step; the step-0 eval's 2 greedy responses
    counts = [m["faults/reward_failures"] for m in metrics if "faults/reward_failures" in m]
    assert counts == [first_eval + per_step, first_eval + 2 * per_step]


def test_fresh_start_into_an_earlier_run_and_a_bad_resume_are_refused_keeping_config(run_dir):
    config = (run_dir / "config.yaml").read_bytes()
    fresh = _run(train_command(run_dir, *RUN))
    assert fresh.returncode == 2, fresh.stderr[-2000:]
    assert _error_lines(fresh.stderr) == [f"gspo-megatron train: error: {run_dir}: holds an earlier run (checkpoints, "
                                          f"completions.jsonl, config.yaml, metrics.jsonl, sft_metrics.jsonl); pass --resume to continue it, or choose another "
                                          f"--run-dir (or delete that folder)"]
    other_model = _run(train_command(run_dir, *RUN, "model.config.hidden_size=32", resume=True))
    assert other_model.returncode == 2, other_model.stderr[-2000:]
    assert "holds another model (model.config.hidden_size differ)" in other_model.stderr
    assert "Traceback" not in other_model.stderr
    assert (run_dir / "config.yaml").read_bytes() == config
    assert not (run_dir / ".lock").exists()


def test_damaged_newest_checkpoint_is_skipped_with_a_warning(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    damaged = sorted((copy / "checkpoints" / "step_000002").glob("*.distcp"))[0]
    damaged.write_bytes(damaged.read_bytes()[:100])  # a truncated copy
    proc = _run(train_command(copy, *RUN, resume=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warning: skipping damaged checkpoint step_000002: {damaged}: truncated (100 bytes" in proc.stdout
    assert f"resumed from {copy / 'checkpoints' / 'step_000001'} at step 1" in proc.stdout
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def test_full_disk_during_a_save_is_reported_as_enospc(tmp_path):
    # a 1 MiB tmpfs in a private mount namespace: config and metrics fit, the first checkpoint does not
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs unshare -rm (user and mount namespaces) for a small private tmpfs")
    run_dir = tmp_path / "full"
    run_dir.mkdir()
    train = " ".join(f"'{a}'" for a in train_command(run_dir, "train.steps=1", "sft.steps=0", "checkpoint.every_steps=1"))
    proc = _run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{run_dir}' && exec {train}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = _error_lines(proc.stderr)
    assert "step_000001.incomplete: no space left on device (ENOSPC)" in line, line


def test_training_checkpoint_names_its_model_config_without_template(run_dir):
    # item 10: the model config of a training checkpoint is its saved training config's model section
    from gspo_megatron.conversion.offline import export_config
    from gspo_megatron.trainer.config import load_config

    config, template = export_config(run_dir / "checkpoints" / "step_000002", None)
    assert config == load_config(DEMO).model.config and template is None
    # and the whole conversion runs without --hf-template: an HF folder transformers loads
    import transformers

    out = run_dir.parent / "hf_from_training"
    assert convert_cli.main(["megatron-to-hf", "--megatron-dir", str(run_dir / "checkpoints" / "step_000002"),
                             "--out", str(out), "--no-progress"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == config.num_layers and model.config.vocab_size == config.vocab_size


def test_converted_checkpoint_evaluates_with_the_training_yaml(tmp_path):
    import torch
    import transformers

    from gspo_megatron.trainer.config import load_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(load_config(DEMO).model.config.to_hf_config())
    model.save_pretrained(tmp_path / "hf")
    assert convert_cli.main(["hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "meg"),
                             "--no-progress"]) == 0
    data = REPO / "examples" / "data" / "sort" / "eval.jsonl"
    evaluate = [sys.executable, "-m", "gspo_megatron.cli", "eval", "--checkpoint", str(tmp_path / "meg"), "--dataset",
                str(data), "--num-prompts", "4", "--k", "1"]
    without = _run(evaluate)
    assert without.returncode == 2 and "a converted checkpoint holds no training config" in without.stderr
    out = tmp_path / "eval.json"
    proc = _run(evaluate + ["--config", str(DEMO), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 4 and 0.0 <= result["eval_accuracy"] <= 1.0


def test_a_resume_applies_a_changed_lr_and_refuses_a_new_kl_term_by_name(run_dir, tmp_path):
    """--resume optimizer.lr=1e-3 on a 3e-4 run (the demo's) trains at 1e-3 (Megatron's scheduler used to keep the
    checkpoint's value while config.yaml said 0.001); loss.kl_coef 0 -> 0.1 would need a reference model the
    checkpoint lacks: one line naming the field, exit 2, config.yaml unchanged (was a raw traceback)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = (copy / "config.yaml").read_bytes()
    refused = _run(train_command(copy, *RUN, "loss.kl_coef=0.1", resume=True))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert _error_lines(refused.stderr) == [
        "gspo-megatron train: error: loss.kl_coef: cannot change on resume (0.0 in the checkpoint, 0.1 now): the frozen "
        "reference model exists only with kl_coef > 0: the checkpoint holds one exactly when its kl_coef was > 0 (a "
        "change between two values > 0 is applied). Resume with loss.kl_coef=0.0, or start a new run (--init-from "
        "takes the weights)"]
    assert "Traceback" not in refused.stderr and (copy / "config.yaml").read_bytes() == config
    applied = _run(train_command(copy, *[r for r in RUN if not r.startswith("train.steps")], "train.steps=3",
                                 "optimizer.lr=1e-3", resume=True))
    assert applied.returncode == 0, applied.stderr[-3000:]
    assert "resume: optimizer.lr 0.0003 -> 0.001 (applied)" in applied.stdout
    assert "resume: train.steps 2 -> 3 (applied)" in applied.stdout
    metrics = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert metrics[2]["lr"] == pytest.approx(3e-4) and metrics[3]["lr"] == pytest.approx(1e-3)
    assert "lr: 0.001" in (copy / "config.yaml").read_text()


def test_a_resume_on_other_training_data_is_refused_with_exit_2(run_dir, tmp_path):
    """The prompt iterator's fingerprint: one line, exit 2 (bad input), config.yaml and the lock as they were,
    and no 'resume: data.train_files ... (applied)' before it (the data is checked before the checkpoint load)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = (copy / "config.yaml").read_bytes()
    data = tmp_path / "train.jsonl"  # the demo's prompts less the first: other content, other order
    data.write_text("".join((REPO / "examples" / "data" / "sort" / "train.jsonl").read_text().splitlines(True)[1:]))
    proc = _run(train_command(copy, *RUN, f"data.train_files=[{data}]", resume=True))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == ["gspo-megatron train: error: prompt iterator state: num_prompts is 600 in the "
                                         "checkpoint but 599 now; resuming would not continue the same prompt order"]
    assert "Traceback" not in proc.stderr and (copy / "config.yaml").read_bytes() == config
    assert "resume: data.train_files" not in proc.stdout  # refused before any change is logged as applied
    assert not (copy / ".lock").exists()


def test_a_reward_too_large_for_the_advantages_is_a_counted_failure_naming_its_term(tmp_path):
    """A finite reward of 1e300 (float32 advantages: inf - inf = NaN) is refused per response like a reward
    that raises: scored 0, counted, the warning names the term. Refused on every response, it stops the run as
    any term failing everywhere does, naming the term and the refusal, not the NaN advantages."""
    run_dir = tmp_path / "run"
    huge = "rewards.terms=[{name: synthetic}, {name: 'tests.reliability.failing_reward:huge'}]"
    proc = _run(train_command(run_dir, "train.steps=1", "sft.steps=0", "eval.every_steps=0", huge))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rewards: 16 errors, 0 timeouts in a batch of 16; latest: huge: ValueError: a reward function returned " \
           "1e+300" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert "step 1: reward term 'huge' failed on every response of the batch (huge: ValueError: a reward function " \
           "returned 1e+300" in proc.stderr and "not finite" not in proc.stderr, proc.stderr[-3000:]


def test_weighted_rewards_that_overflow_the_advantages_stop_the_run_naming_the_terms(tmp_path):
    """weight 1e300 x a reward of 0 or 1: the summed reward is inf in float32 and the advantages NaN, so every
    update of the step would be skipped and the run would exit 0 having trained nothing: it stops instead,
    naming the term."""
    run_dir = tmp_path / "run"
    proc = _run(train_command(run_dir, "train.steps=2", "sft.steps=0", "eval.every_steps=0",
                              "rewards.terms=[{name: synthetic}, "
                              "{name: 'tests.reliability.failing_reward:parity', weight: 1.0e300}]"))
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "the group advantages are not finite" in proc.stderr, proc.stderr[-2000:]
    assert "rewards.terms[1] 'parity' (weight 1e+300)" in proc.stderr, proc.stderr[-2000:]


def test_a_step_whose_every_update_is_skipped_stops_the_run():
    from gspo_megatron.trainer.finite import TrainingStopped, check_some_update_applied

    check_some_update_applied([{"update_skipped": 1.0}, {"update_skipped": 0.0}], 3, 1)  # one is contained
    with pytest.raises(TrainingStopped, match="step 3: every update was skipped"):
        check_some_update_applied([{"update_skipped": 1.0}, {"update_skipped": 1.0}], 3, 2)


@pytest.mark.parametrize("function, error", [("always_raises", "RuntimeError: verifier broken"),
                                             ("returns_text", "TypeError: a reward function must return a number, got str")])
def test_a_reward_that_fails_on_every_response_stops_the_run_with_its_traceback(tmp_path, function, error):
    """A counting term that fails on every response scores 0 everywhere: the run would train on nothing and exit
    0. It stops at the first step, naming the term, and the run folder holds the first traceback with the
    reward's own file and line."""
    run_dir = tmp_path / "run"
    proc = _run(train_command(run_dir, "train.steps=3", "sft.steps=0", "eval.every_steps=0",
                              f"rewards.terms=[{{name: synthetic}}, {{name: 'tests.reliability.failing_reward:{function}'}}]"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = run_dir / "reward_failures.log"
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"gspo-megatron train: error: TrainingStopped: step 1: reward term {function!r} failed on every response of "
        f"the batch ({function}: {error}); the first traceback of each failing term: {log} "), proc.stderr[-3000:]
    text = log.read_text()
    source = REPO / "tests" / "reliability" / "failing_reward.py"
    line = next(i for i, t in enumerate(source.read_text().splitlines(), 1) if t.startswith(f"def {function}("))
    assert f"defined at {source}:{line}" in text and error in text, text
    if function == "always_raises":  # the raising line itself, in the traceback
        assert f'File "{source}", line {line + 1}, in always_raises' in text, text
    assert not list((run_dir / "checkpoints").glob("step_*"))  # nothing trained, nothing saved
