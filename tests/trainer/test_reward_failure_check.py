"""The reward-failure stop (trainer/finite.py): every response failing stops at once; a share above
rewards.stop_failure_fraction stops after rewards.stop_after_failing_batches batches in a row."""
import pytest

from gspo_megatron.rewards.config import RewardConfig, RewardTermConfig
from gspo_megatron.trainer.finite import (TrainingStopped, check_reward_failures, failure_fractions,
                                          reward_failure_verdict)
from gspo_megatron.typed_config import ConfigError, build


def _metrics(errors: float, timeouts: float = 0.0, responses: float = 16.0, key: str = "f") -> dict[str, float]:
    return {f"rewards/{key}/errors": errors, f"rewards/{key}/timeouts": timeouts, "rewards/responses": responses,
            "rewards/g/errors": 16.0, "rewards/g/timeouts": 0.0}


def test_terms_with_weight_zero_do_not_count():
    terms = [RewardTermConfig("m:f"), RewardTermConfig("m:g", weight=0.0)]
    assert failure_fractions(_metrics(4, 4), terms) == {"f": 0.5}
    assert failure_fractions({}, terms) == {}  # nothing scored on any rank


def test_every_response_failing_stops_at_once_and_a_high_share_after_a_streak():
    streaks, why = reward_failure_verdict({"f": 1.0}, {}, 0.5, 3)
    assert why == "reward term 'f' failed on every response of the batch" and streaks == {"f": 1}
    streaks = {}
    for batch in range(2):
        streaks, why = reward_failure_verdict({"f": 0.75}, streaks, 0.5, 3)
        assert why is None and streaks == {"f": batch + 1}
    streaks, why = reward_failure_verdict({"f": 0.5}, streaks, 0.5, 3)
    assert (streaks, why) == ({"f": 0}, None)  # at the limit: not failing, the streak starts over
    for _ in range(2):
        streaks, why = reward_failure_verdict({"f": 0.75}, streaks, 0.5, 3)
    streaks, why = reward_failure_verdict({"f": 0.75}, streaks, 0.5, 3)
    assert streaks == {"f": 3} and why.startswith("reward term 'f' failed on more than 0.5 of the responses in 3")
    assert reward_failure_verdict({"f": 0.75}, {"f": 99}, 0.5, 0) == ({"f": 100}, None)  # 0: the streak never stops


def test_the_stop_writes_the_first_tracebacks_and_names_the_file(tmp_path):
    cfg = RewardConfig(terms=[RewardTermConfig("m:f")], stop_after_failing_batches=2)
    first = {"f": "term 'f': function 'f' defined at /u/r.py:3\nTraceback ...\nKeyError: 'answer'\n"}
    streaks = check_reward_failures(_metrics(12), cfg, {}, 1, first, tmp_path, 0)
    assert streaks == {"f": 1} and not list(tmp_path.iterdir())
    with pytest.raises(TrainingStopped) as stop:
        check_reward_failures(_metrics(12), cfg, streaks, 2, first, tmp_path, 1)
    log = tmp_path / "reward_failures.rank1.log"
    assert str(stop.value).endswith(f"(f: KeyError: 'answer'); the first traceback of each failing term: {log}")
    assert "defined at /u/r.py:3" in log.read_text()


@pytest.mark.parametrize("field, value, message", [
    ("stop_failure_fraction", 1.0, r"rewards.stop_failure_fraction: must be in \[0, 1\)"),
    ("stop_after_failing_batches", -1, r"rewards.stop_after_failing_batches: must be >= 0")])
def test_the_settings_are_checked(field, value, message):
    with pytest.raises(ConfigError, match=message):
        build(RewardConfig, {field: value}, "rewards")
