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


def _qwen3_moe_hf_dir(folder: Path) -> Path:
    """A tiny random Qwen3-MoE saved by transformers' own classes (the demo's shape), with a tokenizer whose
    eos / pad are set and a generation config: what a user's `model.hf_dir` holds. The tokenizer's
    model_max_length (77) and the generation config's temperature (0.7) mark them as this folder's."""
    import transformers

    from gspo_megatron.data.tokenizer import demo_tokenizer_path

    tok = transformers.AutoTokenizer.from_pretrained(demo_tokenizer_path(), model_max_length=77)
    special = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None}
    config = transformers.Qwen3MoeConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64, intermediate_size=128, norm_topk_prob=True,
                                         max_position_embeddings=128, tie_word_embeddings=False, **special)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    transformers.GenerationConfig(temperature=0.7, do_sample=True, **special).save_pretrained(folder)
    return folder


def _convert(checkpoint: Path, out: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "convert", "megatron-to-hf", "--megatron-dir",
                           str(checkpoint), "--out", str(out), "--no-progress", *extra],
                          capture_output=True, text=True, timeout=600, cwd=cwd, env=ENV)


@pytest.mark.slow
def test_a_run_from_an_hf_folder_exports_its_tokenizer_and_generation_config(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    hf = _qwen3_moe_hf_dir(tmp_path / "my_model")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir",
                           str(run), "model.config=null", f"model.hf_dir={hf}", "logging.console=false",
                           "logging.tensorboard=false", "sft.steps=0", "train.steps=1", "eval.num_prompts=4",
                           "eval.pass_k=1"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = run / "checkpoints" / "step_000001"

    out = tmp_path / "trained_hf"
    proc = _convert(checkpoint, out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"side files (config, generation config, tokenizer) from the run's model.hf_dir {hf}" in proc.stdout
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 0)  # <|im_end|>, <pad>
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 100 and tok.model_max_length == 77 and tok.eos_token == "<|im_end|>"
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id, generation.temperature) == (2, 0, 0.7)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == tok.eos_token_id

    # model.hf_dir gone, nothing else names the model or its tokenizer: refused on one line, nothing written
    moved = hf.rename(tmp_path / "moved")
    proc = _convert(checkpoint, tmp_path / "lost", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "lost").exists()
    assert proc.stderr.strip().splitlines() == [
        f"gspo-megatron convert: error: {checkpoint}: the run's model.hf_dir {hf} is gone (no config.json): the "
        f"checkpoint holds the weights only; pass --hf-template with the model's Hugging Face folder (config and "
        f"tokenizer files)"]
    # the folder given where it now is: exported as before
    proc = _convert(checkpoint, tmp_path / "found", "--hf-template", str(moved), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from --hf-template {moved}" in proc.stdout
    assert len(AutoTokenizer.from_pretrained(tmp_path / "found")) == 100
