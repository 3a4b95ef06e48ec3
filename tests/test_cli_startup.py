"""`gspo-megatron --help` and every command's --help, and `plot`, start without torch or Megatron (they
take seconds to import); the flags all have help text."""
import subprocess
import sys

import pytest

PROBE = """
import sys
from gspo_megatron import cli
try:
    cli.main({argv!r})
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "megatron", "transformers") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def _heavy_imports(argv, cwd=None) -> tuple[list[str], str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=300,
                          cwd=cwd)
    line = [x for x in proc.stdout.splitlines() if x.startswith("HEAVY=")]
    assert line, proc.stdout + proc.stderr
    return [m for m in line[-1].removeprefix("HEAVY=").split(",") if m], proc.stdout


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["demo", "--help"], ["eval", "--help"],
                                  ["smoke", "--help"], ["convert", "--help"], ["convert", "megatron-to-hf", "--help"],
                                  ["plot", "--help"], ["prepare", "--help"]], ids=" ".join)
def test_help_does_not_import_torch(argv):
    heavy, out = _heavy_imports(argv)
    assert heavy == [], (argv, heavy)
    assert "usage:" in out


def test_plot_does_not_import_torch(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.5}\n{"step": 1, "reward_mean": 0.2}\n')
    heavy, _ = _heavy_imports(["plot", str(tmp_path / "run")])
    assert heavy == [] and any((tmp_path / "run" / "plots").glob("*.png"))


def test_every_flag_has_help_text():
    from gspo_megatron.cli import build_parser
    from gspo_megatron.conversion.cli import build_parser as convert_parser

    def walk(parser, where):
        for action in parser._actions:
            if action.dest != "help" and action.help is None and not action.option_strings == []:
                yield f"{where} {'/'.join(action.option_strings)}"
            for name, sub in getattr(action, "choices", {}).items() if hasattr(action, "_name_parser_map") else []:
                yield from walk(sub, f"{where} {name}")

    from gspo_megatron.trainer.plot import build_parser as plot_parser

    missing = (list(walk(build_parser(), "gspo-megatron")) + list(walk(convert_parser(), "gspo-megatron convert"))
               + list(walk(plot_parser(), "gspo-megatron plot")))
    assert missing == []


def test_known_harmless_warnings_are_silenced_and_others_are_not():
    import warnings

    from gspo_megatron.cli import _quiet_known_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _quiet_known_warnings()
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
        warnings.warn("`load_state_dict` is deprecated and will be removed in future versions.", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]


def test_reward_metrics_have_the_documented_keys():
    from gspo_megatron.trainer.loop import reward_metric_keys

    assert reward_metric_keys({"rewards/mean": 0.5, "rewards/synthetic/errors": 1.0}) == {
        "reward/mean": 0.5, "reward/synthetic/errors": 1.0}


def test_install_shows_progress():
    """tools/setup_env.sh: no silent `pip -q` over the large installs (torch, megatron-core, the package, and
    SGLang's own venv, whose ~9 minute install prints one line per package rather than bars into a log)."""
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "tools" / "setup_env.sh").read_text()
    installs = [line.strip() for line in script.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert all("-q" not in line.split() for line in installs), installs
    sglang = [line for line in installs if "sglang==" in line]
    assert len(sglang) == 1 and "--progress-bar off" in sglang[0]
    ours = [line for line in installs if line not in sglang]
    assert len(ours) == 3 and all("--progress-bar on" in line for line in ours), ours
    assert script.count("setup_env: [") == 3


def _torchrun_banner(env: dict) -> bool:
    """Whether torchrun (the real one, two workers running ``true``) prints its OMP_NUM_THREADS banner."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--no-python", "true"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return "Setting OMP_NUM_THREADS" in done.stderr


def test_train_nproc_sets_the_ranks_threads_so_torchrun_prints_no_banner():
    """`train --nproc N` starts torchrun with OMP_NUM_THREADS set (the cores per rank, as each CPU rank uses), so
    torchrun's "Setting OMP_NUM_THREADS ... to be 1" banner is not printed; a value the user set is kept."""
    import os

    from gspo_megatron.trainer.entry import torchrun_environment

    bare = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert _torchrun_banner(bare)  # what the ranks got before: torchrun's default and its banner
    env = torchrun_environment(bare, 2)
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert not _torchrun_banner(env)
    assert torchrun_environment({**bare, "OMP_NUM_THREADS": "3"}, 2)["OMP_NUM_THREADS"] == "3"
