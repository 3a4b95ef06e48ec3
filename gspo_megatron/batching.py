"""Training sequences and their micro-batches: the neutral data the trainer builds and the Megatron seam
consumes (pure torch; imports nothing from Megatron).

Token alignment. A sequence is prompt + response, ``tokens[0:L]`` with the response at ``[P, L)``. The
model reads all L tokens; the logit at position t predicts token t + 1, so the log-prob of response token
j sits at position j - 1. Every per-token tensor of a micro-batch is laid out at those *label positions*
([b, s], s >= L - 1 after padding), and ``loss_mask`` is True exactly on response-token positions.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import torch


@dataclasses.dataclass
class TrainSequence:
    """One prompt + response for training.

    tokens:           [L] int64, prompt then response;
    prompt_len:       P (the response is tokens[P:]);
    advantage:        A_i (GSPO / GRPO) -- or token_advantages [L - P] (GSPO-token);
    old_logprobs, ref_logprobs, rollout_logprobs, teacher_logprobs: [L - P] float32 per response token,
                      optional (teacher: the distillation teacher's, trainer step 5).
    routed_experts:   [R, num_moe_layers, top_k] int, optional: the experts Routing Replay forces in this
                      sequence's forwards, row p for model input position p (R = L - 1: an engine's
                      record, "R3"; or R = L: a RoutingRecorder's, "R2"). See ``megatron/routing.py``.
    routing_key:      (data-parallel rank, index), optional: where ``routed_experts`` waits until the step's
                      shares are cut (R3, trainer/routing_exchange.py).
    response_mask:    [L - P] bool, optional (multi-turn trajectories, ``rollout/agent_loop.py``): True on
                      the tokens the model sampled. Tool-output and chat-template tokens (False) stay in
                      the sequence the model reads but leave ``loss_mask``, so the loss, the log-ratios,
                      the KL and |y_i| count the model's own tokens only (GSPO's ratio, Eq. 7).
    """

    tokens: torch.Tensor
    prompt_len: int
    advantage: float = 0.0
    token_advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    routing_key: tuple[int, int] | None = None

    @property
    def response_len(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len

    @property
    def loss_tokens(self) -> int:
        """|y_i|: the response tokens the loss counts (the model's own tokens of a multi-turn trajectory)."""
        return self.response_len if self.response_mask is None else int(self.response_mask.sum())


def pack_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose *padded* size (count x longest) stays within
    ``max_tokens``: longest first, each into the first micro-batch it fits (first-fit decreasing).

    A sequence longer than the budget gets a micro-batch of its own. Deterministic for given lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    longest: list[int] = []
    for i in order:
        for b, members in enumerate(bins):
            if (len(members) + 1) * max(longest[b], lengths[i]) <= max_tokens:
                members.append(i)
                longest[b] = max(longest[b], lengths[i])
                break
        else:
            bins.append([i])
            longest.append(lengths[i])
    return bins


def _round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


PER_TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs", "teacher_logprobs", "token_advantages")


def present_fields(seqs: Sequence[TrainSequence]) -> tuple[str, ...]:
    """The optional per-token fields every sequence of ``seqs`` carries."""
    return tuple(name for name in PER_TOKEN_FIELDS if seqs and all(getattr(q, name) is not None for q in seqs))


def collate(seqs: Sequence[TrainSequence], pad_multiple: int = 1, pad_id: int = 0, rows: int = 0,
            min_len: int = 1, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Pad sequences into one micro-batch. Per-token tensors are at label positions (see module doc).

    ``rows`` / ``min_len`` pad the batch to at least that many rows / positions (padding rows have an
    all-False loss mask). Returns input_ids, position_ids, labels [b, s] int64; loss_mask [b, s] bool;
    padding_mask [b, s] bool (True past each sequence's end and on padding rows, Megatron's convention);
    advantages [b] (or token_advantages [b, s]); old/ref/rollout/teacher_logprobs [b, s] when every sequence
    has them.
    """
    lengths = [int(q.tokens.numel()) for q in seqs]
    s = _round_up(max([min_len] + lengths), pad_multiple)
    b = max(rows, len(seqs))
    out = {
        "input_ids": torch.full((b, s), pad_id, dtype=torch.long),
        "labels": torch.full((b, s), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((b, s), dtype=torch.bool),
        "padding_mask": torch.ones((b, s), dtype=torch.bool),
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
    }
    fields = present_fields(seqs) if fields is None else fields
    per_token = {name: torch.zeros((b, s), dtype=torch.float32) for name in fields}
    if seqs:
        # One masked write per tensor instead of a slice per row: a boolean mask takes the values in row-major
        # order, which is the order of the concatenated sequences (all fields, in every position they fill).
        n = len(seqs)
        if min(q.prompt_len for q in seqs) < 1:
            raise ValueError("collate: every sequence needs prompt_len >= 1 (the first response token is "
                             "predicted from the last prompt position)")
        position = torch.arange(s)
        length = torch.tensor(lengths).unsqueeze(1)
        start = torch.tensor([q.prompt_len - 1 for q in seqs]).unsqueeze(1)
        out["input_ids"][:n][position < length] = torch.cat([q.tokens for q in seqs])
        out["labels"][:n][position < length - 1] = torch.cat([q.tokens[1:] for q in seqs])
        response = (position >= start) & (position < length - 1)
        out["loss_mask"][:n] = response
        if any(q.response_mask is not None for q in seqs):
            out["loss_mask"][:n][response] = torch.cat([_model_token_mask(q) for q in seqs])
        out["padding_mask"][:n] = position >= length
        for name, tensor in per_token.items():
            values = [getattr(q, name) for q in seqs]
            bad = [i for i, (q, v) in enumerate(zip(seqs, values)) if v.numel() != q.response_len]
            if bad:
                raise ValueError(f"collate: sequence {bad[0]} has {values[bad[0]].numel()} {name} for "
                                 f"{seqs[bad[0]].response_len} response tokens")
            tensor[:n][response] = torch.cat(values).to(torch.float32)
    out.update(per_token)
    if "token_advantages" not in per_token:
        out["advantages"] = torch.zeros(b, dtype=torch.float32)
        out["advantages"][:len(seqs)] = torch.tensor([q.advantage for q in seqs], dtype=torch.float32)
    return out


def _model_token_mask(q: TrainSequence) -> torch.Tensor:
    """[L - P] bool: which response tokens the loss counts (all unless the sequence has a response_mask)."""
    if q.response_mask is None:
        return torch.ones(q.response_len, dtype=torch.bool)
    if q.response_mask.numel() != q.response_len:
        raise ValueError(f"collate: response_mask has {q.response_mask.numel()} entries for {q.response_len} "
                         "response tokens")
    return q.response_mask.to(torch.bool)


def split_for_data_parallel(items: Sequence, dp_size: int, dp_rank: int) -> list:
    """This DP rank's share of a mini-batch: a contiguous slice, sizes differing by at most one."""
    n = len(items)
    start = dp_rank * n // dp_size
    stop = (dp_rank + 1) * n // dp_size
    return list(items[start:stop])


def iter_minibatches(items: Sequence, count: int) -> Iterable[list]:
    """Split a rollout batch into ``count`` mini-batches of near-equal size, in order."""
    n = len(items)
    for k in range(count):
        yield list(items[k * n // count:(k + 1) * n // count])
