"""Pure functions for SGLang's native HTTP API: request bodies, response parsing, launch commands.

Nothing here does I/O, so every function is unit-tested against payload shapes taken from SGLang's
sources and docs. Where a shape comes from is cited next to the code that builds or reads it; the
file versions read are listed in docs/rollout.md ("Sources read").
"""
from __future__ import annotations

import base64
import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch

from gspo_megatron.rollout.base import FinishReason, Sample, SamplingParams
from gspo_megatron.rollout.sampling import sample_seed  # re-exported: shared with the transformers engine
from gspo_megatron.rollout.sglang.config import CPU_FLAGS, SGLangLaunchConfig


class SGLangProtocolError(ValueError):
    """A response from a server does not have the shape SGLang documents."""


# ----------------------------------------------------------------------------------------------------
# /generate request
# ----------------------------------------------------------------------------------------------------

def sampling_params_body(params: SamplingParams, *, n: int, sampling_seed: int | None) -> dict[str, Any]:
    """One ``sampling_params`` object of a /generate request.

    Keys from python/sglang/srt/sampling/sampling_params.py (class SamplingParams). Every sampling key is
    sent explicitly because servers started with ``--sampling-defaults model`` (the default, per
    docs/basic_usage/sampling_params.md) otherwise fill gaps from the model's generation_config.json.
    ``top_k = -1`` disables top-k in SGLang; ours uses 0 for that.

    ``ignore_eos`` is always false: in SGLang (0.5.6.post2 to 0.5.23) ``Req._check_token_based_finish``
    returns before it reads ``stop_token_ids`` when ``ignore_eos`` is set, so every sample would run to
    ``max_new_tokens``. The model's own EOS ids (config.json / generation_config.json) therefore stop a
    response as well as ``stop_token_ids`` do.
    """
    body: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": 0.0,
        "n": n,
        "ignore_eos": False,
        # Token ids only in and out; text skipping rules would otherwise decide nothing here.
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if sampling_seed is not None:
        body["sampling_seed"] = sampling_seed
    return body


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One /generate call covering prompts ``prompt_indices`` (indices into the caller's prompt list)."""

    prompt_indices: tuple[int, ...]
    samples_per_prompt: int
    body: dict[str, Any]
    # 'n': SGLang expands each prompt G times (outputs prompt-major); 'repeat': we sent each prompt G times.
    expansion: str


def build_generate_request(prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                           samples_per_prompt: int, params: SamplingParams, *, seeded: bool) -> GenerateRequest:
    """The body of one batched /generate call (io_struct.py GenerateReqInput, docs sampling_params.md).

    ``input_ids`` is always a list of lists so a batch of one is still a batch (GenerateReqInput
    ._determine_batch_size). Without seeds we pass ``n = G``: tokenizer_manager._handle_batch_request
    sends, for i in prompts, for j in range(n), one request each and gathers the outputs in that
    order, i.e. prompt-major, which is our group order. With seeds (or a server in deterministic mode,
    whose seedless requests all use seed 42) each sample needs its own seed, so prompts are repeated
    G times explicitly with one sampling_params object per copy, n = 1.
    """
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    chosen = [list(prompts[i]) for i in prompt_indices]
    body: dict[str, Any] = {"return_logprob": True, "logprob_start_len": -1}
    if params.return_routed_experts:
        body["return_routed_experts"] = True
    if not seeded:
        body["input_ids"] = chosen
        body["sampling_params"] = sampling_params_body(
            params, n=samples_per_prompt, sampling_seed=None)
        expansion = "n"
    else:
        base_seed = params.seed if params.seed is not None else 0
        body["input_ids"] = [ids for ids in chosen for _ in range(samples_per_prompt)]
        body["sampling_params"] = [
            sampling_params_body(params, n=1,
                                 sampling_seed=sample_seed(base_seed, params.prompt_index(i), j))
            for i in prompt_indices for j in range(samples_per_prompt)
        ]
        expansion = "repeat"
    return GenerateRequest(tuple(prompt_indices), samples_per_prompt, body, expansion)


# ----------------------------------------------------------------------------------------------------
# /generate response
# ----------------------------------------------------------------------------------------------------

def parse_finish_reason(value: Any, where: str) -> tuple[FinishReason, int | None]:
    """``meta_info.finish_reason`` -> (our reason, matched stop token id or None).

    Shapes from managers/schedule_batch.py FINISH_*.to_json(): {"type": "stop", "matched": int|str},
    {"type": "length", "length": int}, {"type": "abort", "message": str, ...}.
    """
    if not isinstance(value, Mapping) or value.get("type") not in ("stop", "length", "abort"):
        raise SGLangProtocolError(f"{where}: finish_reason must be {{'type': stop|length|abort, ...}}, got {value!r}")
    matched = value.get("matched")
    return value["type"], matched if isinstance(matched, int) and not isinstance(matched, bool) else None


@dataclasses.dataclass(frozen=True)
class RoutedExpertsLayout:
    """What SGLang's routed experts hold, and which of their layers the trainer replays.

    SGLang 0.5.23 captures routed experts by *global* layer id (srt/state_capturer/routed_experts.py: a
    buffer [tokens, num_hidden_layers, num_experts_per_tok], ``capture(layer_id, ...)`` from each MoE layer);
    the rows of dense layers (DeepSeek-V3's and GLM-4.5's ``first_k_dense_replace`` first layers) are never
    written and hold zeros. The trainer's per-sample layout is by MoE-layer position
    ([R, num_moe_layers, top_k], megatron/routing.py), so the MoE layers' columns are selected.

    num_layers: the capture's layer axis, the model's ``num_hidden_layers``;
    top_k:      ``num_experts_per_tok``;
    moe_layers: global indices (0-based, ascending) of the MoE layers: the trainer's MoE layer j is
                SGLang's layer ``moe_layers[j]``.
    """

    num_layers: int
    top_k: int
    moe_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.top_k < 1:
            raise ValueError(f"RoutedExpertsLayout: num_layers={self.num_layers} and top_k={self.top_k} must be >= 1")
        if not self.moe_layers or list(self.moe_layers) != sorted(set(self.moe_layers)) or not (
                0 <= self.moe_layers[0] and self.moe_layers[-1] < self.num_layers):
            raise ValueError(f"RoutedExpertsLayout: moe_layers {list(self.moe_layers)} must be distinct ascending "
                             f"layer indices in [0, {self.num_layers})")

    @classmethod
    def from_first_dense(cls, num_layers: int, top_k: int, first_dense_layers: int) -> "RoutedExpertsLayout":
        """Every layer from ``first_dense_layers`` on is MoE (the rule of every family this project trains:
        ModelConfig.is_moe_layer)."""
        return cls(num_layers, top_k, tuple(range(first_dense_layers, num_layers)))


def decode_routed_experts(encoded: str, *, rows: int, layers: int, top_k: int, where: str) -> torch.Tensor:
    """``meta_info.routed_experts`` -> int32 tensor [rows, layers, top_k], every layer of the model.

    SGLang sends base64 of a C-order int32 array (tokenizer_manager: pybase64.b64encode(t.numpy().tobytes()))
    with one row per position fed through the model, i.e. prompt + response - 1 rows, and one column per
    *global* layer (``RoutedExpertsLayout``).
    """
    raw = base64.b64decode(encoded, validate=True)
    expected = rows * layers * top_k * 4
    if len(raw) != expected:
        raise SGLangProtocolError(
            f"{where}: routed_experts has {len(raw)} bytes, expected {rows} rows x {layers} layers x "
            f"{top_k} experts x 4 bytes = {expected}; check routed_experts_layers / routed_experts_top_k")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(rows, layers, top_k).clone()


def moe_layer_columns(full: torch.Tensor, layout: RoutedExpertsLayout) -> torch.Tensor:
    """[rows, num_layers, top_k] (global layers, SGLang's capture) -> [rows, num_moe_layers, top_k]: the
    MoE layers' columns in model order, the trainer's per-sample layout."""
    if full.dim() != 3 or full.shape[1:] != (layout.num_layers, layout.top_k):
        raise ValueError(f"moe_layer_columns: expected [rows, {layout.num_layers}, {layout.top_k}], got {tuple(full.shape)}")
    return full[:, list(layout.moe_layers)].contiguous()


def parse_output(output: Any, *, prompt_index: int, prompt_len: int, where: str,
                 routed_experts_layout: RoutedExpertsLayout | None) -> Sample:
    """One element of the /generate response list -> Sample.

    Element shape (tokenizer_manager._handle_batch_output): {"output_ids": [int], "meta_info": {...},
    "text": str (absent with --skip-tokenizer-init)}. meta_info carries "finish_reason", "prompt_tokens",
    "completion_tokens" and, with return_logprob, "output_token_logprobs" = [[logprob, token_id,
    text|null], ...], one triple per sampled token including a matched stop token.

    The response ids are read from the log-prob triples: ``output_ids`` may have the matched stop token
    trimmed (detokenizer_manager.trim_matched_stop acts on decode ids), our contract keeps it.
    """
    if not isinstance(output, Mapping) or not isinstance(output.get("meta_info"), Mapping):
        raise SGLangProtocolError(f"{where}: expected {{'output_ids': [...], 'meta_info': {{...}}}}, got {type(output).__name__}")
    meta = output["meta_info"]
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise SGLangProtocolError(f"{where}: meta_info.output_token_logprobs missing; the request must set return_logprob")
    ids: list[int] = []
    logprobs: list[float] = []
    for k, triple in enumerate(triples):
        if (not isinstance(triple, (list, tuple)) or len(triple) < 2 or not isinstance(triple[1], int)
                or not isinstance(triple[0], (int, float)) or not math.isfinite(triple[0]) or triple[0] > 1e-4):
            raise SGLangProtocolError(f"{where}: output_token_logprobs[{k}] must be [logprob <= 0, token_id, text], got {triple!r}")
        logprobs.append(float(triple[0]))
        ids.append(triple[1])
    reason, matched = parse_finish_reason(meta.get("finish_reason"), f"{where}.meta_info")
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids) != ids and not (matched is not None and ids and ids[-1] == matched
                                                                  and list(output_ids) == ids[:-1]):
        raise SGLangProtocolError(f"{where}: output_ids {list(output_ids)[:8]}... disagree with the log-prob token ids {ids[:8]}...")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(ids):
        raise SGLangProtocolError(f"{where}: completion_tokens={completion} but {len(ids)} log-probs")
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None and prompt_tokens != prompt_len:
        # Catches a grouping mistake: the output does not belong to the prompt we think it does.
        raise SGLangProtocolError(f"{where}: prompt_tokens={prompt_tokens} but prompt {prompt_index} has {prompt_len} tokens")
    routed = prompt_routed = None
    if routed_experts_layout is not None:
        encoded = meta.get("routed_experts")
        if not isinstance(encoded, str):
            raise SGLangProtocolError(f"{where}: meta_info.routed_experts missing; start the server with --enable-return-routed-experts")
        layout = routed_experts_layout
        full = decode_routed_experts(encoded, rows=prompt_len + len(ids) - 1, layers=layout.num_layers,
                                     top_k=layout.top_k, where=where)
        full = moe_layer_columns(full, layout)
        # Row p routes input position p; response token t was produced at position prompt_len - 1 + t.
        routed, prompt_routed = full[prompt_len - 1:], full[:prompt_len - 1]
    return Sample(prompt_index=prompt_index, response_ids=ids, logprobs=logprobs,
                  finish_reason=reason, routed_experts=routed, prompt_routed_experts=prompt_routed)


def parse_generate_response(response: Any, request: GenerateRequest, prompts: Sequence[Sequence[int]], *,
                            routed_experts_layout: RoutedExpertsLayout | None, where: str) -> list[Sample]:
    """The JSON list of a batched /generate call -> Samples grouped by prompt, in prompt order."""
    g = request.samples_per_prompt
    expected = len(request.prompt_indices) * g
    if not isinstance(response, list) or len(response) != expected:
        got = len(response) if isinstance(response, list) else type(response).__name__
        raise SGLangProtocolError(f"{where}: expected a list of {expected} outputs ({len(request.prompt_indices)} prompts x {g}), got {got}")
    samples = []
    for k, output in enumerate(response):
        prompt_index = request.prompt_indices[k // g]  # both expansions are prompt-major (see build_generate_request)
        samples.append(parse_output(output, prompt_index=prompt_index, prompt_len=len(prompts[prompt_index]),
                                    where=f"{where}[{k}]", routed_experts_layout=routed_experts_layout))
    return samples


# SGLang 0.5.23 tokenizer_manager._validate_one_request: a prompt of N tokens with N >= the context length,
# or N + max_new_tokens > it, is refused before any work, as HTTP 400 {"error": {"message": ...}}
# (http_server._create_error_response) with one of these two sentences.
CONTEXT_REFUSALS = ("is longer than the model's context length", "exceeds the model's maximum context length")


def context_refusal(body: Any) -> str | None:
    """The server's message when a /generate was refused because a prompt (with its max_new_tokens) does not
    fit the context length (``body``: the 400 answer, decoded); None for any other answer."""
    error = body.get("error") if isinstance(body, Mapping) else None
    message = error.get("message") if isinstance(error, Mapping) else None
    if isinstance(message, str) and any(sentence in message for sentence in CONTEXT_REFUSALS):
        return message
    return None


# ----------------------------------------------------------------------------------------------------
# Server facts
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What the engine needs from /server_info (older: /get_server_info): ServerArgs as a dict."""

    tp_size: int
    dp_size: int
    deterministic: bool
    memory_saver: bool
    routed_experts: bool
    skip_tokenizer_init: bool
    version: str
    base_gpu_id: int = 0  # the server's GPUs are base_gpu_id .. + tp_size * dp_size - 1 of its node

    def gpus(self) -> range:
        return range(self.base_gpu_id, self.base_gpu_id + self.tp_size * self.dp_size)


def parse_server_info(info: Any, where: str) -> ServerInfo:
    """http_server.py get_server_info returns {**dataclasses.asdict(server_args), **scheduler_info,
    "version": ...}; flags missing from older versions read as off."""
    if not isinstance(info, Mapping) or not isinstance(info.get("tp_size"), int):
        raise SGLangProtocolError(f"{where}: expected the server's ServerArgs as a JSON object with 'tp_size'")
    return ServerInfo(
        tp_size=info["tp_size"], dp_size=int(info.get("dp_size", 1)),
        deterministic=bool(info.get("enable_deterministic_inference", False)),
        memory_saver=bool(info.get("enable_memory_saver", False)),
        routed_experts=bool(info.get("enable_return_routed_experts", False)),
        skip_tokenizer_init=bool(info.get("skip_tokenizer_init", False)),
        version=str(info.get("version", "unknown")), base_gpu_id=int(info.get("base_gpu_id", 0)))


# ----------------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------------

def launch_command(cfg: SGLangLaunchConfig, server_index: int, python: str) -> list[str]:
    """``python -m sglang.launch_server`` for server ``server_index`` of this node.

    Flags from docs/advanced_features/server_arguments.md; --enable-memory-saver and the refit endpoints
    from docs/advanced_features/sglang_for_rl.md.
    """
    gpus = cfg.gpus_per_server()
    cmd = [python, "-m", "sglang.launch_server",
           "--model-path", cfg.model_path,
           "--host", cfg.host, "--port", str(cfg.base_port + server_index),
           "--tp-size", str(cfg.tp_size), "--dp-size", str(cfg.dp_size), "--ep-size", str(cfg.ep_size),
           # CPU: SGLang derives the NUMA node to bind threads to from the GPU id (srt/utils/numa_utils.py),
           # and asserts it exists; every CPU server uses node 0, the only one on a laptop.
           "--base-gpu-id", str(0 if cfg.device == "cpu" else cfg.base_gpu_id + server_index * gpus),
           "--mem-fraction-static", str(cfg.mem_fraction_static),
           "--dtype", cfg.dtype, "--load-format", cfg.load_format,
           "--log-level", cfg.log_level]
    if cfg.device == "cpu":
        cmd += CPU_FLAGS
    if cfg.kv_tokens():
        cmd += ["--max-total-tokens", str(cfg.kv_tokens())]
    if cfg.memory_saver():
        cmd.append("--enable-memory-saver")
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if cfg.enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cfg.enable_deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if cfg.random_seed is not None:
        cmd += ["--random-seed", str(cfg.random_seed)]
    return cmd + list(cfg.extra_args)


def launch_env(cfg: SGLangLaunchConfig, device_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Extra environment of a launched server (on top of the trainer's): ``device_env`` (a CPU server's,
    rollout/sglang/cpu.cpu_server_env), then the user's ``launch.env``, which wins."""
    env = {**(device_env or {}), **cfg.env}
    if cfg.return_original_logprob:
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # srt/layers/sampler.py: log-probs before temperature
    return env


__all__ = ["CONTEXT_REFUSALS", "GenerateRequest", "SGLangProtocolError", "ServerInfo", "build_generate_request",
           "context_refusal",
           "RoutedExpertsLayout", "decode_routed_experts", "moe_layer_columns", "launch_command", "launch_env", "parse_finish_reason",
           "parse_generate_response", "parse_output", "parse_server_info", "sample_seed",
           "sampling_params_body"]
