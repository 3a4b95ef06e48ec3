"""Generations submitted ahead on an engine whose ``generate`` blocks: ``ThreadedEngine``.

The overlapped schedule (``train.rollout_mode: overlap``, trainer/schedule/overlap.py) needs an engine with
``submit`` / ``result`` / ``cancel`` / ``wait_submitted`` (``base.AsyncRolloutEngine``). ``ProcessRolloutEngine``
is one by construction (its child process). Every other engine (SGLang, whose generation already runs in
its servers; the multi-turn agent loop around it) gets the same interface from this one wrapper: each
submitted ``generate`` runs on one background thread, in submission order, and ``update_weights`` first
waits for every generation submitted before it, so a generation never sees partly updated weights.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Iterable, Sequence

import torch

from gspo_megatron.rollout.base import EngineDecorator, GenerationResult, RolloutEngine, Sample, SamplingParams


class ThreadedEngine(EngineDecorator):
    """``engine`` with ``submit`` / ``result`` / ``cancel`` / ``wait_submitted`` on one background thread
    (module docstring); everything else passes through to ``engine``."""

    def __init__(self, engine: RolloutEngine):
        super().__init__(engine)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._results: dict[int, concurrent.futures.Future] = {}
        self._unfinished: list[concurrent.futures.Future] = []
        self._next_id = 0

    def submit(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams) -> int:
        version = self.engine.weight_version  # updates wait for this generation: it runs on these weights
        prompts = [list(p) for p in prompts]

        def run() -> GenerationResult:
            start = time.perf_counter()
            samples = self.engine.generate(prompts, samples_per_prompt, params)
            return GenerationResult(samples, version, time.perf_counter() - start)

        request_id, self._next_id = self._next_id, self._next_id + 1
        future = self._pool.submit(run)
        self._results[request_id] = future
        self._unfinished.append(future)
        return request_id

    def result(self, request_id: int) -> GenerationResult:
        if request_id not in self._results:
            raise KeyError(f"no submitted generation {request_id} (never submitted, cancelled or already taken)")
        return self._results.pop(request_id).result()

    def cancel(self, request_id: int) -> None:
        self._results.pop(request_id).cancel()

    def wait_submitted(self) -> None:
        concurrent.futures.wait(self._unfinished)
        self._unfinished = [f for f in self._unfinished if not f.done()]

    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 params: SamplingParams) -> list[Sample]:
        return self.result(self.submit(prompts, samples_per_prompt, params)).samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool) -> None:
        self.wait_submitted()  # a generation submitted before the update runs entirely on the old weights
        super().update_weights(named_tensors, final=final)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._results.clear()
        self._unfinished = []
        super().shutdown()
