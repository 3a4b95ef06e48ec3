"""The docs hold: every ``section.field=value`` override and YAML example README.md and docs/*.md show
name fields of the typed config tree, every repository path they and setup.py cite exists, and every
``gspo-megatron CMD --flag`` they show is a command and flag of the CLI (a newcomer copies these lines as
they are)."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from gspo_megatron.trainer.config import TrainConfig
from gspo_megatron.typed_config import ConfigError, field_at

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)  # fenced blocks and inline code: what is meant to be typed
OVERRIDE = re.compile(r"(?<![\w./$-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*|\[\d+\])+)=(?!=)")
# dotted names shown with '=' that are not overrides: the placeholder of the syntax, a Linux sysctl
NOT_OVERRIDES = {"section.field", "kernel.unprivileged_userns_clone"}
REPO_PATH = re.compile(r"(?<![\w./:-])((?:gspo_megatron|tests|tools|examples|docs|benchmarks|\.ci)/[\w./{},*-]*[\w*}])")
PACKAGE_MODULE = re.compile(r"(?<![\w./:-])((?:algorithms|megatron|conversion|rollout|rewards|data|trainer|models)"
                            r"/[\w/*]*\.py)\b")
COMMAND = re.compile(r"(?<![\w-])gspo-megatron +([a-z][a-z-]*)(?![\w:-])((?:[^\n|;&#]|\\\n)*)")


def _code(page: Path) -> str:
    return "\n".join(span.strip("`") for span in CODE.findall(page.read_text()))


def _brace_expand(path: str) -> list[str]:
    """``a_{x,y}.yaml`` -> [a_x.yaml, a_y.yaml] (how the docs name a pair of files)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [p for alt in match.group(1).split(",")
            for p in _brace_expand(path[:match.start()] + alt + path[match.end():])]


def _exists(path: str, base: Path) -> bool:
    path = path.split("::")[0].rstrip(".")
    return any((base / p).exists() or any(base.glob(p)) for p in _brace_expand(path))


def _written_by_shown_commands(text: str) -> list[str]:
    """Folders a command on the page creates (``--out DIR``): they do not exist in a clone."""
    return re.findall(r"--out[ =]([\w./-]+)", text)


def _missing_paths(text: str) -> list[str]:
    created = _written_by_shown_commands(text)
    missing = [p for p in REPO_PATH.findall(text) if not _exists(p, REPO)
               and not any(p.rstrip(".") == c or p.startswith(c.rstrip("/") + "/") for c in created)]
    # paths inside the package written without its name (`megatron/device.py`)
    missing += [p for p in PACKAGE_MODULE.findall(text) if not _exists(p, REPO / "gspo_megatron")
                and not p.startswith("megatron/core/")]  # Megatron-Core's own files
    return sorted(set(missing))


@pytest.mark.parametrize("page", PAGES + [REPO / "setup.py"], ids=lambda p: p.name)
def test_cited_repository_paths_exist(page):
    assert _missing_paths(page.read_text()) == [], f"{page.relative_to(REPO)} cites files that are not in the repository"


def _unknown_fields(keys) -> list[str]:
    """The error of each dotted key that names no field of the config tree (without the list of known ones)."""
    unknown = []
    for key in keys:
        try:
            field_at(TrainConfig, key)
        except ConfigError as err:
            unknown.append(re.split(r", did you mean| \(known", str(err))[0])
    return unknown


def _unknown_overrides(code: str) -> list[str]:
    return _unknown_fields(sorted(set(OVERRIDE.findall(code)) - NOT_OVERRIDES))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_shown_overrides_name_config_fields(page):
    assert _unknown_overrides(_code(page)) == [], f"{page.relative_to(REPO)} shows overrides of fields that do not exist"


def _yaml_keys(data: dict, prefix: str = ""):
    """Every dotted key of a YAML mapping (``rewards.terms[0].name`` for a list of mappings)."""
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        yield key
        if isinstance(value, dict):
            yield from _yaml_keys(value, key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    yield from _yaml_keys(item, f"{key}[{i}]")


def _unknown_yaml_keys(text: str) -> list[str]:
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return _unknown_fields(key for block in blocks for key in _yaml_keys(yaml.safe_load(block) or {}))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_shown_yaml_configs_name_config_fields(page):
    assert _unknown_yaml_keys(page.read_text()) == [], f"{page.relative_to(REPO)}: a YAML example has unknown fields"


def _our_settings_in_mapping_table(text: str) -> list[str]:
    """The dotted names in the gspo-megatron column (the last) of the TRL / verl settings table."""
    section = text.split("### Settings you may know from TRL or verl", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and "---" not in line][1:]
    return [code.split(":")[0].strip() for row in rows for code in re.findall(r"`([^`]+)`", row.split("|")[-2])
            if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+(:.*)?", code)]


def _names_ours(dotted: str) -> bool:
    """A field of the config tree, or a function of the package (``rewards.trl.from_trl``)."""
    import importlib

    try:
        field_at(TrainConfig, dotted)
        return True
    except ConfigError:
        module, _, name = dotted.rpartition(".")
        try:
            return hasattr(importlib.import_module(f"gspo_megatron.{module}"), name)
        except ModuleNotFoundError:
            return False


def test_the_trl_verl_table_names_our_settings():
    ours = _our_settings_in_mapping_table((REPO / "docs" / "installation.md").read_text())
    assert {"rollout.samples_per_prompt", "train.prompts_per_step", "loss.algorithm", "rewards.trl.from_trl"} <= set(ours)
    assert [name for name in ours if not _names_ours(name)] == []
    assert not _names_ours("rollout.num_generations") and not _names_ours("rewards.trl.from_verl")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _command_errors(code: str) -> list[str]:
    """What is wrong with each ``gspo-megatron CMD [SUB] --flag ...`` in ``code``: an unknown command or flag."""
    from gspo_megatron import cli
    from gspo_megatron.conversion import cli as convert_cli
    from gspo_megatron.trainer import plot

    top = cli.build_parser()
    commands = dict(_subcommands(top), convert=convert_cli.build_parser(), plot=plot.build_parser())
    errors = []
    for command, rest in COMMAND.findall(code):
        words = rest.replace("\\\n", " ").replace("[", " ").replace("]", " ").split()
        if command not in commands:
            errors.append(f"gspo-megatron {command}: no such command")
            continue
        parser = commands[command]
        if command == "convert" and words and words[0] != "...":
            if words[0] not in _subcommands(parser):
                errors.append(f"gspo-megatron convert {words[0]}: no such command")
                continue
            parser = _subcommands(parser)[words[0]]
        known = _flags(parser) | _flags(top)
        errors += [f"gspo-megatron {command} {flag}: no such flag" for flag in
                   (w.split("=")[0] for w in words if w.startswith("--")) if flag not in known]
    return errors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_shown_commands_and_flags_exist(page):
    assert _command_errors(_code(page)) == [], f"{page.relative_to(REPO)} shows commands or flags the CLI lacks"


def test_the_checks_catch_what_the_first_day_found():
    """The stale lines the new user tripped on (issue 33, item 9) fail these checks."""
    assert _command_errors("`gspo-megatron train --config x.yaml --run-dir r --steps 3`") == [
        "gspo-megatron train --steps: no such flag"]
    assert _command_errors("`gspo-megatron convert megatron-to-hf --megatron-dir c --template t`") == [
        "gspo-megatron convert --template: no such flag"]
    assert _command_errors("`gspo-megatron export --out x`") == ["gspo-megatron export: no such command"]
    assert _command_errors("gspo-megatron train: error: x.jsonl:3: not UTF-8") == []  # an error line, not a command
    assert _unknown_overrides("sbatch examples/slurm/x.sbatch trainer.steps=20 rollout.sglang.launch.dtpe=bf16") == [
        "rollout.sglang.launch.dtpe: unknown field", "trainer: unknown field"]
    assert _unknown_overrides("`train.steps.max=3`") == ["train.steps: is a setting, not a section: it has no field 'max'"]
    assert _unknown_yaml_keys("```yaml\ndata:\n  eval_holdout: 5\nrewards:\n  terms: [{name: math, wieght: 2}]\n```") == [
        "rewards.terms[0].wieght: unknown field"]
    assert _missing_paths("setup.py: see docs/installation-guide.md and `megatron/devices.py`") == [
        "docs/installation-guide.md", "megatron/devices.py"]
    assert _missing_paths("`make --out examples/data/new` writes examples/data/new/train.jsonl") == []


def test_a_doc_shows_how_to_open_tensorboard():
    """A user finds the ``tensorboard --logdir`` line, and it names the folder the metrics logger writes."""
    from gspo_megatron.trainer.metrics_log import TENSORBOARD_DIR

    shown = [d for page in PAGES for d in re.findall(r"tensorboard --logdir[ =](\S+)", _code(page))]
    assert any(Path(d).name == TENSORBOARD_DIR for d in shown), shown


# ---- the docs read as a manual: each measured figure has one generated home, and no page carries history ----

def _script(path: Path):
    """A tool script (not a package module) loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _between(text: str, begin: str, end: str) -> str:
    assert text.count(begin) == 1 and text.count(end) == 1, f"needs exactly one {begin} ... {end}"
    return begin + text.split(begin)[1].split(end)[0] + end


def _demo_home():
    demo = _script(REPO / "tools" / "cpu_demo_results.py")
    data = json.loads(demo.RESULTS.read_text())
    return demo.doc_block(demo.DOC.read_text()), demo.render(data), [demo.FIGURE]


def _gspo_vs_grpo_home():
    driver = _script(REPO / "examples" / "experiments" / "gspo_vs_grpo.py")
    data = json.loads(driver.RESULTS.read_text())
    expected = driver.doc_block(data, driver.summarise(data), "figures/gspo_vs_grpo")
    return (_between(driver.DOC.read_text(), driver.BEGIN, driver.END), expected,
            [driver.FIGURES / f"{name}.png" for name in driver.FIGURE_NAMES])


def _batch_filling_home():
    bench = _script(REPO / "benchmarks" / "bench_batch_filling.py")
    block = _between((REPO / "docs" / "training.md").read_text(), "<!-- batch_filling:begin -->",
                     "<!-- batch_filling:end -->")
    table = bench.report(json.loads(bench.RESULTS.read_text()))
    # the block holds the generated table among its prose: compare the table's lines
    shown = "\n".join(line for line in block.splitlines() if line.startswith("|"))
    return shown, table, [REPO / "docs" / "figures" / "batch_filling.png"]


ONE_HOMES = {"cpu_demo (docs/quickstart.md)": _demo_home, "gspo_vs_grpo (docs/training.md)": _gspo_vs_grpo_home,
             "batch_filling (docs/training.md)": _batch_filling_home}


@pytest.mark.parametrize("name", list(ONE_HOMES))
def test_one_home_figures_equal_their_results_file(name):
    """A measured figure's home page shows what its script renders from the results file, not numbers typed by
    hand (regenerate: the script's ``report``), and the charts it cites exist."""

    shown, rendered, figures = ONE_HOMES[name]()
    assert shown == rendered, f"{name}: the page's block differs from its results file; run the script's report"
    assert all(f.is_file() for f in figures), figures


def test_the_readme_links_to_the_demo_figures_rather_than_repeating_them():
    readme = (REPO / "README.md").read_text()
    assert "docs/quickstart.md, \"Measured\"" in readme
    assert re.findall(r"\d\.\d{3} -> \d\.\d{3}", readme) == []


# what a lab notebook says and a manual does not: history and the sessions that wrote it (CHANGELOG.md keeps it)
HISTORY = re.compile(r"\b(used to|no longer|this session|another session|session's (changes|tests)|before this fix|"
                     r"an earlier release|a day later|kept for the record)\b", re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_user_docs_carry_no_session_history(page):
    found = [f"{page.name}:{n}: {m.group(0)!r}" for n, line in enumerate(page.read_text().splitlines(), 1)
             for m in [HISTORY.search(line)] if m]
    assert found == [], "history belongs in CHANGELOG.md; the docs say what the code does now"


def test_the_history_has_a_home():
    assert (REPO / "CHANGELOG.md").is_file()
