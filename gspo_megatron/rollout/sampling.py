"""Pure sampling maths for the in-process rollout engine: temperature, top-k, top-p, token log-probs, and
per-sample seeds.

Every function takes next-token logits ``[B, V]`` (one row per sequence being decoded) and works on them
as float32; nothing here knows about models or caches, so each piece is tested on its own.

Log-prob modes (what ``Sample.logprobs`` holds):

- ``"temperature"`` (the engines' default): ``log_softmax(logits / temperature)``, before top-k / top-p
  truncation: the distribution the tokens were sampled from, what SGLang reports by default and what the
  trainer's forward computes (``PolicyModel(temperature=...)``), so the train/rollout log-prob gap
  measures numerics only, not a difference in distributions.
- ``"raw"``: ``log_softmax(logits)``, the unmodified policy at temperature 1 (equal to ``"temperature"``
  at T = 1).
- ``"sampling"``: the exact distribution the token was drawn from (temperature, then top-k, then top-p,
  renormalised).

At ``temperature == 0`` decoding is greedy (argmax of the raw logits, top-k / top-p ignored). Like SGLang,
which turns temperature 0 into top_k = 1 at temperature 1 (srt/sampling/sampling_params.py), ``"raw"`` and
``"temperature"`` then report ``log_softmax(logits)``; ``"sampling"`` reports the point mass, 0.0.

Randomness is per sample: sample j of prompt i draws its uniforms from its own seed
``sample_seed(call seed, i, j)`` (``sample_uniforms``), so a response does not depend on which rank, batch
or chunk produced it; the SGLang engine sends the same seeds as ``sampling_seed``.
"""
from __future__ import annotations

import hashlib
from typing import Literal

import torch

LogprobMode = Literal["raw", "temperature", "sampling"]
LOGPROB_MODES: tuple[str, ...] = ("raw", "temperature", "sampling")

# float64 rows of the cumulative distribution are built this many elements at a time, so a 150k vocabulary
# with a few hundred rows does not need gigabytes.
_CDF_CHUNK_ELEMENTS = 1 << 23


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row, -inf elsewhere (ties with the k-th value are kept).

    logits: [B, V] float. ``top_k <= 0`` or ``top_k >= V`` returns ``logits`` unchanged.
    """
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the most probable tokens until their mass reaches ``top_p``, -inf elsewhere.

    A token is kept when the probability of all strictly more probable tokens is below ``top_p``, so the
    most probable token always survives; tokens tied with the least probable kept one are kept too.
    logits: [B, V] float (already temperature-scaled). ``top_p >= 1`` returns ``logits`` unchanged.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_logits.gather(-1, kept - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def sampling_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The logits of the distribution tokens are drawn from: ``filter_p(filter_k(logits / T))``.

    logits: [B, V]; returns [B, V] float32 with -inf on filtered tokens. Requires ``temperature > 0``.
    """
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return apply_top_p(apply_top_k(scaled, top_k), top_p)


def sample_seed(base_seed: int, prompt_index: int, sample_index: int) -> int:
    """A distinct, reproducible 63-bit seed per (call seed, prompt, sample).

    SGLang's seeded sampler draws from (seed, position) only (layers/sampler.py multinomial_with_seed), so
    G samples of one prompt with one seed would be identical; each sample gets its own. The trainer's call
    seed is a function of (run seed, step) and ``prompt_index`` is global in the step, so the seed of a
    response does not depend on the parallel layout.
    """
    digest = hashlib.blake2b(f"{base_seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_uniforms(base_seed: int, prompt_indices: list[int], samples_per_prompt: int, steps: int) -> torch.Tensor:
    """[len(prompt_indices) * samples_per_prompt, steps] float64 uniforms in [0, 1), prompt-major: row
    ``k * G + j`` is sample j of prompt ``prompt_indices[k]``, drawn from its own ``sample_seed``; column t
    decides its t-th token."""
    rows = []
    for i in prompt_indices:
        for j in range(samples_per_prompt):
            generator = torch.Generator().manual_seed(sample_seed(base_seed, i, j))
            rows.append(torch.rand(steps, generator=generator, dtype=torch.float64))
    return torch.stack(rows)


def sample_inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``softmax(logits)`` by inverting the cumulative distribution at the
    row's uniform number.

    One uniform number per row (not one per vocabulary entry, as Gumbel or exponential races need) keeps
    this ~25x cheaper than ``torch.multinomial`` on CPU. The CDF is float64 so its rounding cannot bias the
    draw; a token of probability exactly 0 is never chosen, because its CDF step is empty.
    logits: [B, V] (may hold -inf); uniforms: [B] float64 in [0, 1); returns [B] int64.
    """
    rows, vocab = logits.shape
    uniforms = uniforms.to(device=logits.device, dtype=torch.float64).view(rows, 1)
    chunk_rows = max(1, _CDF_CHUNK_ELEMENTS // vocab)
    tokens = []
    for start in range(0, rows, chunk_rows):
        cdf = torch.softmax(logits[start : start + chunk_rows].double(), dim=-1).cumsum_(dim=-1)
        total = cdf[:, -1:]
        # u * total < total strictly, so the search always lands on a token with non-zero mass.
        below_total = torch.nextafter(total, torch.zeros_like(total))
        target = torch.minimum(uniforms[start : start + chunk_rows] * total, below_total)
        tokens.append(torch.searchsorted(cdf, target, right=True).squeeze(-1))
    return torch.cat(tokens).clamp_(max=vocab - 1)


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    uniforms: torch.Tensor,
    logprob_mode: LogprobMode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row and its log-prob under ``logprob_mode`` (see the module docstring).

    logits: [B, V] raw model logits; uniforms: [B] float64, each row's random number for this token (unused
    when greedy). Returns (tokens [B] int64, logprobs [B] float32).
    """
    raw = logits.float()
    if temperature == 0.0:
        tokens = raw.argmax(dim=-1)
        if logprob_mode != "sampling":
            return tokens, _gather_logprobs(raw, tokens)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    drawn_from = sampling_logits(raw, temperature, top_k, top_p)
    tokens = sample_inverse_cdf(drawn_from, uniforms)
    if logprob_mode == "raw":
        return tokens, _gather_logprobs(raw, tokens)
    if logprob_mode == "temperature":
        return tokens, _gather_logprobs(raw / temperature, tokens)
    return tokens, _gather_logprobs(drawn_from, tokens)


def _gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[b, tokens[b]] for each row b. logits: [B, V]; tokens: [B] -> [B] float32."""
    chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
    return (chosen - torch.logsumexp(logits, dim=-1)).float()


__all__ = [
    "LOGPROB_MODES",
    "LogprobMode",
    "apply_top_k",
    "apply_top_p",
    "sample_inverse_cdf",
    "sample_next_tokens",
    "sample_seed",
    "sample_uniforms",
    "sampling_logits",
]
