"""RolloutEngine on SGLang servers: batched /generate over several servers, weight sync, memory release.

Servers are either launched here (``SGLangConfig.launch``: one ``python -m sglang.launch_server`` per
entry, owned: restarted when dead, stopped on shutdown) or attached by URL (``SGLangConfig.urls``).
A generate call is cut into requests of ``prompts_per_request`` prompts, each sent with all G samples
(so a group never spans servers) from a thread pool to the least-loaded usable server.

Each server carries the weight version it holds. A server restarted after a sync holds stale weights
and takes no rollouts until the next complete sync (disk mode reloads the last checkpoint at once);
when no usable server is left, generate raises SGLangEngineError saying why.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from gspo_megatron.megatron.device import cuda_present
from gspo_megatron.rollout.base import RolloutEngine, RolloutInputError, Sample, SamplingParams
from gspo_megatron.rollout.sglang.config import MEMORY_TAGS, QUANTIZED_SYNC_REFUSAL, SGLangConfig, served_quantization
from gspo_megatron.rollout.sglang.cpu import cpu_server_env, libcuda_standin_dir
from gspo_megatron.rollout.sglang.http import (RetriesExhausted, RetryPolicy, ServerBusy, ServerRejected,
                                               ServerUnreachable, call_with_retry, request)
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.rollout.sglang.protocol import (RoutedExpertsLayout, ServerInfo, build_generate_request, context_refusal, launch_command,
                                                   launch_env, parse_generate_response, parse_server_info)
from gspo_megatron.rollout.sglang.server import ServerProcess, ServerStartError, probe_health, wait_healthy
from gspo_megatron.rollout.sglang.weight_sync import (DiskCheckpointWriter, NamedTensors, TrainerBroadcastGroup,
                                                      bucket_named_tensors, init_group_body, rank_offsets,
                                                      serialize_named_tensors, update_from_disk_body,
                                                      update_from_distributed_body, update_from_tensor_body)

log = logging.getLogger(__name__)

NOT_RETRIED = frozenset({"/init_weights_update_group", "/update_weights_from_distributed"})
# SGLang >= 0.5.2x (PR #28001) accepts tensor and distributed updates only inside this session; older
# servers answer 404 on both endpoints and need none.
SESSION_PATHS = ("/begin_weight_update", "/end_weight_update")

HEALTH_PATH = "/health"
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")  # newer SGLang renamed the second to the first


class SGLangEngineError(RuntimeError):
    """The engine cannot do what was asked; the message says which server and why."""


@dataclasses.dataclass(eq=False)
class ServerSlot:
    """One server as the engine sees it."""

    url: str
    process: ServerProcess | None = None  # set when we launched it (and so may restart it)
    info: ServerInfo | None = None
    weight_version: int = 0
    inflight: int = 0
    restarts: int = 0
    dead: bool = False
    last_error: str = ""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def state(self, engine_version: int) -> str:
        if self.dead:
            return f"dead ({self.last_error})"
        return "ready" if self.weight_version == engine_version else f"stale (holds weights v{self.weight_version})"


@dataclasses.dataclass
class ColocatedSync:
    """Colocated tensor sync with several trainer ranks per server.

    Every rank serializes the bucket it holds on its own GPU; ``gather(payload)`` returns, on the leader (the
    one rank that talks to server ``server_index``), the payloads of that server's GPUs in TP-rank order,
    and None on the other ranks (see ``gather_to_leader``). ``ack(answered)`` is the per-bucket
    acknowledgement: the leader passes True once its post of the bucket has returned (the server's HTTP
    answer), every other rank passes None and receives the leader's value (see ``ack_from_leader``); only
    then may a rank drop that bucket. update_weights is collective over these ranks.
    """

    server_index: int
    is_leader: bool
    gather: Callable[[str], list[str] | None]
    ack: Callable[[bool | None], bool]


@dataclasses.dataclass
class _SyncState:
    """A weight sync under way (between the first update_weights call and the final=True one)."""

    targets: list[ServerSlot]
    failed: set[int] = dataclasses.field(default_factory=set)  # id() of targets that dropped out
    posted: bool = False  # some server may already hold part of the new weights
    session: list[ServerSlot] | None = None  # servers inside begin_weight_update (None: not begun yet)

    def live(self) -> list[ServerSlot]:
        return [s for s in self.targets if id(s) not in self.failed and not s.dead]


def gather_to_leader(group: Any, leader_global_rank: int) -> Callable[[str], list[str] | None]:
    """A ColocatedSync.gather over a torch.distributed group whose ranks are ordered like the server's GPUs."""

    def gather(payload: str) -> list[str] | None:
        is_leader = torch.distributed.get_rank() == leader_global_rank
        out: list[Any] | None = [None] * torch.distributed.get_world_size(group) if is_leader else None
        torch.distributed.gather_object(payload, out, dst=leader_global_rank, group=group)
        return out

    return gather


def ack_from_leader(group: Any, leader_global_rank: int) -> Callable[[bool | None], bool]:
    """A ColocatedSync.ack over the group of gather_to_leader: the leader's value, broadcast to every rank."""

    def ack(answered: bool | None) -> bool:
        box = [answered]
        torch.distributed.broadcast_object_list(box, src=leader_global_rank, group=group)
        return bool(box[0])

    return ack


def _with_last(items: Iterable[NamedTensors]) -> Iterator[tuple[NamedTensors, bool]]:
    """Yield (item, is_last) with one item of look-ahead."""
    iterator = iter(items)
    current = next(iterator, None)
    while current is not None:
        following = next(iterator, None)
        yield current, following is None
        current = following


def _validate_prompts(prompts: Sequence[Sequence[int]]) -> None:
    if not prompts:
        raise RolloutInputError("generate needs at least one prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise RolloutInputError(f"prompts[{i}] is empty")
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or t < 0]
        if bad:
            raise RolloutInputError(f"prompts[{i}] has non token ids {bad[:5]}")


class SGLangEngine(RolloutEngine):
    """See the module docstring. Build it with ``SGLangEngine.from_config(cfg)``."""

    def __init__(self, cfg: SGLangConfig, slots: Sequence[ServerSlot], *, colocated: ColocatedSync | None = None,
                 posts_weights: bool = True, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        """posts_weights=False makes a follower: another trainer rank posts the weights (disk / distributed
        mode with several ranks), so update_weights drops the buckets and final=True only advances the
        versions; adopt_sync_report then takes the poster's word on which servers hold the new weights."""
        if not slots:
            raise ValueError("SGLangEngine needs at least one server")
        if colocated is not None and not posts_weights:
            raise ValueError("a colocated engine takes part in every sync (posts_weights must be True)")
        if colocated is not None and not 0 <= colocated.server_index < len(slots):
            raise ValueError(f"colocated.server_index {colocated.server_index} is not one of {len(slots)} servers")
        if colocated is not None and cfg.weight_sync != "tensor":
            raise ValueError(f"colocated sync is for weight_sync 'tensor', not {cfg.weight_sync!r}")
        self.cfg = cfg
        self.slots = list(slots)
        self.colocated = colocated
        self.posts_weights = posts_weights
        self.weight_version = 0
        self._sleep = sleep
        self._clock = clock
        self._policy = RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.backoff_max_s, cfg.retry_deadline_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self.slots) * cfg.concurrent_requests_per_server, thread_name_prefix="sglang")
        self._router_lock = threading.Lock()
        self._next = 0
        self._closed = False
        self._dummy_start = cfg.launch is not None and cfg.launch.load_format == "dummy"
        self._sync: _SyncState | None = None
        self._disk_writer: DiskCheckpointWriter | None = None
        self._last_disk_dir: Path | None = None
        self._group: TrainerBroadcastGroup | None = None
        self._group_members: list[ServerSlot] = []
        self._group_generation = 0
        self._group_broken = False  # a member restarted: rebuild the group before the next bucket
        self._session_api: dict[str, bool] = {}  # url -> has /begin_weight_update (False: answered 404)
        # Tensor sync: the buckets whose CUDA IPC handles the servers may still open, oldest first; at most
        # cfg.tensor_buckets_in_flight of them (see _settle_buckets).
        self._in_flight: collections.deque[NamedTensors] = collections.deque()
        self._released: set[str] = set()  # memory regions this engine released on its servers
        # colocated (tensor sync): the servers share the trainer's GPUs
        self.releases_memory = cfg.weight_sync == "tensor" and cfg.release_memory
        for slot in self.slots:
            slot.info = self._fetch_server_info(slot)
            slot.weight_version = self._version_after_start()
            if cfg.weight_sync in ("tensor", "distributed") and slot.info.dp_size > 1:
                # tensor: one payload per TP rank cannot feed DP replicas; distributed: SGLang 0.5.23 asserts
                # dp_size == 1 for /init_weights_update_group (see SGLangConfig.validate)
                raise SGLangEngineError(f"{slot.url} runs --dp-size {slot.info.dp_size}; rollout.sglang.weight_sync "
                                        f"'{cfg.weight_sync}' needs one server per TP group (dp_size 1)")

    @classmethod
    def from_config(cls, cfg: SGLangConfig, **kwargs: Any) -> "SGLangEngine":
        slots = launch_servers(cfg) if cfg.launch is not None else attach_servers(cfg)
        return cls(cfg, slots, **kwargs)

    def _version_after_start(self) -> int:
        # A fresh server holds the launch checkpoint: current only before the first sync, never if dummy.
        return 0 if self.weight_version == 0 and not self._dummy_start else -1

    def _config_dir(self) -> str:
        return self.cfg.disk_config_dir or (self.cfg.launch.model_path if self.cfg.launch is not None else "")

    # ------------------------------------------------------------------ HTTP helpers

    def _call(self, slot: ServerSlot, method: str, path: str, body: Any, *, timeout_s: float | None = None) -> Any:
        """One call with retries on 5xx / no answer; raises RetriesExhausted or ServerRejected."""
        timeout = self.cfg.admin_timeout_s if timeout_s is None else timeout_s
        return call_with_retry(lambda: request(slot.url, method, path, body, timeout_s=timeout), self._policy,
                               what=f"{method} {slot.url}{path}", sleep=self._sleep, clock=self._clock)

    def _admin(self, slot: ServerSlot, path: str, body: Any) -> Any:
        """A POST whose failure is the caller's failure, as SGLangEngineError. The NCCL-group calls are
        posted once, never retried: a second /init_weights_update_group or /update_weights_from_distributed
        leaves the server waiting in NCCL for ranks or broadcasts that never come."""
        try:
            if path in NOT_RETRIED:
                return request(slot.url, "POST", path, body, timeout_s=self.cfg.admin_timeout_s)
            return self._call(slot, "POST", path, body)
        except (RetriesExhausted, ServerRejected, ServerUnreachable, ServerBusy) as err:
            raise SGLangEngineError(f"POST {slot.url}{path}: {err}") from err

    def _map(self, fn: Callable[[ServerSlot], Any], slots: Sequence[ServerSlot]) -> list[Any]:
        """Run fn on every slot concurrently; wait for all, then raise the first error."""
        futures = [self._pool.submit(fn, slot) for slot in slots]
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def _fetch_server_info(self, slot: ServerSlot) -> ServerInfo:
        for path in SERVER_INFO_PATHS:
            try:
                info = self._call(slot, "GET", path, None)
            except ServerRejected as err:
                if err.status == 404 and path != SERVER_INFO_PATHS[-1]:
                    continue  # an older server: try the old name
                raise SGLangEngineError(f"{slot.url}: cannot read server info: {err}") from err
            except RetriesExhausted as err:
                raise SGLangEngineError(f"{slot.url}: cannot read server info: {err}") from err
            self._refuse_quantized(slot, info)
            return parse_server_info(info, f"{slot.url}{path}")
        raise AssertionError("the loop returns or raises")

    def _refuse_quantized(self, slot: ServerSlot, info: Any) -> None:
        """Tensor / distributed sync into a quantized model (SGLangConfig.validate checks the launch config;
        this catches attached servers): the server's ``--quantization`` or its model folder's config.json,
        when that folder is readable here."""
        if self.cfg.weight_sync not in ("tensor", "distributed") or not isinstance(info, Mapping):
            return
        quantized = (f"--quantization {info['quantization']}" if info.get("quantization")
                     else served_quantization(str(info.get("model_path") or "")))
        if quantized is not None:
            raise SGLangEngineError(f"{slot.url} serves a quantized model ({quantized}); rollout.sglang.weight_sync "
                                    f"'{self.cfg.weight_sync}' cannot update it: {QUANTIZED_SYNC_REFUSAL}")

    # ------------------------------------------------------------------ routing and recovery

    def _usable(self) -> list[ServerSlot]:
        return [s for s in self.slots if not s.dead and s.weight_version == self.weight_version]

    def _acquire(self) -> ServerSlot:
        with self._router_lock:
            usable = self._usable()
            if not usable:
                states = "; ".join(f"{s.url}: {s.state(self.weight_version)}" for s in self.slots)
                raise SGLangEngineError(
                    f"no SGLang server can serve weights v{self.weight_version} ({states}). A server is dead after "
                    f"max_restarts={self.cfg.max_restarts} restarts, or when attached by URL and not answering; a stale "
                    f"one was restarted and takes rollouts again after the next complete update_weights")
            n = len(self.slots)
            rank = {id(s): (self.slots.index(s) - self._next) % n for s in usable}
            if self.cfg.router == "least_loaded":
                slot = min(usable, key=lambda s: (s.inflight, rank[id(s)]))
            else:
                slot = min(usable, key=lambda s: rank[id(s)])
            self._next = (self.slots.index(slot) + 1) % n
            slot.inflight += 1
            return slot

    def _release(self, slot: ServerSlot) -> None:
        with self._router_lock:
            slot.inflight -= 1

    def _recover(self, slot: ServerSlot, reason: str) -> None:
        """After no answer from ``slot``: restart it if we own it and it is dead or hung, else mark it dead.
        Concurrent callers for one slot restart it once (the second finds it healthy)."""
        with slot.lock:
            if slot.dead:
                return
            healthy = probe_health(slot.url, HEALTH_PATH, timeout_s=self.cfg.health_timeout_s)
            if slot.process is None:
                if not healthy:
                    self._mark_dead(slot, f"attached server stopped answering: {reason}")
                return
            if healthy and slot.process.alive():
                return  # a passing fault, or another thread restarted it already
            if slot.restarts >= self.cfg.max_restarts:
                slot.process.stop()
                self._mark_dead(slot, f"failed again after {slot.restarts} restart(s): {reason}")
                return
            slot.restarts += 1
            log.warning("%s: restart %d of %d after: %s", slot.url, slot.restarts, self.cfg.max_restarts, reason)
            try:
                slot.process.restart()
            except ServerStartError as err:
                self._mark_dead(slot, f"restart failed: {err}")
                return
            slot.info = self._fetch_server_info(slot)
            slot.weight_version = self._version_after_start()
            if slot in self._group_members:
                self._group_broken = True
            if self.cfg.weight_sync == "disk" and self._last_disk_dir is not None:
                self._catch_up_from_disk(slot)

    def _mark_dead(self, slot: ServerSlot, why: str) -> None:
        slot.dead, slot.last_error = True, why
        log.error("%s is out of service: %s", slot.url, why)

    def _catch_up_from_disk(self, slot: ServerSlot) -> None:
        body = update_from_disk_body(str(self._last_disk_dir), weight_version=str(self.weight_version))
        try:
            self._call(slot, "POST", "/update_weights_from_disk", body)
        except (RetriesExhausted, ServerRejected) as err:
            self._mark_dead(slot, f"restarted but could not load {self._last_disk_dir}: {err}")
            return
        slot.weight_version = self.weight_version

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams) -> list[Sample]:
        """Samples grouped by prompt in prompt order (RolloutEngine.generate). Log-probs are SGLang's:
        log_softmax(logits / temperature) before top-k / top-p, unless the servers run with
        SGLANG_RETURN_ORIGINAL_LOGPROB (launch.return_original_logprob), then before temperature."""
        self._check_open()
        _validate_prompts(prompts)
        if samples_per_prompt < 1:
            raise RolloutInputError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if self._sync is not None:
            raise SGLangEngineError("generate called in the middle of a weight sync (no final=True update yet)")
        routed_layout = self._routed_experts_layout() if params.return_routed_experts else None
        # Seeds need one request per sample; so does a deterministic server, whose seedless requests all use seed 42.
        seeded = params.seed is not None or any(s.info.deterministic for s in self.slots if not s.dead)
        step = self.cfg.prompts_per_request
        chunks = [list(range(i, min(i + step, len(prompts)))) for i in range(0, len(prompts), step)]
        futures = [self._pool.submit(self._generate_chunk, prompts, chunk, samples_per_prompt, params, seeded,
                                     routed_layout) for chunk in chunks]
        concurrent.futures.wait(futures)
        return [sample for future in futures for sample in future.result()]

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], chunk: list[int], g: int, params: SamplingParams,
                        seeded: bool, routed_layout: RoutedExpertsLayout | None) -> list[Sample]:
        req = build_generate_request(prompts, chunk, g, params, seeded=seeded)
        where = f"/generate of prompts {chunk[0]}..{chunk[-1]}"
        start = self._clock()
        retry = 0
        while True:
            slot = self._acquire()
            try:
                response = request(slot.url, "POST", "/generate", req.body, timeout_s=self.cfg.request_timeout_s)
            except (ServerUnreachable, ServerBusy) as err:
                self._release(slot)
                if isinstance(err, ServerUnreachable):
                    self._recover(slot, str(err))
                retry += 1
                delay = self._policy.delay_s(retry)
                if retry > self.cfg.max_retries or self._clock() + delay - start > self.cfg.retry_deadline_s:
                    raise SGLangEngineError(f"{where}: gave up after {retry} attempt(s): {err}") from err
                log.warning("%s on %s failed (%s); retry %d in %.1f s", where, slot.url, err, retry, delay)
                self._sleep(delay)
                continue
            except ServerRejected as err:
                self._release(slot)
                refusal = context_refusal(err.body)
                if refusal is not None:
                    # deterministic: every server of this model refuses it, so neither retried nor restarted
                    longest = max(len(prompts[i]) for i in chunk)
                    raise RolloutInputError(
                        f"{where}: {slot.url} refused a prompt that does not fit its context length: {refusal} (the "
                        f"longest prompt of the request has {longest} tokens, max_new_tokens is {params.max_new_tokens}; "
                        f"lower data.max_prompt_tokens or rollout.max_new_tokens, or serve a longer --context-length)"
                    ) from err
                raise SGLangEngineError(f"{where}: rejected by the server (not retried: a malformed request or a bad "
                                        f"input): {err}") from err
            self._release(slot)
            return parse_generate_response(response, req, prompts, routed_experts_layout=routed_layout,
                                           where=f"{slot.url}{where}")

    def _routed_experts_layout(self) -> RoutedExpertsLayout:
        """SGLang's routed-experts layout (global layers) and the model's MoE layers, from
        ``routed_experts_layers`` / ``routed_experts_top_k`` / ``routed_experts_first_dense_layers`` when the
        first two are set, else from the model's config.json through the project's own model config (the
        rule the trainer's ``moe_layer_numbers`` follows)."""
        missing = [s.url for s in self.slots if not s.dead and not s.info.routed_experts]
        if missing:
            raise SGLangEngineError("return_routed_experts needs servers started with --enable-return-routed-experts "
                                    f"(launch.enable_return_routed_experts); these are not: {missing}")
        if self.cfg.routed_experts_layers and self.cfg.routed_experts_top_k:
            if self.cfg.routed_experts_first_dense_layers >= self.cfg.routed_experts_layers:
                raise SGLangEngineError(f"routed_experts_first_dense_layers={self.cfg.routed_experts_first_dense_layers} "
                                        f"leaves no MoE layer of routed_experts_layers={self.cfg.routed_experts_layers}")
            return RoutedExpertsLayout.from_first_dense(self.cfg.routed_experts_layers, self.cfg.routed_experts_top_k,
                                                        self.cfg.routed_experts_first_dense_layers)
        config_path = Path(self._config_dir()) / "config.json"
        if not self._config_dir() or not config_path.exists():
            raise SGLangEngineError("return_routed_experts: set routed_experts_layers and routed_experts_top_k "
                                    "(there is no model config.json to read them from)")
        hf = json.loads(config_path.read_text())
        if "num_experts_per_tok" not in hf:
            raise SGLangEngineError(f"{config_path}: no num_experts_per_tok; not an MoE model, routed experts undefined")
        model = ModelConfig.from_hf_dict(hf, source=str(config_path))
        moe_layers = tuple(i for i, is_moe in enumerate(model.moe_layer_pattern()) if is_moe)
        return RoutedExpertsLayout(hf["num_hidden_layers"], hf["num_experts_per_tok"], moe_layers)

    # ------------------------------------------------------------------ weight sync

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool) -> None:
        """Push HF-named tensors, split into ``bucket_bytes`` buckets; ``final=True`` completes the sync:
        servers flush their prefix cache and ``weight_version`` increases.

        tensor: collective over the ranks of ``colocated`` (else this process feeds every server);
        distributed: call on the trainer rank that holds the tensors (rank 0 of the NCCL group);
        disk: call on one rank; it writes the checkpoint the servers read.
        A server that stops answering during a sync is recovered, left out of the rest of it, and stays stale.
        """
        self._check_open()
        if not self.posts_weights:
            if final:
                # Provisional until adopt_sync_report: the poster knows which servers took the weights.
                self.weight_version += 1
                for slot in self.slots:
                    if not slot.dead:
                        slot.weight_version = self.weight_version
            return
        if self._sync is None:
            self._sync = _SyncState(targets=[s for s in self.slots if not s.dead])
        try:
            self._update_weights(named_tensors, final)
        except BaseException:
            self._abort_sync()  # a failed sync is abandoned whole; the next one starts from scratch
            raise

    def _abort_sync(self) -> None:
        sync, self._sync = self._sync, None
        for slot in (sync.session or []) if sync is not None else []:
            # close the session so the next sync can begin one; the sync's own error is what is raised
            try:
                request(slot.url, "POST", "/end_weight_update", {}, timeout_s=self.cfg.admin_timeout_s)
            except (ServerRejected, ServerUnreachable, ServerBusy) as err:
                log.error("%s: could not end the aborted weight-update session: %s", slot.url, err)
        if sync is not None and sync.posted:
            for slot in sync.targets:
                slot.weight_version = -1  # may hold a mix of old and new weights: stale until a complete sync
        writer, self._disk_writer = self._disk_writer, None
        if writer is not None and writer.tmp_path.exists():
            shutil.rmtree(writer.tmp_path)

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], final: bool) -> None:
        new_version = self.weight_version + 1
        sent_any = False
        session = self.cfg.weight_sync in ("tensor", "distributed")
        for bucket, is_last in _with_last(bucket_named_tensors(named_tensors, self.cfg.bucket_bytes)):
            sent_any = True
            closing = final and is_last
            label = str(new_version) if closing else None
            if session and self._sync.session is None:
                self._begin_session()
            if self.cfg.weight_sync == "tensor":
                self._in_flight.append(bucket)
                self._push_tensor_bucket(bucket, flush=closing, weight_version=label)
                self._settle_buckets(keep=self.cfg.tensor_buckets_in_flight - 1)
            elif self.cfg.weight_sync == "distributed":
                self._push_distributed_bucket(bucket, flush=closing, weight_version=label)
            else:
                self._write_disk_bucket(bucket, new_version)
        if not final:
            return
        if self.cfg.weight_sync == "disk":
            self._finish_disk_sync(new_version)
        elif not sent_any:
            self._map(lambda s: self._sync_post(s, "/flush_cache", None), self._posting_targets())
        self._settle_buckets(keep=0)
        if self._sync.session:
            self._map(lambda s: self._sync_post(s, "/end_weight_update", {}), self._sync.session)
        sync, self._sync = self._sync, None
        for slot in sync.targets:
            if id(slot) in sync.failed:
                slot.weight_version = -1  # recovered mid-sync: stale until the next complete one
            elif not slot.dead:
                slot.weight_version = new_version
        self.weight_version = new_version

    def _posting_targets(self) -> list[ServerSlot]:
        """The servers this process itself posts to in the current sync."""
        if self.colocated is not None:
            own = self.slots[self.colocated.server_index]
            return [own] if self.colocated.is_leader and own in self._sync.live() else []
        return self._sync.live()

    def _sync_post(self, slot: ServerSlot, path: str, body: Any, *, missing_ok: bool = False) -> bool:
        """A sync call to one server; True when it was answered. A server that stops answering is recovered
        and dropped from the rest of this sync; a rejection (bad payload, failed load) is a bug and raised,
        except a 404 with ``missing_ok`` (an endpoint older servers lack)."""
        if id(slot) in self._sync.failed or slot.dead:
            return False
        self._sync.posted = True
        try:
            self._call(slot, "POST", path, body)
            return True
        except ServerRejected as err:
            if missing_ok and err.status == 404:
                return False
            raise SGLangEngineError(f"weight sync v{self.weight_version + 1} rejected by {slot.url}{path}: {err}") from err
        except RetriesExhausted as err:
            self._sync.failed.add(id(slot))
            log.error("%s dropped from weight sync v%d: %s", slot.url, self.weight_version + 1, err)
            self._recover(slot, str(err))
            return False

    def _begin_session(self) -> None:
        """POST /begin_weight_update to the servers this process feeds (skipped where it answers 404)."""
        self.release_sync_buffers()  # the previous sync's buckets: every rank is past it by now
        targets = [s for s in self._posting_targets() if self._session_api.get(s.url, True)]

        def begin(slot: ServerSlot) -> bool:
            begun = self._sync_post(slot, "/begin_weight_update", {}, missing_ok=True)
            if not begun and id(slot) not in self._sync.failed and not slot.dead:
                self._session_api[slot.url] = False
                log.info("%s has no /begin_weight_update (SGLang before 0.5.2x): updating without a session", slot.url)
            return begun

        self._sync.session = [s for s, begun in zip(targets, self._map(begin, targets)) if begun]

    def _settle_buckets(self, *, keep: int) -> None:
        """Drop the oldest tensor-sync buckets until ``keep`` are left, each only after its acknowledgement.

        The acknowledgement is the leader's post of that bucket having returned (one process: its own posts
        returned already). SGLang 0.5.23 answers once its copies out of the IPC handles are enqueued, not
        done (UPSTREAM_GPU_FACTS.md, item 12); dropping our reference then is still safe because torch keeps
        a CUDA block shared over IPC out of the allocator until every consumer has released its handle, and
        a consumer synchronizes its stream before it does (torch ``StorageSharing.cpp``,
        ``THPStorage_newSharedCuda``'s deleter; ``CudaIPCTypes.cpp``'s limbo of sent blocks).
        ``torch.cuda.ipc_collect()`` then returns the released blocks to the allocator; without it they
        wait in that limbo. Keeping one more bucket than acknowledged (the default of 2 in flight) gives
        the server a further post's time before its handle is the only one left."""
        settled = False
        while len(self._in_flight) > keep:
            if self.colocated is not None:
                self.colocated.ack(True if self.colocated.is_leader else None)
            self._in_flight.popleft()
            settled = True
        if settled:
            self._collect_ipc()

    @staticmethod
    def _collect_ipc() -> None:
        # device branch: ipc_collect frees blocks shared through CUDA IPC; a CPU tensor's shared-memory
        # segment is unlinked when its last opener closes it, with nothing to collect on this side.
        if cuda_present():
            torch.cuda.ipc_collect()

    def release_sync_buffers(self) -> None:
        """Drop what an aborted tensor sync left in flight (a complete sync leaves nothing: _settle_buckets)
        and let CUDA free the memory the servers' IPC handles pinned. Called once every rank is past the
        sync (adopt_sync_report) and by the next sync."""
        self._in_flight.clear()
        self._collect_ipc()

    def _push_tensor_bucket(self, bucket: NamedTensors, *, flush: bool, weight_version: str | None) -> None:
        payload = serialize_named_tensors(bucket)
        if self.colocated is not None:
            payloads = self.colocated.gather(payload)
            if not self.colocated.is_leader:
                return
            slot = self.slots[self.colocated.server_index]
            if payloads is None or len(payloads) != slot.info.tp_size:
                got = None if payloads is None else len(payloads)
                raise SGLangEngineError(f"{slot.url}: the colocated gather gave {got} payloads for tp_size {slot.info.tp_size}")
            for target in self._posting_targets():
                self._sync_post(target, "/update_weights_from_tensor",
                                update_from_tensor_body(payloads, flush_cache=flush, weight_version=weight_version))
            return
        # One process feeds every server: each TP rank opens the same tensors (CUDA IPC peer access, one node),
        # from a payload pickled for it alone: a CPU tensor's shared-memory segment counts one reference per
        # pickle and each opener gives one back, so a payload opened twice would unlink the segment while the
        # trainer still shares it, and the next sync of that storage finds no file (met against SGLang 0.5.23).
        targets = self._posting_targets()
        fresh = iter([payload])  # the first receiver takes the payload built above
        bodies = {id(s): update_from_tensor_body(
            [next(fresh, None) or serialize_named_tensors(bucket) for _ in range(s.info.tp_size)],
            flush_cache=flush, weight_version=weight_version) for s in targets}
        self._map(lambda s: self._sync_post(s, "/update_weights_from_tensor", bodies[id(s)]), targets)

    def _push_distributed_bucket(self, bucket: NamedTensors, *, flush: bool, weight_version: str | None) -> None:
        self._ensure_group()
        body = update_from_distributed_body(bucket, group_name=self._group.group_name, flush_cache=flush,
                                            weight_version=weight_version)
        self._sync.posted = True
        # Each server blocks in its receive until our broadcasts arrive: post first, then broadcast.
        futures = [self._pool.submit(self._admin, s, "/update_weights_from_distributed", body)
                   for s in self._group_members]
        try:
            self._group.broadcast_bucket(bucket)
        finally:
            concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            self._drop_group()
            raise SGLangEngineError(f"distributed weight sync failed; the NCCL group is dropped and rebuilt by the "
                                    f"next sync, which must send every tensor again: {errors[0]}") from errors[0]

    def _ensure_group(self) -> None:
        if self._group is not None and not self._group_broken:
            return
        self._drop_group()
        d = self.cfg.distributed
        members = [s for s in self.slots if not s.dead]
        offsets, world = rank_offsets([s.info.tp_size for s in members])  # dp_size is 1 (checked at start)
        name = f"{d.group_name}-{self._group_generation}"
        futures = [self._pool.submit(self._admin, s, "/init_weights_update_group", init_group_body(
            master_address=d.master_address, master_port=d.master_port, rank_offset=offset, world_size=world,
            group_name=name, backend=d.backend)) for s, offset in zip(members, offsets)]
        try:
            # Servers join from their HTTP handlers while we build rank 0 (gloo blocks here until all joined).
            self._group = TrainerBroadcastGroup(master_address=d.master_address, master_port=d.master_port,
                                                world_size=world, group_name=name, backend=d.backend,
                                                timeout_s=d.timeout_s)
        finally:
            concurrent.futures.wait(futures)
        self._group_members = members
        self._group_broken = False
        for f in futures:
            f.result()

    def _drop_group(self) -> None:
        """Forget the NCCL group; live members are told to destroy it (the endpoint is absent in old SGLang,
        and the next group has a new name either way)."""
        group, self._group = self._group, None
        members, self._group_members = self._group_members, []
        if group is None:
            return
        self._group_generation += 1
        for slot in members:
            if slot.dead:
                continue
            try:
                self._call(slot, "POST", "/destroy_weights_update_group", {"group_name": group.group_name})
            except ServerRejected as err:
                if err.status != 404:
                    raise SGLangEngineError(f"{slot.url}: cannot destroy group {group.group_name}: {err}") from err
                log.warning("%s has no /destroy_weights_update_group (older SGLang)", slot.url)
        group.destroy()

    def _write_disk_bucket(self, bucket: NamedTensors, new_version: int) -> None:
        if self._disk_writer is None:
            config_dir = self._config_dir()
            self._disk_writer = DiskCheckpointWriter(Path(self.cfg.disk_dir), f"weights-v{new_version}",
                                                     Path(config_dir) if config_dir else None)
        self._disk_writer.add_bucket(bucket)

    def _finish_disk_sync(self, new_version: int) -> None:
        if self._disk_writer is None:
            raise SGLangEngineError("a disk sync needs at least one tensor before final=True")
        path, self._disk_writer = self._disk_writer.finish(), None
        body = update_from_disk_body(str(path), weight_version=str(new_version))
        self._map(lambda s: self._sync_post(s, "/update_weights_from_disk", body), self._sync.live())
        previous, self._last_disk_dir = self._last_disk_dir, path
        if previous is not None and previous != path:
            shutil.rmtree(previous)

    # ------------------------------------------------------------------ several trainer ranks

    def sync_report(self) -> dict[str, bool]:
        """After a complete sync: {url: holds the current weights} for the servers this engine posts to
        itself (all of them; a colocated leader's own one; none for a follower or a colocated non-leader).
        The trainer merges every rank's report and hands it to adopt_sync_report on every rank."""
        if self._sync is not None:
            raise SGLangEngineError("sync_report called in the middle of a weight sync (no final=True update yet)")
        if not self.posts_weights:
            return {}
        if self.colocated is not None:
            own = self.slots[self.colocated.server_index]
            mine = [own] if self.colocated.is_leader else []
        else:
            mine = self.slots
        return {s.url: not s.dead and s.weight_version == self.weight_version for s in mine}

    def adopt_sync_report(self, report: Mapping[str, bool]) -> None:
        """Take the posting ranks' word (merged sync_reports) on the servers they fed: a server reported
        current serves the current weights (and is in service again if this engine had given up on it: the
        poster reached it), one reported not current is stale until the next sync. Servers not in the
        report keep this engine's own view."""
        self.release_sync_buffers()  # every rank has passed the sync: the servers have copied the buckets
        by_url = {s.url: s for s in self.slots}
        unknown = sorted(set(report) - set(by_url))
        if unknown:
            raise SGLangEngineError(f"sync report names servers this engine does not know: {unknown}")
        for url, current in report.items():
            slot = by_url[url]
            if current:
                slot.dead, slot.last_error = False, ""
                slot.weight_version = self.weight_version
            else:
                slot.weight_version = -1

    # ------------------------------------------------------------------ memory and cache

    def _memory_slots(self) -> list[ServerSlot]:
        if self.colocated is not None:
            slots = [self.slots[self.colocated.server_index]] if self.colocated.is_leader else []
        else:
            slots = self.slots
        live = [s for s in slots if not s.dead]
        missing = [s.url for s in live if not s.info.memory_saver]
        if missing:
            raise SGLangEngineError(f"releasing memory needs servers started with --enable-memory-saver; not: {missing}")
        return live

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """POST /release_memory_occupation: all regions, or ``tags`` (kv_cache, weights, cuda_graph).
        SGLang asserts that no request is running: call between rollouts only."""
        self._check_open()
        body = {"tags": list(tags)} if tags else {}
        self._map(lambda s: self._admin(s, "/release_memory_occupation", body), self._memory_slots())
        self._released |= set(tags or MEMORY_TAGS)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """POST /resume_memory_occupation for the released regions among ``tags`` (all when None); nothing
        when none of them is released. Resuming ['weights'] before a sync and ['kv_cache'] after it keeps
        the peak low; released weights hold garbage until the next sync."""
        self._check_open()
        wanted = [t for t in (tags or MEMORY_TAGS) if t in self._released]
        if not wanted:
            return
        body = {"tags": wanted} if tags else {}
        self._map(lambda s: self._admin(s, "/resume_memory_occupation", body), self._memory_slots())
        self._released -= set(wanted)

    def flush_cache(self) -> None:
        """POST /flush_cache to every live server; SGLang refuses (400) while requests run, so that is retried."""
        self._check_open()

        def flush(slot: ServerSlot) -> None:
            for attempt in range(1, self.cfg.max_retries + 2):
                try:
                    self._call(slot, "POST", "/flush_cache", None)
                    return
                except ServerRejected as err:
                    if attempt > self.cfg.max_retries:
                        raise SGLangEngineError(f"{slot.url}/flush_cache refused {attempt} times: {err}") from err
                    self._sleep(self._policy.delay_s(attempt))
                except RetriesExhausted as err:
                    raise SGLangEngineError(str(err)) from err

        self._map(flush, [s for s in self.slots if not s.dead])

    # ------------------------------------------------------------------ health and shutdown

    def healthy(self) -> bool:
        """True when every server is in service, its process (if ours) alive, and /health answers."""
        if self._closed:
            return False
        return all(not s.dead and (s.process is None or s.process.alive())
                   and probe_health(s.url, HEALTH_PATH, timeout_s=self.cfg.health_timeout_s) for s in self.slots)

    def server_states(self) -> dict[str, str]:
        return {s.url: s.state(self.weight_version) for s in self.slots}

    def _check_open(self) -> None:
        if self._closed:
            raise SGLangEngineError("the engine was shut down")

    def shutdown(self) -> None:
        """Stop the servers we launched and the request threads; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._group is not None:
            self._group.destroy()
            self._group = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        for slot in self.slots:
            if slot.process is not None:
                slot.process.stop()

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


# ----------------------------------------------------------------------------------------------------
# Getting servers
# ----------------------------------------------------------------------------------------------------

def launch_servers(cfg: SGLangConfig, *, command_for: Callable[[int], list[str]] | None = None) -> list[ServerSlot]:
    """Start ``cfg.launch.servers`` servers concurrently and wait until all are healthy; on any failure
    stop the ones started and raise. ``command_for(i)`` replaces the SGLang command (tests start stand-ins)."""
    launch = cfg.launch
    python = os.path.expanduser(launch.python) if launch.python else sys.executable  # '~/...' in YAML
    make = command_for or (lambda i: launch_command(launch, i, python))
    connect_host = "127.0.0.1" if launch.host == "0.0.0.0" else launch.host  # a server on all interfaces
    device_env = cpu_server_env(libcuda_standin_dir(), os.environ) if launch.device == "cpu" else None
    processes = [ServerProcess(make(i), f"http://{connect_host}:{launch.base_port + i}",
                               Path(launch.log_dir) / f"sglang-{launch.host}-{launch.base_port + i}.log",
                               env=launch_env(launch, device_env), startup_timeout_s=launch.startup_timeout_s,
                               poll_s=launch.health_poll_s)
                 for i in range(launch.servers)]
    # spawned from this thread, so that they die with it (ServerProcess.spawn); the health waits run in parallel
    spawn_errors = []
    for p in processes:
        try:
            p.spawn()
        except ServerStartError as err:  # a port in use: reported with the others below
            spawn_errors.append(err)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(processes)) as pool:
        futures = [pool.submit(p.wait_ready) for p in processes if p.alive()]
        concurrent.futures.wait(futures)
    errors = spawn_errors + [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for p in processes:
            p.stop()
        raise SGLangEngineError(f"{len(errors)} of {len(processes)} SGLang servers failed to start: {errors[0]}") from errors[0]
    return [ServerSlot(url=p.url, process=p) for p in processes]


def attach_servers(cfg: SGLangConfig) -> list[ServerSlot]:
    """Wait (up to attach_timeout_s) for servers started elsewhere to answer /health."""
    for url in cfg.urls:
        wait_healthy(url.rstrip("/"), deadline_s=cfg.attach_timeout_s, poll_s=min(2.0, cfg.attach_timeout_s))
    return [ServerSlot(url=url.rstrip("/")) for url in cfg.urls]


__all__ = ["ColocatedSync", "SGLangEngine", "SGLangEngineError", "ServerSlot", "ack_from_leader", "attach_servers",
           "gather_to_leader", "launch_servers"]
