"""Partial rollouts in the trainer (rollout.partial; sync and overlap mode, transformers engine): responses
carried over steps with their weight versions, saved in checkpoints, and a SIGKILL + resume with responses in
flight (and, in overlap mode, a round generating ahead) equals the uninterrupted run."""
import json
import signal
import subprocess

import pytest

from tests.runs import DEMO, ENV, REPO, command, kill_after_checkpoint, train

PARTIAL = ["rollout.partial=true", "rollout.partial_token_budget=4", "rollout.logprobs_from=engine"]
COMMON = ["train.steps=4", "sft.steps=40", "train.prompts_per_step=8", "eval.every_steps=2", "eval.num_prompts=8",
          "eval.pass_k=1", "checkpoint.every_steps=2", *PARTIAL]
KEYS = ("reward_mean", "pg_loss", "grad_norm", "eval_accuracy", "staleness", "response_length_mean",
        "partial/groups_trained", "partial/carried_responses", "partial/carried_tokens", "partial/max_token_age",
        "partial/multi_version_responses", "partial/rounds")


@pytest.mark.slow
def test_partial_run_resumes_exactly_after_sigkill_with_responses_in_flight(tmp_path):
    full = train(tmp_path / "full", *COMMON)
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4]
    steps = full[1:]
    # carried responses finish the next step under the next weights: tokens one update old, never more
    assert all(m["partial/carried_responses"] > 0 for m in steps)
    assert max(m["partial/max_token_age"] for m in steps) == 1.0
    assert all(m["staleness"] == m["partial/max_token_age"] for m in steps)
    assert sum(m["partial/multi_version_responses"] for m in steps) > 0
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "gspo_meta.json").read_text())
    groups = saved["partial_rollouts"]["ranks"][0]
    assert groups and all(len(g["responses"]) == 8 for g in groups)
    assert any(r["finish_reason"] is None and r["segments"] for g in groups for r in g["responses"])

    assert kill_after_checkpoint(tmp_path / "split", 2, *COMMON) == -signal.SIGKILL
    resumed = train(tmp_path / "split", *COMMON, resume=True)
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    for a, b in zip(resumed, full):
        for key in KEYS:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


@pytest.mark.slow
def test_partial_rollouts_with_dynamic_sampling_carry_refill_groups_and_resume_exactly(tmp_path):
    """The two compose (trainer/schedule/partial.py): a refill round's groups join the pool; those it does not
    finish are carried and judged by the filter in the step that finishes them. The pool, refill groups
    included, is in the checkpoint, so a SIGKILLed run resumes to the same metrics."""
    run = [*COMMON, "rollout.filter_groups=zero_variance", "rollout.max_generation_rounds=3"]
    full = train(tmp_path / "full", *run)
    steps = full[1:]
    assert max(m["filter/rounds"] for m in steps) > 1  # refills happened
    assert all(m["filter/groups_trained"] <= 8 for m in steps)
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "gspo_meta.json").read_text())
    slots = [g["slot"] for g in saved["partial_rollouts"]["ranks"][0]]
    assert max(slots) >= 8  # a refill round's groups (slots after the step's 8 prompts), carried in flight
    assert len(set(zip(slots, [g["started"] for g in saved["partial_rollouts"]["ranks"][0]]))) == len(slots)
    assert kill_after_checkpoint(tmp_path / "split", 2, *run) == -signal.SIGKILL
    resumed = train(tmp_path / "split", *run, resume=True)
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    for a, b in zip(resumed, full):
        for key in (*KEYS, "filter/rounds", "filter/groups_generated", "filter/groups_dropped"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


@pytest.mark.slow
def test_partial_rollouts_with_r3_replay_each_segments_own_experts_and_resume_exactly(tmp_path):
    """R3 with partial rollouts (rollout/partial.py): each segment keeps the experts its own weights chose, the
    pool saves them, and a SIGKILLed run resumes to the same metrics (the replayed updates included)."""
    run = [*COMMON, "train.routing_replay=r3"]
    full = train(tmp_path / "full", *run)
    assert sum(m["partial/multi_version_responses"] for m in full[1:]) > 0  # records stitched from two versions
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "gspo_meta.json").read_text())
    carried = [r for g in saved["partial_rollouts"]["ranks"][0] for r in g["responses"] if r["segments"]]
    assert carried and all(s["routed_experts"] is not None for r in carried for s in r["segments"])
    assert all(r["prompt_routed_experts"] is not None for r in carried)
    assert kill_after_checkpoint(tmp_path / "split", 2, *run) == -signal.SIGKILL
    resumed = train(tmp_path / "split", *run, resume=True)
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    for a, b in zip(resumed, full):
        for key in KEYS:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


OVERLAP = ["train.rollout_mode=overlap", "train.max_staleness=2"]


@pytest.mark.slow
def test_the_sglang_engine_generates_the_partial_round_ahead_in_overlap_mode(tmp_path):
    """The SGLang engine (HTTP stand-in, tests/rollout/sglang_standin.py) in overlap mode: the round submitted
    while step 0 trains is generated by step 0's weights, so the groups step 1 trains were written by one
    version (in sync mode by two), and step 2 trains tokens two updates old."""
    from gspo_megatron.megatron.spawn import run_distributed
    from tests.rollout.sglang_standin import StandinServer

    with StandinServer() as server:
        metrics = run_distributed(sglang_partial_worker, 1, (str(tmp_path / "run"), server.url, str(tmp_path / "sync"),
                                                             tuple(OVERLAP) + ("rollout.sglang.release_memory=false",),
                                                             3), timeout_s=300)[0]
    assert [m["partial/max_token_age"] for m in metrics] == [0.0, 1.0, 2.0]
    assert metrics[1]["partial/groups_trained"] > 0 and metrics[1]["partial/multi_version_responses"] == 0
    assert metrics[2]["partial/multi_version_responses"] > 0 and "overlap_hidden_frac" in metrics[2]


@pytest.mark.slow
def test_overlap_partial_run_resumes_exactly_after_sigkill_with_a_round_generating_ahead(tmp_path):
    """Overlap mode: each step's first round is generated while the step before trains, so carried tokens are
    one update older than in sync mode (2, not 1); the checkpoint takes the round generating ahead into the
    pool it saves, and the resumed run starts its next step from that pool."""
    full = train(tmp_path / "full", *COMMON, *OVERLAP)
    steps = full[1:]
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4]
    assert steps[0]["partial/max_token_age"] == 0.0  # step 0 generates its first round itself
    assert [m["partial/max_token_age"] for m in steps[2:]] == [2.0, 2.0]
    assert all(m["staleness"] == m["partial/max_token_age"] for m in steps)
    assert sum(m["partial/multi_version_responses"] for m in steps) > 0
    # the rounds of steps 1-3 ran while the steps before trained: the trainer hardly waited for them
    assert all(0.0 <= m["overlap_hidden_frac"] <= 1.0 for m in steps[1:]) and "overlap_hidden_frac" not in steps[0]
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "gspo_meta.json").read_text())
    assert saved["partial_round_ahead"] == 2
    groups = saved["partial_rollouts"]["ranks"][0]
    # step 2's fresh prompts are in the pool already, with the segment the weights of 1 update sampled
    fresh = [g for g in groups if g["started"] == 2]
    assert len(fresh) == 8 and all(r["segments"][0]["version"] == 1 for g in fresh for r in g["responses"])

    assert kill_after_checkpoint(tmp_path / "split", 2, *COMMON, *OVERLAP) == -signal.SIGKILL
    resumed = train(tmp_path / "split", *COMMON, *OVERLAP, resume=True)
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    for a, b in zip(resumed, full):
        for key in KEYS:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


def test_a_checkpoint_with_responses_in_flight_is_not_resumed_without_partial(tmp_path):
    train(tmp_path / "run", "train.steps=1", "sft.steps=5", "eval.every_steps=0", "eval.num_prompts=4",
          "eval.pass_k=1", "checkpoint.every_steps=1", *PARTIAL)
    proc = subprocess.run(command(tmp_path / "run", "train.steps=2", "sft.steps=5", "eval.every_steps=0",
                                  "eval.num_prompts=4", "eval.pass_k=1", resume=True),
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV)
    assert proc.returncode != 0
    assert "holds partial responses in flight; resume it with rollout.partial=true" in proc.stderr


def sglang_partial_worker(rank, world_size, run_dir: str, url: str, disk_dir: str, extra: tuple[str, ...] = (),
                          steps: int = 2) -> list[dict]:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer
    from tests.runs import sglang_standin_overrides as _trainer_overrides

    config = load_config(DEMO, _trainer_overrides([url], disk_dir, f"train.steps={steps}", "rollout.partial=true",
                                                  "rollout.partial_token_budget=2", "rollout.logprobs_from=engine",
                                                  *extra))
    trainer = Trainer(config, run_dir)
    try:
        out = []
        for _ in range(steps):
            out.append(trainer.train_step())
            trainer.step += 1
        return out
    finally:
        trainer.close()


@pytest.mark.slow
def test_the_sglang_engine_continues_partial_responses_with_input_ids(tmp_path):
    """The SGLang engine against the HTTP stand-in (tests/rollout/sglang_standin.py, not SGLang): step 1
    samples 2 of the 4 tokens of every response; step 2 sends each unfinished response back as ``input_ids``
    (its prompt + its 2 tokens) for 2 more, under the weights synced after step 1."""
    from gspo_megatron.megatron.spawn import run_distributed
    from tests.rollout.sglang_standin import StandinServer

    with StandinServer() as server:
        metrics = run_distributed(sglang_partial_worker, 1, (str(tmp_path / "run"), server.url, str(tmp_path / "sync")),
                                  timeout_s=300)[0]
        bodies = [body for path, body in server.state.requests if path == "/generate"]
    rows = [(ids, sp) for body in bodies for ids, sp in zip(body["input_ids"], body["sampling_params"])]
    assert all(sp["max_new_tokens"] == 2 for _, sp in rows)
    sent = {tuple(ids) for ids, _ in rows}
    # a continuation is an earlier request's input (its prompt) + the 2 tokens sampled for it, the first of
    # which echoes the prompt's last token (the stand-in's rule)
    continued = [ids for ids, _ in rows if tuple(ids[:-2]) in sent and ids[-2] == ids[-3]]
    first, second = metrics
    # step 1's extra round (no group had finished) continued one group; step 2 continues every carried one
    assert first["partial/rounds"] == 2 and len(continued) > first["partial/carried_responses"] > 0 and second["partial/multi_version_responses"] > 0
    assert second["partial/max_token_age"] == 1.0


@pytest.mark.slow
@pytest.mark.distributed
def test_overlap_partial_run_is_the_same_at_dp2(tmp_path_factory):
    """Partial rollouts in overlap mode at 1 process and at DP=2: each rank carries its share of the groups
    and makes the same engine calls in every round (its own engine process), so the counts summed over
    ranks, the rewards and the updates are those of the single process."""
    from gspo_megatron.megatron.spawn import run_distributed
    from tests.runs import TOL, train_layouts as _train_layouts
    from tests.runs import LOSS_TOL

    run = [*PARTIAL, *OVERLAP, "optimizer.lr=1e-4", "train.prompts_per_step=8", "eval.pass_k=1"]
    runs = {world: run_distributed(_train_layouts, world, (str(tmp_path_factory.mktemp(f"partial{world}")),
                                                            {"run": run}, 3), timeout_s=880)[0]["run"]
            for world in (1, 2)}
    one, two = runs[1], runs[2]
    assert [m["step"] for m in one] == [m["step"] for m in two] == [0, 1, 2, 3]
    assert one[-1]["partial/max_token_age"] == 2.0 and sum(m["partial/multi_version_responses"] for m in one[1:]) > 0
    for a, b in zip(one, two):
        for key in ("reward_mean", "accuracy", "eval_accuracy", "response_length_mean", "partial/groups_trained",
                    "partial/carried_responses", "partial/carried_tokens", "partial/max_token_age",
                    "partial/multi_version_responses", "partial/rounds"):
            if key in a:
                assert a[key] == b[key], (a["step"], key)
        for key, tol in {**TOL, **LOSS_TOL}.items():
            if key in a:
                assert a[key] == pytest.approx(b[key], **tol), (a["step"], key)
