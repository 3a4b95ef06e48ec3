"""Fast tests of the rollout schedule (trainer/schedule/): every driver, the supervisor's restart path and the
staleness bound, against a small scripted engine that fails on cue, in one process over a real one-rank gloo
group (the collectives are real; the whole-run subprocess tests keep pinning seeds and collective order)."""
from __future__ import annotations

import dataclasses
import itertools
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gspo_megatron.rollout.ahead import ThreadedEngine
from gspo_megatron.rollout.base import RolloutEngine, RolloutInputError, Sample, SamplingParams
from gspo_megatron.rollout.partial import PartialRollouts
from gspo_megatron.rollout.sampling import sample_seed
from gspo_megatron.trainer.batch_filling import BatchFiller
from gspo_megatron.trainer.schedule.base import RolloutGroup
from gspo_megatron.trainer.schedule.filling import FillingDriver
from gspo_megatron.trainer.schedule.overlap import OverlapDriver
from gspo_megatron.trainer.schedule.partial import PartialDriver
from gspo_megatron.trainer.schedule.rollouts import Rollouts, SamplingRule
from gspo_megatron.trainer.schedule.supervisor import EngineSupervisor
from gspo_megatron.trainer.schedule.sync import SyncDriver
from gspo_megatron.typed_config import ConfigError

STOP, G, P, MAX_NEW = 0, 2, 3, 8


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int
    prompt_ids: list[int]


class ScriptedEngine(RolloutEngine):
    """Deterministic samples: each response wants ``1 + seed % (2 * MAX_NEW)`` tokens (its sample seed), the last
    one the stop token; cut at ``max_new_tokens`` (finish ``length``). ``fail``: errors raised by the next calls,
    in order (None: succeed)."""

    def __init__(self, fail=()):
        self.fail, self.calls, self.weight_version = list(fail), [], 0

    def generate(self, prompts, samples_per_prompt, params: SamplingParams) -> list[Sample]:
        self.calls.append((len(prompts), params.max_new_tokens))
        if self.fail:
            error = self.fail.pop(0)
            if error is not None:
                raise error
        out = []
        for i, prompt in enumerate(prompts):
            for j in range(samples_per_prompt):
                seed = sample_seed(params.seed, params.prompt_index(i), j)
                want = 1 + seed % (2 * MAX_NEW)
                n = min(want, params.max_new_tokens)
                ids = [1 + (seed + k) % 5 for k in range(n - 1)] + [STOP if n == want else 1 + seed % 5]
                out.append(Sample(i, ids, [-0.5] * n, "stop" if n == want else "length"))
        return out

    def update_weights(self, named_tensors, *, final: bool) -> None:
        list(named_tensors)
        self.weight_version += int(final)


def score(mine, samples, samples_per_prompt):
    """Reward: 1 for an even response length; verdict: reward 1."""
    rewards = [float(len(s.response_ids) % 2 == 0) for s in samples]
    return [RolloutGroup(p, samples[k * samples_per_prompt:(k + 1) * samples_per_prompt],
                         rewards[k * samples_per_prompt:(k + 1) * samples_per_prompt],
                         [r == 1.0 for r in rewards[k * samples_per_prompt:(k + 1) * samples_per_prompt]])
            for k, p in enumerate(mine)], {"rewards/len/mean": sum(rewards) / max(len(rewards), 1)}


def make(engines, asynchronous=False):
    """A supervisor over ``engines`` (each build takes the next), and Rollouts over an endless prompt stream."""
    built = iter(engines)
    faults = {"engine_restarts": 0}

    def build():
        engine = next(built)
        return (ThreadedEngine(engine) if asynchronous else engine), engine

    def export(engine):
        engine.update_weights([], final=True)
        return {"sync_bytes_per_s": 0.0}

    supervisor = EngineSupervisor(build, export, faults, asynchronous=asynchronous, shared_servers=False,
                                  share_report=None, rank=0)
    dataset = [Prompt(i, [10 + i, 20 + i]) for i in range(1000)]
    counter = itertools.count()
    prompts = iter(lambda: [dataset[next(counter)] for _ in range(P)], None)
    rule = SamplingRule(seed=3, samples_per_prompt=G, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW,
                        stop_token_ids=(STOP,), routed_experts=False)
    rollouts = Rollouts(supervisor, prompts, dataset, rule, score, None, 1, 0)
    supervisor.sync_weights(0)
    return supervisor, rollouts


def test_sync_driver_gives_whole_scored_groups_in_prompt_order():
    supervisor, rollouts = make([ScriptedEngine()])
    out = SyncDriver(rollouts).step_groups(0)
    assert [g.prompt.index for g in out.groups] == [0, 1, 2] and all(len(g.samples) == G for g in out.groups)
    assert [g.rewards for g in out.groups] == [[float(len(s.response_ids) % 2 == 0) for s in g.samples]
                                               for g in out.groups]
    assert out.staleness == 0 and "rewards/len/mean" in out.reward_metrics
    again = SyncDriver(make([ScriptedEngine()])[1]).step_groups(0)  # per-sample seeds: the same responses
    assert [s.response_ids for g in again.groups for s in g.samples] == [s.response_ids for g in out.groups for s in g.samples]


def test_supervisor_restarts_a_failed_engine_resyncs_it_and_counts_it():
    first, second = ScriptedEngine(fail=[ConnectionError("died")]), ScriptedEngine()
    supervisor, rollouts = make([first, second])
    groups, _ = rollouts.rollout(rollouts.next_prompts(), 1, G, 1.0, MAX_NEW)
    assert len(groups) == P and supervisor.faults["engine_restarts"] == 1
    assert supervisor.engine is second and second.weight_version == 1  # the rebuilt engine got the weights
    assert supervisor.version == 1


def test_supervisor_stops_on_an_input_error_and_on_the_same_error_after_a_restart():
    supervisor, rollouts = make([ScriptedEngine(fail=[RolloutInputError("prompt too long")])])
    with pytest.raises(RolloutInputError, match="an input error: the engine was not restarted"):
        supervisor.generate([[1]], G, SamplingParams(seed=1))
    assert supervisor.faults["engine_restarts"] == 0
    same = ConnectionError("illegal memory access")
    flaky = ScriptedEngine(fail=[same, ConnectionError("illegal memory access")])
    supervisor, _ = make([flaky, flaky])
    with pytest.raises(RuntimeError, match="failed the same way after a restart"):
        supervisor.generate([[1]], G, SamplingParams(seed=1))
    assert supervisor.faults["engine_restarts"] == 1
    broken = ScriptedEngine(fail=[ConnectionError(f"died {k}") for k in range(5)])
    supervisor, _ = make([broken] * 4)
    with pytest.raises(RuntimeError, match="failed after 2 restarts"):
        supervisor.generate([[1]], G, SamplingParams(seed=1))


def test_overlap_driver_keeps_the_next_batches_ahead_and_reports_their_staleness():
    supervisor, rollouts = make([ScriptedEngine()], asynchronous=True)
    driver = OverlapDriver(rollouts, max_staleness=1)
    supervisor.on_restart = driver.resubmit
    first = driver.step_groups(0)
    assert first.staleness == 0 and [f.step for f in driver.ahead.queue] == [1]
    assert "overlap_hidden_frac" in first.metrics
    supervisor.sync_weights(1)  # step 0's update
    second = driver.step_groups(1)  # submitted before that update: 1 update old
    assert second.staleness == 1 and [g.prompt.index for g in second.groups] == [3, 4, 5]
    # the same run synchronously: the same responses (overlap changes when, not what, is sampled)
    sync = SyncDriver(make([ScriptedEngine()])[1])
    assert [[s.response_ids for s in g.samples] for g in sync.step_groups(0).groups] == \
        [[s.response_ids for s in g.samples] for g in first.groups]


def test_the_staleness_bound_is_never_crossed():
    supervisor, rollouts = make([ScriptedEngine()], asynchronous=True)
    driver = OverlapDriver(rollouts, max_staleness=1)
    driver.step_groups(0)
    assert driver.ahead.queue[0].version == 1  # step 1's batch: the weights of 0 updates, 1 update old at step 1
    supervisor.sync_weights(1)
    driver.ahead.queue[0].version = 0  # as if generated one update earlier still: a schedule bug, refused
    with pytest.raises(RuntimeError, match="the batch of step 1 is 2 updates old"):
        driver.step_groups(1)


def test_overlap_resubmits_the_queue_with_the_rebuilt_engines_weights():
    broken = ScriptedEngine(fail=[None, ConnectionError("died")])  # step 0 fine; step 1's queued batch fails
    supervisor, rollouts = make([broken, ScriptedEngine()], asynchronous=True)
    driver = OverlapDriver(rollouts, max_staleness=1)
    supervisor.on_restart = driver.resubmit
    driver.step_groups(0)
    supervisor.sync_weights(1)
    out = driver.step_groups(1)
    assert supervisor.faults["engine_restarts"] == 1
    assert out.staleness == 0  # generated again by the weights re-synced after the restart
    assert [f.version for f in driver.ahead.queue] == [supervisor.version]


def test_overlap_state_round_trips_and_other_schedules_refuse_it(tmp_path):
    supervisor, rollouts = make([ScriptedEngine()], asynchronous=True)
    driver = OverlapDriver(rollouts, max_staleness=1)
    driver.step_groups(0)
    driver.drain()
    state = driver.state_dict()
    restored = OverlapDriver(make([ScriptedEngine()], asynchronous=True)[1], max_staleness=1)
    restored.load_state_dict(state, tmp_path)
    assert [(f.step, [p.index for p in f.prompts]) for f in restored.ahead.queue] == [(1, [3, 4, 5])]
    assert [s.response_ids for s in restored.ahead.queue[0].samples] == [s.response_ids for s in driver.ahead.queue[0].samples]
    with pytest.raises(ConfigError, match="holds batches generated ahead; resume it with train.rollout_mode=overlap"):
        SyncDriver(rollouts).load_state_dict(state, Path("ckpt"))


def partial_driver(rollouts, overlapped=False, need=1, budget=3):
    pool = PartialRollouts(G, budget, MAX_NEW, max_staleness=3)
    return PartialDriver(rollouts, pool, need, overlapped)


def test_partial_driver_trains_finished_groups_and_carries_the_rest_with_their_versions():
    supervisor, rollouts = make([ScriptedEngine()])
    driver = partial_driver(rollouts)
    trained, carried, ages = [], [], []
    for step in range(4):
        out = driver.step_groups(step)
        trained += [g.prompt.index for g in out.groups]
        carried.append(out.metrics["partial/carried_groups"])
        ages.append(out.metrics["partial/max_token_age"])
        assert all(len(s.response_ids) <= MAX_NEW for g in out.groups for s in g.samples)
        supervisor.sync_weights(step + 1)
    assert len(set(trained)) == len(trained) and trained  # each group trained once
    assert any(c > 0 for c in carried)  # some responses needed more than one step's budget
    assert max(ages) >= 1 and max(ages) <= 2  # ceil(8 / 3) steps in flight: tokens at most 2 updates old
    assert all(n <= 3 for _, n in supervisor.engine.calls)  # no call asked for more than the budget


def test_partial_rollouts_compose_with_dynamic_sampling():
    """An extra round's fresh groups join the pool; those it finishes are judged now, the rest stay in flight
    and are judged by the filter in the step they finish."""
    supervisor, rollouts = make([ScriptedEngine()])
    inner = partial_driver(rollouts)
    driver = FillingDriver(inner, BatchFiller(P, 1, "zero_variance", max_generation_rounds=3))
    out = driver.step_groups(0)
    rounds = int(out.metrics["filter/rounds"])
    assert rounds >= 2  # zero-variance groups asked for refills
    # every prompt drawn is either judged now (finished) or still in flight in the pool
    assert out.metrics["filter/groups_generated"] + len(inner.pool.groups) == P * rounds
    assert any(g.slot >= P for g in inner.pool.groups)  # a refill's unfinished group, carried
    assert len({g.key for g in inner.pool.groups}) == len(inner.pool.groups)  # refill slots never collide
    informative = [g for g in out.groups if max(g.rewards) != min(g.rewards)]
    assert len(informative) == min(P, len(out.groups)) or out.metrics["filter/underfilled"] == 1.0


def test_filling_wraps_the_sync_driver_with_extra_rounds_and_says_so(capsys):
    """Dynamic sampling around the synchronous schedule: zero-variance groups are replaced by extra rounds of
    fresh prompts (each round's prompts follow the last's), with a progress line per round."""
    supervisor, rollouts = make([ScriptedEngine()])
    driver = FillingDriver(SyncDriver(rollouts), BatchFiller(P, 1, "zero_variance", max_generation_rounds=4),
                           progress=True)
    out = driver.step_groups(0)
    rounds = int(out.metrics["filter/rounds"])
    assert rounds >= 2 and out.metrics["filter/groups_generated"] == P * rounds
    informative = [g for g in out.groups if max(g.rewards) != min(g.rewards)]
    assert len(informative) == min(P, int(out.metrics["filter/groups_generated"] - out.metrics["filter/groups_dropped"]))
    assert [g.prompt.index for g in informative] == sorted(g.prompt.index for g in informative)  # round order
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"step 1: dynamic sampling round {r + 1}/4" for r in range(1, rounds)]


def test_a_stop_signal_ends_the_filling_between_rounds():
    supervisor, rollouts = make([ScriptedEngine()])
    asked = []

    def stop_requested():
        asked.append(True)
        return len(asked) >= 2  # the signal came during the first refill

    filler = BatchFiller(P, 1, "zero_variance", max_generation_rounds=64)
    out = FillingDriver(SyncDriver(rollouts), filler, stop_requested=stop_requested).step_groups(0)
    assert out.metrics["filter/rounds"] == 2.0 and out.metrics["filter/stopped_by_signal"] == 1.0
    assert len(asked) == 2
    calm = FillingDriver(SyncDriver(make([ScriptedEngine()])[1]), filler).step_groups(0)
    assert calm.metrics["filter/stopped_by_signal"] == 0.0
