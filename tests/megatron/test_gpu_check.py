"""The CPU-side parts of tools/gpu_check.sh: its wheel list, its dry run, its refusal without wheels, and
the size of the model its GSPO step trains. The GPU steps themselves run only on a lent GPU (docs/gpu.md)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _wheels() -> dict[str, str]:
    lines = [line.strip() for line in (ROOT / "tools" / "gpu_wheels.txt").read_text().splitlines()]
    reqs = [line for line in lines if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", r) for r in reqs), reqs
    return dict(r.split("==") for r in reqs)


def test_wheel_list_pins_the_megatron_core_the_project_supports():
    wheels = _wheels()
    assert wheels["megatron-core"] == "0.16.1"
    setup = (ROOT / "setup.py").read_text()
    assert re.search(r'"megatron-core[^"]*0\.16\.1', setup)
    # no package the GPU machine already has in its CUDA build, nor one too large to carry
    assert not {"torch", "transformers", "transformer-engine", "sglang", "pyarrow"} & set(wheels)


def _run(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_dry_run_lists_every_step_without_running_it():
    out = _run("--dry-run", env={"GSPO_GPU_VENV": "/nonexistent/venv"})
    assert out.returncode == 0, out.stderr
    steps = re.findall(r"^== ([\w-]+):", out.stdout, flags=re.M)
    assert steps == ["venv", "wheels", "device", "gpu-tests", "gspo-step", "hf-engine"]
    assert "--no-index" in out.stdout and "-m gpu" in out.stdout
    assert not Path("/nonexistent/venv").exists()


def test_without_the_wheels_it_stops_before_doing_anything(tmp_path):
    out = _run(env={"GSPO_GPU_WHEELS": str(tmp_path / "none"), "GSPO_GPU_VENV": str(tmp_path / "venv")})
    assert out.returncode == 3
    assert "megatron-core==0.16.1" in out.stderr and "--fetch-wheels" in out.stderr
    assert not (tmp_path / "venv").exists()


def test_bad_argument_is_refused():
    assert _run("--bogus").returncode == 2


def test_the_gspo_step_trains_a_few_hundred_million_parameters():
    out = subprocess.run([sys.executable, "tools/gpu_step.py", "plan"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    import json

    plan = json.loads(out.stdout.split("GPU_CHECK ", 1)[1])
    assert 2e8 < plan["params"] < 1e9 and plan["train_tokens"] >= 16384


def test_parameter_count_matches_the_canonical_tensors():
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_step

    from gspo_megatron.testing.models import canonical_shapes

    config = gpu_step.model_config()
    total = sum(int(torch_numel(shape)) for shape in canonical_shapes(config).values())
    assert abs(gpu_step.parameter_count(config) - total) < 1e-3 * total  # norms are left out of the count


def torch_numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_a_complete_wheel_folder_passes_the_check(tmp_path):
    for name, version in _wheels().items():  # named as pip names the files it downloads
        (tmp_path / f"{name.replace('-', '_').lower()}-{version}-py3-none-any.whl").touch()
    out = _run(env={"GSPO_GPU_WHEELS": str(tmp_path), "GSPO_GPU_VENV": str(tmp_path / "venv"),
                    "GSPO_GPU_PYTHON": "/bin/false"})
    assert out.returncode == 1 and "== venv" in out.stdout and "missing" not in out.stderr
