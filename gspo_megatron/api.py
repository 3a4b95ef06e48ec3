"""Train from Python (a notebook, a TRL user's script): ``train(config, rewards=..., train_data=...)``.

    from gspo_megatron.api import Reward, train

    def correct(sample, response):                 # sample: the row (answer, meta, ...); response: the text
        return float(response.strip() == sample["answer"])

    run_dir = train("examples/cpu_demo.yaml", rewards=[correct], train_data=rows, eval_data=held_out,
                    overrides=["train.steps=20"])   # rows: a list of dicts or a datasets.Dataset

What it runs is the command line's run: it writes the config as YAML and the rows as JSONL under
``RUN_DIR/inputs/``, registers the reward callables where the reward pool imports them
(``rewards/registered.py``), and calls ``gspo-megatron train --config RUN_DIR/inputs/config.yaml --run-dir
RUN_DIR`` through the command line's own parser and entry (``trainer/entry.py run_training``), in this
process. The same config, data and seed give the same metrics as the command line (tests/test_api.py).

Reward callables run in this process (``rewards.num_workers: 0``): a fresh worker interpreter cannot import a
function defined in a notebook. A function written for TRL's ``GRPOTrainer`` (``f(prompts, completions,
**columns) -> list[float]``) goes in as ``Reward.from_trl(f)``. docs/installation.md, "Training from Python".
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import yaml

TRAIN_ROWS, EVAL_ROWS, CONFIG_FILE = "train.jsonl", "eval.jsonl", "config.yaml"


@dataclasses.dataclass(frozen=True)
class Reward:
    """One reward term given as a Python callable: ``fn(sample: dict, response: str) -> float`` (or a
    ``Verdict``; ``async def`` too), or with ``batched=True`` ``fn(samples, responses) -> list[float]``.
    ``weight``, ``key`` (its metric name; default: the function's name) and ``range`` are the term's
    settings (``rewards.terms[i]``, docs/rewards.md)."""

    fn: Callable[..., Any]
    weight: float = 1.0
    key: str | None = None
    batched: bool = False
    range: tuple[float, float] | None = None

    @classmethod
    def from_trl(cls, fn: Callable[..., Sequence[float | None]], weight: float = 1.0,
                 key: str | None = None) -> "Reward":
        """A TRL reward function ``fn(prompts, completions, **columns) -> list[float]`` (``rewards/trl.py``)."""
        from gspo_megatron.rewards.trl import from_trl

        return cls(from_trl(fn), weight=weight, key=key or getattr(fn, "__name__", None), batched=True)


def config_tree(config: Any) -> tuple[dict, str]:
    """``config`` as the nested dict a YAML config file holds, and a name for the default run folder.

    ``config``: a dict (the YAML tree; relative paths are relative to the current folder), a ``TrainConfig``,
    or the path of a YAML file (relative paths relative to its folder, as on the command line)."""
    from gspo_megatron.trainer.config import TrainConfig, resolve_paths
    from gspo_megatron.typed_config import ConfigError, to_dict

    if isinstance(config, TrainConfig):
        tree, name = to_dict(config), "python"
    elif isinstance(config, Mapping):
        tree, name = copy.deepcopy(dict(config)), "python"
    elif isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        tree, name = yaml.safe_load(path.read_text()) or {}, path.stem
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        resolve_paths(tree, path)
        return tree, name
    else:
        raise TypeError(f"config: expected a dict, a TrainConfig or a YAML file path, got {type(config).__name__}")
    # the YAML written under RUN_DIR/inputs must name the same files: relative to the current folder, made absolute
    resolve_paths(tree, Path.cwd() / "config.yaml")
    return tree, name


def _section(tree: dict, name: str) -> dict:
    from gspo_megatron.typed_config import ConfigError

    node = tree.setdefault(name, {})
    if not isinstance(node, dict):
        raise ConfigError(f"{name}: expected a section (a mapping), got {type(node).__name__}")
    return node


def reward_terms(rewards: Sequence[str | Callable[..., Any] | Reward]) -> list[dict[str, Any]]:
    """The ``rewards.terms`` entries of ``rewards``: a string is a term's name (a built-in such as ``"math"``, or
    ``module:function``); a callable or ``Reward`` is registered under its key (``rewards/registered.py``)."""
    from gspo_megatron.rewards import registered

    terms = []
    for i, item in enumerate(rewards):
        if isinstance(item, str):
            terms.append({"name": item})
            continue
        reward = item if isinstance(item, Reward) else Reward(item)
        if not callable(reward.fn):
            raise TypeError(f"rewards[{i}]: {type(reward.fn).__name__} is neither a term name nor callable")
        key = reward.key or getattr(reward.fn, "__name__", "")
        if not re.fullmatch(r"[A-Za-z_]\w*", key):  # a lambda, a functools.partial: no usable name
            key = f"reward_{i}"
        term = {"name": registered.register(key, reward.fn), "weight": reward.weight, "key": key,
                "batched": reward.batched}
        if reward.range is not None:
            term["range"] = list(reward.range)
        terms.append(term)
    return terms


def _set_rewards(tree: dict, rewards: Sequence[str | Callable[..., Any] | Reward]) -> None:
    """``rewards`` as the config's reward terms, in place of the ones it names (said when they were not the
    default; strings in ``rewards`` keep built-in or module terms). Callables run in this process:
    ``rewards.num_workers`` becomes 0 (said when it was not)."""
    from gspo_megatron.rewards.config import RewardConfig
    from gspo_megatron.typed_config import to_dict

    section = _section(tree, "rewards")
    named, terms = section.get("terms"), reward_terms(rewards)
    if named and named != to_dict(RewardConfig())["terms"]:  # the config's own choice, not the default: say so
        print(f"rewards.terms {[t.get('name') for t in named]} -> {[t['name'] for t in terms]} (rewards=; a string "
              f"there keeps a built-in or module:function term)", flush=True)
    section["terms"] = terms
    if any(not isinstance(r, str) for r in rewards):
        workers = section.get("num_workers", 0)
        if workers:
            print(f"rewards.num_workers {workers} -> 0: reward functions given as Python callables run in this "
                  f"process", flush=True)
        section["num_workers"] = 0


def _rows(data: Iterable[Mapping[str, Any]], where: str) -> list[str]:
    """The JSONL lines of ``data`` (a list of dicts or a ``datasets.Dataset``, which iterates dicts)."""
    lines = []
    for i, row in enumerate(data):
        if not isinstance(row, Mapping):
            raise TypeError(f"{where}[{i}]: {type(row).__name__}, expected a mapping of column -> value (give a list "
                            f"of dicts or a datasets.Dataset; a pandas DataFrame: df.to_dict('records'))")
        for column, value in row.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as err:
                raise TypeError(f"{where}[{i}][{column!r}]: {type(value).__name__} cannot be stored as JSON ({err}); "
                                f"give plain Python values (str, numbers, lists, dicts)") from err
        lines.append(json.dumps(dict(row), ensure_ascii=False, sort_keys=True) + "\n")
    if not lines:
        raise ValueError(f"{where}: no rows")
    return lines


def _write_rows(path: Path, lines: list[str], resume: bool) -> None:
    """Writes the rows; a resumed run's rows must be the ones it started with (the data position belongs to
    them), so a different file is refused rather than replaced."""
    text = "".join(lines)
    if path.is_file() and resume and path.read_text(encoding="utf-8") != text:
        raise ValueError(f"{path}: the run was started with other rows than the ones given now; resume with the "
                         f"same data, or start a new run (another run_dir)")
    path.write_text(text, encoding="utf-8")


def prepare_run(config: Any, rewards: Sequence[str | Callable[..., Any] | Reward] = (),
                train_data: Iterable[Mapping[str, Any]] | None = None,
                eval_data: Iterable[Mapping[str, Any]] | None = None, run_dir: str | Path | None = None,
                resume: bool = False) -> tuple[Path, Path]:
    """Writes ``RUN_DIR/inputs/`` (config.yaml, train.jsonl, eval.jsonl) and registers the rewards; returns
    (config file, run folder). Nothing is trained."""
    from gspo_megatron.cli import fresh_run_dir
    from gspo_megatron.trainer.run_dir import INPUTS_DIR, check_fresh_start

    tree, name = config_tree(config)
    if run_dir is None:
        if resume:
            raise ValueError("resume=True needs run_dir: the folder of the run to continue")
        run_dir = fresh_run_dir(Path("runs") / name)
    run_dir = Path(run_dir).resolve()
    if not resume:
        check_fresh_start(run_dir)  # before inputs/ is written over an earlier run's
    inputs = run_dir / INPUTS_DIR
    data = _section(tree, "data")
    files = {}
    for field, rows, file in (("train_files", train_data, TRAIN_ROWS), ("eval_files", eval_data, EVAL_ROWS)):
        if rows is None:
            continue
        lines = _rows(rows, field.replace("files", "data"))
        if data.get(field):
            print(f"data.{field} {data[field]} -> the {len(lines)} rows of {field.replace('files', 'data')}", flush=True)
        files[field] = (inputs / file, lines)
    if rewards:
        _set_rewards(tree, rewards)
    inputs.mkdir(parents=True, exist_ok=True)
    for field, (path, lines) in files.items():
        _write_rows(path, lines, resume)
        data[field] = [str(path)]
    config_file = inputs / CONFIG_FILE
    config_file.write_text(yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return config_file, run_dir


def train(config: Any, rewards: Sequence[str | Callable[..., Any] | Reward] = (),
          train_data: Iterable[Mapping[str, Any]] | None = None, eval_data: Iterable[Mapping[str, Any]] | None = None,
          run_dir: str | Path | None = None, overrides: Sequence[str] = (), resume: bool = False,
          init_from: str | Path | None = None) -> Path:
    """Trains in this process, as ``gspo-megatron train`` would, and returns the run folder.

    config: a dict (the YAML tree), a ``TrainConfig`` or a YAML file path. rewards: the reward terms, in place
    of ``rewards.terms``: callables or ``Reward``s, and strings naming built-in or ``module:function`` terms
    (``["math", my_format_reward]``). train_data / eval_data: rows (a list of dicts or a ``datasets.Dataset``) in
    place of ``data.train_files`` / ``data.eval_files``; the row format is the data files' (``data.fields``).
    A setting of the config that these replace is named in one printed line.
    run_dir: default a fresh ``runs/<config name>[-N]`` (``runs/python`` for a dict). overrides:
    ``section.field=value`` strings, as on the command line. resume / init_from: ``--resume`` / ``--init-from``.
    Raises the command line's errors (a bad field is a ``ConfigError`` naming it); a Ctrl-C stops the run
    with a checkpoint and raises ``KeyboardInterrupt`` naming the folder to resume.
    """
    from gspo_megatron.cli import build_parser
    from gspo_megatron.reporting import EXIT_INTERRUPTED, quiet_known_warnings
    from gspo_megatron.trainer.entry import run_training

    quiet_known_warnings()  # what the command line installs first
    config_file, run_dir = prepare_run(config, rewards, train_data, eval_data, run_dir, resume)
    argv = ["train", "--config", str(config_file), "--run-dir", str(run_dir), *(["--resume"] if resume else []),
            *(["--init-from", str(init_from)] if init_from is not None else []), *overrides]
    args = build_parser().parse_args(argv)
    if run_training(args, argv) == EXIT_INTERRUPTED:
        raise KeyboardInterrupt(f"{run_dir}: stopped with a checkpoint; train(..., run_dir={str(run_dir)!r}, "
                                f"resume=True) continues it")
    return run_dir


__all__ = ["Reward", "config_tree", "prepare_run", "reward_terms", "train"]
