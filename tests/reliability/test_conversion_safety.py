"""Conversion never eats its input, cleans up after killed runs, converts training checkpoints, and exits
with distinct codes (gspo_megatron/conversion)."""
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from gspo_megatron.conversion import cli
from gspo_megatron.conversion.offline import remove_stale_staging
from tests.conversion.hf_models import make_hf_dir


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    hf = make_hf_dir("qwen3_moe", root / "models" / "hf")
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(root / "models" / "meg"), "--no-progress"]) == 0
    return root, hf, root / "models" / "meg"


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_overwrite_never_deletes_an_input(converted, capsys, direction):
    root, hf, meg = converted
    source = ["--hf-dir", str(hf)] if direction == "hf-to-megatron" else ["--megatron-dir", str(meg)]
    before = sorted(p.name for p in (root / "models").rglob("*"))
    for out, why in ((root / "models", "contains the input"), (meg / "sub" if direction == "megatron-to-hf" else hf / "sub",
                                                              "is inside the input")):
        assert cli.main([direction, *source, "--out", str(out), "--overwrite", "--no-progress"]) == 2
        assert why in capsys.readouterr().err
    assert sorted(p.name for p in (root / "models").rglob("*")) == before


def test_staging_folder_of_a_killed_conversion_is_removed(converted, tmp_path):
    _, hf, _ = converted
    out = tmp_path / "meg"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".meg.incomplete-{socket.gethostname()}-{dead.pid}-abcd1234"
    live = tmp_path / f".meg.incomplete-{socket.gethostname()}-{os.getpid()}-abcd1234"  # a running conversion's
    for folder in (stale, live):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x" * 100)
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(out), "--no-progress"]) == 0
    assert not stale.exists() and live.exists()
    assert remove_stale_staging(out) == []


def test_a_killed_conversion_leaves_a_staging_folder_the_next_run_removes(converted, tmp_path):
    _, hf, _ = converted
    out = tmp_path / "meg"
    proc = subprocess.Popen([sys.executable, "-m", "gspo_megatron.cli", "convert", "hf-to-megatron", "--hf-dir", str(hf),
                             "--out", str(out), "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not list(tmp_path.glob(".meg.incomplete-*")):
        assert proc.poll() is None, "the conversion ended before its staging folder appeared"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(list(tmp_path.glob(".meg.incomplete-*"))) == 1
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(out), "--no-progress"]) == 0
    assert list(tmp_path.glob(".meg.incomplete-*")) == []


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_a_full_disk_names_the_output_folder(converted, tmp_path, direction):
    # a 64 KiB tmpfs in a private mount namespace: the staging folder fits, the weights do not
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs unshare -rm (user and mount namespaces) for a small private tmpfs")
    _, hf, meg = converted
    full = tmp_path / "full"
    full.mkdir()
    source = f"--hf-dir '{hf}'" if direction == "hf-to-megatron" else f"--megatron-dir '{meg}'"
    convert = f"{sys.executable} -m gspo_megatron.cli convert {direction} {source} --out '{full / 'out'}' --no-progress"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{full}' && {{ {convert}; "
                           f"code=$?; echo left: $(ls -A '{full}'); exit $code; }}"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "left:", proc.stdout  # nothing, the staging folder included
    [line] = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert line.startswith(f"gspo-megatron convert: error: {full / 'out'}: no space left on device (ENOSPC) while "
                           f"writing the conversion output (its staging folder .out.incomplete-"), line
    assert line.endswith(" was removed)"), line


def test_check_failure_and_crash_have_distinct_exit_codes(converted, tmp_path, capsys, monkeypatch):
    _, hf, meg = converted
    other = make_hf_dir("qwen3_moe", tmp_path / "other", seed=1)
    assert cli.main(["check", "--hf-dir", str(other), "--megatron-dir", str(meg)]) == 3
    capsys.readouterr()
    from gspo_megatron.conversion import check

    def crash(*args, **kwargs):  # not one of our errors -> a crash
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(check, "run_check", crash)
    code = cli.main(["check", "--hf-dir", str(hf), "--megatron-dir", str(meg)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("gspo-megatron convert: error: ZeroDivisionError"), err
    assert "traceback: " in err[0] and "--debug prints it" in err[0]


BROKEN_JSON = '{\n  "architectures": ["x"],\n  oops\n}\n'  # JSONDecodeError at line 3


@pytest.mark.parametrize("command,broken", [
    ("hf-to-megatron", "hf/config.json"),
    ("megatron-to-hf", "meg/gspo_meta.json"),
    ("megatron-to-hf", "meg/model_config.json"),
    ("megatron-to-hf", "meg/hf/config.json"),  # the template the export copies
    ("check", "hf/config.json"),
    ("check", "meg/model_config.json"),
])
def test_a_malformed_json_file_is_named_with_its_line(converted, tmp_path, capsys, command, broken):
    _, hf, meg = converted
    shutil.copytree(hf, tmp_path / "hf")
    shutil.copytree(meg, tmp_path / "meg")
    (tmp_path / broken).write_text(BROKEN_JSON)
    args = {"hf-to-megatron": ["--hf-dir", str(tmp_path / "hf")], "megatron-to-hf": ["--megatron-dir", str(tmp_path / "meg")],
            "check": ["--hf-dir", str(tmp_path / "hf"), "--megatron-dir", str(tmp_path / "meg")]}[command]
    out = [] if command == "check" else ["--out", str(tmp_path / "out"), "--no-progress"]
    code = cli.main([command, *args, *out])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"gspo-megatron convert: error: {tmp_path / broken}:3: not valid JSON ("), err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key, value, named", [
    ("num_hidden_layers", 1_000_000_000, "num_hidden_layers=1000000000 but the weights hold 2 layers"),
    ("num_experts", 1_000_000, "num_experts=1000000 but the weights hold 4 experts")])
def test_config_sizes_beyond_the_weights_present_are_refused_before_allocating(converted, tmp_path, capsys, key,
                                                                             value, named):
    """A config.json whose sizes the weights do not have is refused from the tensor headers, before any model,
    layout or table is built (1e9 layers used to grow memory without bound)."""
    import json
    import resource

    _, hf, _ = converted
    shutil.copytree(hf, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config[key] = value
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = cli.main(["hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"config.json: {named}" in err[0], err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing was built


def _convert_edited(hf, tmp_path, capsys, edit) -> tuple[int, list[str]]:
    """hf-to-megatron of a copy of ``hf`` changed by ``edit(folder)``: (exit code, stderr lines)."""
    shutil.copytree(hf, tmp_path / "hf")
    edit(tmp_path / "hf")
    code = cli.main(["hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "out"), "--no-progress"])
    assert not (tmp_path / "out").exists()
    return code, capsys.readouterr().err.strip().splitlines()


def _set_config(folder, **changes):
    import json

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("value, message", [("two", "expected an integer, got 'two'"),
                                            (2.5, "expected an integer, got 2.5"),
                                            (True, "expected an integer, got True")])
def test_a_config_count_that_is_not_an_integer_is_refused_naming_the_key(converted, tmp_path, capsys, value, message):
    """"two" was a raw ValueError (exit 1) and 2.5 silently became 2."""
    _, hf, _ = converted
    code, err = _convert_edited(hf, tmp_path, capsys, lambda folder: _set_config(folder, num_hidden_layers=value))
    assert code == 2 and len(err) == 1 and f"config.json: num_hidden_layers: {message}" in err[0], err


def test_an_index_entry_outside_the_model_folder_is_refused_and_never_opened(converted, tmp_path, capsys):
    import json

    _, hf, _ = converted
    (tmp_path / "secret.safetensors").write_bytes(b"SECRET-BYTES" * 100)

    def point_outside(folder):
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        from safetensors import safe_open

        with safe_open(folder / "model-00001-of-00001.safetensors", "pt") as f:
            weight_map = {name: "model-00001-of-00001.safetensors" for name in f.keys()}
        first = sorted(weight_map)[0]
        weight_map[first] = "../secret.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    code, err = _convert_edited(hf, tmp_path, capsys, point_outside)
    assert code == 2 and len(err) == 1, err
    assert "weight_map" in err[0] and "'../secret.safetensors' is not a file name inside" in err[0], err
    assert "SECRET" not in err[0]


def test_a_config_json_symlink_loop_is_reported_as_a_loop(converted, tmp_path, capsys):
    def loop(folder):
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to(folder / "other.json")
        (folder / "other.json").symlink_to(folder / "config.json")

    code, err = _convert_edited(*converted[1:2], tmp_path, capsys, loop)
    assert code == 2 and len(err) == 1 and "config.json: cannot be read: a symbolic link loop" in err[0], err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key, hf_key, value, named", [
    ("num_layers", "num_hidden_layers", 1_000_000_000, "num_layers=1000000000 but the checkpoint holds 2 layers"),
    ("num_experts", "num_experts", 1_000_000, "num_experts=1000000 but the checkpoint's routers score [4] experts")])
def test_megatron_to_hf_refuses_config_counts_beyond_the_checkpoint_before_allocating(converted, tmp_path, capsys, key,
                                                                                    hf_key, value, named):
    """model_config.json and the hf/ template both claiming 1e9 layers (they must agree) are checked against the
    checkpoint's tensors before the table or the layout is built, like hf-to-megatron's count check (the
    layer count used to grow memory without bound)."""
    import json
    import resource

    _, _, meg = converted
    shutil.copytree(meg, tmp_path / "meg")
    for name, field in (("model_config.json", key), ("hf/config.json", hf_key)):
        config = json.loads((tmp_path / "meg" / name).read_text())
        (tmp_path / "meg" / name).write_text(json.dumps({**config, field: value}))
    meta = json.loads((tmp_path / "meg" / "gspo_meta.json").read_text())
    meta["model_config"][key] = value
    (tmp_path / "meg" / "gspo_meta.json").write_text(json.dumps(meta))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = cli.main(["megatron-to-hf", "--megatron-dir", str(tmp_path / "meg"), "--out", str(tmp_path / "out"),
                     "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing was built
