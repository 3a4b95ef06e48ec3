"""A training checkpoint exports to a complete Hugging Face folder: transformers loads the model and its
tokenizer, and generation stops at the tokenizer's EOS (checkpoint.export_hf and `convert megatron-to-hf`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu_demo.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _greedy_stops_at_eos(hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert len(tok) > 10 and tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id is not None
    # after the warm start the model writes three digits and EOS: generation must stop there
    ids = torch.tensor([tok.encode("sort 8 4 2", add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:].tolist()
    assert tok.eos_token_id in out and len(out) < 30, tok.decode(out)
    assert out[-1] == tok.eos_token_id


@pytest.mark.slow
def test_run_exports_complete_hf_folder_and_convert_finds_the_tokenizer(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir",
                           str(run), "logging.console=false", "logging.tensorboard=false", "sft.steps=60",
                           "train.steps=1", "eval.num_prompts=4", "eval.pass_k=1", "checkpoint.export_hf=end"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = run / "hf" / "step_000001"
    assert f"exported {exported}" in proc.stdout and "demo tokenizer" in proc.stdout
    _greedy_stops_at_eos(exported)

    # the same from the command line, and it says where the tokenizer came from
    out = tmp_path / "trained_hf"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "convert", "megatron-to-hf", "--megatron-dir",
                           str(run / "checkpoints" / "step_000001"), "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenizer from the repository's demo tokenizer" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 0)  # the demo tokenizer: <|im_end|>, <pad>
    _greedy_stops_at_eos(out)
