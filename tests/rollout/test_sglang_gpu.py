"""The SGLang engine against a real SGLang server on a tiny random model built here (no hub download).

Skipped without CUDA or without the sglang package; never run on the development machine (no GPU, sglang
not installable). Checks what the stand-in cannot: that SGLang accepts our requests, that its log-probs match
transformers on the same weights, that each weight-sync path changes what the server computes, and that
memory release / resume round-trips.
"""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.typed_config import build

from tests.rollout.sglang_standin import free_port

pytestmark = [
    pytest.mark.gpu, pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang package"),
]

VOCAB = 512
EOS = 1
# Widely supported shapes (head_dim 64) on the triton attention backend; CUDA graphs off to start fast.
SERVER_ARGS = ["--attention-backend", "triton", "--disable-cuda-graph", "--context-length", "512"]


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>").save_pretrained(path)


def _save_model(path: Path, moe: bool) -> None:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=EOS)
    torch.manual_seed(0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                                                   num_experts_per_tok=2, decoder_sparse_step=1, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, **common))
    model.to(torch.bfloat16).save_pretrained(path)
    GenerationConfig(eos_token_id=EOS, bos_token_id=EOS).save_pretrained(path)
    _tokenizer(path)


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    _save_model(path, moe=False)
    return path


def _engine(model: Path, tmp: Path, **overrides) -> SGLangEngine:
    launch = {"model_path": str(model), "base_port": free_port(), "mem_fraction_static": 0.3, "log_dir": str(tmp / "logs"),
              "startup_timeout_s": 600.0, "extra_args": SERVER_ARGS, **overrides.pop("launch", {})}
    cfg = build(SGLangConfig, {"launch": launch, **overrides}, "rollout.sglang")
    return SGLangEngine.from_config(cfg)


def _hf_logprobs(model_dir: Path, prompt: list[int], response: list[int], overrides: dict | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda().eval()
    for name, tensor in (overrides or {}).items():
        model.get_parameter(name).data.copy_(tensor)
    ids = torch.tensor([prompt + response], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits.float()[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response, device="cuda")[:, None])[:, 0].cpu()


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


def test_generate_logprobs_tensor_sync_and_memory_release(dense_model, tmp_path):
    with _engine(dense_model, tmp_path) as engine:
        params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=[EOS])
        samples = engine.generate(PROMPTS, 4, params)
        assert [s.prompt_index for s in samples] == [i for i in range(3) for _ in range(4)]
        for s in samples:
            assert 1 <= len(s.response_ids) <= 12 and len(s.logprobs) == len(s.response_ids)
            assert s.finish_reason in ("stop", "length") and all(lp <= 1e-4 for lp in s.logprobs)
        # SGLang's log-probs (temperature 1: no scaling) against transformers on the same bf16 weights
        s = samples[0]
        ref = _hf_logprobs(dense_model, PROMPTS[0], s.response_ids)
        assert (torch.tensor(s.logprobs) - ref).abs().max().item() < 0.1

        # Colocated tensor sync: a zero lm_head makes every next token uniform, log-prob -log(V)
        zero_head = torch.zeros(VOCAB, 128, dtype=torch.bfloat16, device="cuda")
        engine.update_weights([("lm_head.weight", zero_head)], final=True)
        assert engine.weight_version == 1
        uniform = engine.generate(PROMPTS, 2, params)
        for s in uniform:
            assert max(abs(lp + math.log(VOCAB)) for lp in s.logprobs) < 0.02

        # Release everything, resume weights, sync, resume the KV cache, generate again
        engine.release_memory()
        engine.resume_memory(["weights"])
        engine.update_weights([("lm_head.weight", zero_head)], final=True)
        engine.resume_memory(["kv_cache", "cuda_graph"])
        again = engine.generate(PROMPTS, 2, params)
        assert all(max(abs(lp + math.log(VOCAB)) for lp in s.logprobs) < 0.02 for s in again)
        assert engine.healthy()


def test_disk_sync_restores_the_original_head(dense_model, tmp_path):
    from safetensors.torch import load_file

    original = load_file(dense_model / "model.safetensors")
    with _engine(dense_model, tmp_path, weight_sync="disk", disk_dir=str(tmp_path / "sync"),
                 launch={"load_format": "dummy"}) as engine:
        # dummy weights: the server starts stale and serves after the first sync
        engine.update_weights(original.items(), final=True)
        samples = engine.generate(PROMPTS[:1], 2, SamplingParams(max_new_tokens=8, temperature=1.0))
        ref = _hf_logprobs(dense_model, PROMPTS[0], samples[0].response_ids)
        assert (torch.tensor(samples[0].logprobs) - ref).abs().max().item() < 0.1


def test_routed_experts_of_a_tiny_moe(tmp_path_factory, tmp_path):
    model = tmp_path_factory.mktemp("tiny-qwen3-moe")
    _save_model(model, moe=True)
    with _engine(model, tmp_path, launch={"enable_return_routed_experts": True}) as engine:
        samples = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, return_routed_experts=True))
        for s in samples:
            assert s.routed_experts.shape == (len(s.response_ids), 2, 2)
            assert ((s.routed_experts >= 0) & (s.routed_experts < 4)).all()
            assert (s.routed_experts[:, :, 0] != s.routed_experts[:, :, 1]).all()  # top-2 picks two experts


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the server on different GPUs")
def test_distributed_sync_over_nccl(dense_model, tmp_path):
    torch.cuda.set_device(0)
    with _engine(dense_model, tmp_path, weight_sync="distributed", launch={"base_gpu_id": 1},
                 distributed={"master_address": "127.0.0.1", "master_port": free_port()}) as engine:
        engine.update_weights([("lm_head.weight", torch.zeros(VOCAB, 128, dtype=torch.bfloat16, device="cuda"))], final=True)
        samples = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6))
        assert all(max(abs(lp + math.log(VOCAB)) for lp in s.logprobs) < 0.02 for s in samples)
