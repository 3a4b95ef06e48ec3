"""Generations submitted ahead on an engine whose work already runs in other processes (SGLang servers).

The overlapped trainer (``train.rollout_mode: overlap``, trainer/overlap.py) needs ``submit`` / ``result`` /
``cancel`` and one ordering guarantee: a generation submitted before a weight update runs entirely on the
old weights. ``ProcessRolloutEngine`` gets both from its child, which executes requests in order. For SGLang
the generation is already elsewhere, so only the trainer's blocking HTTP calls need to leave the trainer's
thread: ``SubmittedGenerations`` runs each submitted ``generate`` on one background thread, in submission
order, and ``wait`` blocks until every generation submitted so far has finished; the engine calls it before
it sends weights (``SGLangEngine.update_weights``). Servers shared by several trainer ranks also need every
rank to have waited before any rank posts: ``Trainer.sync_weights`` adds a barrier.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Callable, Sequence

from gspo_megatron.rollout.base import Sample, SamplingParams
from gspo_megatron.rollout.process_engine import GenerationResult

Generate = Callable[[Sequence[Sequence[int]], int, SamplingParams], list[Sample]]


class SubmittedGenerations:
    """``submit`` / ``result`` / ``cancel`` around ``generate``, run on one background thread in submission
    order; ``version()`` is the weight version a submitted generation will run on (updates wait for it)."""

    def __init__(self, generate: Generate, version: Callable[[], int]):
        self._generate = generate
        self._version = version
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._results: dict[int, concurrent.futures.Future] = {}
        self._unfinished: list[concurrent.futures.Future] = []
        self._next_id = 0

    def submit(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams) -> int:
        version = self._version()
        prompts = [list(p) for p in prompts]

        def run() -> GenerationResult:
            start = time.perf_counter()
            samples = self._generate(prompts, samples_per_prompt, params)
            return GenerationResult(samples, version, time.perf_counter() - start)

        request_id, self._next_id = self._next_id, self._next_id + 1
        future = self._pool.submit(run)
        self._results[request_id] = future
        self._unfinished.append(future)
        return request_id

    def result(self, request_id: int) -> GenerationResult:
        """Wait for generation ``request_id``; its error, if it failed, is raised here."""
        if request_id not in self._results:
            raise KeyError(f"no submitted generation {request_id} (never submitted, cancelled or already taken)")
        return self._results.pop(request_id).result()

    def cancel(self, request_id: int) -> None:
        """Drop a submitted generation's result; one already running still finishes (``wait`` waits for it)."""
        self._results.pop(request_id).cancel()

    def wait(self) -> None:
        """Block until every generation submitted so far has finished (results and errors stay for ``result``)."""
        concurrent.futures.wait(self._unfinished)
        self._unfinished = [f for f in self._unfinished if not f.done()]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._results.clear()
        self._unfinished = []
