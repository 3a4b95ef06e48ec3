"""Partial rollouts (``rollout.partial``, issue #30): a step does not wait for its longest responses.

Every step the engine gives each unfinished response at most ``rollout.partial_token_budget`` new tokens.
A group whose responses have all ended (a stop token, or ``rollout.max_new_tokens``) is scored and trained;
the others are carried into the next step with what they have: their tokens, the engine's log-probs of
those tokens and the weight version that sampled each token. Under the next step's weights they continue
from their token ids (the prompt and the response so far are the new "prompt"), so a finished response is
a list of ``Segment`` s, one per weight version that wrote part of it.

The behaviour policy of such a response is not one policy: token t was drawn by version v_t. Its
per-token behaviour log-probs ``behaviour_logprobs(segments)`` are each segment's own engine log-probs,
and the age of token t when trained at version v is ``v - v_t`` (``token_ages``). GSPO's sequence ratio
(Eq. 7) then reads, for a response y_i of segments S_1..S_m,

    log s_i = (1/|y_i|) * sum_m sum_{t in S_m} [ log pi_theta(y_t) - log pi_{v_m}(y_t) ]

which is what the loss computes when ``old_logprobs`` are the behaviour log-probs (``rollout.logprobs_from:
engine``; the trainer's ``Sample.logprobs`` of a finished response are exactly ``behaviour_logprobs``).
With ``recompute`` pi_old would be the current weights for every token, blind to the older segments, so the
config accepts it only with truncated importance sampling (``loss.tis_mode``), which weights the recomputed
(proximal) pi_old towards these per-token behaviour log-probs (``rollout_logprobs``).

Bounds. A response gets ``budget`` tokens in every step it is in flight, so it ends within
``steps_in_flight(max_new_tokens, budget)`` steps and no trained token is older than that minus one: the
config requires this to be <= ``train.max_staleness`` (``PartialRollouts.take_finished`` checks every
token). The pool holds at most that many steps' prompts.

Overlap mode. A round is planned (``plan_round``: its engine calls) before it is generated, so the
trainer can submit a step's first round while the step before trains and apply its samples a step later
(``RoundCall.apply``, at the version that generated them): one update more per token, so the bound is
``steps_in_flight(max_new_tokens, budget)`` there.

Sampling. A fresh group's first segment is sampled exactly as without partial rollouts (the step's seed, G
samples per prompt, the prompt's global index), cut at ``budget`` tokens. A continuation is one row per
response, seeded by ``continuation_seed(step seed, round)`` and the response's own ``uid``. The calls of a
round are the same on every rank (``continuation_lengths``), so every rank joins every engine call's
collective even when it has nothing to continue.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Callable, Sequence

import torch

from gspo_megatron.rollout.base import Sample, SamplingParams

Generate = Callable[[list[list[int]], int, SamplingParams], list[Sample]]  # EngineSupervisor.generate's signature
UID_STRIDE = 1_000_003  # uid = (start step * UID_STRIDE + global prompt index) * G + sample: distinct in a run


@dataclasses.dataclass(frozen=True)
class Segment:
    """The tokens of one response that one weight version sampled: token_ids [n], the engine's log-probs of
    them [n] (the behaviour policy's), ``version`` (the number of updates in those weights) and, for Routing
    Replay R3, ``routed_experts`` [n, num_moe_layers, top_k]: the experts those weights chose at the n
    positions that produced the tokens (``Sample.routed_experts`` of the call that sampled them)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    routed_experts: torch.Tensor | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Segment: {len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs")
        if self.routed_experts is not None and self.routed_experts.shape[0] != len(self.token_ids):
            raise ValueError(f"Segment: {len(self.token_ids)} token_ids but {self.routed_experts.shape[0]} rows of "
                             "routed experts")


def behaviour_logprobs(segments: Sequence[Segment]) -> torch.Tensor:
    """[T] float32: log pi_{v_t}(y_t) for every token of the response, each from the version that sampled it."""
    return torch.tensor([lp for s in segments for lp in s.logprobs], dtype=torch.float32)


def token_versions(segments: Sequence[Segment]) -> torch.Tensor:
    """[T] int64: the weight version v_t that sampled each token."""
    return torch.tensor([s.version for s in segments for _ in s.token_ids], dtype=torch.long)


def token_ages(segments: Sequence[Segment], version: int) -> torch.Tensor:
    """[T] int64: v - v_t, how many updates each token is behind the weights ``version`` that train it."""
    ages = version - token_versions(segments)
    if ages.numel() and int(ages.min()) < 0:
        raise ValueError(f"token_ages: a segment of version {int(token_versions(segments).max())} is newer than "
                         f"the training version {version}")
    return ages


def steps_in_flight(max_new_tokens: int, budget: int) -> int:
    """The most steps a response can be generated over: ceil(max_new_tokens / budget)."""
    return math.ceil(max_new_tokens / budget)


def continuation_lengths(max_new_tokens: int, budget: int) -> list[int]:
    """The ``max_new_tokens`` of each continuation call of a round, the same on every rank. A response in
    flight holds a multiple of ``budget`` tokens (it got ``budget`` every round, else it ended), so its room
    is either >= ``budget`` (one call of ``budget``) or the remainder of max_new_tokens by budget (a call of
    that many, which keeps prompt + response within the positions of the config's check)."""
    rest = max_new_tokens % budget
    return [budget] + ([rest] if rest else [])


def continuation_seed(step_seed: int, round_index: int) -> int:
    """The seed of a round's continuation calls: not the fresh call's, so a continuation never reuses the
    random numbers of a fresh sample whose (prompt index, sample index) seeds collide with its uid."""
    digest = hashlib.blake2b(f"{step_seed}:continue:{round_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


@dataclasses.dataclass
class InFlightResponse:
    """One response of a group: its segments so far; ``finish_reason`` None while it is unfinished;
    ``prompt_routed_experts`` [P - 1, num_moe_layers, top_k]: the prompt's prefill experts from the call that
    sampled the first segment (R3; shared by the group's responses)."""

    uid: int
    segments: list[Segment] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_routed_experts: torch.Tensor | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def __len__(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def extend(self, sample: Sample, version: int, max_new_tokens: int) -> None:
        """Append the engine's continuation ``sample`` as a segment of ``version``, cut at ``max_new_tokens``
        in all; the response ends at a stop token or at the limit, else stays in flight."""
        if self.finish_reason is not None:
            raise ValueError(f"response {self.uid}: extended after it finished ({self.finish_reason})")
        if sample.finish_reason not in ("stop", "length"):
            raise ValueError(f"response {self.uid}: the engine returned finish_reason {sample.finish_reason!r}")
        room = max_new_tokens - len(self)
        ids, logprobs = sample.response_ids[:room], sample.logprobs[:room]
        routed = sample.routed_experts[:len(ids)] if sample.routed_experts is not None else None
        if not self.segments:
            self.prompt_routed_experts = sample.prompt_routed_experts
        if ids:
            self.segments.append(Segment(tuple(ids), tuple(float(x) for x in logprobs), version, routed))
        if sample.finish_reason == "stop" and len(sample.response_ids) <= room:
            self.finish_reason = "stop"
        elif len(self) >= max_new_tokens:
            self.finish_reason = "length"

    def routed_experts(self) -> torch.Tensor | None:
        """[T, num_moe_layers, top_k]: each segment's own records, in order, so every position replays the
        experts of the weights that sampled the token it produced (None: not recorded)."""
        records = [s.routed_experts for s in self.segments]
        if not records or any(r is None for r in records):
            return None
        return torch.cat([r.to(records[0].dtype) for r in records])

    def to_sample(self, prompt_index: int) -> Sample:
        """The finished response as the trainer's Sample: its log-probs are the behaviour log-probs; under R3
        its experts are the prompt's prefill record and the segments' own records (``routed_experts``)."""
        if self.finish_reason is None:
            raise ValueError(f"response {self.uid}: unfinished responses are not trained")
        routed = self.routed_experts()
        return Sample(prompt_index=prompt_index, response_ids=self.token_ids,
                      logprobs=behaviour_logprobs(self.segments).tolist(), finish_reason=self.finish_reason,
                      routed_experts=routed, prompt_routed_experts=self.prompt_routed_experts if routed is not None else None)


@dataclasses.dataclass
class InFlightGroup:
    """The G responses of one prompt; ``slot``: the prompt's global index in its start step's prompts."""

    prompt: Any  # data.dataset.PromptSample
    slot: int
    started: int
    responses: list[InFlightResponse]

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.responses)

    @property
    def key(self) -> tuple[int, int]:
        """(start step, global prompt index): the group's place in the run, the same at every layout; the
        pool holds its groups in this order."""
        return self.started, self.slot


@dataclasses.dataclass
class RoundCall:
    """One engine call of a round: ``prompts`` (each a prompt, or a prompt + a response so far) and the
    ``responses`` its samples extend, in the engine's output order (``samples_per_prompt`` per prompt)."""

    responses: list[InFlightResponse]
    prompts: list[list[int]]
    samples_per_prompt: int
    params: SamplingParams

    def apply(self, samples: Sequence[Sample], version: int, max_new_tokens: int) -> None:
        """Extend every response by its sample, a segment of weight ``version``."""
        if len(samples) != len(self.responses):
            raise ValueError(f"partial rollouts: the engine returned {len(samples)} samples for "
                             f"{len(self.responses)} responses")
        for response, sample in zip(self.responses, samples):
            response.extend(sample, version, max_new_tokens)


class PartialRollouts:
    """The pool of groups in flight on this rank (module docstring)."""

    def __init__(self, samples_per_prompt: int, budget: int, max_new_tokens: int, max_staleness: int):
        self.G, self.budget, self.max_new_tokens, self.max_staleness = (samples_per_prompt, budget, max_new_tokens,
                                                                        max_staleness)
        self.groups: list[InFlightGroup] = []

    def add(self, prompts: Sequence[Any], first_slot: int, step: int) -> None:
        """This rank's fresh prompts of ``step`` (the first at global index ``first_slot``)."""
        for k, prompt in enumerate(prompts):
            slot = first_slot + k
            uids = [(step * UID_STRIDE + slot) * self.G + j for j in range(self.G)]
            self.groups.append(InFlightGroup(prompt, slot, step, [InFlightResponse(u) for u in uids]))

    def generate_round(self, generate: Generate, params: SamplingParams, version: int, round_index: int,
                       only: set[tuple[int, int]] | None = None) -> None:
        """One round now: ``plan_round``'s calls made with ``generate`` and their samples applied at ``version``."""
        for call in self.plan_round(params, round_index, only):
            call.apply(generate(call.prompts, call.samples_per_prompt, call.params), version, self.max_new_tokens)

    def plan_round(self, params: SamplingParams, round_index: int,
                   only: set[tuple[int, int]] | None = None) -> list["RoundCall"]:
        """The engine calls of one round: ``budget`` more tokens for every unfinished response
        (``only``: of the groups with these ``InFlightGroup.key`` s). Round 0 first samples the fresh
        groups with ``params`` (the step's sampling, as without partial rollouts); then one continuation
        call per ``continuation_lengths`` entry. The same number of calls on every rank, empty or not (each
        is an engine call every rank joins). Overlap mode submits them ahead and applies them a step later."""
        unfinished = [g for g in self.groups if not g.done and (only is None or g.key in only)]
        running = [(g, r) for g in unfinished for r in g.responses if r.finish_reason is None and len(r) > 0]
        calls = []
        if round_index == 0:
            fresh = [g for g in self.groups if all(len(r) == 0 and r.finish_reason is None for r in g.responses)
                     and (only is None or g.key in only)]
            first = dataclasses.replace(params, max_new_tokens=min(self.budget, self.max_new_tokens))
            calls.append(RoundCall([r for g in fresh for r in g.responses], [list(g.prompt.prompt_ids) for g in fresh],
                                   self.G, first))
        seed = continuation_seed(params.seed, round_index)
        lengths = continuation_lengths(self.max_new_tokens, self.budget)
        rows = {n: [(g, r) for g, r in running if min(self.budget, self.max_new_tokens - len(r)) == n] for n in lengths}
        if sum(map(len, rows.values())) != len(running):  # an engine returned fewer tokens than asked, no stop
            raise RuntimeError(f"partial rollouts: responses in flight hold no multiple of "
                               f"rollout.partial_token_budget={self.budget} tokens")
        for n, pairs in rows.items():
            call = dataclasses.replace(params, seed=seed, prompt_offset=0, prompt_indices=[r.uid for _, r in pairs],
                                       max_new_tokens=n)
            calls.append(RoundCall([r for _, r in pairs], [list(g.prompt.prompt_ids) + r.token_ids for g, r in pairs],
                                   1, call))
        return calls

    def counts(self) -> tuple[int, int]:
        """(finished samples of finished groups, unfinished responses) on this rank."""
        finished = sum(len(g.responses) for g in self.groups if g.done)
        return finished, sum(r.finish_reason is None for g in self.groups for r in g.responses)

    def take_finished(self, version: int) -> tuple[list[InFlightGroup], dict[str, float], int]:
        """Remove and return the finished groups (in pool order: oldest first), this rank's counts
        (``partial/...``, to be summed over ranks) and the age of its oldest trained token. Raises if any
        token would be trained more than ``max_staleness`` updates after it was sampled (the config rules
        that out)."""
        finished = [g for g in self.groups if g.done]
        self.groups = [g for g in self.groups if not g.done]
        ages = [token_ages(r.segments, version) for g in finished for r in g.responses]
        oldest = max((int(a.max()) for a in ages if a.numel()), default=0)
        if oldest > self.max_staleness:
            raise RuntimeError(f"partial rollouts: a token {oldest} updates old would be trained "
                               f"(train.max_staleness={self.max_staleness})")
        carried = [r for g in self.groups for r in g.responses]
        return finished, {
            "partial/groups_trained": float(len(finished)),
            "partial/multi_version_responses": float(sum(len({s.version for s in r.segments}) > 1
                                                         for g in finished for r in g.responses)),
            "partial/carried_groups": float(len(self.groups)),
            "partial/carried_responses": float(sum(r.finish_reason is None for r in carried)),
            "partial/carried_tokens": float(sum(len(r) for r in carried)),
        }, oldest

    # ---- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> list[dict[str, Any]]:
        """The groups in flight as plain JSON data (float32 log-probs survive the float64 round trip)."""
        return [{"prompt": g.prompt.index, "slot": g.slot, "started": g.started,
                 "responses": [{"uid": r.uid, "finish_reason": r.finish_reason,
                                "prompt_routed_experts": tensor_to_dict(r.prompt_routed_experts),
                                "segments": [{"ids": list(s.token_ids), "logprobs": list(s.logprobs),
                                              "version": s.version, "routed_experts": tensor_to_dict(s.routed_experts)}
                                             for s in r.segments]}
                               for r in g.responses]} for g in self.groups]

    def load_state_dict(self, state: Sequence[dict[str, Any]], dataset) -> None:
        self.groups = [InFlightGroup(dataset[int(g["prompt"])], int(g["slot"]), int(g["started"]), [
            InFlightResponse(int(r["uid"]), [Segment(tuple(int(t) for t in s["ids"]),
                                                     tuple(float(x) for x in s["logprobs"]), int(s["version"]),
                                                     tensor_from_dict(s.get("routed_experts")))
                                             for s in r["segments"]], r["finish_reason"],
                             tensor_from_dict(r.get("prompt_routed_experts")))
            for r in g["responses"]]) for g in state]
        if any(len(g.responses) != self.G for g in self.groups):
            raise ValueError(f"partial rollouts: the checkpoint's groups do not hold rollout.samples_per_prompt={self.G} "
                             "responses")


def tensor_to_dict(value: torch.Tensor | None) -> dict[str, Any] | None:
    """An integer tensor (routed expert ids) as JSON data: its dtype, shape and values."""
    if value is None:
        return None
    return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape), "values": value.reshape(-1).tolist()}


def tensor_from_dict(data: dict[str, Any] | None) -> torch.Tensor | None:
    if data is None:
        return None
    return torch.tensor(data["values"], dtype=getattr(torch, data["dtype"])).view(data["shape"])


__all__ = ["InFlightGroup", "InFlightResponse", "PartialRollouts", "RoundCall", "Segment", "behaviour_logprobs",
           "continuation_lengths", "continuation_seed", "steps_in_flight", "token_ages", "token_versions"]
