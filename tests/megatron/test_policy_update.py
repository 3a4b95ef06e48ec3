"""The GSPO loss inside Megatron's forward_backward_func: one mini-batch gives the same gradient at every
parallel layout and every micro-batch split, and the no-grad log-prob forward matches a plain one."""
import pytest
import torch

from gspo_megatron.megatron.logprobs import naive_logprobs
from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config
from tests.megatron.train_workers import all_layouts, make_sequences, microbatch_splits

GSPO = {"algorithm": "gspo"}
PARALLEL = ["tp2", "pp2", "ep2", "dp2"]


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_moe_config()
    single = run_distributed(all_layouts, 1, (cfg, ["single"], GSPO, 2))[0]["single"]
    splits = run_distributed(microbatch_splits, 1, (cfg, [8, 24, 4096], GSPO))[0]
    return single, splits


@pytest.fixture(scope="module")
def parallel_runs():
    return run_distributed(all_layouts, 2, (tiny_moe_config(), PARALLEL + ["dp2_distopt"], GSPO, 2))


def test_gradient_is_not_trivial(reference):
    single, _ = reference
    assert single["metrics"]["seqs"] == 6 and single["metrics"]["tokens"] > 6
    # perturbed old log-probs: the GSPO clip (3e-4 / 4e-4) is active for some sequences, not all
    clipped = single["metrics"]["clip_low_seqs"] + single["metrics"]["clip_high_seqs"]
    assert 0 < clipped < 6
    assert sum(g.abs().sum() for g in single["grads"].values()) > 0


def test_microbatch_split_does_not_change_the_gradient(reference):
    single, splits = reference
    for budget, out in splits.items():
        for name, grad in single["grads"].items():
            torch.testing.assert_close(out["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=f"budget {budget} {name}")
        assert out["metrics"]["seqs"] == 6


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_layout_gives_the_single_process_gradient(reference, parallel_runs, layout):
    single, _ = reference
    for rank in range(2):
        out = parallel_runs[rank][layout]
        for a, b in zip(out["old"], single["old"]):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
        for name, grad in single["grads"].items():
            torch.testing.assert_close(out["grads"][name], grad, rtol=1e-3, atol=1e-6, msg=f"{layout} {name}")
        for key in ("seqs", "tokens", "loss", "clip_low_seqs", "clip_high_seqs"):
            assert out["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("layout", PARALLEL + ["dp2_distopt"])
def test_optimizer_steps_match(reference, parallel_runs, layout):
    """Two Adam steps (clipping included) leave the same weights at every layout, also with the
    distributed optimizer, whose gradients are sharded and so only comparable through the weights."""
    single, _ = reference
    out = parallel_runs[0][layout]
    assert [s["update_skipped"] for s in out["steps"]] == [0.0, 0.0]
    for a, b in zip(out["steps"], single["steps"]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    # atol = 1% of one Adam step (lr 1e-2): for an element whose gradient is near Adam's eps (~1e-7),
    # g / (|g| + eps) turns a 1e-9 rounding difference between layouts into ~1e-5 of weight per step
    for name, w in single["weights"].items():
        torch.testing.assert_close(out["weights"][name], w, rtol=1e-3, atol=1e-4, msg=f"{layout} {name}")


def test_old_logprobs_match_a_plain_forward(reference):
    """compute_logprobs (micro-batched, padded, vocab-parallel) == log_softmax of the same model run
    sequence by sequence without padding."""
    single, _ = reference
    plain = run_distributed(_plain_logprobs, 1, (tiny_moe_config(),))[0]
    for got, want, h_got, h_want in zip(single["old"], plain["logp"], single["entropy"], plain["entropy"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(h_got, h_want, rtol=0, atol=1e-4)


def _plain_logprobs(rank, world_size, cfg):
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import causal_mask
    from gspo_megatron.testing.models import canonical_weights

    initialize_model_parallel(ParallelConfig())
    model = build_model(cfg, ParallelConfig())
    sharding.load_full_state_dict(model, canonical_weights(cfg, seed=1))
    out = {"logp": [], "entropy": []}
    with torch.no_grad():
        for q in make_sequences(cfg):
            n = q.tokens.numel()
            # the padded vocabulary rows (divisor x TP) take no probability mass
            logits = model(q.tokens[None], torch.arange(n)[None], causal_mask(n))[0][..., :cfg.vocab_size]
            lp, h = naive_logprobs(logits[q.prompt_len - 1:n - 1], q.tokens[q.prompt_len:], with_entropy=True)
            out["logp"].append(lp)
            out["entropy"].append(h)
    return out


def _per_sequence(forwards, plan, lengths, last: bool = False):
    """RoutingRecorder.routed_experts() (one [b, s, layers, k] per micro-batch) -> per sequence
    [length - 1, layers, k], every position but the last (what an engine routes; ``last``: all length
    positions), ids sorted per token."""
    out = {}
    for batch, members in zip(forwards, plan):
        for row, i in enumerate(members):
            out[i] = batch[row, :lengths[i] - (0 if last else 1)].sort(-1).values
    return [out[i] for i in range(len(lengths))]


def test_routing_replay_r2_in_the_update_forward():
    from tests.megatron.train_workers import replay_after_update

    out = run_distributed(replay_after_update, 1, (tiny_moe_config(),))[0]
    before, free, replayed = (_per_sequence(out[k], out["plan"], out["lengths"], last=True)
                              for k in ("before", "free", "replayed"))
    assert any(not torch.equal(f, b) for f, b in zip(free, before))  # without replay the update changed experts
    for r, b in zip(replayed, before):  # every token of every sequence (padding is not replayed)
        assert torch.equal(r, b)


def test_nan_gradient_skips_the_update_on_every_rank():
    from tests.megatron.train_workers import nan_gradient_is_skipped

    for out in run_distributed(nan_gradient_is_skipped, 2, (tiny_moe_config(),)):
        assert out["skipped"]["update_skipped"] == 1.0 and out["unchanged"] and out["count"] == 1
        assert out["clean"]["update_skipped"] == 0.0 and out["changed"]


@pytest.mark.parametrize("save_layout, load_layout", [("tp2", "dp2"), ("dp2", "tp2"), ("ep2", "ep2"),
                                                      ("dp2_distopt", "tp2_distopt"), ("tp2_distopt", "dp2_distopt")])
def test_training_state_checkpoint_moves_between_layouts(tmp_path, save_layout, load_layout):
    """Model + Adam state + LR schedule saved at one layout continue at another. Between layouts with and
    without expert parallelism only the weights move (Megatron builds a different optimizer structure
    for expert parameters); resume those at the same EP size. The distributed optimizer's state moves
    between DP=2 and TP=2 (DP=1): the reason its checkpoints stay ``fully_reshardable`` (docs/slurm.md)."""
    from tests.megatron.train_workers import training_state_across_layouts

    out = run_distributed(training_state_across_layouts, 2,
                          (tiny_moe_config(), save_layout, load_layout, str(tmp_path)))[0]
    assert out["lr"][0] == out["lr"][1]  # the LR schedule (warm-up) resumed where it was
    for name, weight in out["expected"].items():
        # float32 reduction order differs between layouts; Adam turns it into ~1e-5 weight differences
        torch.testing.assert_close(out["got"][name], weight, rtol=1e-3, atol=2e-5, msg=name)


@pytest.mark.parametrize("layout, ranks", [("ep2", 2)])
def test_routing_replay_r3_replays_the_engines_experts(layout, ranks):
    """R3: the old-policy and update forwards use the rollout engine's experts at every position the engine
    fed (prompt and response), even after an update that changes free routing; with the engine's weights
    the replayed log-probs equal the engine's."""
    from tests.megatron.train_workers import replay_rollout_routing

    for out in run_distributed(replay_rollout_routing, ranks, (tiny_moe_config(), layout)):
        engine = [e.to(torch.long).sort(-1).values for e in out["engine"]]
        assert [e.shape[0] for e in engine] == [n - 1 for n in out["lengths"]]
        before = _per_sequence(out["replayed_before"], out["plan"], out["lengths"])
        after = _per_sequence(out["replayed_after"], out["plan"], out["lengths"])
        free = _per_sequence(out["free_after"], out["plan"], out["lengths"])
        for e, b, a in zip(engine, before, after):
            assert torch.equal(b, e) and torch.equal(a, e)
        assert any(not torch.equal(f, e) for f, e in zip(free, engine))  # without replay routing moved
        for got, want in zip(out["replayed_logprobs"], out["engine_logprobs"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
