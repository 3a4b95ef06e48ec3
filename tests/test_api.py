"""Training from Python (``gspo_megatron.api.train``): a config dict or dataclass, reward callables and rows in,
the run folder out; the same run as ``gspo-megatron train`` with the same config, data and seed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from gspo_megatron import api
from gspo_megatron.trainer.config import TrainConfig, load_config
from gspo_megatron.trainer.run_dir import RunDirError, check_fresh_start
from gspo_megatron.typed_config import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "cpu_demo.yaml"
SORT = REPO / "examples" / "data" / "sort"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _demo_tree() -> dict:
    """examples/cpu_demo.yaml as a dict without its data files (the rows are handed in instead)."""
    tree = yaml.safe_load(DEMO.read_text())
    del tree["data"]["train_files"], tree["data"]["eval_files"], tree["rewards"]
    return tree


def sorted_digits(sample, response):
    from gspo_megatron.rewards.synthetic import synthetic_reward

    return synthetic_reward(sample, response)


def test_prepare_run_writes_a_config_the_command_line_loads(tmp_path):
    """A dict, reward callables and rows become RUN_DIR/inputs/: a config the CLI's loader builds, naming the rows'
    JSONL files and the registered rewards, which import in this process."""
    from gspo_megatron.rewards.terms import build_terms

    rows = _rows(SORT / "train.jsonl")[:20]
    config_file, run_dir = api.prepare_run(_demo_tree(), rewards=[sorted_digits, api.Reward(lambda s, r: 0.5, 0.1)],
                                           train_data=rows, eval_data=_rows(SORT / "eval.jsonl")[:4],
                                           run_dir=tmp_path / "run")
    assert config_file == tmp_path / "run" / "inputs" / "config.yaml" and run_dir == tmp_path / "run"
    config = load_config(config_file)
    assert config.data.train_files == [str(run_dir / "inputs" / "train.jsonl")]
    assert _rows(Path(config.data.train_files[0])) == rows and len(_rows(Path(config.data.eval_files[0]))) == 4
    assert [(t.metric_key, t.weight) for t in config.rewards.terms] == [("sorted_digits", 1.0), ("reward_1", 0.1)]
    assert config.rewards.num_workers == 0
    terms = build_terms(config.rewards)
    assert terms[0].fn is sorted_digits and terms[1].fn(rows[0], "x") == 0.5
    check_fresh_start(run_dir)  # inputs/ alone: still a fresh run folder for the trainer


def test_a_train_config_dataclass_and_strings_naming_terms(tmp_path, capsys):
    tree = _demo_tree()
    tree["data"]["train_files"] = [str(SORT / "train.jsonl")]
    config = load_config_from(tree, tmp_path)
    assert isinstance(config, TrainConfig)
    config_file, _ = api.prepare_run(config, rewards=["synthetic", sorted_digits], run_dir=tmp_path / "run")
    loaded = load_config(config_file)
    assert [t.name for t in loaded.rewards.terms] == ["synthetic", "gspo_megatron.rewards.registered:sorted_digits"]
    # the dataclass carries the pool's default (2 workers): a callable runs here, and that is said
    assert loaded.rewards.num_workers == 0 and "rewards.num_workers 2 -> 0" in capsys.readouterr().out


def load_config_from(tree: dict, folder: Path) -> TrainConfig:
    path = folder / "given.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_config(path)


def test_a_yaml_file_whose_data_files_and_terms_the_call_replaces_says_so(tmp_path, capsys):
    """The documented form: the demo's YAML file, its data files and reward terms replaced by rows and a callable,
    each replacement named in one line."""
    rows = _rows(SORT / "train.jsonl")[:8]
    config_file, run_dir = api.prepare_run(DEMO, rewards=[sorted_digits], train_data=rows, run_dir=tmp_path / "run")
    said = capsys.readouterr().out
    assert f"data.train_files [{str(SORT / 'train.jsonl')!r}] -> the 8 rows of train_data" in said
    assert "rewards.terms ['synthetic'] -> ['gspo_megatron.rewards.registered:sorted_digits']" in said
    config = load_config(config_file)
    assert config.data.train_files == [str(run_dir / "inputs" / "train.jsonl")]
    assert config.data.eval_files == [str(SORT / "eval.jsonl")]  # not given: the file's, made absolute
    with pytest.raises(ConfigError, match=r"\.yaml: config file not found"):
        api.prepare_run(tmp_path / "missing.yaml", run_dir=tmp_path / "other")


def test_trl_reward_functions_become_batched_terms(tmp_path):
    def accuracy(prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    config_file, _ = api.prepare_run(_demo_tree(), rewards=[api.Reward.from_trl(accuracy)],
                                     train_data=_rows(SORT / "train.jsonl")[:4], run_dir=tmp_path / "run")
    [term] = load_config(config_file).rewards.terms
    assert term.batched and term.metric_key == "accuracy"
    from gspo_megatron.rewards.terms import build_terms

    fn = build_terms(load_config(config_file).rewards)[0].fn
    assert fn([{"prompt": "p", "answer": "2 4 8"}] * 2, ["2 4 8", "8 4 2"]) == [1.0, 0.0]


def test_bad_input_is_named(tmp_path):
    rows = _rows(SORT / "train.jsonl")[:4]
    with pytest.raises(TypeError, match=r"train_data\[1\]: str, expected a mapping"):
        api.prepare_run(_demo_tree(), train_data=[rows[0], "sort 1 2 3"], run_dir=tmp_path / "a")
    with pytest.raises(TypeError, match=r"train_data\[0\]\['answer'\]: set cannot be stored as JSON"):
        api.prepare_run(_demo_tree(), train_data=[dict(rows[0], answer={1})], run_dir=tmp_path / "b")
    with pytest.raises(TypeError, match=r"config: expected a dict"):
        api.prepare_run(["not", "a", "config"], run_dir=tmp_path / "e")
    with pytest.raises(ValueError, match="resume=True needs run_dir"):
        api.prepare_run(_demo_tree(), train_data=rows, resume=True)


def test_an_earlier_run_and_other_rows_on_resume_are_refused_before_anything_is_written(tmp_path):
    rows = _rows(SORT / "train.jsonl")[:4]
    run = tmp_path / "run"
    api.prepare_run(_demo_tree(), train_data=rows, run_dir=run)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # the run has started
    with pytest.raises(RunDirError, match="holds an earlier run"):
        api.prepare_run(_demo_tree(), train_data=rows[:2], run_dir=run)
    with pytest.raises(ValueError, match="started with other rows than the ones given now"):
        api.prepare_run(_demo_tree(), train_data=rows[:2], run_dir=run, resume=True)
    assert _rows(run / "inputs" / "train.jsonl") == rows
    api.prepare_run(_demo_tree(), train_data=rows, run_dir=run, resume=True)  # the same rows: a resume


# a short run of the demo: the warm start, 2 RL steps, a small evaluation
SHORT = ["sft.steps=20", "train.steps=2", "eval.num_prompts=4", "eval.pass_k=1", "logging.console=false",
         "checkpoint.every_steps=2"]
# what differs between two equal runs: wall-clock time and what is derived from it
TIMING = ("time_", "tokens_per_s", "sync_bytes_per_s", "reward/time", "rewards/time")


def _comparable(run: Path) -> list[dict]:
    from gspo_megatron.trainer.metrics_log import read_metrics

    records = read_metrics(run / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


@pytest.mark.slow
def test_train_from_python_logs_what_the_command_line_logs(tmp_path):
    """The demo with a reward function from a module: `gspo-megatron train` on files, and `api.train` on the same
    rows as lists and the function as a callable, in a fresh interpreter as a notebook would be: equal metrics."""
    (tmp_path / "sort_reward.py").write_text(textwrap.dedent('''
        from gspo_megatron.rewards.synthetic import synthetic_reward

        def sorted_digits(sample, response):
            return synthetic_reward(sample, response)
    '''))
    cli_config = dict(_demo_tree(), rewards={"terms": [{"name": "sort_reward:sorted_digits"}], "num_workers": 0})
    cli_config["data"].update(train_files=[str(SORT / "train.jsonl")], eval_files=[str(SORT / "eval.jsonl")])
    (tmp_path / "cli.yaml").write_text(yaml.safe_dump(cli_config))
    done = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(tmp_path / "cli.yaml"),
                           "--run-dir", str(tmp_path / "cli_run"), *SHORT], capture_output=True, text=True,
                          cwd=tmp_path, env=ENV, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    script = textwrap.dedent(f'''
        import json, yaml
        from gspo_megatron.api import train
        from sort_reward import sorted_digits

        def rows(path):
            return [json.loads(line) for line in open(path)]

        config = yaml.safe_load(open({str(DEMO)!r}))
        del config["data"]["train_files"], config["data"]["eval_files"], config["rewards"]
        run = train(config, rewards=[sorted_digits], train_data=rows({str(SORT / "train.jsonl")!r}),
                    eval_data=rows({str(SORT / "eval.jsonl")!r}), run_dir="api_run", overrides={SHORT!r})
        print("RUN", run)
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=ENV,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"RUN {tmp_path / 'api_run'}" in done.stdout
    cli, python = _comparable(tmp_path / "cli_run"), _comparable(tmp_path / "api_run")
    assert [r["step"] for r in cli] == [0, 1, 2] and "reward/sorted_digits/mean" in cli[1], cli
    assert python == cli
    assert (tmp_path / "api_run" / "checkpoints" / "step_000002").is_dir()


def test_a_datasets_dataset_gives_the_same_rows(tmp_path):
    """A ``datasets.Dataset`` (when installed) is written as the same rows as the list it was made from."""
    datasets = pytest.importorskip("datasets")
    rows = _rows(SORT / "train.jsonl")[:5]
    _, run_dir = api.prepare_run(_demo_tree(), train_data=datasets.Dataset.from_list(rows), run_dir=tmp_path / "run")
    assert _rows(run_dir / "inputs" / "train.jsonl") == rows
