"""On-policy distillation's loss term (losses.distill_penalty) and its place in policy_loss."""
import pytest
import torch

from gspo_megatron.algorithms import LossConfig, LossNormalisers, packed_batch, policy_loss
from gspo_megatron.algorithms.config import DistillConfig
from gspo_megatron.algorithms.losses import distill_penalty
from gspo_megatron.typed_config import ConfigError, build


def tiny_batch(logp, teacher, requires_grad=True):
    """Two sequences of 3 and 2 tokens; the third token of sequence 0 is off the mask."""
    logp = torch.tensor(logp, requires_grad=requires_grad)
    return packed_batch(logp, logp.detach().clone(), cu_seqlens=torch.tensor([0, 3, 5]),
                        advantages=torch.tensor([1.0, -1.0]), mask=torch.tensor([True, True, False, True, True]),
                        teacher_logprobs=torch.tensor(teacher))


LOGP = [-1.0, -2.0, -0.3, -0.5, -1.5]
TEACHER = [-1.5, -1.0, -9.0, -0.5, -0.2]


def test_k1_term_and_gradient_by_hand():
    batch = tiny_batch(LOGP, TEACHER)
    value, metrics = distill_penalty(batch, LossNormalisers(num_seqs=2, num_tokens=4), estimator="k1",
                                     aggregation="seq_mean_token_mean")
    # d = logp - teacher on the mask: seq 0 (2 tokens): 0.5, -1.0; seq 1: 0.0, -1.3
    expected = ((0.5 - 1.0) / 2 + (0.0 - 1.3) / 2) / 2
    assert value.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["distill_kl_sum"].item() == pytest.approx(0.5 - 1.0 + 0.0 - 1.3, abs=1e-6)
    (grad,) = torch.autograd.grad(value, batch.logprobs)
    # k1: d loss / d logp_t = sg[d_t] / (|y_i| num_seqs); 0 off the mask
    assert torch.allclose(grad, torch.tensor([0.5 / 4, -1.0 / 4, 0.0, 0.0, -1.3 / 4]), atol=1e-6)


def test_k3_term_and_gradient_by_hand():
    batch = tiny_batch(LOGP, TEACHER)
    value, _ = distill_penalty(batch, LossNormalisers(num_seqs=2, num_tokens=4), estimator="k3",
                               aggregation="token_mean")
    d = torch.tensor([0.5, -1.0, 0.0, -1.3])
    r = torch.exp(-d)
    assert value.item() == pytest.approx(float((r - 1 + d).sum() / 4), abs=1e-6)
    (grad,) = torch.autograd.grad(value, batch.logprobs)
    want = (1 - r) / 4
    assert torch.allclose(grad, torch.tensor([want[0], want[1], 0.0, want[2], want[3]]), atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_teacher_equal_to_student_gives_zero_term_and_zero_gradient(estimator):
    batch = tiny_batch(LOGP, LOGP)
    value, metrics = distill_penalty(batch, LossNormalisers(num_seqs=2, num_tokens=4), estimator=estimator,
                                     aggregation="seq_mean_token_mean")
    (grad,) = torch.autograd.grad(value, batch.logprobs)
    assert value.item() == 0.0 and metrics["distill_kl_sum"].item() == 0.0
    assert torch.count_nonzero(grad) == 0


def test_policy_loss_adds_the_term_with_its_coefficient_and_only_drops_the_policy_term():
    norm = LossNormalisers(num_seqs=2, num_tokens=4)
    loss_config = LossConfig()
    plain, _ = policy_loss(loss_config, tiny_batch(LOGP, TEACHER), norm)
    term, _ = distill_penalty(tiny_batch(LOGP, TEACHER), norm, estimator="k1", aggregation="seq_mean_token_mean")
    both_batch = tiny_batch(LOGP, TEACHER)
    both, metrics = policy_loss(loss_config, both_batch, norm,
                                distill=DistillConfig(teacher_dir="t", coef=0.7, estimator="k1"))
    assert both.item() == pytest.approx(plain.item() + 0.7 * term.item(), abs=1e-6)
    assert "distill_kl_sum" in metrics and "pg_loss" in metrics
    only_batch = tiny_batch(LOGP, TEACHER)
    only, metrics = policy_loss(loss_config, only_batch, norm,
                                distill=DistillConfig(teacher_dir="t", coef=0.7, estimator="k1", only=True))
    assert only.item() == pytest.approx(0.7 * term.item(), abs=1e-6)
    assert metrics["pg_loss"].item() == pytest.approx(plain.item(), abs=1e-6)  # still logged
    (g_only,) = torch.autograd.grad(only, only_batch.logprobs)
    distill_batch = tiny_batch(LOGP, TEACHER)
    term, _ = distill_penalty(distill_batch, norm, estimator="k1", aggregation="seq_mean_token_mean")
    (g_term,) = torch.autograd.grad(term, distill_batch.logprobs)
    assert torch.allclose(g_only, 0.7 * g_term)  # the GSPO term adds no gradient under distill.only


def test_policy_loss_refuses_a_batch_without_teacher_logprobs():
    logp = torch.tensor(LOGP, requires_grad=True)
    batch = packed_batch(logp, logp.detach(), cu_seqlens=torch.tensor([0, 3, 5]), advantages=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="distill.teacher_dir"):
        policy_loss(LossConfig(), batch, LossNormalisers(num_seqs=2, num_tokens=5), distill=DistillConfig(teacher_dir="t"))


@pytest.mark.parametrize("fields,field", [({"estimator": "k2"}, "distill.estimator"),
                                          ({"teacher_dir": "t", "coef": 0.0}, "distill.coef"),
                                          ({"coef": -1.0}, "distill.coef"),
                                          ({"only": True}, "distill.only")])
def test_bad_distill_config_names_the_field(fields, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build(DistillConfig, fields, "distill")
