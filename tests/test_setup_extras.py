"""setup.py's requirements as pip reads them: the ``gpu`` extra installs the megatron-core the GPU path was
read against (0.16.1) and the Transformer Engine range that megatron-core declares, while the base
requirements keep the CPU legs' range (0.16.1 on Python 3.11, up to 0.19.2 on 3.12)."""
from __future__ import annotations

import importlib.metadata
import runpy
from pathlib import Path

import pytest
import setuptools
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_kwargs() -> dict:
    """The keyword arguments setup.py hands to ``setuptools.setup`` (nothing is built)."""
    seen = {}
    original = setuptools.setup
    setuptools.setup = lambda **kw: seen.update(kw)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = original
    return seen


def _allowed(requirements: list[str], name: str, python: str) -> list[Requirement]:
    """The requirements on ``name`` that apply under Python ``python`` (their markers evaluated)."""
    reqs = [Requirement(r) for r in requirements]
    return [r for r in reqs if r.name == name and (r.marker is None or r.marker.evaluate({"python_version": python}))]


def _admits(reqs: list[Requirement], version: str) -> bool:
    return all(r.specifier.contains(version, prereleases=True) for r in reqs)


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_gpu_extra_pins_the_megatron_core_the_gpu_path_was_read_against(setup_kwargs, python):
    base = setup_kwargs["install_requires"]
    gpu = setup_kwargs["extras_require"]["gpu"]
    both = _allowed(base, "megatron-core", python) + _allowed(gpu, "megatron-core", python)
    assert _admits(both, "0.16.1")
    for newer in ("0.17.0", "0.18.0", "0.19.2"):
        assert not _admits(both, newer), (python, newer)
    # the CPU legs (no gpu extra) keep testing up to 0.19.2 on Python 3.12 (tools/setup_env.sh installs it)
    assert _admits(_allowed(base, "megatron-core", "3.12"), "0.19.2")
    assert not _admits(_allowed(base, "megatron-core", "3.11"), "0.19.2")


def test_gpu_extra_pins_transformer_engine_to_megatron_cores_own_range(setup_kwargs):
    """The range is read from the installed megatron-core 0.16.1's metadata (its ``dev`` extra), not
    copied by hand: a different megatron-core pin must come with its TE range."""
    declared = [Requirement(r) for r in importlib.metadata.requires("megatron-core")
                if r.startswith("transformer-engine")]
    assert importlib.metadata.version("megatron-core") == "0.16.1" and declared
    theirs = declared[0].specifier
    ours = _allowed(setup_kwargs["extras_require"]["gpu"], "transformer-engine", "3.12")
    assert len(ours) == 1 and "pytorch" in ours[0].extras
    assert ours[0].specifier == theirs, (str(ours[0].specifier), str(theirs))
    assert not _admits(ours, "2.12.0") and _admits(ours, "2.11.0")


def test_setup_env_installs_no_gpu_extra():
    """CI's Python 3.12 leg installs megatron-core 0.19.2 explicitly and then ``.[dev]``: the gpu extra's
    0.16.1 pin must not reach it."""
    script = (ROOT / "tools" / "setup_env.sh").read_text()
    assert 'megatron-core==${GSPO_MEGATRON_CORE:-0.19.2}' in script
    assert '-e ".[dev]"' in script and "[gpu]" not in script


def test_building_the_package_declares_its_assets_without_setuptools_banners(tmp_path):
    """What ``pip install`` runs (build_py) prints no "Package would be ignored" banner for the asset folders, and
    the built package holds every asset file (the demo tokenizers, the CPU SGLang stand-in's source)."""
    import shutil
    import subprocess
    import sys

    src = tmp_path / "src"
    shutil.copytree(ROOT / "gspo_megatron", src / "gspo_megatron", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.py", src / "setup.py")
    proc = subprocess.run([sys.executable, "setup.py", "build_py", "--build-lib", str(tmp_path / "lib")], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "would be ignored" not in output and "Warning" not in output, output[-3000:]
    assets = ROOT / "gspo_megatron" / "assets"
    wanted = sorted(p.relative_to(assets) for p in assets.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    built = tmp_path / "lib" / "gspo_megatron" / "assets"
    assert wanted and sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file()) == wanted
