"""Score (prompt sample, response) pairs with the configured reward terms in a pool of worker processes.

    pool = RewardPool(build(RewardConfig, yaml["rewards"], "rewards"))
    rewards, metrics = pool.score([(sample, response_text), ...])   # rewards: list[float], one per pair
    scores = pool.score_verdicts(batch)   # also scores.correct: list[bool], the verifiers' verdicts
    pool.close()

Each response gets ``sum_k weight_k * r_k`` over the terms. A verifier that raises, returns a
non-number, hangs past ``timeout_s`` or kills its worker scores 0 for that term and is counted in the
metrics (``rewards/<term>/errors``, ``rewards/<term>/timeouts``, ``rewards/worker_restarts``); the
pool replaces dead or killed workers. Nothing a verifier does propagates to the caller; only a broken
set-up (an import path that does not resolve, a sandbox that cannot run) raises, at construction.

Workers are fresh interpreters started with ``subprocess`` (the equivalent of a 'spawn' context, but
without re-importing the trainer's ``__main__``), so they start in well under a second and never load
torch unless a custom reward does.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

from gspo_megatron.print_cap import PrintCap
from gspo_megatron.rewards.config import BUILTIN_TERMS, RewardConfig
from gspo_megatron.rewards.in_process import InProcessLimits
from gspo_megatron.rewards.sandbox import probe_isolation
from gspo_megatron.rewards.terms import Item, Outcome, RewardSetupError, build_terms, evaluate
from gspo_megatron.rewards.types import sample_mapping

log = logging.getLogger(__name__)

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOT = "from gspo_megatron.rewards.worker import main; main({}, {}, {})"
_ASYNC_GRACE_S = 5.0


@dataclasses.dataclass
class _Task:
    task_id: int
    term_index: int
    indices: list[int]  # positions in the batch
    streamed: bool  # a sync per-response term: results arrive one by one, each on its own clock
    deadline_s: float  # per response when streamed, else for the whole task


@dataclasses.dataclass
class _Worker:
    proc: subprocess.Popen
    inbox: Connection  # we send
    outbox: Connection  # we receive
    started_at: float
    ready: bool = False
    task: _Task | None = None
    received: int = 0  # responses of the current task already scored
    deadline: float = 0.0  # when the current response (streamed) or task times out


Results = dict[tuple[int, int], Outcome]  # (term index, batch position) -> outcome


@dataclasses.dataclass
class Scores:
    """One batch's rewards (``sum_k weight_k * r_k``), whether each response is correct (see
    ``response_correct``; None: no term judges correctness) and the step metrics."""

    rewards: list[float]
    correct: list[bool | None]
    metrics: dict[str, float]


def _judgement(outcome: Outcome, term) -> bool | None:
    """One term's word on correctness: its verdict's own, else the top of its declared range, else none. A
    reward model gives a preference score, not a verdict: it never judges correctness."""
    if outcome.verdict.correct is not None:
        return outcome.verdict.correct
    if term.name == "reward_model":
        return None
    declared = term.declared_range
    return None if declared is None else outcome.verdict.reward == declared[1]


def response_correct(outcomes: list[Outcome | None], terms: list) -> bool | None:
    """Whether one response is correct, from its outcome under each term (``terms``: RewardTermConfig).

    Only terms that count (weight != 0) decide; every one that judges (``_judgement``) must say correct. A
    failed term (error, timeout, out of range) makes the response not correct. When no counting term judges
    (a reward model alone), the weight-0 terms that judge decide instead: a verifier kept beside a reward
    model as a monitor gives the run its accuracy. None when no term judges (plain numbers without a
    declared range): never a threshold on an arbitrary scale."""
    counting = [(o, t) for o, t in zip(outcomes, terms) if t.weight != 0]
    verdict = _all_judged(counting)
    if verdict is not None:
        return verdict
    judging_monitors = [(o, t) for o, t in zip(outcomes, terms) if t.weight == 0 and _judges(t)]
    return _all_judged(judging_monitors) if judging_monitors else None


def _judges(term) -> bool:
    """Whether ``term`` (RewardTermConfig) can judge correctness at all: a built-in verifier or a declared range
    (a custom function's Verdict may also say so; a reward model never does)."""
    return term.name != "reward_model" and (term.name in BUILTIN_TERMS or term.declared_range is not None)


def _all_judged(pairs: list) -> bool | None:
    """False when a term of ``pairs`` failed; else whether every judging term says correct (None: none judges)."""
    if any(o is None or o.verdict is None for o, _ in pairs):
        return False
    judged = [j for j in (_judgement(o, t) for o, t in pairs) if j is not None]
    return all(judged) if judged else None


def _out_of_range(outcome: Outcome, term, index: int) -> Outcome:
    """``outcome``, or an error outcome when its reward lies outside the term's declared range."""
    declared = term.declared_range
    if outcome.verdict is None or declared is None or declared[0] <= outcome.verdict.reward <= declared[1]:
        return outcome
    low, high = declared
    return Outcome(None, f"reward {outcome.verdict.reward:g} outside rewards.terms[{index}].range "
                         f"[{low:g}, {high:g}] of term {term.metric_key!r}", out_of_range=True)


def _kill(worker: _Worker) -> None:
    """SIGKILL the worker's process group (it is a session leader): custom rewards' children die too;
    sandboxes have their own death signal."""
    try:
        os.killpg(worker.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone
    worker.proc.wait()
    worker.inbox.close()
    worker.outbox.close()


def _shutdown(workers: list[_Worker], prints: PrintCap) -> None:
    for w in workers:
        if w.proc.poll() is None:
            try:
                w.inbox.send(("close",))
            except (BrokenPipeError, OSError):
                pass  # it died on its own; killed below anyway
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # killed next
        _kill(w)
    workers.clear()
    prints.close()


class RewardPool:
    """Scores batches with the terms of ``cfg``; see the module docstring."""

    def __init__(self, cfg: RewardConfig, on_failures: Callable[[int], None] | None = None):
        """on_failures(n): called after each batch with n > 0 failed (error or timeout) term scores (the
        trainer's ``faults/reward_failures`` counter)."""
        self.cfg = cfg
        self.on_failures = on_failures
        self.isolation: dict[str, Any] | None = None
        if any(t.name == "code" for t in cfg.terms):
            self.isolation = probe_isolation(cfg.code.sandbox)
            log.info("code sandbox isolation: %s", self.isolation)
        self._local_terms = build_terms(cfg) if cfg.num_workers == 0 else None
        self._workers: list[_Worker] = []
        self._term_kinds: list[tuple[bool, bool]] = (
            [(t.is_async, t.batched) for t in self._local_terms] if self._local_terms is not None else [])
        self._next_task_id = 0
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=20)
        self._prints = PrintCap(cfg.max_print_bytes, "the reward functions' output", "rewards.max_print_bytes")
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._prints)
        # each term's first failure in this pool's life (metric key -> its traceback, or the message of a
        # timeout or a dead worker): what trainer/finite.py's reward check writes to the run folder
        self.first_failures: dict[str, str] = {}
        if cfg.num_workers:
            self._workers.extend(self._spawn() for _ in range(cfg.num_workers))
            deadline = time.monotonic() + cfg.startup_timeout_s
            while not all(w.ready for w in self._workers):
                self._receive(max(0.0, deadline - time.monotonic()), {}, collections.deque(), collections.Counter())
                if time.monotonic() > deadline and not all(w.ready for w in self._workers):
                    self.close()
                    raise RewardSetupError(f"rewards: workers did not start within {cfg.startup_timeout_s} s")

    # -- workers ------------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.setdefault("OMP_NUM_THREADS", "1")  # a reward that imports numpy must not grab every core
        # the worker dies with us (processes.py); the kernel's signal follows the spawning thread, so a
        # worker spawned from another thread relies on its orphan watcher alone
        death_parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        proc = subprocess.Popen([sys.executable, "-c", _BOOT.format(to_worker_r, from_worker_w, death_parent)],
                                pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL, env=env,
                                stdout=self._prints.fd, stderr=self._prints.fd, start_new_session=True)
        os.close(to_worker_r)
        os.close(from_worker_w)
        worker = _Worker(proc, Connection(to_worker_w, readable=False), Connection(from_worker_r, writable=False),
                         started_at=time.monotonic())
        worker.inbox.send(("init", self.cfg, list(sys.path)))
        return worker

    def _replace(self, worker: _Worker) -> None:
        _kill(worker)
        self._workers[self._workers.index(worker)] = self._spawn()

    # -- scoring ------------------------------------------------------------------------------------
    def _new_task(self, term_index: int, indices: list[int], streamed: bool, deadline_s: float) -> _Task:
        self._next_task_id += 1
        return _Task(self._next_task_id, term_index, indices, streamed, deadline_s)

    def _plan(self, n: int) -> list[_Task]:
        """Split each term's responses into tasks: sync per-response terms in chunks of about a quarter
        of a worker's share (streamed back one result at a time), async terms in ``async_chunk_size``
        chunks, batched terms in one chunk per worker."""
        workers = max(1, self.cfg.num_workers)
        tasks = []
        for k, (is_async, batched) in enumerate(self._term_kinds):
            if batched:
                size = -(-n // workers)
            elif is_async:
                size = self.cfg.async_chunk_size
            else:
                size = min(64, -(-n // (4 * workers)))
            for start in range(0, n, max(1, size)):
                indices = list(range(start, min(n, start + size)))
                if batched:
                    tasks.append(self._new_task(k, indices, False, self.cfg.timeout_s * len(indices)))
                elif is_async:
                    tasks.append(self._new_task(k, indices, False, self.cfg.timeout_s + _ASYNC_GRACE_S))
                else:
                    tasks.append(self._new_task(k, indices, True, self.cfg.timeout_s))
        return tasks

    def _fail_task(self, worker: _Worker, results: Results, outcome: Outcome, pending: collections.deque) -> None:
        """The worker is gone or killed mid-task: the response it was on gets ``outcome``; the rest of a
        streamed task goes back to the queue, the rest of any other task gets ``outcome`` too."""
        task = worker.task
        if task is None:
            return
        if task.streamed:
            if worker.received < len(task.indices):  # else it had sent every result, only "done" was missing
                results[task.term_index, task.indices[worker.received]] = outcome
            rest = task.indices[worker.received + 1:]
            if rest:
                pending.appendleft(self._new_task(task.term_index, rest, True, task.deadline_s))
        else:
            for i in task.indices:
                results[task.term_index, i] = outcome
        worker.task = None

    def _receive(self, timeout_s: float, results: Results, pending: collections.deque,
                 stats: collections.Counter) -> None:
        """Wait up to ``timeout_s`` for messages and handle them; dead workers are replaced."""
        by_outbox = {w.outbox: w for w in self._workers}
        for conn in wait(list(by_outbox), timeout=timeout_s):
            worker = by_outbox[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                code = worker.proc.poll()
                if not worker.ready:
                    self.close()
                    raise RewardSetupError(f"rewards: a worker died while starting (exit code {code})")
                self._fail_task(worker, results, Outcome(None, f"reward worker died (exit code {code})"), pending)
                stats["worker_restarts"] += 1
                self._replace(worker)
                continue
            kind = message[0]
            if kind == "ready":
                worker.ready = True
                self._term_kinds = message[1]
            elif kind == "init_error":
                self.close()
                raise RewardSetupError(f"rewards: a worker could not build the reward terms:\n{message[1]}")
            elif kind == "item":
                _, _, position, outcome = message
                task = worker.task
                results[task.term_index, task.indices[position]] = outcome
                worker.received = position + 1
                worker.deadline = time.monotonic() + task.deadline_s
            else:  # "done"
                _, _, outcomes = message
                task = worker.task
                for i, outcome in zip(task.indices, outcomes):
                    results[task.term_index, i] = outcome
                worker.task = None

    def _run_in_workers(self, items: list[Item], tasks: list[_Task], stats: collections.Counter) -> Results:
        expected = sum(len(t.indices) for t in tasks)
        pending = collections.deque(tasks)
        results: Results = {}
        while len(results) < expected:
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.ready and worker.task is None and pending:
                    task = pending.popleft()
                    worker.task, worker.received, worker.deadline = task, 0, now + task.deadline_s
                    try:
                        worker.inbox.send(("task", task.task_id, task.term_index, [items[i] for i in task.indices],
                                           self.cfg.timeout_s))
                    except OSError:  # BrokenPipeError: killed from outside while idle (the OOM killer)
                        # it never saw the task, so no response is lost: the task goes back to the queue
                        worker.task = None
                        pending.appendleft(task)
                        stats["worker_restarts"] += 1
                        self._replace(worker)
            deadlines = [w.deadline for w in self._workers if w.task is not None]
            deadlines += [w.started_at + self.cfg.startup_timeout_s for w in self._workers if not w.ready]
            next_deadline = min(deadlines, default=now + 1.0)
            self._receive(max(0.0, next_deadline - time.monotonic()), results, pending, stats)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.task is not None and now > worker.deadline:
                    timeout = Outcome(None, f"timed out after {worker.task.deadline_s:.1f} s", timed_out=True)
                    self._fail_task(worker, results, timeout, pending)
                    stats["worker_restarts"] += 1
                    self._replace(worker)
                elif not worker.ready and now > worker.started_at + self.cfg.startup_timeout_s:
                    self.close()
                    raise RewardSetupError(f"rewards: a replacement worker did not start within "
                                           f"{self.cfg.startup_timeout_s} s")
        return results

    def score(self, batch: Sequence[tuple[Any, str]]) -> tuple[list[float], dict[str, float]]:
        """``(rewards, metrics)`` of ``score_verdicts``."""
        scores = self.score_verdicts(batch)
        return scores.rewards, scores.metrics

    def score_verdicts(self, batch: Sequence[tuple[Any, str]]) -> Scores:
        """Rewards, correctness and step metrics for ``batch`` = [(prompt sample, response text), ...].

        A prompt sample is a mapping (or a dataclass such as ``data.PromptSample``) with the fields the
        terms read: ``answer`` (math, synthetic), ``tests`` (code), ``meta`` (synthetic), or anything a
        custom function wants. ``len(rewards) == len(correct) == len(batch)``.
        """
        if self._finalizer.alive is False:
            raise RuntimeError("RewardPool.score called after close()")
        start = time.monotonic()
        # A prompt's G responses share one sample object: convert it once, not once per response.
        converted: dict[int, dict] = {}
        items: list[Item] = []
        for s, r in batch:
            if id(s) not in converted:
                converted[id(s)] = dict(sample_mapping(s))
            items.append((converted[id(s)], r))
        stats: collections.Counter = collections.Counter()
        tasks = self._plan(len(items))
        if self._local_terms is not None:
            results: Results = {}
            # timeouts and stop signals in this process; its prints through the cap
            with self._prints.capturing(), InProcessLimits().installed() as limits:
                for t in tasks:
                    outcomes = evaluate(self._local_terms[t.term_index], [items[i] for i in t.indices],
                                        self.cfg.timeout_s, limits)
                    results.update(((t.term_index, i), o) for i, o in zip(t.indices, outcomes))
        else:
            results = self._run_in_workers(items, tasks, stats)
        stats["print_cut_bytes"] = self._prints.end_window()
        return self._combine(len(items), results, stats, time.monotonic() - start)

    def _combine(self, n: int, results: Results, stats: collections.Counter, elapsed_s: float) -> Scores:
        per_term = [[0.0] * n for _ in self.cfg.terms]
        metrics: dict[str, float] = {}
        counts: collections.Counter = collections.Counter()
        results = {(k, i): _out_of_range(o, self.cfg.terms[k], k) for (k, i), o in results.items()}
        for (k, i), outcome in sorted(results.items()):
            key = self.cfg.terms[k].metric_key
            if outcome.out_of_range:
                counts[f"rewards/{key}/out_of_range"] += 1
            if outcome.verdict is not None:
                per_term[k][i] = outcome.verdict.reward
                for tag in outcome.verdict.tags:
                    counts[f"rewards/{key}/{tag}"] += 1
            elif outcome.timed_out:
                counts[f"rewards/{key}/timeouts"] += 1
                self.recent_errors.append(f"{key}: {outcome.error}")
                self.first_failures.setdefault(key, f"term {key!r}: {outcome.error}")
            else:
                counts[f"rewards/{key}/errors"] += 1
                self.recent_errors.append(f"{key}: {outcome.error}")
                self.first_failures.setdefault(key, outcome.traceback or f"term {key!r}: {outcome.error}")
        totals = [sum(t.weight * per_term[k][i] for k, t in enumerate(self.cfg.terms)) for i in range(n)]
        correct = [response_correct([results.get((k, i)) for k in range(len(self.cfg.terms))], self.cfg.terms)
                   for i in range(n)]
        for k, term in enumerate(self.cfg.terms):
            key = term.metric_key
            metrics[f"rewards/{key}/mean"] = sum(per_term[k]) / n if n else 0.0
            metrics[f"rewards/{key}/errors"] = float(counts.pop(f"rewards/{key}/errors", 0))
            metrics[f"rewards/{key}/timeouts"] = float(counts.pop(f"rewards/{key}/timeouts", 0))
        metrics.update({k: float(v) for k, v in counts.items()})
        metrics["rewards/mean"] = sum(totals) / n if n else 0.0
        metrics["rewards/responses"] = float(n)  # the failure fractions' denominator (trainer/finite.py)
        metrics["rewards/errors"] = sum(metrics[f"rewards/{t.metric_key}/errors"] for t in self.cfg.terms)
        metrics["rewards/timeouts"] = sum(metrics[f"rewards/{t.metric_key}/timeouts"] for t in self.cfg.terms)
        metrics["rewards/worker_restarts"] = float(stats["worker_restarts"])
        metrics["rewards/print_cut_bytes"] = float(stats["print_cut_bytes"])
        metrics["rewards/time_s"] = elapsed_s
        failed = int(metrics["rewards/errors"] + metrics["rewards/timeouts"])
        if failed and self.on_failures is not None:
            self.on_failures(failed)
        if failed:
            log.warning("rewards: %d errors, %d timeouts in a batch of %d; latest: %s", metrics["rewards/errors"],
                        metrics["rewards/timeouts"], n, self.recent_errors[-1] if self.recent_errors else "")
        return Scores(totals, correct, metrics)

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_reward_pool(cfg: RewardConfig, on_failures: Callable[[int], None] | None = None) -> RewardPool:
    return RewardPool(cfg, on_failures)


__all__ = ["RewardPool", "Scores", "build_reward_pool", "response_correct"]
