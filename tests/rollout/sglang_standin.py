"""A small local HTTP stand-in for an SGLang server, for tests. It is NOT SGLang.

It answers the native endpoints the SGLang engine uses (/health, /server_info, /generate,
/update_weights_from_*, /init_weights_update_group, /release_memory_occupation, ...) with the request
and response shapes SGLang documents (see docs/rollout.md), generates fake tokens from a seeded
RNG (no model), checks request fields the way SGLang's io_struct / sampling_params do, records every
request for assertions, and can inject faults: 503 answers, dropped connections, a crash mid-request.

It binds 127.0.0.1 only. Run in a thread (``StandinServer``) or as a process:
``python sglang_standin.py --port P`` (exits by itself after --lifetime-s). The standard library only,
so a process starts in well under a second; ``receive-broadcast`` (torch) plays a server's side of the
weight-update process group over gloo.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import random
import struct
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


@dataclasses.dataclass
class StandinState:
    tp_size: int = 1
    dp_size: int = 1
    base_gpu_id: int = 0
    vocab: int = 64
    deterministic: bool = False
    memory_saver: bool = True
    # (num_hidden_layers, top_k) when started "with" --enable-return-routed-experts. Like SGLang 0.5.23
    # (srt/state_capturer/routed_experts.py) the experts come back by global layer, [rows, num_hidden_layers,
    # top_k]; the first ``dense_layers`` layers have no router, so their rows are never written and stay 0.
    routed_experts: tuple[int, int] | None = None
    dense_layers: int = 0
    num_experts: int = 8
    old_api: bool = False  # answer 404 on /server_info like SGLang before the rename
    # SGLang 0.5.23 (PR #28001): tensor and distributed updates only inside begin/end_weight_update;
    # False plays an older server, which answers 404 on both endpoints and needs no session.
    weight_update_session: bool = True
    quantization: str | None = None  # the server's --quantization (ServerArgs.quantization)
    session_open: bool = False
    load_format: str = "auto"  # the server's --load-format; disk updates without one inherit it
    context_length: int = 4096  # the server's --context-length: longer prompts are refused like SGLang refuses them
    fail_generate: int = 0  # answer 503 to the next N /generate
    fail_paths: dict = dataclasses.field(default_factory=dict)  # path -> answer 503 to the next N posts there
    drop_generate: int = 0  # close the connection without an answer for the next N /generate
    die_on_generate: int = 0  # process mode: exit during the Nth /generate (counted from start)
    trim_stop_in_output_ids: bool = False  # like detokenizer_manager.trim_matched_stop on decode ids
    startup_503_s: float = 0.0
    weight_version: str = "default"
    released: set = dataclasses.field(default_factory=set)
    groups: dict = dataclasses.field(default_factory=dict)
    requests: list = dataclasses.field(default_factory=list)
    generate_calls: int = 0
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    sample_counter: int = 0

    def server_info(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "dp_size": self.dp_size, "base_gpu_id": self.base_gpu_id, "model_path": "standin",
                "enable_deterministic_inference": self.deterministic, "enable_memory_saver": self.memory_saver,
                "enable_return_routed_experts": self.routed_experts is not None, "skip_tokenizer_init": True,
                "context_length": self.context_length, "quantization": self.quantization,
                "version": "standin (not SGLang)"}


class BadRequest(Exception):
    pass


# ------------------------------------------------------------------------------------------ /generate

def _check_sampling(sp: Any) -> None:
    """The checks of sglang SamplingParams.verify that matter for us."""
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    if sp.get("temperature", 1.0) < 0:
        raise BadRequest("temperature must be non-negative")
    if not 0.0 < sp.get("top_p", 1.0) <= 1.0:
        raise BadRequest("top_p must be in (0, 1]")
    top_k = sp.get("top_k", -1)
    if top_k < 1 and top_k != -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if sp.get("max_new_tokens", 128) < 0:
        raise BadRequest("max_new_tokens must be at least 0")


def _check_context(context_length: int, prompt_len: int, max_new_tokens: Any) -> None:
    """SGLang 0.5.23 tokenizer_manager._validate_one_request, word for word (the conformance test compares)."""
    if prompt_len >= context_length:
        raise BadRequest(f"The input ({prompt_len} tokens) is longer than the model's context length "
                         f"({context_length} tokens).")
    if max_new_tokens is not None and max_new_tokens + prompt_len > context_length:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
                         f"You requested a total of {max_new_tokens + prompt_len} tokens: {prompt_len} tokens from the "
                         f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                         f"tokens in the input messages or the completion to fit within the limit.")


def _one_output(state: StandinState, prompt: list[int], sp: dict, sample_key: int, want_routed: bool) -> dict:
    seed = sp.get("sampling_seed")
    rng = random.Random(f"{prompt}|{seed}" if seed is not None else f"{prompt}|{sample_key}")
    # SGLang's Req._check_token_based_finish returns before it reads stop_token_ids when ignore_eos is set
    stops = set() if sp.get("ignore_eos") else set(sp.get("stop_token_ids") or [])
    tokens, logprobs = [], []
    reason: dict[str, Any] = {"type": "length", "length": sp.get("max_new_tokens", 128)}
    for k in range(sp.get("max_new_tokens", 128)):
        # The first token echoes the prompt's last one, so a test can tell which prompt a sample belongs to.
        token = prompt[-1] if k == 0 else rng.randrange(state.vocab)
        tokens.append(token)
        logprobs.append(-0.05 - 2.0 * rng.random())
        if token in stops:
            reason = {"type": "stop", "matched": token}
            break
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex, "finish_reason": reason, "prompt_tokens": len(prompt),
        "completion_tokens": len(tokens), "cached_tokens": 0, "weight_version": state.weight_version,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)], "e2e_latency": 0.0,
    }
    if want_routed:
        layers, top_k = state.routed_experts
        rows = len(prompt) + len(tokens) - 1
        values = [0 if layer < state.dense_layers else (p * 7 + layer * 3 + j) % state.num_experts
                  for p in range(rows) for layer in range(layers) for j in range(top_k)]
        meta["routed_experts"] = base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()
    output_ids = tokens[:-1] if state.trim_stop_in_output_ids and reason["type"] == "stop" else tokens
    return {"output_ids": output_ids, "meta_info": meta}


def fake_generate(state: StandinState, body: dict) -> list[dict] | dict:
    """GenerateReqInput handling: batch normalisation and the n-expansion order of tokenizer_manager."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids cannot be empty.")
    single = isinstance(ids[0], int)
    prompts = [ids] if single else ids
    if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise BadRequest("input_ids should be a list of lists for batch processing.")
    sps = body.get("sampling_params") or {}
    sp_list = sps if isinstance(sps, list) else [sps] * len(prompts)
    if len(sp_list) != len(prompts):
        raise BadRequest("sampling_params list must match the batch size")
    for prompt, sp in zip(prompts, sp_list):
        _check_context(state.context_length, len(prompt), sp.get("max_new_tokens") if isinstance(sp, dict) else None)
    for sp in sp_list:
        _check_sampling(sp)
    n = sp_list[0].get("n", 1)
    if any(sp.get("n", 1) != n for sp in sp_list):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    if body.get("return_logprob") is not True:
        raise BadRequest("stand-in: the engine must ask for return_logprob")
    want_routed = bool(body.get("return_routed_experts"))
    if want_routed and state.routed_experts is None:
        raise BadRequest("return_routed_experts needs --enable-return-routed-experts")
    if "kv_cache" in state.released or "weights" in state.released:
        raise BadRequest("stand-in: memory is released; resume it before generating")
    outputs = []
    for prompt, sp in zip(prompts, sp_list):
        for _ in range(n):  # prompt-major, as tokenizer_manager._handle_batch_request sends them
            with state.lock:
                state.sample_counter += 1
                key = state.sample_counter
            outputs.append(_one_output(state, prompt, sp, key, want_routed))
    return outputs[0] if single and n == 1 else outputs


def finishing_late(handler: Any, label: str, delay_s: Any = 0.3) -> Any:
    """``handler`` (a stand-in endpoint function) made slow and traced: it first sleeps ``delay_s`` (seconds,
    or a function of the request body), then answers and records ``("done " + label, body)`` in the request
    log, so a test can tell what reached the server while it was still busy."""
    def slowed(state: StandinState, body: dict) -> Any:
        time.sleep(delay_s(body) if callable(delay_s) else delay_s)
        result = handler(state, body)
        with state.lock:
            state.requests.append((f"done {label}", body))
        return result
    return slowed


# ------------------------------------------------------------------------------------------ weight sync

def _ok(message: str = "Succeeded.") -> dict:
    return {"success": True, "message": message}


def _need(body: dict, *fields: str) -> None:
    missing = [f for f in fields if f not in body]
    if missing:
        raise BadRequest(f"missing fields {missing}")


_SESSION = "must run between begin_weight_update() and end_weight_update()"


def _in_session(state: StandinState, what: str) -> dict | None:
    """0.5.23 scheduler_components/weight_updater.py: success=false (HTTP 400) outside a session."""
    if state.weight_update_session and not state.session_open:
        return {"success": False, "message": f"{what} {_SESSION}"}
    return None


def begin_weight_update(state: StandinState, body: dict) -> dict:
    if state.session_open:
        return {"success": False, "message": "a weight update session is already open"}
    state.session_open = True
    return _ok()


def end_weight_update(state: StandinState, body: dict) -> dict:
    if not state.session_open:
        return {"success": False, "message": "end_weight_update without begin_weight_update"}
    state.session_open = False
    return _ok()


def update_from_tensor(state: StandinState, body: dict) -> dict:
    _need(body, "serialized_named_tensors")
    refused = _in_session(state, "update_weights_from_tensor")
    if refused:
        return refused
    payloads = body["serialized_named_tensors"]
    if not isinstance(payloads, list) or len(payloads) != state.tp_size:
        raise BadRequest(f"serialized_named_tensors must have one entry per TP rank ({state.tp_size})")
    for p in payloads:
        base64.b64decode(p, validate=True)  # raises -> 400 like SGLang's deserialize
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return _ok()


def init_group(state: StandinState, body: dict) -> dict:
    _need(body, "master_address", "master_port", "rank_offset", "world_size")
    name = body.get("group_name", "weight_update_group")
    if name in state.groups:
        raise BadRequest(f"The specified group name {name} has already been created")
    state.groups[name] = body
    return _ok()


def update_from_distributed(state: StandinState, body: dict) -> dict:
    _need(body, "names", "dtypes", "shapes")
    if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
        raise BadRequest("names, dtypes and shapes differ in length")
    refused = _in_session(state, "update_weights_from_distributed")
    if refused:
        return refused
    name = body.get("group_name", "weight_update_group")
    if name not in state.groups:
        return {"success": False, "message": f"group {name} is not initialized"}
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return _ok()


def update_from_disk(state: StandinState, body: dict) -> dict:
    _need(body, "model_path")
    # tokenizer_manager fills a missing load_format from the launch value; a 'dummy' server then gets a
    # DummyModelLoader, which cannot load from disk (0.5.9 tokenizer_manager.py:1355, model_runner)
    if (body.get("load_format") or state.load_format) == "dummy":
        return {"success": False, "message": "Failed to get model loader: DummyModelLoader cannot update from disk"}
    path = Path(body["model_path"])
    if not (path / "model.safetensors.index.json").exists():
        return {"success": False, "message": f"Failed to load weights from {path}: no checkpoint"}
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return _ok()


# ------------------------------------------------------------------------------------------ HTTP

class _Handler(BaseHTTPRequestHandler):
    server_version = "sglang-standin"
    state: StandinState  # set on the subclass built by make_handler
    on_die: Any = None

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _reply(self, status: int, payload: Any, text: bool = False) -> None:
        data = (payload if text else json.dumps(payload)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else None

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        st = self.state
        try:
            body = self._body()
        except json.JSONDecodeError:
            self._reply(400, {"object": "error", "message": "bad JSON", "code": 400})
            return
        with st.lock:
            st.requests.append((self.path, body))
        path = self.path
        if path in ("/health", "/health_generate"):
            starting = time.monotonic() - st.started_at < st.startup_503_s
            self._reply(503 if starting else 200, "" if starting else "", text=True)
            return
        if path in ("/server_info", "/get_server_info"):
            if path == "/server_info" and st.old_api:
                self._reply(404, {"detail": "Not Found"})
            else:
                self._reply(200, st.server_info())
            return
        if path == "/get_model_info":
            self._reply(200, {"model_path": "standin", "is_generation": True, "weight_version": st.weight_version})
            return
        if path == "/generate" and method == "POST":
            with st.lock:
                st.generate_calls += 1
                calls = st.generate_calls
                fail = st.fail_generate > 0
                st.fail_generate -= int(fail)
                drop = not fail and st.drop_generate > 0
                st.drop_generate -= int(drop)
            if st.die_on_generate and calls == st.die_on_generate and self.on_die is not None:
                self.on_die()
            if fail:
                self._reply(503, {"object": "error", "message": "stand-in: injected 503", "code": 503})
                return
            if drop:
                self.close_connection = True
                self.connection.shutdown(2)  # the client sees the connection cut without an answer
                return
        with st.lock:
            injected = st.fail_paths.get(path, 0) > 0
            if injected:
                st.fail_paths[path] -= 1
        if injected:
            self._reply(503, {"object": "error", "message": f"stand-in: injected 503 on {path}", "code": 503})
            return
        handlers = {
            "/generate": fake_generate, "/update_weights_from_tensor": update_from_tensor,
            "/init_weights_update_group": init_group, "/update_weights_from_distributed": update_from_distributed,
            "/update_weights_from_disk": update_from_disk,
        }
        if st.weight_update_session:
            handlers.update({"/begin_weight_update": begin_weight_update, "/end_weight_update": end_weight_update})
        try:
            if path in handlers and method == "POST":
                result = handlers[path](st, body or {})
                failed = isinstance(result, dict) and result.get("success") is False
                self._reply(400 if failed else 200, result)
            elif path == "/destroy_weights_update_group":
                st.groups.pop((body or {}).get("group_name", "weight_update_group"), None)
                self._reply(200, _ok())
            elif path == "/flush_cache":
                self._reply(200, "Cache flushed.\n", text=True)
            elif path in ("/release_memory_occupation", "/resume_memory_occupation"):
                if not st.memory_saver:
                    raise BadRequest("memory saver is not enabled (--enable-memory-saver)")
                tags = set((body or {}).get("tags") or ["kv_cache", "weights", "cuda_graph"])
                if path.startswith("/release"):
                    st.released |= tags
                else:
                    st.released -= tags
                self._reply(200, None)
            else:
                self._reply(404, {"detail": "Not Found"})
        except BadRequest as err:
            # SGLang 0.5.23 http_server._create_error_response (the conformance test compares them)
            self._reply(400, {"error": {"message": str(err)}})


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A connection the stand-in cut on purpose (drop_generate) ends in a broken pipe; report the rest.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, OSError)):
            super().handle_error(request, client_address)


def make_handler(state: StandinState, on_die: Any = None) -> type:
    return type("StandinHandler", (_Handler,), {"state": state, "on_die": staticmethod(on_die) if on_die else None})


class StandinServer:
    """The stand-in in a background thread of the test process."""

    def __init__(self, state: StandinState | None = None, port: int = 0):
        self.state = state or StandinState()
        self.httpd = _QuietServer((HOST, port), make_handler(self.state))
        self.url = f"http://{HOST}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "StandinServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self) -> list[str]:
        return [p for p, _ in self.state.requests]

    def bodies(self, path: str) -> list[Any]:
        return [b for p, b in self.state.requests if p == path]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------ process mode

def serve_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="SGLang stand-in (NOT SGLang), 127.0.0.1 only")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--startup-delay-s", type=float, default=0.0, help="sleep before binding the port")
    ap.add_argument("--startup-503-s", type=float, default=0.0, help="/health answers 503 this long")
    ap.add_argument("--die-on-generate", type=int, default=0, help="exit during the Nth /generate")
    ap.add_argument("--die-once-file", default="", help="die only if this file does not exist yet (then create it)")
    ap.add_argument("--exit-at-start", action="store_true", help="exit with code 3 before serving")
    ap.add_argument("--lifetime-s", type=float, default=60.0, help="exit after this long whatever happens")
    args = ap.parse_args(argv)
    threading.Timer(args.lifetime_s, lambda: os._exit(0)).start()
    if args.exit_at_start:
        print("stand-in: exiting at start as asked", flush=True)
        os._exit(3)
    time.sleep(args.startup_delay_s)
    state = StandinState(tp_size=args.tp_size, startup_503_s=args.startup_503_s)
    die = args.die_on_generate
    if die and args.die_once_file:
        marker = Path(args.die_once_file)
        die = 0 if marker.exists() else die
        marker.touch()
    state.die_on_generate = die
    httpd = _QuietServer((HOST, args.port), make_handler(state, on_die=lambda: os._exit(1)))
    print(f"stand-in serving on {HOST}:{args.port}", flush=True)
    httpd.serve_forever(poll_interval=0.05)


def receive_broadcast_main(argv: list[str]) -> None:
    """Play one server GPU of the weight-update group over gloo: join the way SGLang's
    init_custom_process_group does (tcp rendezvous, PrefixStore(group_name), _new_process_group_helper),
    receive the broadcasts of the buckets listed in --meta (names/dtypes/shapes per bucket), save them."""
    import datetime

    import torch
    from torch.distributed import distributed_c10d as c10d

    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    timeout = datetime.timedelta(seconds=30)
    store, rank, world = next(c10d.rendezvous(f"tcp://{args.master}:{args.port}", args.rank, args.world, timeout=timeout))
    store.set_timeout(timeout)
    prefix = c10d.PrefixStore(args.group, store)
    key = "backend_options" if "backend_options" in __import__("inspect").signature(c10d._new_process_group_helper).parameters else "pg_options"
    group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend("gloo"), prefix, group_name=args.group,
                                              timeout=timeout, **{key: None})
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    received = {}
    for bucket in json.loads(Path(args.meta).read_text()):
        for name, dtype, shape in zip(bucket["names"], bucket["dtypes"], bucket["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(tensor, src=0, group=group)
            received[name] = tensor
    torch.save(received, args.out)
    torch.distributed.destroy_process_group(group)  # else gloo aborts at interpreter exit


if __name__ == "__main__":
    if sys.argv[1:2] == ["receive-broadcast"]:
        receive_broadcast_main(sys.argv[2:])
    else:
        serve_main(sys.argv[1:])
