"""The engine supervisor: builds the rollout engine, restarts failed engines in agreement across ranks,
releases and resumes its memory around the update, and syncs the policy's weights into it (step 7).

Restarts. Every rank calls ``generate``, with or without prompts: one all-reduce per attempt tells every
rank whether any engine failed; the failed ranks rebuild theirs, every rank re-syncs (a collective over the
model's groups: the healthy engines get the same weights again) and the driver submits again what was
ahead (``on_restart``). An input error, or the same error right after a restart, stops the run instead
(``deterministic_engine_error``).

Versions. ``sync_weights(updates)`` makes the engine's weight version ``updates + 1`` (the initial sync
is version 1): the version of every generation submitted from then on (overlap's staleness, partial
rollouts' segments).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.rollout.base import RolloutEngine, RolloutInputError, Sample, SamplingParams
from gspo_megatron.trainer.schedule.overlap import InFlight


def deterministic_engine_error(error: Exception | None, previous: Exception | None) -> Exception | None:
    """The error to stop with instead of restarting the engine, or None: an input error (any engine fails
    the same request the same way), or the same error as before the last restart (type and message)."""
    if isinstance(error, RolloutInputError):
        return RolloutInputError(f"rollout: {error} (an input error: the engine was not restarted)")
    if error is not None and previous is not None and (type(error), str(error)) == (type(previous), str(previous)):
        return RuntimeError(f"rollout engine failed the same way after a restart, not restarted again "
                            f"({type(error).__name__}: {error})")
    return None


@dataclasses.dataclass
class EngineFactory:
    """Builds the run's engine: (the engine the trainer drives, the engine underneath every decorator).

    The transformers engine runs in the trainer's process, or (``asynchronous``: overlap) in a child process
    of its own; SGLang servers are reached through ``trainer/rollout_setup.connect_sglang`` on the first
    build (a collective over all ranks) and rebuilt on the failed ranks only. The multi-turn agent loop
    (``agent``) wraps the engine in one place: here, or inside the child process. Overlapped, an engine
    whose ``generate`` blocks is wrapped in ``ahead.ThreadedEngine``."""

    config: Any  # TrainConfig
    model_config: Any
    agent: Any  # agent_loop.AgentSpec or None
    asynchronous: bool
    environ: dict
    _sglang_rank: Any = None

    def __call__(self) -> tuple[RolloutEngine, RolloutEngine]:
        cfg = self.config
        if cfg.rollout.engine == "hf" and self.asynchronous:
            from gspo_megatron.rollout.process_engine import EngineSpec, ProcessRolloutEngine

            engine = ProcessRolloutEngine(EngineSpec(self.model_config.to_hf_config(), init_seed=cfg.model.init_seed,
                                                     threads=cfg.rollout.engine_threads, nice=cfg.rollout.engine_nice,
                                                     agent=self.agent))
            return engine, engine
        if cfg.rollout.engine == "hf":
            from gspo_megatron.rollout.hf_engine import HFRolloutEngine

            base = HFRolloutEngine(self.model_config.to_hf_config(), init_seed=cfg.model.init_seed)
        elif self._sglang_rank is not None:  # a rebuild: relaunch on the launching rank, else re-attach
            base = self._sglang_rank.build_engine()
        else:
            from gspo_megatron.trainer.rollout_setup import connect_sglang

            # every rank drives its share of the rollouts through all servers (docs/rollout.md, "Several
            # trainer ranks")
            self._sglang_rank, base = connect_sglang(cfg.rollout.sglang, self.environ, self.model_config)
        engine = base if self.agent is None else self.agent.wrap(base)
        if self.asynchronous:
            from gspo_megatron.rollout.ahead import ThreadedEngine

            engine = ThreadedEngine(engine)
        return engine, base


class EngineSupervisor:
    """The engine's owner (module docstring). ``export(engine)``: step 7's weight push (a collective);
    ``faults``: the run's counters (``engine_restarts`` is counted here); ``shared_servers``: SGLang servers
    that several trainer ranks drive."""

    MAX_RESTARTS_PER_CALL = 2

    def __init__(self, build: Callable[[], tuple[RolloutEngine, RolloutEngine]],
                 export: Callable[[RolloutEngine], dict[str, float]], faults: dict[str, int], *,
                 asynchronous: bool, shared_servers: bool, share_report: Callable[[RolloutEngine], None] | None,
                 rank: int):
        self.build, self.export, self.faults = build, export, faults
        self.asynchronous, self.shared_servers, self.share_report, self.rank = (asynchronous, shared_servers,
                                                                                share_report, rank)
        self.engine, self.base = build()
        self.version = 0  # the engine's weight version (1 after the first sync)
        self.updates = 0  # the RL updates in the weights last synced
        self.on_restart: Callable[[bool], None] = lambda rebuilt: None  # the driver's resubmit
        self.rebuilt_in_sync: bool | None = None  # the last sync's dead-engine check (None: none died)

    def _rebuild(self) -> None:
        self.engine.shutdown()
        self.engine, self.base = self.build()

    def generate(self, prompt_ids: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams,
                 flight: InFlight | None = None) -> list[Sample]:
        """engine.generate, restarting failed engines (module docstring) up to MAX_RESTARTS_PER_CALL times,
        each counted in faults/engine_restarts; past that the last error propagates with the count.
        ``flight`` (overlap): the batch was submitted ahead; its result is taken first, and after a restart
        it is generated again with the current weights (``flight.version`` follows)."""
        previous = None
        for attempt in range(self.MAX_RESTARTS_PER_CALL + 1):
            samples, error = [], None
            if prompt_ids:
                try:
                    if flight is not None and flight.request_id is not None and attempt == 0:
                        flight.take(self.engine.result)
                        samples = flight.samples
                    else:
                        samples = self.engine.generate(prompt_ids, samples_per_prompt, params)
                except Exception as err:  # noqa: BLE001 - contained: counted, engine rebuilt, re-raised at the limit
                    error = err
            stop = deterministic_engine_error(error, previous)
            flags = torch.tensor([0 if error is None else 1, int(stop is not None)])
            dist.all_reduce(flags)  # every rank restarts, or stops, together
            failed, stopping = int(flags[0]), int(flags[1])
            if failed == 0:
                return samples
            if stopping:
                if stop is not None:
                    raise stop from error
                raise RuntimeError(f"the rollout engine of {stopping} other rank(s) failed deterministically "
                                   f"(not restarted)")
            previous = error
            reason = str(error) if error is not None else f"the engine of {failed} other rank(s) failed"
            if attempt == self.MAX_RESTARTS_PER_CALL:
                raise RuntimeError(f"rollout engine failed after {attempt} restarts: {reason}") from error
            if error is not None:
                print(f"rank {self.rank}: rollout engine failed ({type(error).__name__}: {error}); restarting it",
                      flush=True)
                self._rebuild()
            self.sync_weights(self.updates, resubmit=False)
            self.faults["engine_restarts"] += failed
            if flight is not None:
                flight.version = self.version  # generated again by the weights just re-synced
            if self.asynchronous:
                # also after a refill round or an evaluation failed: a rebuilt engine lost the queued requests
                self.on_restart(error is not None or bool(self.rebuilt_in_sync))
        raise AssertionError("unreachable")

    def all_healthy(self) -> bool:
        """Whether every rank's engine can serve (a collective)."""
        healthy = torch.tensor([1 if self.engine.healthy() else 0])
        dist.all_reduce(healthy, op=dist.ReduceOp.MIN)
        return bool(int(healthy))

    def _replace_dead_engine(self) -> bool | None:
        """Overlap: an engine process killed since its last request (the OOM killer) is rebuilt before the
        weights go to it, counted in faults/engine_restarts. A collective: None when no rank's engine died,
        else whether this rank's was rebuilt."""
        mine_dead = not self.engine.healthy()
        dead = torch.tensor([1 if mine_dead else 0])
        dist.all_reduce(dead)
        if int(dead) == 0:
            return None
        if mine_dead:
            print(f"rank {self.rank}: rollout engine process is gone; restarting it", flush=True)
            self._rebuild()
        self.faults["engine_restarts"] += int(dead)
        return mine_dead

    def release_for_update(self, busy_during_update: bool) -> None:
        """Colocated servers give their GPUs back while the trainer works (after the rollout's gather: no
        rank still generates); ``sync_weights`` resumes them. Not while the engine generates ahead."""
        if self.engine.releases_memory and not busy_during_update:
            self.engine.release_memory()

    def sync_weights(self, updates: int, resubmit: bool = True) -> dict[str, float]:
        """Step 7: the policy's weights (holding ``updates`` RL updates) to the engine; a collective."""
        from gspo_megatron.megatron import device

        rebuilt = self.rebuilt_in_sync = self._replace_dead_engine() if self.asynchronous else None
        device.release_cached_memory()  # the update's cached blocks, free for the servers' resume
        self.engine.resume_memory(["weights"])  # a no-op unless released (RolloutEngine.releases_memory)
        if self.asynchronous and self.shared_servers:
            # the servers are shared, so every rank's batch generated ahead must be finished before any
            # rank posts weights (each engine waits for its own in update_weights; the barrier for all)
            self.engine.wait_submitted()
            dist.barrier()
        stats = self.export(self.engine)
        if self.share_report is not None:
            # the posting ranks' word on which servers took the weights; also the barrier that keeps every
            # rank from generating before the servers hold them
            self.share_report(self.base)
        device.release_cached_memory()  # the sync's buckets, before the KV cache comes back
        self.engine.resume_memory(["kv_cache", "cuda_graph"])
        self.updates, self.version = updates, updates + 1
        if rebuilt is not None and resubmit:  # the batches queued ahead are generated again, by every rank's engine
            self.on_restart(rebuilt)
        return stats

    def shutdown(self) -> None:
        self.engine.shutdown()
