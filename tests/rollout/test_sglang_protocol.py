"""Request building and response parsing for SGLang's /generate, against SGLang's documented shapes.

Where each expected shape comes from is cited on the test. No server runs here.
"""
import base64
import copy
import struct

import pytest
import torch

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.sglang.config import SGLangLaunchConfig
from gspo_megatron.rollout.sglang.protocol import (RoutedExpertsLayout, SGLangProtocolError, build_generate_request, decode_routed_experts,
                                                   launch_command, launch_env, parse_finish_reason,
                                                   parse_generate_response, parse_output, parse_server_info,
                                                   sample_seed, sampling_params_body)

# The /generate answer printed in SGLang's docs/basic_usage/native_api (rendered notebook, "Generate (text
# generation model)"), trimmed to 4 tokens, plus the log-probs a request with return_logprob adds:
# meta_info.output_token_logprobs = [[logprob, token_id, text-or-null], ...] (tokenizer_manager
# convert_logprob_style / detokenize_logprob_tokens with return_text_in_logprobs=False).
DOC_OUTPUT = {
    "text": " Paris. It",
    "output_ids": [12095, 13, 1084, 374],
    "meta_info": {
        "id": "be6daa5d895e403eb6334fb3a116b933", "finish_reason": {"type": "length", "length": 4},
        "prompt_tokens": 5, "weight_version": "default", "total_retractions": 0, "completion_tokens": 4,
        "cached_tokens": 2, "cached_tokens_details": None, "dp_rank": None, "e2e_latency": 0.0469,
        "output_token_logprobs": [[-0.58, 12095, None], [-0.11, 13, None], [-1.5, 1084, None], [-0.02, 374, None]],
    },
}


def test_sampling_params_body_maps_disabled_top_k_and_sends_every_sampling_key():
    # sampling_params.py: top_k = -1 disables; verify() rejects 0. Servers fill missing keys from the model's
    # generation_config.json (--sampling-defaults model, docs/basic_usage/sampling_params.md).
    body = sampling_params_body(SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=0,
                                               stop_token_ids=[2, 5]), n=4, sampling_seed=None)
    assert body["top_k"] == -1
    assert body["n"] == 4 and body["max_new_tokens"] == 7 and body["stop_token_ids"] == [2, 5]
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["min_p"] == 0.0
    # SGLang's ignore_eos also switches stop_token_ids off (Req._check_token_based_finish): never sent true
    assert body["ignore_eos"] is False
    assert "sampling_seed" not in body
    body = sampling_params_body(SamplingParams(top_k=20), n=1, sampling_seed=11)
    assert body["top_k"] == 20 and body["ignore_eos"] is False and body["sampling_seed"] == 11
    assert "stop_token_ids" not in body


def test_unseeded_request_uses_n_and_a_list_of_lists():
    # io_struct.GenerateReqInput: input_ids List[List[int]] for a batch; n in sampling_params.
    prompts = [[1, 2, 3], [4, 5], [6]]
    req = build_generate_request(prompts, [2], 3, SamplingParams(), seeded=False)
    assert req.body["input_ids"] == [[6]]  # a batch of one is still a list of lists
    assert req.body["sampling_params"]["n"] == 3
    assert req.body["return_logprob"] is True and req.body["logprob_start_len"] == -1
    assert "return_routed_experts" not in req.body
    assert req.expansion == "n" and req.prompt_indices == (2,)
    req = build_generate_request(prompts, [0, 1], 2, SamplingParams(return_routed_experts=True),
                                 seeded=False)
    assert req.body["input_ids"] == [[1, 2, 3], [4, 5]] and req.body["return_routed_experts"] is True


def test_seeded_request_repeats_prompts_with_one_distinct_seed_per_sample():
    prompts = [[1, 2], [3, 4]]
    req = build_generate_request(prompts, [0, 1], 3, SamplingParams(seed=5), seeded=True)
    assert req.body["input_ids"] == [[1, 2]] * 3 + [[3, 4]] * 3  # prompt-major
    sps = req.body["sampling_params"]
    assert len(sps) == 6 and all(sp["n"] == 1 for sp in sps)
    seeds = [sp["sampling_seed"] for sp in sps]
    assert len(set(seeds)) == 6 and all(0 <= s < 2**63 for s in seeds)
    again = build_generate_request(prompts, [0, 1], 3, SamplingParams(seed=5), seeded=True)
    assert [sp["sampling_seed"] for sp in again.body["sampling_params"]] == seeds
    other = build_generate_request(prompts, [0, 1], 3, SamplingParams(seed=6), seeded=True)
    assert not set(seeds) & {sp["sampling_seed"] for sp in other.body["sampling_params"]}
    assert sample_seed(5, 0, 1) == seeds[1]


def test_parse_output_reads_the_documented_shape():
    sample = parse_output(DOC_OUTPUT, prompt_index=3, prompt_len=5, where="t", routed_experts_layout=None)
    assert sample.prompt_index == 3
    assert sample.response_ids == [12095, 13, 1084, 374]
    assert sample.logprobs == pytest.approx([-0.58, -0.11, -1.5, -0.02])
    assert sample.finish_reason == "length" and sample.routed_experts is None


def test_stop_token_is_kept_even_when_output_ids_trim_it():
    # schedule_batch FINISH_MATCHED_TOKEN.to_json -> {"type": "stop", "matched": id}; the detokenizer's
    # trim_matched_stop may drop the stop id from output_ids, the log-prob triples keep it.
    out = copy.deepcopy(DOC_OUTPUT)
    out["meta_info"]["finish_reason"] = {"type": "stop", "matched": 374}
    out["output_ids"] = [12095, 13, 1084]
    sample = parse_output(out, prompt_index=0, prompt_len=5, where="t", routed_experts_layout=None)
    assert sample.finish_reason == "stop" and sample.response_ids[-1] == 374 and len(sample.logprobs) == 4


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o["meta_info"].pop("output_token_logprobs"), "return_logprob"),
    (lambda o: o["meta_info"].update(finish_reason="stop"), "finish_reason"),
    (lambda o: o["meta_info"].update(completion_tokens=9), "completion_tokens"),
    (lambda o: o["meta_info"].update(prompt_tokens=6), "prompt_tokens"),
    (lambda o: o.update(output_ids=[1, 2, 3, 4]), "disagree"),
    (lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(1, [0.7, 13, None]), "logprob <= 0"),
    (lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(1, [None, 13, None]), "logprob <= 0"),
])
def test_parse_output_rejects_malformed_outputs(mutate, message):
    out = copy.deepcopy(DOC_OUTPUT)
    mutate(out)
    with pytest.raises(SGLangProtocolError, match=message):
        parse_output(out, prompt_index=0, prompt_len=5, where="t", routed_experts_layout=None)


def test_finish_reasons():
    assert parse_finish_reason({"type": "abort", "message": "x", "status_code": 400, "err_type": None}, "w") == ("abort", None)
    assert parse_finish_reason({"type": "stop", "matched": "</s>"}, "w") == ("stop", None)  # a stop string
    assert parse_finish_reason({"type": "stop", "matched": 7}, "w") == ("stop", 7)
    with pytest.raises(SGLangProtocolError):
        parse_finish_reason(None, "w")


def _routed(rows, layers, top_k):
    values = [(p * 100 + layer * 10 + k) for p in range(rows) for layer in range(layers) for k in range(top_k)]
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def test_routed_experts_are_decoded_and_cut_to_the_response_positions():
    # tokenizer_manager: meta_info["routed_experts"] = b64encode(int32 array .tobytes()), rows = positions fed
    # through the model = prompt + response - 1 (routed_experts_capturer buffers [tokens, layers, top_k]).
    out = copy.deepcopy(DOC_OUTPUT)
    out["meta_info"]["routed_experts"] = _routed(5 + 4 - 1, 3, 2)
    sample = parse_output(out, prompt_index=0, prompt_len=5, where="t", routed_experts_layout=RoutedExpertsLayout(3, 2, (0, 1, 2)))
    assert sample.routed_experts.shape == (4, 3, 2) and sample.routed_experts.dtype == torch.int32
    # response token t was produced at input position prompt_len - 1 + t
    assert sample.routed_experts[0, 0, 0].item() == 400 and sample.routed_experts[3, 2, 1].item() == 721
    # the prompt positions 0 .. 3 (R3 replays them too); together every fed position, in order
    assert sample.prompt_routed_experts.shape == (4, 3, 2) and sample.prompt_routed_experts[3, 1, 0].item() == 310
    assert sample.all_routed_experts()[:, 0, 0].tolist() == [p * 100 for p in range(8)]
    with pytest.raises(SGLangProtocolError, match="routed_experts_layers"):
        decode_routed_experts(_routed(8, 3, 2), rows=8, layers=4, top_k=2, where="t")
    out["meta_info"].pop("routed_experts")
    with pytest.raises(SGLangProtocolError, match="enable-return-routed-experts"):
        parse_output(out, prompt_index=0, prompt_len=5, where="t", routed_experts_layout=RoutedExpertsLayout(3, 2, (0, 1, 2)))


def test_routed_experts_keep_the_moe_layers_of_a_model_with_dense_first_layers():
    # SGLang 0.5.23 captures by global layer (srt/state_capturer/routed_experts.py: [tokens,
    # num_hidden_layers, top_k]); a model with first_k_dense_replace=1 (GLM-4.5, DeepSeek-V3) has no router on
    # layer 0. The trainer's per-sample layer j is MoE layer j = global layer j + 1.
    out = copy.deepcopy(DOC_OUTPUT)
    out["meta_info"]["routed_experts"] = _routed(5 + 4 - 1, 4, 2)
    layout = RoutedExpertsLayout.from_first_dense(4, 2, first_dense_layers=1)
    assert layout.moe_layers == (1, 2, 3)
    sample = parse_output(out, prompt_index=0, prompt_len=5, where="t", routed_experts_layout=layout)
    assert sample.routed_experts.shape == (4, 3, 2) and sample.prompt_routed_experts.shape == (4, 3, 2)
    # value p*100 + layer*10 + k: MoE layer 0 of response token 0 (position 4) is global layer 1
    assert sample.routed_experts[0, 0].tolist() == [410, 411] and sample.routed_experts[3, 2].tolist() == [730, 731]
    assert sample.prompt_routed_experts[0, 1].tolist() == [20, 21]
    with pytest.raises(ValueError, match="moe_layers"):
        RoutedExpertsLayout(4, 2, (0, 4))


def _out(prompt_len, first_token):
    out = copy.deepcopy(DOC_OUTPUT)
    out["meta_info"]["prompt_tokens"] = prompt_len
    out["output_ids"][0] = first_token
    out["meta_info"]["output_token_logprobs"][0][1] = first_token
    return out


def test_batched_response_is_grouped_prompt_major():
    # tokenizer_manager._handle_batch_request: for i in prompts, for j in range(n) -> outputs in that order.
    prompts = [[9] * 2, [9] * 3]
    req = build_generate_request(prompts, [0, 1], 2, SamplingParams(), seeded=False)
    response = [_out(2, 100), _out(2, 101), _out(3, 102), _out(3, 103)]
    samples = parse_generate_response(response, req, prompts, routed_experts_layout=None, where="t")
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    assert [s.response_ids[0] for s in samples] == [100, 101, 102, 103]
    # sample-major order would pair outputs with the wrong prompts: caught by prompt_tokens
    with pytest.raises(SGLangProtocolError, match="prompt_tokens"):
        parse_generate_response([response[0], response[2], response[1], response[3]], req, prompts,
                                routed_experts_layout=None, where="t")
    with pytest.raises(SGLangProtocolError, match="list of 4"):
        parse_generate_response(response[:3], req, prompts, routed_experts_layout=None, where="t")


def test_server_info_reads_server_args_and_defaults_missing_flags():
    # http_server.get_server_info: {**dataclasses.asdict(server_args), **scheduler_info, "version": ...}
    info = parse_server_info({"tp_size": 4, "dp_size": 2, "enable_memory_saver": True,
                              "enable_deterministic_inference": True, "skip_tokenizer_init": True,
                              "version": "0.5.3rc2", "model_path": "/m"}, "w")
    assert (info.tp_size, info.dp_size, info.memory_saver, info.deterministic, info.routed_experts) == (4, 2, True, True, False)
    with pytest.raises(SGLangProtocolError):
        parse_server_info({"detail": "Not Found"}, "w")


def test_launch_command_uses_documented_flags():
    # docs/advanced_features/server_arguments.md and sglang_for_rl.md
    cfg = SGLangLaunchConfig(model_path="/ckpt", tp_size=2, base_gpu_id=4, base_port=31000, load_format="dummy",
                             enable_return_routed_experts=True, enable_deterministic_inference=True,
                             return_original_logprob=True, extra_args=["--context-length", "4096"])
    cmd = launch_command(cfg, server_index=1, python="/py")
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::1], cmd[4::1]))
    assert flags["--model-path"] == "/ckpt" and flags["--port"] == "31001" and flags["--tp-size"] == "2"
    assert flags["--base-gpu-id"] == "6"  # server 1 of this node starts after server 0's two GPUs
    assert flags["--load-format"] == "dummy" and flags["--mem-fraction-static"] == "0.8"
    for flag in ("--enable-memory-saver", "--skip-tokenizer-init", "--enable-return-routed-experts",
                 "--enable-deterministic-inference"):
        assert flag in cmd
    assert cmd[-2:] == ["--context-length", "4096"]
    assert launch_env(cfg) == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    assert "--enable-memory-saver" not in launch_command(SGLangLaunchConfig(model_path="/c", enable_memory_saver=False), 0, "p")
