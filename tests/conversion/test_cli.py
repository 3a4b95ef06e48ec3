"""`gspo-megatron convert ...`: exit codes and what is printed (in this process; `check` at TP=PP=EP=1)."""
import pytest

from gspo_megatron import cli as top_cli
from gspo_megatron.conversion import cli
from tests.conversion.hf_models import make_hf_dir, read_all


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf = make_hf_dir("qwen3_moe", root / "hf")
    other = make_hf_dir("qwen3_moe", root / "other", seed=1)  # same shapes, other weights
    return root, hf, other


def test_convert_both_ways_and_check(folders, capsys):
    root, hf, other = folders
    assert top_cli.main(["convert", "hf-to-megatron", "--hf-dir", str(hf), "--out", str(root / "meg"),
                         "--tp", "2", "--ep", "2", "--no-progress"]) == 0
    assert f"wrote {root / 'meg'}" in capsys.readouterr().out
    assert cli.main(["check", "--hf-dir", str(hf), "--megatron-dir", str(root / "meg")]) == 0
    line = capsys.readouterr().out
    assert "max |logits_megatron - logits_hf| = " in line and line.strip().endswith(": ok")
    assert float(line.split("= ")[1].split()[0]) < 1e-4
    # the same shapes with other weights: the check must fail
    assert cli.main(["check", "--hf-dir", str(other), "--megatron-dir", str(root / "meg")]) == 3
    assert capsys.readouterr().out.strip().endswith(": MISMATCH")
    assert cli.main(["megatron-to-hf", "--megatron-dir", str(root / "meg"), "--out", str(root / "back"),
                     "--max-shard-bytes", "64KB", "--no-progress"]) == 0
    back, original = read_all(root / "back"), read_all(hf)
    assert back.keys() == original.keys() and all((back[k] == original[k]).all() for k in original)
    assert (root / "back" / "model.safetensors.index.json").is_file()


def test_bad_input_exits_2_with_the_reason(folders, capsys):
    root, hf, _ = folders
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(root / "x"), "--tp", "3"]) == 2
    assert "--tp 3 does not divide the model: num_attention_heads=4" in capsys.readouterr().err
    assert cli.main(["megatron-to-hf", "--megatron-dir", str(root / "missing"), "--out", str(root / "y")]) == 2
    assert capsys.readouterr().err.strip() == f"gspo-megatron convert: error: --megatron-dir {root / 'missing'}: no such folder"
    assert cli.main(["megatron-to-hf", "--megatron-dir", str(hf), "--out", str(root / "y")]) == 2
    assert "no model_config.json" in capsys.readouterr().err
    assert cli.main(["check", "--hf-dir", str(hf / "config.json"), "--megatron-dir", str(hf)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--hf-dir {hf / 'config.json'}: not a folder")
    assert not (root / "x").exists() and not (root / "y").exists()


def test_the_demo_tokenizer_folder_is_the_data_layers(tmp_path):
    """A training checkpoint of an inline model.config exports the demo tokenizer the trainer used."""
    import json
    from pathlib import Path

    from gspo_megatron.conversion import offline
    from gspo_megatron.data.tokenizer import demo_tokenizer_path

    assert offline.tokenizer_source(tmp_path, None, "the checkpoint's model config") == (None, "no template, no model.tokenizer_dir")
    (tmp_path / "gspo_meta.json").write_text(json.dumps({"config": {"model": {"config": {"vocab_size": 100}}}}))
    folder, why = offline.tokenizer_source(tmp_path, None, "the checkpoint's model config")
    assert folder == Path(demo_tokenizer_path()).resolve() and why.startswith("the repository's demo tokenizer")


@pytest.mark.slow
@pytest.mark.distributed
def test_check_on_spawned_ranks_prints_no_warning_and_one_loading_bar(folders):
    """`convert check --ep 2` runs on two spawned ranks, which do not inherit the command's warning filters:
    each rank imported Megatron and printed ~15 apex / Transformer Engine / deprecation warnings."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root, hf, _ = folders
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(root / "meg_ep"), "--no-progress"]) == 0
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "convert", "check", "--hf-dir", str(hf),
                           "--megatron-dir", str(root / "meg_ep"), "--ep", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "ep=2" in done.stdout and done.stdout.strip().endswith(": ok")
    assert "Warning" not in done.stderr, done.stderr
    # the transformers reference is loaded once, in the command's process, not once per rank (its "Loading
    # weights" bar printed once per rank, and each rank held a copy of the HF model)
    import re

    assert len(re.findall(r"Loading weights:\s+0%", done.stderr)) <= 1, done.stderr  # a bar starts at 0%


def test_hf_to_megatron_of_a_folder_without_a_tokenizer_says_what_an_export_will_need(folders, capsys):
    import shutil

    root, hf, _ = folders
    bare = shutil.copytree(hf, root / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    assert cli.main(["hf-to-megatron", "--hf-dir", str(bare), "--out", str(root / "meg_bare"), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"wrote {root / 'meg_bare'}",
                   f"note: {bare} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json): exporting this "
                   f"checkpoint (convert megatron-to-hf) will need --hf-template with a folder that has one, or "
                   f"--weights-only; training from it, model.tokenizer_dir"], out
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(root / "meg_tok"), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {root / 'meg_tok'}"]  # with a tokenizer: no note
