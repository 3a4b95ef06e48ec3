"""A user's own config: reward code beside it imports, every path field is relative to the config file,
a missing path or section is one line naming the field, --init-from says the warm start is skipped."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from gspo_megatron.rewards.terms import build_terms
from gspo_megatron.trainer.config import check_model_folders, load_config
from gspo_megatron.typed_config import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu_demo.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _user_config(folder: Path, **changes) -> Path:
    """The demo config copied into ``folder`` with its data beside it (relative paths), plus ``changes``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(DEMO.read_text())
    (folder / "data").mkdir(exist_ok=True)
    for name in ("train", "eval"):
        (folder / "data" / f"{name}.jsonl").write_text((REPO / "examples/data/sort" / f"{name}.jsonl").read_text())
    data["data"].update(train_files=["data/train.jsonl"], eval_files=["data/eval.jsonl"])
    for section, values in changes.items():
        if values is None:
            data.pop(section)
        else:
            data.setdefault(section, {}).update(values)
    path = folder / "my_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_reward_module_beside_the_config_imports(tmp_path):
    name = f"my_rewards_{os.getpid()}"
    (tmp_path / "cfg" / f"{name}.py").parent.mkdir()
    (tmp_path / "cfg" / f"{name}.py").write_text("def exact_answer(sample, response):\n"
                                                  "    return float(response.strip() == str(sample['answer']))\n")
    path = _user_config(tmp_path / "cfg", rewards={"terms": [{"name": f"{name}:exact_answer"}]})
    config = load_config(path)
    assert config.rewards.import_dirs == [str((tmp_path / "cfg").resolve())]
    sys.modules.pop(name, None)
    sys.path.remove(str((tmp_path / "cfg").resolve()))  # what a reward worker starts with: only import_dirs
    (term,) = build_terms(config.rewards)
    assert term.fn({"answer": "1 2 3"}, "1 2 3 ") == 1.0 and term.key == "exact_answer"


def test_reward_import_errors_are_one_line_naming_the_term(tmp_path):
    (tmp_path / "broken_reward.py").write_text("x = 1\nundefined_name + 1\n")
    with pytest.raises(ConfigError, match=r"^rewards.terms\[0\].name: cannot import module 'no_such_rewards': "
                                          r"No module named 'no_such_rewards' \(looked in .*\)$"):
        load_config(_user_config(tmp_path / "a", rewards={"terms": [{"name": "no_such_rewards:f"}]}))
    path = _user_config(tmp_path, rewards={"terms": [{"name": "broken_reward:f"}]})
    with pytest.raises(ConfigError, match=r"^rewards.terms\[0\].name: importing 'broken_reward' failed: NameError: "
                                          r".*broken_reward.py:2\)$"):
        load_config(path)
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(path)], cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("gspo-megatron train: error: rewards.terms[0].name: importing 'broken_reward'")


def test_every_path_field_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "cfg" / "tok").mkdir(parents=True)
    path = _user_config(tmp_path / "cfg", model={"tokenizer_dir": "tok"})
    config = load_config(path, ["data.eval_files=[data/eval.jsonl]"])  # overrides too
    base = (tmp_path / "cfg").resolve()
    assert config.model.tokenizer_dir == str(base / "tok")
    assert config.data.train_files == [str(base / "data/train.jsonl")]
    assert config.data.eval_files == [str(base / "data/eval.jsonl")]
    # a relative model.hf_dir is a folder beside the config, never a Hub name
    with pytest.raises(ConfigError, match=r"^model.hf_dir: .*/cfg/Qwen/Qwen3-0.6B is not a folder \(relative paths "
                                          r"are relative to the config file .*my_config.yaml; Hub names"):
        check_model_folders(load_config(path, ["model.hf_dir=Qwen/Qwen3-0.6B", "model.config=null"]), path)


def test_a_command_line_path_that_exists_beside_the_config_and_here_is_refused_naming_both(tmp_path, monkeypatch):
    """One rule (relative to the config file's folder); when the same relative name also exists relative to
    the current folder, which was meant cannot be told: an error naming both, not a silent pick."""
    path = _user_config(tmp_path / "cfg")
    (tmp_path / "here" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    # only beside the config: taken from there, as in the file
    assert load_config(path, ["data.eval_files=[data/eval.jsonl]"]).data.eval_files == [
        str((tmp_path / "cfg" / "data" / "eval.jsonl").resolve())]
    (tmp_path / "here" / "data" / "eval.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=rf"^data.eval_files: 'data/eval.jsonl' names both "
                                          rf"{tmp_path.resolve()}/cfg/data/eval.jsonl \(relative to the folder of the "
                                          rf"config file .*my_config.yaml, the rule for relative paths\) and "
                                          rf"{tmp_path.resolve()}/here/data/eval.jsonl \(relative to the current folder\)"):
        load_config(path, ["data.eval_files=[data/eval.jsonl]"])
    with pytest.raises(ConfigError, match=r"^data.eval_files: 'data/eval.jsonl' names both"):  # a whole section too
        load_config(path, ["data={train_files: [data/train.jsonl], eval_files: [data/eval.jsonl]}"])
    # the same name inside the config file is the file's own (its folder), and an absolute path is never ambiguous
    assert load_config(path).data.eval_files == [str((tmp_path / "cfg" / "data" / "eval.jsonl").resolve())]
    here = str(tmp_path / "here" / "data" / "eval.jsonl")
    assert load_config(path, [f"data.eval_files=[{here}]"]).data.eval_files == [here]


def test_a_config_without_a_model_section_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"^model: required section is missing \(model.hf_dir"):
        load_config(_user_config(tmp_path, model=None))


@pytest.mark.slow
def test_init_from_says_the_warm_start_is_skipped(tmp_path):
    common = ["logging.console=false", "logging.tensorboard=false", "eval.num_prompts=4", "eval.pass_k=1"]
    run = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO)]
    proc = subprocess.run(run + ["--run-dir", str(tmp_path / "a"), "sft.steps=2", "train.steps=0", *common],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = tmp_path / "a" / "checkpoints" / "step_000000"
    proc = subprocess.run(run + ["--run-dir", str(tmp_path / "b"), "--init-from", str(ckpt), "train.steps=0", *common],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--init-from {ckpt}: training starts from its weights; the warm start (sft.steps=60) is skipped" in proc.stdout


def test_run_summary_names_start_and_end_accuracy_time_and_plots(tmp_path):
    from gspo_megatron.trainer.entry import run_summary

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.5}\n{"step": 1, "reward_mean": 0.1}\n'
                                            '{"step": 10, "eval_accuracy": 0.875}\n{"step": 20, "eval_accuracy": 0.75}\n')
    text = run_summary(tmp_path, 31.6)
    assert text.startswith("summary: held-out greedy accuracy 0.500 at step 0 -> 0.750 at step 20 (+0.250, best 0.875); "
                           "32 s in this command.")
    assert f"gspo-megatron plot {tmp_path} (PNGs in {tmp_path}/plots)" in text


def test_the_summarys_plot_command_runs_as_printed_in_a_shell_without_the_venv_on_path(tmp_path):
    """A new shell has no activated venv: the printed command must not assume `gspo-megatron` is on PATH."""
    import re

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.5}\n{"step": 1, "reward_mean": 0.1}\n'
                                       '{"step": 2, "eval_accuracy": 0.75}\n')
    bare = {**ENV, "PATH": "/usr/bin:/bin"}
    assert not any(os.path.exists(os.path.join(d, "gspo-megatron")) for d in bare["PATH"].split(":"))
    printed = subprocess.run([sys.executable, "-c", "from pathlib import Path; from gspo_megatron.trainer.entry import "
                              "run_summary; print(run_summary(Path('runs/r'), 1.0))"],
                             cwd=tmp_path, env=bare, capture_output=True, text=True, timeout=120, check=True).stdout
    command = re.search(r"charts: (.+?) \(PNGs in", printed).group(1)
    assert command.endswith(" plot runs/r"), printed
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=bare, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (command, proc.stderr[-2000:])
    assert list((run / "plots").glob("*.png")), proc.stdout


def test_the_command_is_its_plain_name_when_the_venv_is_on_path(tmp_path):
    from gspo_megatron.reporting import cli_command

    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "gspo-megatron")):
        pytest.skip("this interpreter has no gspo-megatron script (not pip-installed)")
    assert cli_command(path_env=bin_dir, cwd=str(tmp_path)) == "gspo-megatron"
    assert cli_command(path_env="/usr/bin:/bin", cwd=str(tmp_path)) == os.path.join(bin_dir, "gspo-megatron")
    assert cli_command(path_env="/usr/bin:/bin", cwd=bin_dir) == "./gspo-megatron"


def test_an_unknown_key_gets_a_did_you_mean_and_its_yaml_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(DEMO.read_text().replace("train:\n", "train:\n  stpes: 3\n", 1))
    line = config.read_text().splitlines().index("  stpes: 3") + 1
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value).startswith(f"{config}:{line}: train.stpes: unknown field, did you mean 'steps'? (known fields:")
    with pytest.raises(ConfigError) as err:  # an override has no line; a far-off name no guess
        load_config(DEMO, ["rollout.zzz=1"])
    assert str(err.value).startswith("rollout.zzz: unknown field (known fields:")
    nested = tmp_path / "n.yaml"
    nested.write_text(DEMO.read_text() + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(nested, ["rewards.terms=[{name: math, wieght: 2}]"])
    assert str(err.value).startswith("rewards.terms[0].wieght: unknown field, did you mean 'weight'?")


def test_a_reward_modules_syntax_error_names_its_file_and_line(tmp_path):
    """Not `<frozen importlib._bootstrap>`: a SyntaxError's traceback ends in the import machinery."""
    (tmp_path / "typo_reward.py").write_text("import math\n\ndef f(sample, response:\n    return 1.0\n")
    path = _user_config(tmp_path, rewards={"terms": [{"name": "typo_reward:f"}]})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith("rewards.terms[0].name: importing 'typo_reward' failed: SyntaxError: ")
    assert str(err.value).endswith(f"({tmp_path / 'typo_reward.py'}:3)"), str(err.value)


RM_CONFIG = REPO / "examples" / "cpu_demo_reward_model.yaml"


def test_an_override_sets_a_field_of_a_list_item_by_its_index(tmp_path):
    """``rewards.terms[0].reward_model.path=...`` changes that one field and keeps the rest of the item and
    list, as the errors spell the key."""
    config = load_config(RM_CONFIG, [f"rewards.terms[0].reward_model.path={tmp_path}", "rewards.terms[1].weight=0.5"])
    rm, verifier = config.rewards.terms
    assert (rm.reward_model.path, rm.reward_model.max_length, rm.reward_model.normalize) == (str(tmp_path), 64, "sigmoid")
    assert (verifier.name, verifier.weight) == ("synthetic", 0.5)
    with pytest.raises(ConfigError) as err:  # a typo in an item's field: "did you mean", named with the index
        load_config(RM_CONFIG, ["rewards.terms[1].wieght=0.5"])
    assert str(err.value).startswith("rewards.terms[1].wieght: unknown field, did you mean 'weight'?")


@pytest.mark.parametrize("override, message", [
    ("rewards.terms[2].weight=1", "rewards.terms has 2 items, no item 2"),
    ("train.steps[0].x=1", "train.steps is not a list"),
    ("rewards.terms[0]=1", "set a field of the item (rewards.terms[0].FIELD=...) or the whole list (rewards.terms=[...])"),
    ("data.train_files[0].x=1", "data.train_files[0] is not a section"),
    ("rewards.terms[x].weight=1", "malformed key 'rewards.terms[x].weight'"),
    ("train..steps=1", "malformed key 'train..steps'"),
])
def test_bad_list_item_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(RM_CONFIG, [override])
    assert message in str(err.value), str(err.value)
