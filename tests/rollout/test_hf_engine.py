"""HFRolloutEngine on tiny random models of every supported family.

The reference for every number is transformers' own ``model(input_ids)`` forward on the unpadded
prompt + response ("teacher forcing"); the engine decodes with its own batched loop and KV cache.
"""
from __future__ import annotations

import functools
import os

import pytest
import safetensors.torch
import torch
import transformers

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.hf_engine import HFRolloutEngine

VOCAB = 96
FP32_ATOL = 2e-5

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,  # large weights: peaked next-token distributions and varied routing
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_config(family: str) -> transformers.PretrainedConfig:
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), layers 0 and 2 MoE
        return transformers.Qwen3MoeConfig(
            **COMMON, num_hidden_layers=3, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
            num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
        )
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=8, intermediate_size=40)
    if family == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**COMMON, num_hidden_layers=2, intermediate_size=40)
    if family == "llama":  # tied embeddings
        return transformers.LlamaConfig(**COMMON, num_hidden_layers=2, intermediate_size=40, tie_word_embeddings=True)
    if family == "mixtral":
        return transformers.MixtralConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "qwen2_moe":  # shared expert + gate
        return transformers.Qwen2MoeConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        )
    if family == "glm4_moe":  # layer 0 dense; half-rotary heads, q/k norm, q/k/v biases, sigmoid router + bias
        return transformers.Glm4MoeConfig(
            **COMMON, num_hidden_layers=3, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
            n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    if family == "deepseek_v3":  # layer 0 dense; MLA with a q latent, interleaved rope dims; sigmoid router + bias
        return transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": COMMON["num_attention_heads"]}, num_hidden_layers=3,
            q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=14,
            intermediate_size=40, moe_intermediate_size=16, n_routed_experts=6, num_experts_per_tok=2,
            n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
            num_nextn_predict_layers=0,
        )
    raise ValueError(family)


FAMILIES = ["qwen3_moe", "qwen3", "qwen2", "llama", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"]
MOE_FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"]
PROMPTS = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46], [9]]


@functools.lru_cache(maxsize=None)
def engine(family: str) -> HFRolloutEngine:
    """One engine per family for the read-only tests (tests that change weights build their own)."""
    return HFRolloutEngine(tiny_config(family), init_seed=0)


def teacher_forced_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[T, V] float32 logits that predicted each response token, from one unpadded forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def teacher_forced_routes(eng: HFRolloutEngine, prompt: list[int], response: list[int],
                          *, whole: bool = False) -> torch.Tensor:
    """[T, num_moe_layers, top_k] expert ids at the positions that predicted each response token
    (``whole``: [P + T - 1, ...], every position but the last)."""
    model = eng.model
    gates = [layer.mlp.gate for layer in model.model.layers if "experts" in dict(layer.mlp.named_children())]
    seen: list[torch.Tensor] = []
    handles = [g.register_forward_hook(lambda m, a, out: seen.append(out[2])) for g in gates]
    try:
        teacher_forced_logits(model, prompt, response)
    finally:
        for h in handles:
            h.remove()
    routes = torch.stack(seen, dim=1)  # [seq, layers, k]
    if whole:
        return routes[: len(prompt) + len(response) - 1]
    return routes[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def assert_logprobs_exact(eng: HFRolloutEngine, prompts, samples, temperature=1.0, mode="raw"):
    for s in samples:
        logits = teacher_forced_logits(eng.model, prompts[s.prompt_index], s.response_ids)
        if mode == "temperature":
            logits = logits / temperature
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=FP32_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_teacher_forced_forward(family):
    eng = engine(family)
    params = SamplingParams(max_new_tokens=10, seed=3)
    samples = eng.generate(PROMPTS, 2, params)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert all(len(s.response_ids) == 10 and s.finish_reason == "length" for s in samples)
    assert len({tuple(s.response_ids) for s in samples}) == len(samples)  # really sampled
    assert_logprobs_exact(eng, PROMPTS, samples)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_experts_match_a_separate_forward(family):
    eng = engine(family)
    samples = eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=4, return_routed_experts=True))
    num_layers = 2  # qwen3_moe has 3 layers, one of them dense
    top_k = eng.model.config.num_experts_per_tok
    assert eng.num_moe_layers == num_layers
    distinct = set()
    for s in samples:
        assert s.routed_experts.shape == (len(s.response_ids), num_layers, top_k)
        expected = teacher_forced_routes(eng, PROMPTS[s.prompt_index], s.response_ids)
        assert torch.equal(s.routed_experts.sort(-1).values, expected.to(torch.int32).sort(-1).values)
        distinct.update(tuple(r) for r in s.routed_experts.reshape(-1, top_k).tolist())
        # R3 needs the prompt positions too: from the (left-padded, batched) prefill
        prompt = PROMPTS[s.prompt_index]
        assert s.prompt_routed_experts.shape == (len(prompt) - 1, num_layers, top_k)
        whole = teacher_forced_routes(eng, prompt, s.response_ids, whole=True)
        assert torch.equal(s.all_routed_experts().sort(-1).values, whole.to(torch.int32).sort(-1).values)
    assert len(distinct) > 2  # routing varies, so the comparison above means something


def test_routed_experts_absent_unless_asked_or_dense():
    samples = engine("qwen3_moe").generate(PROMPTS, 1, SamplingParams(max_new_tokens=3, seed=0))
    assert all(s.routed_experts is None and s.prompt_routed_experts is None for s in samples)
    assert all(s.all_routed_experts() is None for s in samples)
    dense = engine("qwen3").generate(PROMPTS, 1, SamplingParams(max_new_tokens=3, seed=0, return_routed_experts=True))
    assert all(s.routed_experts is None for s in dense)


def test_same_seed_same_samples_other_seed_differs():
    eng = engine("qwen3_moe")
    params = SamplingParams(max_new_tokens=12, seed=11, top_p=0.9, top_k=20, temperature=0.8)
    a, b = eng.generate(PROMPTS, 3, params), eng.generate(PROMPTS, 3, params)
    assert [(s.response_ids, s.logprobs) for s in a] == [(s.response_ids, s.logprobs) for s in b]
    params.seed = 12
    c = eng.generate(PROMPTS, 3, params)
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_stop_tokens_end_rows_independently_and_logprobs_stay_exact():
    eng = engine("qwen3_moe")
    stop = list(range(0, VOCAB, 12))  # 8 of 96 ids: some rows stop, some run to the limit
    prompts = PROMPTS + [[7, 7, 7, 7]]
    params = SamplingParams(max_new_tokens=12, seed=5, stop_token_ids=stop, return_routed_experts=True)
    samples = eng.generate(prompts, 4, params)
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}, reasons
    for s in samples:
        assert not set(s.response_ids[:-1]) & set(stop)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop
        else:
            assert len(s.response_ids) == 12
        assert len(s.logprobs) == len(s.response_ids) == s.routed_experts.shape[0]
        expected_routes = teacher_forced_routes(eng, prompts[s.prompt_index], s.response_ids)
        assert torch.equal(s.routed_experts.sort(-1).values, expected_routes.to(torch.int32).sort(-1).values)
    assert_logprobs_exact(eng, prompts, samples)  # rows left the batch mid-way: the cache compaction is right


def test_greedy_is_argmax_and_identical_across_samples():
    eng = engine("qwen2")
    samples = eng.generate(PROMPTS, 3, SamplingParams(max_new_tokens=8, temperature=0.0, seed=0))
    for i in range(len(PROMPTS)):
        group = samples[3 * i : 3 * i + 3]
        assert group[0].response_ids == group[1].response_ids == group[2].response_ids
        logits = teacher_forced_logits(eng.model, PROMPTS[i], group[0].response_ids)
        assert group[0].response_ids == logits.argmax(-1).tolist()
    assert_logprobs_exact(eng, PROMPTS, samples)  # T = 0 reads as T = 1 with top-k 1: raw log-probs


def test_top_k_restricts_tokens_and_top_k_one_is_greedy():
    eng = engine("mixtral")
    samples = eng.generate(PROMPTS, 4, SamplingParams(max_new_tokens=8, top_k=3, seed=2))
    for s in samples:
        logits = teacher_forced_logits(eng.model, PROMPTS[s.prompt_index], s.response_ids)
        top3 = logits.topk(3, dim=-1).indices
        assert all(tok in row for tok, row in zip(s.response_ids, top3.tolist()))
    one = eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, top_k=1, seed=2))
    greedy = eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert [s.response_ids for s in one] == [s.response_ids for s in greedy]


def test_logprob_modes_after_temperature_and_sampling_distribution():
    config = tiny_config("qwen3")
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, seed=9)
    raw = HFRolloutEngine(config, init_seed=0, logprob_mode="raw").generate(PROMPTS, 2, params)
    scaled_engine = HFRolloutEngine(config, init_seed=0)  # the default: the distribution sampled from
    scaled = scaled_engine.generate(PROMPTS, 2, params)
    sampling_engine = HFRolloutEngine(config, init_seed=0, logprob_mode="sampling")
    drawn = sampling_engine.generate(PROMPTS, 2, params)
    assert [s.response_ids for s in raw] == [s.response_ids for s in scaled] == [s.response_ids for s in drawn]
    assert_logprobs_exact(scaled_engine, PROMPTS, scaled, temperature=0.7, mode="temperature")
    with pytest.raises(AssertionError):  # the modes really differ at T != 1
        assert_logprobs_exact(scaled_engine, PROMPTS, raw, temperature=0.7, mode="temperature")
    for s in drawn:
        logits = teacher_forced_logits(sampling_engine.model, PROMPTS[s.prompt_index], s.response_ids) / 0.7
        kth = logits.topk(5, dim=-1).values[:, -1:]
        filtered = logits.masked_fill(logits < kth, float("-inf"))
        expected = filtered.log_softmax(-1).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=FP32_ATOL, rtol=0)


def test_chunking_by_max_batch_rows_keeps_order_and_exactness():
    config = tiny_config("llama")
    eng = HFRolloutEngine(config, init_seed=0, max_batch_rows=3)  # one prompt (2 rows) per chunk
    samples = eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=5, seed=1))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert_logprobs_exact(eng, PROMPTS, samples)


def test_a_sample_does_not_depend_on_its_batch_chunk_or_caller():
    """Per-sample seeds: the same response for (seed, global prompt index, sample index) whether drawn in
    one batch, in chunks of one prompt, or by a second caller holding only the last prompts (a DP rank,
    ``prompt_offset``); another seed gives other responses."""
    config = tiny_config("qwen3_moe")
    whole = HFRolloutEngine(config, init_seed=0).generate(PROMPTS, 3, SamplingParams(max_new_tokens=8, seed=4))
    chunked = HFRolloutEngine(config, init_seed=0, max_batch_rows=3)
    assert [s.response_ids for s in chunked.generate(PROMPTS, 3, SamplingParams(max_new_tokens=8, seed=4))] == \
        [s.response_ids for s in whole]
    tail = chunked.generate(PROMPTS[1:], 3, SamplingParams(max_new_tokens=8, seed=4, prompt_offset=1))
    assert [s.response_ids for s in tail] == [s.response_ids for s in whole[3:]]
    other = chunked.generate(PROMPTS, 3, SamplingParams(max_new_tokens=8, seed=5))
    assert [s.response_ids for s in other] != [s.response_ids for s in whole]


def test_request_validation_names_the_field():
    eng = engine("qwen3")
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(PROMPTS, 1, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        eng.generate(PROMPTS, 1, SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        eng.generate([[1], []], 1, SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\].*outside"):
        eng.generate([[VOCAB]], 1, SamplingParams())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.generate([[1]], 1, SamplingParams(max_new_tokens=200))
    with pytest.raises(ValueError, match="samples_per_prompt"):
        eng.generate([[1]], 0, SamplingParams())


# ---------------------------------------------------------------------------------------------- construction


def test_build_from_local_directory_and_from_model(tmp_path):
    config = tiny_config("qwen3_moe")
    reference = engine("qwen3_moe")
    reference.model.save_pretrained(tmp_path)
    from_dir = HFRolloutEngine(str(tmp_path))
    from_model = HFRolloutEngine(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    params = SamplingParams(max_new_tokens=6, seed=8)
    expected = [s.response_ids for s in reference.generate(PROMPTS, 2, params)]
    assert [s.response_ids for s in from_dir.generate(PROMPTS, 2, params)] == expected
    assert [s.response_ids for s in from_model.generate(PROMPTS, 2, params)] == expected
    assert from_dir.model.config.model_type == config.model_type


def test_unsupported_model_type_and_missing_directory():
    with pytest.raises(ValueError, match="gpt2"):
        HFRolloutEngine(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        HFRolloutEngine("/nonexistent/model/dir")


# ---------------------------------------------------------------------------------------------- update_weights


def saved_checkpoint(family: str, seed: int, directory) -> tuple[dict[str, torch.Tensor], transformers.PreTrainedModel]:
    """A model with other weights, written by save_pretrained and read back with safetensors."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    model.save_pretrained(directory)
    return safetensors.torch.load_file(os.path.join(directory, "model.safetensors")), model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "llama"])
def test_update_weights_round_trip_from_save_pretrained(family, tmp_path):
    state, source = saved_checkpoint(family, seed=123, directory=tmp_path)
    eng = HFRolloutEngine(tiny_config(family), init_seed=0)
    assert set(eng.checkpoint_weight_names()) <= set(state)  # checkpoint names, not in-memory ones
    items = sorted(state.items())
    buckets = [items[i : i + 7] for i in range(0, len(items), 7)]
    for i, bucket in enumerate(buckets):
        eng.update_weights(iter(bucket), final=i == len(buckets) - 1)
    assert eng.weight_version == 1
    for name, param in source.named_parameters():
        assert torch.equal(eng.model.get_parameter(name), param), name
    reference = HFRolloutEngine(source)
    params = SamplingParams(max_new_tokens=6, seed=21, return_routed_experts=True)
    got, expected = eng.generate(PROMPTS, 2, params), reference.generate(PROMPTS, 2, params)
    assert [(s.response_ids, s.logprobs) for s in got] == [(s.response_ids, s.logprobs) for s in expected]


def test_update_weights_accepts_fused_in_memory_names():
    source = HFRolloutEngine(tiny_config("qwen3_moe"), init_seed=5).model
    eng = HFRolloutEngine(tiny_config("qwen3_moe"), init_seed=0)
    eng.update_weights(source.named_parameters(), final=True)
    assert eng.weight_version == 1
    for name, param in source.named_parameters():
        assert torch.equal(eng.model.get_parameter(name), param), name


def test_update_weights_errors_name_the_tensor(tmp_path):
    state, _ = saved_checkpoint("mixtral", seed=1, directory=tmp_path)
    eng = HFRolloutEngine(tiny_config("mixtral"), init_seed=0)
    before = {n: p.clone() for n, p in eng.model.named_parameters()}
    with pytest.raises(KeyError, match="model.layers.0.mlp.experts.9.w1.weight"):
        eng.update_weights([("model.layers.0.mlp.experts.9.w1.weight", torch.zeros(16, 32))], final=False)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    with pytest.raises(ValueError, match=rf"{name}.*\(16, 32\).*\(32, 16\)"):
        bucket = [("model.norm.weight", state["model.norm.weight"]), (name, torch.zeros(16, 32))]
        eng.update_weights(bucket, final=False)
    # a bad bucket changes nothing, not even its valid tensors
    assert all(torch.equal(p, before[n]) for n, p in eng.model.named_parameters())
    missing = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    with pytest.raises(ValueError, match=rf"1 of {len(state)} weights were not sent.*{missing}"):
        eng.update_weights([(k, v) for k, v in state.items() if k != missing], final=True)
    assert eng.weight_version == 0
    eng.update_weights(state.items(), final=True)  # the next sync starts afresh and succeeds
    assert eng.weight_version == 1


# ---------------------------------------------------------------------------------------------- sampling maths


def test_inverse_cdf_sampler_matches_the_distribution_and_skips_zero_mass():
    from gspo_megatron.rollout.sampling import sample_inverse_cdf

    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    rows = 40_000
    logits = probs.log().expand(rows, -1)  # log(0) = -inf: a filtered token
    draws = sample_inverse_cdf(logits, torch.rand(rows, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[4] == 0
    sigma = (rows * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - rows * probs.double()).abs() <= 4 * sigma + 1e-9).all(), counts


def test_top_p_keeps_the_smallest_set_reaching_p_and_top_k_keeps_ties():
    from gspo_megatron.rollout.sampling import apply_top_k, apply_top_p

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda out: (out > float("-inf")).squeeze(0).tolist()  # noqa: E731
    assert kept(apply_top_p(logits, 0.79)) == [True, True, False, False]
    assert kept(apply_top_p(logits, 0.81)) == [True, True, True, False]
    assert kept(apply_top_p(logits, 1e-6)) == [True, False, False, False]
    assert kept(apply_top_k(torch.tensor([[3.0, 1.0, 3.0, 2.0]]), 1)) == [True, False, True, False]
    assert kept(apply_top_k(torch.tensor([[3.0, 1.0, 0.0, 2.0]]), 2)) == [True, False, False, True]


def test_greedy_log_probs_per_mode():
    from gspo_megatron.rollout.sampling import sample_next_tokens

    logits = torch.tensor([[0.0, 2.0, 1.0]])
    kwargs = dict(temperature=0.0, top_k=0, top_p=1.0, uniforms=torch.rand(1, dtype=torch.float64))
    tokens, raw = sample_next_tokens(logits, logprob_mode="raw", **kwargs)
    assert tokens.tolist() == [1]
    torch.testing.assert_close(raw, logits.log_softmax(-1)[:, 1])
    # greedy is temperature 1 with top-k 1 (SGLang's reading): "temperature" reports the raw log-prob too
    torch.testing.assert_close(sample_next_tokens(logits, logprob_mode="temperature", **kwargs)[1], raw)
    assert sample_next_tokens(logits, logprob_mode="sampling", **kwargs)[1].tolist() == [0.0]
