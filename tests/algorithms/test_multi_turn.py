"""GSPO on multi-turn trajectories: tool and template tokens are masked out of the loss, log-ratios, KL and
|y_i| (batching.TrainSequence.response_mask), so a trajectory trains exactly like its model tokens alone."""
import pytest
import torch

from gspo_megatron.algorithms import (LossConfig, LossNormalisers, packed_batch, padded_batch, policy_loss,
                                      turn_ids, turn_token_advantages)
from gspo_megatron.batching import TrainSequence, collate

# two trajectories after a 3-token prompt: model turn, tool/template tokens, model turn (, tool, model turn)
MASKS = [[1, 1, 1, 0, 0, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]]
PROMPT = 3
ADVANTAGES = [1.3, -0.7]
CONFIGS = [LossConfig(algorithm="gspo", clip_low=0.5, clip_high=0.5),  # no clipping: Eq. 10 everywhere
           LossConfig(algorithm="gspo"),  # the paper's clip range: some sequences clip
           LossConfig(algorithm="gspo", kl_coef=0.1, kl_estimator="k3"),
           LossConfig(algorithm="gspo_token", clip_low=0.5, clip_high=0.5),
           LossConfig(algorithm="grpo", aggregation="token_mean")]


def trajectory_batch(seed: int):
    """The two trajectories collated like the trainer collates them, with random per-token tensors."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for mask, a in zip(MASKS, ADVANTAGES):
        n = len(mask)
        seqs.append(TrainSequence(torch.randint(0, 50, (PROMPT + n,), generator=gen), PROMPT, advantage=a,
                                  response_mask=torch.tensor(mask, dtype=torch.bool)))
    mb = collate(seqs)
    shape = mb["loss_mask"].shape
    # tool positions get wild values: masked, they must not matter
    old = -torch.rand(shape, generator=gen) * 3
    new = (old + 0.01 * torch.randn(shape, generator=gen)).requires_grad_(True)
    ref = old + 0.05 * torch.randn(shape, generator=gen)
    return seqs, mb, new, old, ref


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.algorithm}-kl{c.kl_coef}-clip{c.clip_low}")
def test_gspo_on_a_trajectory_equals_gspo_on_its_model_tokens_alone(config):
    seqs, mb, new, old, ref = trajectory_batch(0)
    mask = mb["loss_mask"]
    assert mask.sum().item() == sum(q.loss_tokens for q in seqs) == sum(sum(m) for m in MASKS)
    num_tokens = float(mask.sum())
    norm = LossNormalisers(num_seqs=2.0, num_tokens=num_tokens)
    garbage = torch.where(mask, 0.0, 1e30)  # inserted positions hold nonsense; none of it may leak
    adv = torch.tensor(ADVANTAGES)
    if config.algorithm == "gspo_token":  # one advantage per model turn, each the trajectory's A_i (Eq. 16)
        rows = [turn_token_advantages(torch.tensor(m, dtype=torch.bool), torch.full((int(turn_ids(torch.tensor(m, dtype=torch.bool)).max()) + 1,), a))
                for m, a in zip(MASKS, ADVANTAGES)]
        adv = torch.zeros(mask.shape)
        for i, row in enumerate(rows):
            adv[i, PROMPT - 1:PROMPT - 1 + row.numel()] = row
    traj = padded_batch(new, old - garbage, mask, adv, ref_logprobs=ref + garbage)
    loss, _ = policy_loss(config, traj, norm)
    (grad,) = torch.autograd.grad(loss, new)

    # the same numbers for the model tokens only, packed, every token counted
    leaf = new.detach()[mask].clone().requires_grad_(True)
    lengths = mask.sum(dim=1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    alone = packed_batch(leaf, old[mask], cu_seqlens=cu, advantages=torch.tensor(ADVANTAGES),
                         ref_logprobs=ref[mask])
    reference = policy_loss(LossConfig(**{**config.__dict__, "algorithm": "gspo" if config.algorithm == "gspo_token"
                                          else config.algorithm}), alone, norm)[0]
    (grad_alone,) = torch.autograd.grad(reference, leaf)

    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad[mask], grad_alone, rtol=1e-5, atol=1e-10)
    assert torch.all(grad[~mask] == 0)
    assert grad_alone.abs().sum() > 0


def test_turn_ids_and_turn_advantages():
    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    assert turn_ids(mask).tolist() == [0, 0, -1, -1, 1, -1, 2, 2]
    adv = turn_token_advantages(mask, torch.tensor([0.5, -1.0, 2.0]))
    assert adv.tolist() == [0.5, 0.5, 0.0, 0.0, -1.0, 0.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="2 advantages for 3 model turns"):
        turn_token_advantages(mask, torch.tensor([1.0, 2.0]))
