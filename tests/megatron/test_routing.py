"""MoE routing record, drift and Routing Replay on Megatron-Core's TopKRouter.

Unit tests of the pure pieces, then one spawn of two gloo ranks that runs the real model at EP=1, EP=2
and TP=2 with sequence parallelism (``routing_workers.routing_checks``)."""
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.megatron import routing
from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config
from tests.megatron.routing_workers import ROUTING_LAYOUTS, routing_checks

LAYOUTS = list(ROUTING_LAYOUTS)


# ---- pure functions ------------------------------------------------------------------------------


def _random_sets(gen, n, num_experts, k):
    return torch.stack([torch.randperm(num_experts, generator=gen)[:k].sort().values for _ in range(n)])


def test_topk_from_routing_map_gives_ascending_sets():
    routing_map = torch.tensor([[False, True, False, True], [True, False, True, False], [False, False, True, True]])
    assert torch.equal(routing.topk_from_routing_map(routing_map, 2), torch.tensor([[1, 3], [0, 2], [2, 3]]))
    with pytest.raises(ValueError, match="exactly top_k=2"):
        routing.topk_from_routing_map(torch.tensor([[True, True, True, False]]), 2)


def test_routing_drift_against_set_comparison():
    gen = torch.Generator().manual_seed(0)
    before = {0: _random_sets(gen, 50, 8, 2), 3: _random_sets(gen, 50, 8, 2)}
    after = {layer: t.clone() for layer, t in before.items()}
    after[0][::3] = _random_sets(gen, 17, 8, 2)
    after[3][5] = ((before[3][5] + 1) % 8).sort().values  # a rotated pair of 8 is always another set
    after[3][7] = before[3][7].flip(0)  # the same set in another order is no change
    mask = torch.rand(50, generator=gen) > 0.4
    stats = routing.routing_drift(before, after, mask, num_layers=4)
    for layer in (0, 3):
        expected = sum(1 for t in range(50) if mask[t] and set(before[layer][t].tolist()) != set(after[layer][t].tolist()))
        assert stats["changed"][layer] == expected
        assert stats["tokens"][layer] == int(mask.sum())
    assert stats["changed"][3] == int(mask[5]) and stats["changed"][0] > 0
    assert stats["tokens"][1] == 0 and stats["tokens"][2] == 0  # layers not recorded here
    fractions = routing.drift_fractions(stats)
    assert fractions["set_per_layer"][0] == stats["changed"][0] / int(mask.sum())
    assert fractions["set_per_layer"][1] == 0
    assert fractions["set_overall"] == stats["changed"].sum() / (2 * int(mask.sum()))
    # the headline: the paper's fraction of activated experts that changed, by brute force per expert
    for layer in (0, 3):
        moved = sum(len(set(before[layer][t].tolist()) - set(after[layer][t].tolist())) for t in range(50) if mask[t])
        assert stats["moved"][layer] == moved and stats["slots"][layer] == 2 * int(mask.sum())
        assert fractions["per_layer"][layer] == moved / (2 * int(mask.sum()))
    assert fractions["overall"] == stats["moved"].sum() / (4 * int(mask.sum()))
    assert fractions["overall"] < fractions["set_overall"]  # some changed sets kept one of their 2 experts
    # no distributed group: reduce is the identity
    assert all(torch.equal(routing.reduce_drift(stats)[k], stats[k]) for k in routing.DRIFT_SUMS)


def test_per_expert_rate_is_a_kth_of_the_set_rate_when_one_expert_moves():
    """k = 4: a token whose set changed by one expert counts 1 in the set rate and 1/4 in the paper's."""
    before = {0: torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])}
    after = {0: torch.tensor([[0, 1, 2, 9], [7, 6, 5, 4]])}  # token 0: one expert moved; token 1: same set
    fractions = routing.drift_fractions(routing.routing_drift(before, after))
    assert fractions["set_overall"] == 0.5 and fractions["overall"] == 1 / 8
    assert routing.moved_experts(before[0], after[0]).tolist() == [1, 0]


def test_routing_drift_rejects_mismatched_records():
    a = {0: torch.zeros(4, 2, dtype=torch.long)}
    with pytest.raises(ValueError, match="different layers"):
        routing.routing_drift(a, {1: a[0]})
    with pytest.raises(ValueError, match="not the same tokens"):
        routing.routing_drift(a, {0: torch.zeros(5, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="token_mask has 3 elements"):
        routing.routing_drift(a, a, torch.ones(3, dtype=torch.bool))


def test_moe_layer_numbers_follow_moe_layer_freq():
    assert routing.moe_layer_numbers(SimpleNamespace(moe_layer_freq=1, num_layers=3)) == [0, 1, 2]
    assert routing.moe_layer_numbers(SimpleNamespace(moe_layer_freq=2, num_layers=5)) == [0, 2, 4]
    assert routing.moe_layer_numbers(SimpleNamespace(moe_layer_freq=[0, 1, 1], num_layers=3)) == [1, 2]
    with pytest.raises(ValueError, match="pattern of length 2"):
        routing.moe_layer_numbers(SimpleNamespace(moe_layer_freq=[0, 1], num_layers=3))


def test_router_order_is_megatrons_sequence_major_flattening():
    b, s, k = 2, 3, 2
    experts = torch.arange(b * s * k).view(b, s, k)
    flat = routing.to_router_order(experts)
    # Megatron: hidden [s, b, h] -> logits.view(-1, E): token row = position * b + batch row
    for row in range(b):
        for pos in range(s):
            assert torch.equal(flat[pos * b + row], experts[row, pos])


def test_experts_to_batch_pads_with_fill_and_checks_ids():
    rows = [torch.tensor([[[1, 3]], [[0, 2]]]), torch.tensor([[[2, 3]]])]  # [R, 1 layer, 2]
    batch = routing.experts_to_batch(rows, 4, num_experts=4)
    assert batch.shape == (2, 4, 1, 2) and batch.dtype == torch.long
    assert torch.equal(batch[0, :2], rows[0]) and torch.equal(batch[1, :1], rows[1])
    pad = batch[0, 2:, 0]  # [2 padded positions, k]: distinct experts per token, not all 0..k-1
    assert all(len(set(ids.tolist())) == 2 for ids in pad) and set(pad.reshape(-1).tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        routing.experts_to_batch([torch.tensor([[[routing.NO_EXPERT, 1]]])], 4, num_experts=4)
    with pytest.raises(ValueError, match="more than seq_len=1"):
        routing.experts_to_batch(rows, 1, num_experts=4)


@pytest.mark.parametrize("num_experts,top_k,ep", [(8, 2, 4), (128, 8, 8), (6, 4, 3)])
def test_padding_experts_spread_over_every_ep_rank(num_experts, top_k, ep):
    """Padding tokens (right padding, padding rows, each sample's unfed last position) are routed by Routing
    Replay too: with experts 0..k-1 for all of them every padded token lands on EP rank 0. They must spread
    over all experts (hence every EP rank, each holding a contiguous block of num_experts / ep) evenly."""
    rows = [torch.zeros(3, 2, top_k, dtype=torch.long) + torch.arange(top_k)] + [torch.empty(0, 2, top_k, dtype=torch.long)] * 3
    batch = routing.experts_to_batch(rows, 40, num_experts=num_experts)
    padded = torch.ones(4, 40, dtype=torch.bool)
    padded[0, :3] = False
    ids = batch[padded]  # [padded tokens, layers, k]
    assert all(len(set(t.tolist())) == top_k for t in ids.reshape(-1, top_k))  # a top-k set: distinct ids
    per_rank = torch.bincount(ids.reshape(-1) // (num_experts // ep), minlength=ep)
    # each expert within one of the others per layer (2 layers): a rank within its expert count x 2 of the others
    assert int(per_rank.min()) > 0 and int(per_rank.max()) - int(per_rank.min()) <= (num_experts // ep) * 2, per_rank.tolist()
    per_expert = torch.bincount(ids[:, 0].reshape(-1), minlength=num_experts)
    assert int(per_expert.max()) - int(per_expert.min()) <= 1, per_expert.tolist()
    # deterministic: a pure function of the padded positions
    assert torch.equal(batch, routing.experts_to_batch(rows, 40, num_experts=num_experts))
    assert torch.equal(routing.padding_experts(5, top_k, num_experts), routing.padding_experts(5, top_k, num_experts))


def test_recorded_rows_split_per_sample():
    forward = torch.arange(2 * 5 * 1 * 2).view(2, 5, 1, 2)
    samples = routing.recorded_rows([forward], [[5, 3]])
    assert [tuple(s.shape) for s in samples] == [(5, 1, 2), (3, 1, 2)]
    assert torch.equal(samples[1], forward[1, :3])


# ---- the real model on two gloo ranks ------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    return run_distributed(routing_checks, 2, (tiny_moe_config(),))


def _records_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_recorder_matches_megatrons_record_and_is_layout_free(runs, layout):
    cfg = tiny_moe_config()
    for rank in range(2):
        out = runs[rank][layout]
        recorded = out["recorded"]
        assert sorted(recorded) == list(range(cfg.num_layers))
        for ids in recorded.values():
            assert ids.shape == (4 * 12, cfg.moe_router_topk)
            assert bool((ids.diff(dim=1) > 0).all())  # ascending, distinct: a set per token
        assert out["routed_shapes"] == [(2, 12, cfg.num_layers, cfg.moe_router_topk)] * 2
        assert out["megatron_record_matches"]
        # SP slices gathered back / experts split over EP: the same routing as one process
        assert _records_equal(recorded, runs[rank]["reference"]["recorded"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_drift_is_zero_for_same_weights_and_counts_changed_sets(runs, layout):
    for rank in range(2):
        out = runs[rank][layout]
        same = out["drift_same_weights"]
        assert same["tokens"].tolist() == [48.0, 48.0] and same["changed"].tolist() == [0.0, 0.0]
        assert same["moved"].tolist() == [0.0, 0.0]
        moved = out["drift_perturbed"]
        assert (moved["changed"] > 0).all() and (moved["changed"] < moved["tokens"]).all()
        assert (moved["changed"] <= moved["moved"]).all() and (moved["moved"] <= 2 * moved["changed"]).all()
        masked = out["drift_perturbed_masked"]
        recorded, free = out["recorded"], out["free_perturbed"]
        mask = torch.zeros(4, 12, dtype=torch.bool)
        mask[:, 4:] = True
        for layer in recorded:
            differs = (recorded[layer] != free[layer]).any(dim=1)
            assert masked["changed"][layer] == int((differs & mask.reshape(-1)).sum())
            assert masked["tokens"][layer] == 32
        # both ranks hold the same tokens here: the world reduce doubles both sums, not the fraction
        world = out["drift_stats_world"]
        assert torch.equal(world["changed"], 2 * moved["changed"])
        torch.testing.assert_close(routing.drift_fractions(world)["overall"], routing.drift_fractions(moved)["overall"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_forces_recorded_experts_after_router_change(runs, layout):
    for rank in range(2):
        out = runs[rank][layout]
        assert not _records_equal(out["free_perturbed"], out["recorded"])  # free routing moved
        assert _records_equal(out["replayed"], out["recorded"])  # replay pinned it
        assert out["replay_inert_after_exit"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_with_unchanged_weights_gives_the_recorded_logits(runs, layout):
    for rank in range(2):
        out = runs[rank][layout]
        for replayed, free in zip(out["logits_replay_original"], out["logits_free"], strict=True):
            torch.testing.assert_close(replayed, free, rtol=0, atol=1e-6)
        # with perturbed routers the replayed forward is a different function (guards a no-op replay)
        assert max((a - b).abs().max() for a, b in zip(out["logits_replay_perturbed"], out["logits_free"])) > 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_r3_engine_rows_replay_every_fed_position(runs, layout):
    """Engine-style rows (all positions but the last) padded by experts_to_batch: every position the
    engine routed is replayed exactly; the last one takes ``padding_experts`` (two micro-batches of 2 rows,
    each counting its padded tokens from 0; the recorder lists each set ascending)."""
    config = tiny_moe_config()
    fill = routing.padding_experts(2, config.moe_router_topk, config.num_experts).sort(dim=1).values.repeat(2, 1)
    for rank in range(2):
        out = runs[rank][layout]
        for layer, ids in out["recorded"].items():
            got = out["r3_replayed"][layer].view(4, 12, -1)
            assert torch.equal(got[:, :-1], ids.view(4, 12, -1)[:, :-1])
            assert torch.equal(got[:, -1], fill)


@pytest.mark.distributed
def test_replay_gradient_survives_activation_recomputation(runs):
    """1F1B order (forward mb0, mb1, backward mb0, mb1) with the MoE layers recomputed in backward: the
    recomputation replays its own micro-batch (REPLAY_BACKWARD), so the router gradients equal those
    without recomputation, and the recorder ignores the recomputed forwards."""
    for rank in range(2):
        plain, recompute = runs[rank]["grads_plain"], runs[rank]["grads_recompute"]
        for layer, grad in plain["router_grads"].items():
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0
            torch.testing.assert_close(recompute["router_grads"][layer], grad, rtol=0, atol=1e-7)
        for run in (plain, recompute):
            assert run["forwards_recorded"] == 2
            assert _records_equal(run["replayed"], run["recorded"])


# ---- drift through PolicyModel: zero-update controls ----------------------------------------------


def _drift_controls(rank, world_size, model_config):
    """The trainer's drift procedure (the same no-grad forward of one mini-batch before and after an
    update, PolicyModel.routing_drift) at EP=2 over DP=2: the same forward twice, an update of lr 0, and a
    real update."""
    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.batching import split_for_data_parallel
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import PolicyModel
    from gspo_megatron.testing.models import canonical_weights
    from tests.megatron.train_workers import make_sequences

    parallel = ParallelConfig(expert_parallel=2)
    initialize_model_parallel(parallel, seed=0)
    out = {}
    for name, lr in (("lr0", 0.0), ("lr_real", 5e-2)):
        # lr 0 bypasses OptimizerConfig.validate on purpose: Adam then moves no weight at all
        policy = PolicyModel(model_config, parallel, OptimizerConfig(lr=lr, clip_grad=0.0), LossConfig(algorithm="grpo"))
        sharding.load_full_state_dict(policy.module, canonical_weights(model_config, seed=1))
        seqs = split_for_data_parallel(make_sequences(model_config, count=8), world_size, rank)

        def free_routing():
            with policy.routing_recorder() as recorder:
                old = policy.compute_logprobs(seqs)
            return recorder, old

        def update_routing():
            # the trainer reads "after" from the next update's own forward (Trainer._update)
            with policy.routing_recorder() as recorder:
                policy.train_minibatch(seqs)
            return recorder

        recorder, old = free_routing()
        before = policy.sequence_routing(seqs, recorder)
        if name == "lr0":
            out["same_forward_twice"] = policy.routing_drift(seqs, before, free_routing()[0])
        for q, o in zip(seqs, old):
            q.old_logprobs = o["logprobs"]
        if name == "lr0":
            out["update_forward"] = policy.routing_drift(seqs, before, update_routing())
        policy.train_minibatch(seqs)
        out[name] = policy.routing_drift(seqs, before, free_routing()[0])
        out[f"{name}_from_update_forward"] = policy.routing_drift(seqs, before, update_routing())
    return out


@pytest.fixture(scope="module")
def drift_controls():
    return run_distributed(_drift_controls, 2, (tiny_moe_config(),))


@pytest.mark.distributed
def test_drift_controls_read_exactly_zero(drift_controls):
    for rank in range(2):
        for control in ("same_forward_twice", "update_forward", "lr0", "lr0_from_update_forward"):
            metrics = drift_controls[rank][control]
            assert metrics["routing_drift"] == 0.0 and metrics["routing_drift_set"] == 0.0, (rank, control)
            assert set(metrics) >= {"routing_drift/layer0", "routing_drift_set/layer1"}
            assert all(v == 0.0 for v in metrics.values()), (rank, control)


@pytest.mark.distributed
def test_drift_after_a_real_update_is_the_per_expert_rate(drift_controls):
    """A real update moves experts; the headline (per expert) is between the set rate / k and the set
    rate, and both ranks report the DP-reduced figure."""
    metrics = drift_controls[0]["lr_real"]
    assert metrics["routing_drift"] > 0
    k = tiny_moe_config().moe_router_topk
    assert metrics["routing_drift_set"] / k <= metrics["routing_drift"] <= metrics["routing_drift_set"]
    assert drift_controls[1]["lr_real"] == metrics


@pytest.mark.distributed
def test_drift_read_from_the_update_forward_equals_a_free_forward(drift_controls):
    """The trainer's "after" record is the next update's own forward: it routes exactly like a no-grad
    forward of the same weights (EP=2, DP=2)."""
    for rank in range(2):
        assert drift_controls[rank]["lr_real_from_update_forward"] == drift_controls[rank]["lr_real"]
        assert drift_controls[rank]["lr_real"]["routing_drift"] > 0
