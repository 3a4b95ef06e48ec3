"""The one interface every rollout engine implements (transformers on CPU, SGLang on GPU).

The trainer only talks to ``RolloutEngine``; engines differ in where the model lives and how weights
reach it, never in what ``generate`` returns.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Iterable, Literal, Protocol, Sequence, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]


class RolloutInputError(ValueError):
    """The request itself cannot be generated (a prompt beyond the context, an invalid sampling setting):
    any engine fails it the same way, so the trainer stops instead of restarting the engine."""


@dataclasses.dataclass
class SamplingParams:
    """Sampling settings for one ``generate`` call.

    ``top_k = 0`` and ``top_p = 1.0`` disable those filters. ``stop_token_ids`` end a response when sampled
    (the stop token is kept in the response). ``seed`` makes a call reproducible: sample j of prompt i is
    drawn from ``rollout.sampling.sample_seed(seed, prompt_offset + i, j)`` in every engine, so a response
    does not depend on the batch or rank that produced it. ``prompt_offset``: the global index of
    ``prompts[0]`` when a caller splits one batch of prompts over several ``generate`` calls (DP ranks).
    ``prompt_indices``: the global index of every prompt instead (the agent loop's later turns, whose
    prompts are the trajectories still running); ``prompt_index(i)`` is what both engines seed with.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    seed: int | None = None
    prompt_offset: int = 0
    return_routed_experts: bool = False
    prompt_indices: list[int] | None = None

    def prompt_index(self, i: int) -> int:
        """The global index of ``prompts[i]``: what sample j of it is seeded with (``sample_seed``)."""
        return self.prompt_indices[i] if self.prompt_indices is not None else self.prompt_offset + i


@dataclasses.dataclass
class Sample:
    """One sampled response.

    response_ids: [T] token ids of the response only (no prompt).
    logprobs: [T] float32 log-probabilities of those tokens under the engine's policy (see each engine's
        docs for whether they are taken before or after temperature scaling).
    finish_reason: why generation stopped.
    routed_experts: optional [T, num_moe_layers, top_k] int tensor: row t holds the experts of the model
        input position that produced response token t (prompt position P - 1 + t); None when not asked for
        or not an MoE model.
    prompt_routed_experts: optional [P - 1, num_moe_layers, top_k] int tensor: the experts of prompt
        positions 0 .. P - 2 (the prefill), present together with ``routed_experts``. Concatenated,
        ``[prompt_routed_experts; routed_experts]`` covers every position the engine fed
        (P + T - 1 rows): what Routing Replay "R3" replays in the training forwards. The samples of one
        group may share this tensor (one prefill per prompt): do not modify it in place.
    response_mask: optional [T] bools of a multi-turn trajectory (``rollout/agent_loop.py``): True on the
        tokens the model sampled, False on the tool-output and chat-template tokens inserted between its
        turns (their ``logprobs`` are 0.0). None: every token was sampled.
    tool_stats: optional counters of a trajectory (turns, tool_calls, tool_errors, ...: ``agent_loop.STAT_KEYS``).
    routing_key: set by the trainer when it has taken the routed experts out for the data-parallel gather:
        (data-parallel rank, index) of the rank that holds them (trainer/routing_exchange.py).
    """

    prompt_index: int
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: torch.Tensor | None = None
    prompt_routed_experts: torch.Tensor | None = None
    response_mask: list[bool] | None = None
    tool_stats: dict[str, int] | None = None
    routing_key: tuple[int, int] | None = None

    def all_routed_experts(self) -> torch.Tensor | None:
        """[P + T - 1, num_moe_layers, top_k]: the experts of every fed position, prompt then response."""
        if self.routed_experts is None:
            return None
        if self.prompt_routed_experts is None:
            raise ValueError(f"sample of prompt {self.prompt_index}: routed_experts without prompt_routed_experts; "
                             "the engine did not report the prompt positions' experts")
        return torch.cat([self.prompt_routed_experts.to(self.routed_experts.dtype), self.routed_experts])


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds expert ids 0 .. num_experts - 1: uint8 up to 256 experts (every
    model this project trains: Qwen3-30B-A3B 128, DeepSeek-V3 256, GLM-4.5 160), int16 up to 32768. Routed
    experts are kept and gathered in it: per token they cost num_moe_layers x top_k bytes instead of the
    engine's int32 (Qwen3-30B-A3B: 48 x 8 = 384 bytes instead of 1536)."""
    if num_experts < 1:
        raise ValueError(f"expert_id_dtype: num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 1 << 15:
        return torch.int16
    raise ValueError(f"expert_id_dtype: {num_experts} experts do not fit int16 ids")


def compact_routed_experts(samples: Sequence["Sample"], num_experts: int) -> list["Sample"]:
    """``samples`` with their routed experts (response and prompt rows) in ``expert_id_dtype(num_experts)``.
    A prompt record shared by the samples of a group stays shared (one tensor, pickled once when gathered).
    Samples without routed experts are returned as they are. Ids outside [0, num_experts) are refused."""
    if all(s.routed_experts is None for s in samples):
        return list(samples)
    dtype = expert_id_dtype(num_experts)
    converted: dict[int, torch.Tensor] = {}

    def compact(ids: torch.Tensor | None) -> torch.Tensor | None:
        if ids is None or ids.dtype == dtype:
            return ids
        if id(ids) not in converted:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
                raise ValueError(f"routed experts: ids outside [0, {num_experts}) (min {int(ids.min())}, "
                                 f"max {int(ids.max())}); does the engine serve the trained model?")
            converted[id(ids)] = ids.to(dtype)
        return converted[id(ids)]

    return [s if s.routed_experts is None else dataclasses.replace(
        s, routed_experts=compact(s.routed_experts), prompt_routed_experts=compact(s.prompt_routed_experts))
        for s in samples]


@dataclasses.dataclass
class GenerationResult:
    """What one ``submit`` produced: the samples (as ``generate`` returns them), the weight version (number
    of completed syncs) of the model that generated them, and the wall time of the generation (how much work
    an overlapped schedule can hide)."""

    samples: list[Sample]
    weight_version: int
    generate_s: float


class RolloutEngine(abc.ABC):
    """Generates groups of responses and takes weight updates from the trainer."""

    weight_version: int = 0

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams
    ) -> list[Sample]:
        """Sample ``samples_per_prompt`` responses for each prompt.

        Returns ``len(prompts) * samples_per_prompt`` samples, grouped by prompt in prompt order
        (samples ``i*G .. i*G+G-1`` belong to prompt ``i``) so groups are contiguous for the advantages.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool) -> None:
        """Load one bucket of HF-named tensors. ``final=True`` on the last bucket of a sync bumps
        ``weight_version`` (and, for servers, flushes the prefix cache)."""

    # True when the engine shares the trainer's accelerators and gives its memory back while the trainer
    # updates: the trainer then calls, per step, release_memory() after the rollout,
    # resume_memory(["weights"]) before the weight sync and resume_memory(["kv_cache", "cuda_graph"])
    # after it (the sync writes into resumed weights; the cache comes back only once they are in place).
    releases_memory: bool = False

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free accelerator memory held by the engine (colocated mode, before training): all regions, or
        ``tags`` of ``kv_cache``, ``weights``, ``cuda_graph``."""

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory released by ``release_memory`` (``tags``: those regions only); regions not
        released are left alone."""

    def healthy(self) -> bool:
        """True while the engine can serve ``generate``. The trainer asks before each weight sync in overlap
        mode (an engine process killed between requests is rebuilt there); otherwise it learns of a failed
        engine from the exception ``generate`` raises (``EngineSupervisor.generate``)."""
        return True

    def shutdown(self) -> None:
        """Stop servers and free resources; safe to call twice."""



class EngineDecorator(RolloutEngine):
    """A ``RolloutEngine`` around another, ``engine``: weight updates, memory, health and shutdown pass
    through; subclasses change ``generate`` (the multi-turn agent loop) or when it runs (``ahead.ThreadedEngine``)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.releases_memory = engine.releases_memory

    @property
    def weight_version(self) -> int:  # type: ignore[override]
        return self.engine.weight_version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool) -> None:
        self.engine.update_weights(named_tensors, final=final)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.engine.resume_memory(tags)

    def healthy(self) -> bool:
        return self.engine.healthy()

    def shutdown(self) -> None:
        self.engine.shutdown()

@runtime_checkable
class AsyncRolloutEngine(Protocol):
    """A ``RolloutEngine`` that can also generate ahead of the trainer (``train.rollout_mode: overlap``).

    The one ordering guarantee the overlapped schedule relies on: a generation submitted before a weight
    update runs entirely on the old weights (its ``GenerationResult.weight_version`` says which).
    Implemented by ``process_engine.ProcessRolloutEngine`` (its child runs requests in order) and by
    ``ahead.ThreadedEngine`` around any blocking engine (SGLang, the multi-turn agent loop)."""

    def submit(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams) -> int:
        """Queue one ``generate``; returns its request id at once."""

    def result(self, request_id: int) -> GenerationResult:
        """Wait for generation ``request_id``; its error, if it failed, is raised here."""

    def cancel(self, request_id: int) -> None:
        """Drop a submitted generation's result (one already running still finishes)."""

    def wait_submitted(self) -> None:
        """Block until every generation submitted so far has finished (servers shared by several trainer
        ranks need this on every rank before any rank posts weights)."""
