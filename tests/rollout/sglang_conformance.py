"""The calls the conformance test sends to the stand-in and to a real SGLang server, and how answers
compare (tests/rollout/test_sglang_cpu_server.py). Only endpoints a CPU server serves are here; memory
release, the memory saver, routed experts and the NCCL group are covered by the stand-in alone
(docs/rollout.md, "The stand-in and the real server").
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.sglang.protocol import build_generate_request
from gspo_megatron.rollout.sglang.weight_sync import serialize_named_tensors, update_from_tensor_body

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def raw_call(url: str, method: str, path: str, body: Any) -> tuple[int, Any]:
    """(HTTP status, parsed JSON or text) of one call; no retries, errors are answers too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw, kind = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, raw, kind = err.code, err.read(), err.headers.get("Content-Type", "")
    text = raw.decode(errors="replace")
    return status, json.loads(text) if "json" in kind and text else text


# calls whose answers must be equal, text included (the stand-in words its refusals like SGLang)
SAME_TEXT = ("generate with a prompt beyond the context", "generate with max_new_tokens beyond the context")


def conformance_calls(context_length: int) -> list[tuple[str, str, str, Any]]:
    """(label, method, path, body) in order; the session calls depend on their order. ``context_length``:
    the real server's --context-length (the stand-in is given the same)."""
    params = SamplingParams(max_new_tokens=4, stop_token_ids=[3, 4, 5])
    by_n = build_generate_request(PROMPTS, [0, 1], 2, params, seeded=False).body
    repeated = build_generate_request(PROMPTS, [0, 1], 2, SamplingParams(max_new_tokens=4, seed=3), seeded=True).body
    bad_top_k = {**by_n, "sampling_params": {**by_n["sampling_params"], "top_k": 0}}
    long_prompt = build_generate_request([[7] * (context_length + 10)], [0], 1, params, seeded=False).body
    long_answer = build_generate_request([[7] * (context_length - 2)], [0], 1, params, seeded=False).body
    empty_tensors = update_from_tensor_body([serialize_named_tensors([])], flush_cache=False, weight_version=None)
    return [
        ("health", "GET", "/health", None),
        ("health_generate", "GET", "/health_generate", None),
        ("server_info", "GET", "/server_info", None),
        ("get_server_info", "GET", "/get_server_info", None),
        ("get_model_info", "GET", "/get_model_info", None),
        ("generate with n", "POST", "/generate", by_n),
        ("generate repeated, one sampling_params each", "POST", "/generate", repeated),
        ("generate with top_k 0", "POST", "/generate", bad_top_k),
        ("generate without input_ids", "POST", "/generate", {**by_n, "input_ids": []}),
        (SAME_TEXT[0], "POST", "/generate", long_prompt),
        (SAME_TEXT[1], "POST", "/generate", long_answer),
        ("flush_cache", "POST", "/flush_cache", None),
        ("tensor update outside a session", "POST", "/update_weights_from_tensor", empty_tensors),
        ("begin_weight_update", "POST", "/begin_weight_update", {}),
        ("end_weight_update", "POST", "/end_weight_update", {}),
        ("disk update from a missing folder", "POST", "/update_weights_from_disk",
         {"model_path": "/nonexistent/gspo-conformance", "load_format": "auto"}),
        ("unknown endpoint", "GET", "/no_such_endpoint", None),
    ]


def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def assert_same_shape(fake: Any, real: Any, where: str, *, top: bool = True) -> None:
    """Every field of the stand-in's answer exists in the real one with the same JSON type, recursively
    (numbers match numbers). A top-level list (the outputs of a /generate) has the same length in both;
    inner ones (sampled tokens) compare element by element up to the shorter one."""
    assert _kind(fake) == _kind(real), f"{where}: stand-in gives {_kind(fake)} {fake!r:.200}, real {_kind(real)} {real!r:.200}"
    if isinstance(fake, dict):
        if "type" in fake and "type" in real and fake["type"] != real["type"]:
            # a sampled outcome (finish_reason "stop" with "matched" vs "length" with "length"): each type's
            # fields are compared wherever both servers sampled that type
            return
        missing = sorted(set(fake) - set(real))
        assert not missing, f"{where}: the stand-in answers fields the real server does not: {missing}"
        for key in fake:
            assert_same_shape(fake[key], real[key], f"{where}.{key}", top=False)
    elif isinstance(fake, list):
        assert not top or len(fake) == len(real), f"{where}: stand-in list of {len(fake)}, real {len(real)}"
        for i, (a, b) in enumerate(zip(fake, real)):
            assert_same_shape(a, b, f"{where}[{i}]", top=False)


__all__ = ["SAME_TEXT", "assert_same_shape", "conformance_calls", "raw_call"]
