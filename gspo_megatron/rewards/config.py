"""The ``rewards:`` config section."""
from __future__ import annotations

import dataclasses
import re

from gspo_megatron.rewards.code import CodeRewardConfig
from gspo_megatron.rewards.math import MathRewardConfig
from gspo_megatron.typed_config import check

BUILTIN_TERMS = ("math", "code", "synthetic")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclasses.dataclass
class RewardTermConfig:
    """One reward term. ``name`` is a built-in ("math", "code", "synthetic") or ``module:function``.

    A custom function is ``f(sample: dict, response: str) -> float`` (or ``async def``), or with
    ``batched: true`` ``f(samples: list[dict], responses: list[str]) -> list[float]`` (sync or async).
    ``key`` names the term in metrics (default: the built-in name or the function name).
    ``range``: [low, high] the term's rewards lie in (the built-ins: [0, 1]); a reward outside it scores
    0 and is counted as an error naming the term. Correctness (accuracy, pass@k) is the verifier's own
    verdict (``Verdict.correct``); a function that returns a plain number is correct at ``high`` when it
    declares a range, and judges no correctness when it does not (docs/rewards.md, "Correctness").
    """

    name: str
    weight: float = 1.0
    batched: bool = False
    key: str | None = None
    range: tuple[float, float] | None = None

    def validate(self, path: str) -> None:
        check(self.name in BUILTIN_TERMS or bool(_IMPORT_PATH.match(self.name)), f"{path}.name",
              f"must be one of {list(BUILTIN_TERMS)} or 'module.path:function', got {self.name!r}")
        check(not (self.batched and self.name in BUILTIN_TERMS), f"{path}.batched",
              "applies to custom functions only")
        check(self.key is None or bool(re.fullmatch(r"[\w.-]+", self.key)), f"{path}.key",
              "may contain letters, digits, '_', '.', '-' only")
        if self.range is not None:
            check(len(self.range) == 2 and self.range[0] < self.range[1], f"{path}.range",
                  f"must be [low, high] with low < high, got {list(self.range)}")
            check(self.name not in BUILTIN_TERMS, f"{path}.range",
                  f"the built-in {self.name!r} scores in [0, 1]; range applies to custom functions")

    @property
    def declared_range(self) -> tuple[float, float] | None:
        """The range rewards are checked against: the built-ins' [0, 1], else ``range`` (None: unchecked)."""
        return (0.0, 1.0) if self.name in BUILTIN_TERMS else self.range

    @property
    def metric_key(self) -> str:
        return self.key or self.name.rsplit(":", 1)[-1]


@dataclasses.dataclass
class RewardConfig:
    """Reward = sum_k weight_k * term_k(sample, response), computed in a worker pool.

    num_workers: reward processes (0 runs everything in the calling process: timeout_s and the stop signals then
        interrupt a reward through Python signal handlers, rewards/in_process.py).
    timeout_s: per response; a response whose verifier takes longer scores 0 and is counted
        (a batched term gets timeout_s times its batch length; an async chunk gets timeout_s + 5).
    async_chunk_size: responses per task for async per-response functions (awaited concurrently).
    startup_timeout_s: how long workers may take to start and import the reward functions.
    import_dirs: folders put first on the import path for ``module:function`` terms (default: the config
        file's folder, so a reward module beside the config imports); a training run imports each custom
        term at start-up, and a failure is one line naming the term (trainer/config.py).
    max_print_bytes: what the reward functions may print per scored batch (workers' stdout and stderr, an
        in-process reward's ``print``), all together; the rest is cut, one log line says how much
        (``rewards/print_cut_bytes``; gspo_megatron/print_cap.py).
    stop_failure_fraction: a training batch in which a term with weight != 0 fails (error or timeout) on more
        than this fraction of its responses is a failing batch for that term.
    stop_after_failing_batches: this many failing batches of one term in a row stop the run (0: never); a batch
        in which such a term fails on every response stops it at once (trainer/finite.py). The stop names the
        term and writes each term's first traceback to the run folder (reward_failures.log).
    """

    terms: list[RewardTermConfig] = dataclasses.field(default_factory=lambda: [RewardTermConfig("math")])
    num_workers: int = 2
    timeout_s: float = 60.0
    async_chunk_size: int = 32
    startup_timeout_s: float = 120.0
    math: MathRewardConfig = dataclasses.field(default_factory=MathRewardConfig)
    code: CodeRewardConfig = dataclasses.field(default_factory=CodeRewardConfig)
    import_dirs: list[str] = dataclasses.field(default_factory=list)
    max_print_bytes: int = 65536
    stop_failure_fraction: float = 0.5
    stop_after_failing_batches: int = 3

    def validate(self, path: str) -> None:
        check(len(self.terms) > 0, f"{path}.terms", "needs at least one reward term")
        keys = [t.metric_key for t in self.terms]
        for i, k in enumerate(keys):
            check(keys.index(k) == i, f"{path}.terms[{i}].key",
                  f"metric key {k!r} is used twice; set a distinct 'key'")
        check(self.num_workers >= 0, f"{path}.num_workers", "must be >= 0")
        check(self.timeout_s > 0, f"{path}.timeout_s", "must be > 0")
        check(self.async_chunk_size >= 1, f"{path}.async_chunk_size", "must be >= 1")
        check(self.startup_timeout_s > 0, f"{path}.startup_timeout_s", "must be > 0")
        check(self.max_print_bytes >= 0, f"{path}.max_print_bytes", f"must be >= 0, got {self.max_print_bytes}")
        check(0 <= self.stop_failure_fraction < 1, f"{path}.stop_failure_fraction",
              f"must be in [0, 1) (every response failing stops the run anyway), got {self.stop_failure_fraction}")
        check(self.stop_after_failing_batches >= 0, f"{path}.stop_after_failing_batches",
              f"must be >= 0 (0: never), got {self.stop_after_failing_batches}")


__all__ = ["BUILTIN_TERMS", "RewardConfig", "RewardTermConfig"]
