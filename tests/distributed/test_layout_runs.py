"""Layout-independent training, end to end: the same config and seed train the same model at every
parallel layout. The trainer runs (supervised warm start, rollouts, rewards, GSPO updates, weight syncs)
at 1 process, TP=2, PP=2, EP=2, DP=2, CP=2 and TP=2 with EP=2 over whole experts (ETP=1), and on 4 and 8 processes in combinations (TP2+EP2, PP2+DP2,
TP2+PP2, CP2+TP2, CP2+EP2, CP2+DP2, CP2+PP2; TP2+PP2+EP2 over DP2), and every step's rewards must be identical and its losses and gradient
norms equal up to float32 reduction-order noise (see TOL).

What makes this hold: canonical random initialisation (megatron/canonical_init.py), per-sample sampling
seeds from (train.seed, step, global prompt index, sample index) (rollout/sampling.py), and a loss whose
gradient does not depend on the split (tested per mini-batch in tests/megatron/test_policy_update.py).

One spawn per world size serves all its layouts, run one after another in the same processes. The 4-
and 8-process runs are `slow` (2 steps each; 8 ranks on 2 cores take minutes).
"""
from pathlib import Path

import pytest

from gspo_megatron.megatron.spawn import run_distributed
from tests.runs import TOL, train_layouts as _train_layouts

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
OVERLAP = ["train.rollout_mode=overlap"]  # the engine in its own process, batches one update stale
LAYOUTS = {
    1: {"single": [], "single_overlap": OVERLAP},
    2: {"tp2": ["parallel.tensor_parallel=2"], "pp2": ["parallel.pipeline_parallel=2"],
        "ep2": ["parallel.expert_parallel=2"], "dp2": [], "dp2_overlap": OVERLAP,
        # dense TP2 while whole experts are split EP2 over the same two ranks (the TP4 x EP8 on 8 GPUs shape)
        "tp2_ep2_etp1": ["parallel.tensor_parallel=2", "parallel.expert_parallel=2",
                         "parallel.expert_tensor_parallel=1"],
        "cp2": ["parallel.context_parallel=2"]},
    4: {"tp2_ep2": ["parallel.tensor_parallel=2", "parallel.expert_parallel=2"],
        "pp2_dp2": ["parallel.pipeline_parallel=2"],
        "tp2_pp2": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]},
    8: {"tp2_pp2_ep2_dp2": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
                            "parallel.expert_parallel=2"]},
}
STEPS = {1: 4, 2: 4, 4: 2, 8: 2}
# context parallelism combined, 4 processes, in a spawn of its own (the spawn timeout covers one spawn);
# cp2_dp2 is CP=2 over two data-parallel ranks (DP is what the world size leaves). The spawn's first layout
# pays the start-up (~80 s here); measured on 2 shared cores, each later one adds 12-15 s (docs/megatron.md)
CP_LAYOUTS_4 = {"cp2_tp2": ["parallel.context_parallel=2", "parallel.tensor_parallel=2"],
                "cp2_ep2": ["parallel.context_parallel=2", "parallel.expert_parallel=2"],
                "cp2_dp2": ["parallel.context_parallel=2"],
                "cp2_pp2": ["parallel.context_parallel=2", "parallel.pipeline_parallel=2"]}
def _runs(tmp_path_factory, world_size, layouts=None):
    base = tmp_path_factory.mktemp(f"layouts{world_size}")
    layouts = LAYOUTS[world_size] if layouts is None else layouts
    return run_distributed(_train_layouts, world_size, (str(base), layouts, STEPS[world_size]), timeout_s=880)[0]


@pytest.fixture(scope="module")
def ones(tmp_path_factory):
    return _runs(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def single(ones):
    return ones["single"]


def _assert_same_run(got, want, layout):
    steps = [m for m in got if m["step"] > 0]
    assert len(steps) >= 2, layout
    for m in steps:
        ref = want[m["step"]]
        assert ref["step"] == m["step"]
        # identical responses give identical rewards; layout-dependent sampling would change them
        for key in ("reward_mean", "reward_std", "response_length_mean"):
            assert m[key] == ref[key], (layout, m["step"], key, m[key], ref[key])
        for key, tol in TOL.items():
            assert m[key] == pytest.approx(ref[key], **tol), (layout, m["step"], key)
    evaluated = [m["step"] for m in got if "eval_accuracy" in m]
    assert evaluated == [0, 2] + ([4] if len(got) > 3 else []), layout
    for step in evaluated:
        assert got[step]["eval_accuracy"] == want[step]["eval_accuracy"], (layout, step)


def test_the_reference_run_learns_something_to_compare(single):
    """The one-process run is not degenerate: rewards vary between steps, updates are non-zero."""
    steps = [m for m in single if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert len({m["reward_mean"] for m in steps}) > 1
    assert all(m["grad_norm"] > 0 for m in steps)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _runs(tmp_path_factory, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [name for name in LAYOUTS[2] if not name.endswith("_overlap")])
def test_two_process_layouts_train_the_same_model(single, two, layout):
    _assert_same_run(two[layout], single, layout)


@pytest.mark.distributed
def test_overlapped_rollouts_train_the_same_model_on_two_data_parallel_ranks(ones, two):
    """Overlap mode at DP=2 (an engine process per rank, each generating its share ahead) equals overlap
    mode on one process; and it is a different schedule from sync mode (one-step-stale batches)."""
    _assert_same_run(two["dp2_overlap"], ones["single_overlap"], "dp2_overlap")
    assert [m.get("staleness") for m in ones["single_overlap"][1:]] == [0.0, 1.0, 1.0, 1.0]
    assert [m["reward_mean"] for m in ones["single_overlap"][2:]] != [m["reward_mean"] for m in ones["single"][2:]]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _runs(tmp_path_factory, 4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS[4]))
def test_four_process_combinations_train_the_same_model(single, four, layout):
    _assert_same_run(four[layout], single, layout)


@pytest.fixture(scope="module")
def four_cp(tmp_path_factory):
    return _runs(tmp_path_factory, 4, CP_LAYOUTS_4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(CP_LAYOUTS_4))
def test_context_parallel_combined_on_four_processes_trains_the_same_model(single, four_cp, layout):
    _assert_same_run(four_cp[layout], single, layout)


@pytest.mark.slow
@pytest.mark.distributed
def test_eight_processes_tp2_pp2_ep2_dp2_train_the_same_model(single, tmp_path_factory):
    runs = _runs(tmp_path_factory, 8)
    _assert_same_run(runs["tp2_pp2_ep2_dp2"], single, "tp2_pp2_ep2_dp2")
