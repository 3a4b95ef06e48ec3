"""Tiny random models and engine settings for the tests against real SGLang servers on CPU (the
``sglang`` test leg). Not SGLang itself: the server comes from the interpreter in GSPO_SGLANG_PYTHON,
which ``tools/run_tests.sh`` sets to the venv ``tools/setup_env.sh sglang`` keeps in the cache folder.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.typed_config import build

from tests.rollout.sglang_standin import free_port

VOCAB = 512
EOS = 1
CONTEXT = 512
SGLANG_PYTHON = os.environ.get("GSPO_SGLANG_PYTHON", "")

needs_sglang = [
    pytest.mark.sglang, pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PYTHON, reason="needs a real SGLang server: runs in the sglang leg "
                       "(GSPO_LEGS=sglang bash tools/run_tests.sh), which sets GSPO_SGLANG_PYTHON"),
]


def save_model(path: Path, *, moe: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A tiny random Qwen3 (or Qwen3-MoE: 4 experts, top-2) saved as a HF folder, no tokenizer (the
    servers run with --skip-tokenizer-init and take token ids)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                  eos_token_id=EOS, bos_token_id=EOS)
    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                                                   num_experts_per_tok=2, decoder_sparse_step=1, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, **common))
    with torch.no_grad():  # random init's lm_head is near uniform; a larger scale gives peaked, testable log-probs
        model.lm_head.weight.mul_(8.0)
    model.to(dtype).save_pretrained(path)
    GenerationConfig(eos_token_id=EOS, bos_token_id=EOS).save_pretrained(path)
    return path


def cpu_launch(model: Path, tmp: Path, servers: int = 1, **overrides) -> dict:
    """``rollout.sglang.launch`` for CPU servers of ``model`` (the one user setting: device cpu)."""
    return {"model_path": str(model), "device": "cpu", "python": SGLANG_PYTHON, "servers": servers,
            "base_port": free_port_block(servers), "dtype": "float32", "log_dir": str(tmp / "sglang_logs"),
            "startup_timeout_s": 600.0, "extra_args": ["--context-length", str(CONTEXT)], **overrides}


def free_port_block(n: int) -> int:
    """A port p with p .. p+n-1 free now (servers bind base_port + i)."""
    from gspo_megatron.rollout.sglang.server import port_is_free

    for _ in range(50):
        base = free_port()
        if base + n < 65000 and all(port_is_free("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports")


def launch_engine(model: Path, tmp: Path, *, servers: int = 1, launch: dict | None = None, **cfg) -> SGLangEngine:
    settings = {"launch": cpu_launch(model, tmp, servers, **(launch or {})), "release_memory": False, **cfg}
    return SGLangEngine.from_config(build(SGLangConfig, settings, "rollout.sglang"))


def hf_logprobs(model_dir: Path, prompt: list[int], response: list[int], *, temperature: float = 1.0,
                head: torch.Tensor | None = None) -> torch.Tensor:
    """[T] log-probs of ``response`` after ``prompt`` under log_softmax(logits / T), fp32 transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if head is not None:
        model.lm_head.weight.data.copy_(head)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def server_processes(port: int | str) -> list[str]:
    """PIDs of the processes whose command line holds ``--port <port>`` (a server's, pgrep -f). pgrep's own
    errors raise: the pattern once went to pgrep without ``--``, which read it as an unknown option and
    printed no PID, so a check for processes left behind passed without looking."""
    proc = subprocess.run(["pgrep", "-f", "--", f"--port {port}( |$)"], capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 1: none matched
        raise RuntimeError(f"pgrep exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout.split()


__all__ = ["CONTEXT", "EOS", "SGLANG_PYTHON", "VOCAB", "cpu_launch", "free_port_block", "hf_logprobs",
           "launch_engine", "needs_sglang", "save_model", "server_processes"]
