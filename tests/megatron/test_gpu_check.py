"""tools/gpu_check.sh on the CPU: the ``--cpu`` dry run executes every step of the GPU check (tiny model,
gloo, shared memory instead of CUDA IPC) and each writes its JSON line; a step made to raise or hang
still lets the others write theirs; the wheel list, the unpickling allowlist against SGLang 0.5.23's."""
from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.testing import gpu_check

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _run(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("OUT", gpu_check.INJECT_ENV)}
    environ.update(GSPO_GPU_PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=environ)


def _records(path: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len({r["step"] for r in lines}), "one line per step"
    return {r["step"]: r for r in lines}


def _printed(stdout: str) -> dict[str, dict]:
    return {r["step"]: r for r in (json.loads(line[len(gpu_check.PREFIX):]) for line in stdout.splitlines()
                                   if line.startswith(gpu_check.PREFIX))}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("check") / "results.jsonl"
    out = _run("--cpu", "--size", "tiny", "--results", str(results))
    return out, _records(results)


def test_every_step_writes_an_ok_line(dry_run):
    out, records = dry_run
    assert list(records) == list(gpu_check.STEPS)
    assert _printed(out.stdout) == records  # the same line printed and appended
    failed = {name: r["error"] for name, r in records.items() if not r["ok"]}
    assert not failed, failed
    assert out.returncode == 0, out.stdout[-2000:]


def test_versions_name_the_packages(dry_run):
    a = dry_run[1]["a_versions"]
    import megatron.core

    assert a["megatron_core"] == megatron.core.__version__ and a["torch"] == torch.__version__
    assert a["device"] == "cpu" and a["mcore_have_te"] is False and a["layer_spec_auto"] == "local"


def test_gspo_step_audit_at_equal_weights(dry_run):
    b = dry_run[1]["b_gspo_step"]
    for recompute in ("selective", "full"):
        r = b[recompute]
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
        audit = r["audit"]
        # the CPU is deterministic: two passes agree exactly, and the first mini-batch's ratios are all 1
        assert audit["passes_max_token_logprob_diff"] == 0.0 and audit["passes_within_clip"] is True
        assert audit["first_seq_ratio_max_dev"] < gpu_check.GSPO_CLIP and audit["first_clip_frac_seq"] == 0.0
    # full and selective recomputation compute the same step
    assert b["full"]["grad_norm"] == pytest.approx(b["selective"]["grad_norm"], rel=1e-3)


def test_logprob_gap_is_measured_on_real_samples(dry_run):
    c = dry_run[1]["c_logprob_gap"]
    size = gpu_check.SIZES["tiny"]
    assert 0 < c["samples"] <= size.gen_prompts * size.gen_samples and c["tokens"] >= c["samples"]
    # bf16 engine against bf16 trainer on the same weights: close, not equal
    assert 0 < c["token_abs_gap_mean"] <= c["token_abs_gap_max"] < 0.05


def test_sync_sends_the_served_model_once_in_both_modes(dry_run):
    d = dry_run[1]["d_memory_sync"]
    for mode in ("sync_release_each_bucket", "sync_hold_all_buckets"):
        assert d[mode]["bytes"] == d["model_bytes"] and d[mode]["buckets"] > 1
    assert d["model_bytes"] > 0 and d["after_update"]["reserved_gib"] is None  # no allocator to read on CPU


def test_ipc_round_trip_and_the_refusal(dry_run):
    e = dry_run[1]["e_cuda_ipc"]
    assert e["devices"] == ["cpu"] and e["tensors"] == 5 and e["bytes"] > gpu_check.SIZES["tiny"].ipc_bytes // 2
    assert "blocked global" in e["blocked_global_refused"]


def test_checkpoint_round_trip_is_exact(dry_run):
    f = dry_run[1]["f_checkpoint"]
    assert f["param_diff_before_load"] > 0 and f["param_max_diff"] == 0.0 and f["optimizer_max_diff"] == 0.0
    assert f["optimizer_tensors"] > 0 and f["param_max_diff_after_next_update"] == 0.0


def test_the_offloaded_optimizer_is_built_on_the_cpu(dry_run):
    g = dry_run[1]["g_offload"]
    assert g["ok"] and g["offload_fraction"] == gpu_check.OFFLOAD_FRACTION
    assert g["inner_optimizer"] == "HybridDeviceOptimizer" and g["stepped"] is False


def test_a_failing_and_a_hanging_step_leave_the_others_their_lines(tmp_path):
    results = tmp_path / "r.jsonl"
    out = _run("--cpu", "--steps", "a,b,e", "--timeout-scale", "0.5", "--results", str(results),
               env={gpu_check.INJECT_ENV: "b:raise,e_cuda_ipc:hang"})
    records = _records(results)
    assert list(records) == ["a_versions", "b_gspo_step", "e_cuda_ipc"]
    assert records["a_versions"]["ok"] is True
    assert records["b_gspo_step"]["ok"] is False and "injected" in records["b_gspo_step"]["error"]
    assert records["e_cuda_ipc"]["ok"] is False and records["e_cuda_ipc"]["error"].startswith("timed out after")
    assert out.returncode == 1 and "1/3 steps ok" in out.stdout


def test_a_spent_budget_still_writes_every_line(tmp_path):
    results = tmp_path / "r.jsonl"
    out = _run("--cpu", "--budget-s", "0", "--results", str(results), timeout=60)
    records = _records(results)
    assert list(records) == list(gpu_check.STEPS) and out.returncode == 1
    assert all(not r["ok"] and "budget" in r["error"] for r in records.values())


def test_without_wheels_the_steps_still_run_and_say_why(tmp_path):
    """Off --cpu, here: the missing wheel is named, then the steps run anyway (and, without CUDA, fail)."""
    if torch.cuda.is_available():
        pytest.skip("a statement about a machine without CUDA")
    results = tmp_path / "r.jsonl"
    out = _run("--steps", "a", "--results", str(results), env={"GSPO_GPU_WHEELS": str(tmp_path / "none"),
                                                              "GSPO_GPU_SITE": str(tmp_path / "site")})
    assert "megatron-core==0.16.1 is missing" in out.stderr and "--fetch-wheels" in out.stderr
    record = _records(results)["a_versions"]
    assert record["ok"] is False and "no CUDA device" in record["error"] and out.returncode == 1


def _probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel named like the pinned megatron-core (pip reads its dist-info), holding
    one marker module instead of megatron (the real package stays the one the steps import)."""
    import zipfile

    path = folder / "megatron_core-0.16.1-py3-none-any.whl"
    info = "megatron_core-0.16.1.dist-info"
    files = {"gspo_probe_marker.py": "MARK = 1\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.16.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_the_wheels_install_into_a_folder_on_pythonpath_without_a_venv(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _probe_wheel(wheels)
    results = tmp_path / "r.jsonl"
    out = _run("--steps", "a", "--results", str(results), env={"GSPO_GPU_WHEELS": str(wheels),
                                                              "GSPO_GPU_SITE": str(site)})
    assert (site / "gspo_probe_marker.py").is_file() and "missing" not in out.stderr
    assert list(_records(results)) == ["a_versions"]  # and the step ran after the install
    assert not list(tmp_path.glob("**/pyvenv.cfg"))


def test_unknown_step_and_bad_injection_are_refused():
    with pytest.raises(SystemExit, match="unknown step"):
        gpu_check.resolve_steps("a,z")
    with pytest.raises(SystemExit, match="STEP:raise or STEP:hang"):
        gpu_check.injected("a_versions", {gpu_check.INJECT_ENV: "a:explode"})
    assert gpu_check.resolve_steps("c,a") == ["a_versions", "c_logprob_gap"]
    assert gpu_check.injected("e_cuda_ipc", {gpu_check.INJECT_ENV: "b:raise,e:hang"}) == "hang"


def test_default_results_path_follows_out(tmp_path):
    assert gpu_check.default_results_path({"OUT": str(tmp_path)}) == tmp_path / "gpu_check.jsonl"
    assert gpu_check.default_results_path({}) == ROOT / "build" / "gpu_check.jsonl"


# ---- the unpickling rules of (e)

def test_allowlist_takes_the_sync_payload_and_refuses_other_globals():
    from gspo_megatron.rollout.sglang.weight_sync import serialize_named_tensors

    bucket = [("w", torch.randn(4, 3).to(torch.bfloat16)), ("n", torch.arange(5))]
    got = gpu_check.safe_deserialize(serialize_named_tensors(bucket))
    assert [n for n, _ in got] == ["w", "n"] and all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket, got))
    with pytest.raises(pickle.UnpicklingError, match="blocked global"):
        gpu_check.safe_deserialize(base64.b64encode(pickle.dumps(os.system)).decode())


def _sglang_allowed_globals() -> set[tuple[str, str]] | None:
    from gspo_megatron.rollout.sglang.cpu import sglang_venv

    found = sorted(sglang_venv().glob("lib/python3*/site-packages/sglang/srt/utils/common.py"))
    if not found:
        return None
    source = found[0].read_text()
    body = source[source.index("ALLOWED_GLOBALS = {"):source.index("def find_class", source.index("class SafeUnpickler"))]
    return set(re.findall(r'\(\s*"([\w.]+)",\s*"(\w+)",?\s*\)', body))


def test_allowlist_is_within_sglang_0_5_23s():
    allowed = _sglang_allowed_globals()
    if allowed is None:
        pytest.skip("SGLang 0.5.23 is not installed here (tools/setup_env.sh sglang)")
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in allowed  # the parse found the list
    assert gpu_check.SGLANG_TENSOR_GLOBALS <= allowed, gpu_check.SGLANG_TENSOR_GLOBALS - allowed


# ---- sizes and wheels

def test_wheel_list_pins_the_megatron_core_the_gpu_path_was_read_against():
    lines = [ln.strip() for ln in (ROOT / "tools" / "gpu_wheels.txt").read_text().splitlines()]
    reqs = dict(ln.split("==") for ln in lines if ln and not ln.startswith("#"))
    assert reqs == {"megatron-core": "0.16.1"}  # the lent machine has everything else (docs/gpu.md)
    assert re.search(r'"megatron-core[^"]*0\.16\.1', (ROOT / "setup.py").read_text())


def test_the_gpu_size_trains_a_few_hundred_million_parameters():
    from gspo_megatron.testing.models import canonical_shapes

    size = gpu_check.SIZES["gpu"]
    config = gpu_check.model_config(size)
    total = sum(int(torch.Size(shape).numel()) for shape in canonical_shapes(config).values())
    assert abs(gpu_check.parameter_count(config) - total) < 1e-3 * total  # norms are left out of the count
    assert 2e8 < total < 1e9 and size.seqs * size.length >= 16384
