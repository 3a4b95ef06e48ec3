"""Routing Replay (R3) records travel to the data-parallel rank that trains them, not to every rank.

The rollout's data-parallel gather (``schedule.rollouts.Rollouts.score_and_gather``) hands every rank the whole batch:
prompts, responses, log-probs and rewards, which advantages, dynamic sampling and the mini-batch split need
on every rank. The engine's routed experts are by far its largest part (num_moe_layers x top_k ids per
token: Qwen3-30B-A3B 384 bytes a token in uint8) and a rank trains only its share of each mini-batch. So

1. ``RoutingHold.keep`` takes each sample's routed experts out before the gather and leaves a key
   ``(data-parallel rank, index)`` on the sample (``Sample.routing_key``), which reaches the
   ``TrainSequence`` built from it;
2. once the step's shares are cut (the same on every rank), ``RoutingHold.deliver`` sends each rank the
   records of the sequences it trains: one ``scatter_object_list`` per source rank, so each record moves
   once, to one rank.

Records not delivered by the step (groups dynamic sampling dropped, samples overlong masking left out) are
dropped at ``deliver``.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from gspo_megatron.batching import TrainSequence


class RoutingHold:
    """This rank's routed-expert records between the rollout's gather and the step's update.

    dp_rank, dp_size: this rank's place in ``group`` (the data-parallel group; None: no collectives, one rank).
    """

    def __init__(self, dp_rank: int, dp_size: int, group=None):
        self.dp_rank, self.dp_size, self.group = dp_rank, dp_size, group
        self._held: dict[tuple[int, int], torch.Tensor] = {}

    def keep(self, samples: Sequence) -> list:
        """``samples`` without their routed experts, each with ``routing_key``; the records ([P + T - 1,
        num_moe_layers, top_k], ``Sample.all_routed_experts``) stay here. Samples without routed experts
        are returned as they are."""
        out = []
        for sample in samples:
            if sample.routed_experts is None:
                out.append(sample)
                continue
            key = (self.dp_rank, len(self._held))
            self._held[key] = sample.all_routed_experts()
            out.append(dataclasses.replace(sample, routed_experts=None, prompt_routed_experts=None, routing_key=key))
        return out

    def deliver(self, shares: Sequence[Sequence[TrainSequence]]) -> None:
        """Set ``routed_experts`` on this rank's sequences from the ranks that hold them.

        shares: per data-parallel rank r, the sequences rank r trains this step (every rank passes the same
        split, built from the same gathered batch); the entry of this rank is updated in place.
        A collective over the data-parallel group; the hold is empty afterwards."""
        if len(shares) != self.dp_size:
            raise ValueError(f"RoutingHold.deliver: {len(shares)} shares for {self.dp_size} data-parallel ranks")
        outgoing = [{q.routing_key: self._held[q.routing_key] for q in share
                     if q.routing_key is not None and q.routing_key[0] == self.dp_rank} for share in shares]
        received: dict[tuple[int, int], torch.Tensor] = dict(outgoing[self.dp_rank])
        if self.dp_size > 1:
            for src in range(self.dp_size):
                part = [None]
                dist.scatter_object_list(part, outgoing if src == self.dp_rank else None,
                                         src=dist.get_global_rank(self.group, src), group=self.group)
                if src != self.dp_rank:
                    received.update(part[0])
        for q in shares[self.dp_rank]:
            if q.routing_key is not None:
                q.routed_experts = received[q.routing_key]
        self._held.clear()


__all__ = ["RoutingHold"]
