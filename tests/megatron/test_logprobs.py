"""Vocab-parallel log-probs and entropy (``megatron/logprobs.py``) against full-vocabulary ``log_softmax`` +
gather in float64: values and gradients at TP=1, with entropy, with padding columns, under chunking, and at
TP=2 on two gloo ranks (one spawn) against the unsplit computation, including a rank whose slice is all
padding; and at sampling temperatures T != 1, against log_softmax(logits / T) with its gradient w.r.t. the
raw logits.

The function works in float32 whatever the input dtype (the reductions are float32 on GPU too), so the
tolerances are float32's; a wrong gradient term is off by O(1e-2), far outside them.
"""
import pytest
import torch

from gspo_megatron.megatron.logprobs import naive_logprobs, vocab_parallel_logprobs
from gspo_megatron.megatron.spawn import run_distributed

TOL = {"rtol": 1e-5, "atol": 2e-5}


def _problem(n: int, vocab: int, padded: int, seed: int = 0):
    """float64 logits [n, padded] (padding columns hold large garbage that must be ignored), targets in
    [0, vocab), and upstream weights for log p and H."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(n, padded, generator=gen, dtype=torch.float64)
    logits[:, vocab:] = 50.0
    targets = torch.randint(0, vocab, (n,), generator=gen)
    w_logp, w_h = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    return logits, targets, w_logp, w_h


def _reference(logits, targets, vocab, w_logp, w_h, temperature=1.0):
    """float64 log_softmax(logits / T) + gather and entropy over the true vocabulary; gradient w.r.t. all
    columns of the raw logits."""
    z = logits.detach().clone().requires_grad_(True)
    logsm = torch.log_softmax(z[:, :vocab] / temperature, dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    (logp * w_logp).sum().backward(retain_graph=True)
    grad_logp = z.grad.clone()
    z.grad = None
    ((logp * w_logp).sum() + (entropy * w_h).sum()).backward()
    return logp.detach(), entropy.detach(), grad_logp, z.grad


def _ours(logits, targets, vocab, w_logp, w_h, with_entropy, **kwargs):
    z = logits.detach().clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(z, targets, vocab_size=vocab, with_entropy=with_entropy, **kwargs)
    objective = (logp * w_logp).sum() + ((entropy * w_h).sum() if with_entropy else 0.0)
    objective.backward()
    return logp.detach(), None if entropy is None else entropy.detach(), z.grad


TEMPERATURES = (1.0, 0.6, 1.3)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("vocab,padded", [(37, 37), (37, 40)])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_tp1_equals_log_softmax_gather(with_entropy, vocab, padded, temperature):
    logits, targets, w_logp, w_h = _problem(23, vocab, padded)
    ref_logp, ref_h, ref_grad_logp, ref_grad_both = _reference(logits, targets, vocab, w_logp, w_h, temperature)
    logp, entropy, grad = _ours(logits, targets, vocab, w_logp, w_h, with_entropy, temperature=temperature)
    assert logp.dtype == torch.float32 and grad.dtype == torch.float64
    torch.testing.assert_close(logp.double(), ref_logp, **TOL)
    torch.testing.assert_close(grad, ref_grad_both if with_entropy else ref_grad_logp, **TOL)
    if with_entropy:
        torch.testing.assert_close(entropy.double(), ref_h, **TOL)
    else:
        assert entropy is None
    assert torch.count_nonzero(grad[:, vocab:]) == 0  # padding columns get no gradient


def test_naive_reference_agrees():
    """``naive_logprobs`` (the benchmark's baseline) is the same computation."""
    logits, targets, w_logp, w_h = _problem(11, 29, 29)
    for temperature in TEMPERATURES:
        ref_logp, ref_h, _, _ = _reference(logits, targets, 29, w_logp, w_h, temperature)
        logp, entropy = naive_logprobs(logits, targets, with_entropy=True, temperature=temperature)
        torch.testing.assert_close(logp.double(), ref_logp, **TOL)
        torch.testing.assert_close(entropy.double(), ref_h, **TOL)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 100])
def test_chunking_does_not_change_results(chunk_tokens):
    logits, targets, w_logp, w_h = _problem(23, 37, 40, seed=1)
    whole = _ours(logits, targets, 37, w_logp, w_h, True, chunk_tokens=23)
    chunked = _ours(logits, targets, 37, w_logp, w_h, True, chunk_tokens=chunk_tokens)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"expected logits \[N, V\] and targets \[N\], got \(4, 5\) and \(3,\)"):
        vocab_parallel_logprobs(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        vocab_parallel_logprobs(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), temperature=0.0)


# ---- TP = 2 ------------------------------------------------------------------------------------------
# (true vocabulary, padded vocabulary): padding inside rank 1's slice, and rank 1's slice all padding
TP2_CASES = {"padding_on_rank1": (37, 40), "rank1_all_padding": (18, 40)}
TP2_CHUNKS = (1024, 5)
TP2_TEMPERATURE = 1.3  # every case also runs at this sampling temperature


def _tp2_worker(rank, world_size):
    import torch.distributed as dist

    out = {}
    for name, (vocab, padded) in TP2_CASES.items():
        logits, targets, w_logp, w_h = _problem(23, vocab, padded, seed=2)
        v_local = padded // world_size
        mine = logits[:, rank * v_local:(rank + 1) * v_local]
        for chunk in TP2_CHUNKS:
            for with_entropy in (False, True):
                for temperature in (1.0, TP2_TEMPERATURE):
                    out[name, chunk, with_entropy, temperature] = _ours(
                        mine, targets, vocab, w_logp, w_h, with_entropy, tp_group=dist.group.WORLD,
                        vocab_start=rank * v_local, chunk_tokens=chunk, temperature=temperature)
    return out


@pytest.fixture(scope="module")
def tp2_runs():
    return run_distributed(_tp2_worker, 2, ())


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(TP2_CASES))
@pytest.mark.parametrize("chunk_tokens", TP2_CHUNKS)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, TP2_TEMPERATURE])
def test_tp2_equals_unsplit(tp2_runs, case, chunk_tokens, with_entropy, temperature):
    vocab, padded = TP2_CASES[case]
    logits, targets, w_logp, w_h = _problem(23, vocab, padded, seed=2)
    ref_logp, ref_h, ref_grad_logp, ref_grad_both = _reference(logits, targets, vocab, w_logp, w_h, temperature)
    ref_grad = ref_grad_both if with_entropy else ref_grad_logp
    v_local = padded // 2
    for rank, out in enumerate(tp2_runs):
        logp, entropy, grad = out[case, chunk_tokens, with_entropy, temperature]
        torch.testing.assert_close(logp.double(), ref_logp, **TOL)  # every TP rank holds every token's value
        if with_entropy:
            torch.testing.assert_close(entropy.double(), ref_h, **TOL)
        torch.testing.assert_close(grad, ref_grad[:, rank * v_local:(rank + 1) * v_local], **TOL)
    if case == "rank1_all_padding":
        assert torch.count_nonzero(tp2_runs[1][case, chunk_tokens, with_entropy, temperature][2]) == 0
