"""Faults inside the loop are contained and counted: a rollout engine that fails is rebuilt, re-synced
and the step goes on; one that keeps failing stops the run with a clear error."""
from pathlib import Path

import pytest

from gspo_megatron.megatron.spawn import run_distributed

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"


def engine_failures(rank, world_size, run_dir: str, failures: int, failing_rank: int = 0) -> dict:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    overrides = ["sft.steps=0", "train.steps=1", "logging.console=false", "logging.tensorboard=false",
                 "train.prompts_per_step=4"]
    if world_size == 2:
        overrides.append("parallel.expert_parallel=2")  # the re-sync gathers expert shards from both ranks
    config = load_config(DEMO, overrides)
    trainer = Trainer(config, run_dir)
    broken = trainer.engine
    calls = {"n": 0}
    real_generate = broken.generate

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if rank == failing_rank and calls["n"] <= failures:
            raise ConnectionError(f"engine died (call {calls['n']})")  # transient: not the same error twice
        return real_generate(*args, **kwargs)

    broken.generate = flaky
    trainer.supervisor.build = lambda: (broken, broken)  # the "rebuilt" engine is the same object, still flaky
    try:
        metrics = trainer.train_step()
        return {"ok": True, "restarts": trainer.faults["engine_restarts"], "reward": metrics["reward_mean"],
                "version": broken.weight_version}
    except RuntimeError as err:
        return {"ok": False, "error": str(err), "restarts": trainer.faults["engine_restarts"]}
    finally:
        trainer.close()


@pytest.mark.slow
def test_failed_engine_is_restarted_then_gives_up(tmp_path):
    one = run_distributed(engine_failures, 1, (str(tmp_path / "a"), 1))[0]
    assert one["ok"] and one["restarts"] == 1 and 0.0 <= one["reward"] <= 1.0
    assert one["version"] >= 2  # the restart re-synced the weights
    many = run_distributed(engine_failures, 1, (str(tmp_path / "b"), 5))[0]
    assert not many["ok"] and many["restarts"] == 2
    assert "rollout engine failed after 2 restarts: engine died" in many["error"]


@pytest.mark.slow
def test_one_ranks_engine_fails_every_rank_resyncs(tmp_path):
    """Two ranks (EP=2): rank 1's engine dies once; both ranks re-sync together (a collective), the step
    finishes on both; when it keeps failing, both ranks stop with the error."""
    runs = run_distributed(engine_failures, 2, (str(tmp_path / "a"), 1, 1))
    assert all(r["ok"] and r["restarts"] == 1 for r in runs)
    assert runs[0]["version"] >= 2 and runs[1]["version"] >= 2  # both engines were re-synced
    runs = run_distributed(engine_failures, 2, (str(tmp_path / "b"), 5, 1))
    assert all(not r["ok"] and r["restarts"] == 2 for r in runs)
    assert "engine died" in runs[1]["error"] and "other rank(s) failed" in runs[0]["error"]


def deterministic_errors(rank, world_size, run_dir: str) -> dict:
    from gspo_megatron.rollout.base import RolloutInputError, SamplingParams
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    trainer = Trainer(load_config(DEMO, ["sft.steps=0", "logging.console=false", "logging.tensorboard=false"]), run_dir)
    engine, out = trainer.engine, {}
    real_generate = engine.generate
    try:
        too_long = [[1] * trainer.model_config.max_position_embeddings]  # the real engine's own check
        try:
            trainer.supervisor.generate(too_long, 2, SamplingParams(max_new_tokens=4))
        except RolloutInputError as err:
            out["input"] = (str(err), trainer.faults["engine_restarts"])

        def same_error(*args, **kwargs):
            raise ConnectionError("CUDA error: an illegal memory access was encountered")

        engine.generate = same_error
        trainer.supervisor.build = lambda: (engine, engine)  # the "rebuilt" engine fails the same way
        try:
            trainer.supervisor.generate([[1, 2, 3]], 2, SamplingParams(max_new_tokens=4))
        except RuntimeError as err:
            out["same"] = (str(err), trainer.faults["engine_restarts"])
        return out
    finally:
        engine.generate = real_generate
        trainer.close()


@pytest.mark.slow
def test_a_deterministic_engine_error_stops_without_restarts(tmp_path):
    out = run_distributed(deterministic_errors, 1, (str(tmp_path / "run"),))[0]
    message, restarts = out["input"]
    assert restarts == 0 and message.startswith("rollout: generate: longest prompt (") and message.endswith(
        "exceeds the model's max_position_embeddings (128) (an input error: the engine was not restarted)"), message
    message, restarts = out["same"]
    assert restarts == 1, out  # one restart shows the error is not transient
    assert message == ("rollout engine failed the same way after a restart, not restarted again (ConnectionError: "
                       "CUDA error: an illegal memory access was encountered)")


def overlap_engine_killed(rank, world_size, run_dir: str, extra: tuple[str, ...] = ()) -> dict:
    import os
    import signal

    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    overrides = ["sft.steps=0", "train.steps=2", "logging.console=false", "logging.tensorboard=false",
                 "train.prompts_per_step=2", "rollout.max_new_tokens=4", "train.rollout_mode=overlap",
                 "train.minibatches_per_step=2", *extra]
    trainer = Trainer(load_config(DEMO, overrides), run_dir)
    partial = trainer.config.rollout.partial

    def kill_engine():  # what the OOM killer does
        os.kill(trainer.engine._process.pid, signal.SIGKILL)
        trainer.engine._process.join(30)

    real_train, calls = trainer.policy.train_minibatch, {"n": 0}

    def train_minibatch(*args, **kwargs):  # the engine dies while it generates ahead during the update
        calls["n"] += 1
        if calls["n"] == 1:
            kill_engine()
        return real_train(*args, **kwargs)

    trainer.policy.train_minibatch = train_minibatch
    try:
        trainer.train_step()  # its weight sync meets the dead engine
        trainer.step += 1
        # partial rollouts: the next step's round, generated again after the sync, by the weights of 1 update
        resubmitted = [f.version for f in trainer.driver.inner.round_ahead.flights] if partial else None
        kill_engine()  # between steps: the next top-up (partial: taking the round ahead) meets it
        metrics = trainer.train_step()
        # partial: the first segments of step 1's fresh groups, generated again after the restart
        first = sorted({r.segments[0].version for g in trainer.driver.inner.pool.groups if g.started == 1
                        for r in g.responses if r.segments} if partial else ())
        return {"restarts": trainer.faults["engine_restarts"], "reward": metrics["reward_mean"],
                "healthy": trainer.engine.healthy(), "resubmitted": resubmitted, "first": first,
                "age": metrics.get("partial/max_token_age")}
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_killed_overlap_engine_process_is_restarted_and_the_run_goes_on(tmp_path):
    """The killed engine used to end the run: the failure surfaced in sync_weights, outside the restart loop."""
    result = run_distributed(overlap_engine_killed, 1, (str(tmp_path / "run"),))[0]
    assert result["restarts"] == 2 and result["healthy"] and 0.0 <= result["reward"] <= 1.0


@pytest.mark.slow
def test_a_killed_engine_regenerates_the_partial_round_ahead_with_the_versions_it_used(tmp_path):
    """Partial rollouts in overlap mode: the round generating ahead is lost with the engine and generated
    again; its segments carry the version of the weights that generated them again (engine version 2 = the
    weights of 1 update, partial version 1), not the version it was first submitted with (the restart used
    to label resubmissions one version older than the weights they got)."""
    extra = ("rollout.partial=true", "rollout.partial_token_budget=2", "rollout.logprobs_from=engine",
             "train.max_staleness=2")
    result = run_distributed(overlap_engine_killed, 1, (str(tmp_path / "run"), extra))[0]
    assert result["restarts"] == 2 and result["healthy"] and 0.0 <= result["reward"] <= 1.0
    assert result["resubmitted"] == [2, 2]  # the fresh call and one continuation call (budget 2 of 4)
    assert result["first"] == [1] and result["age"] <= 1.0
