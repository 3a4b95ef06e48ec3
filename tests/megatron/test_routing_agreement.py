"""Engine/trainer routing agreement (closed form) and the ``train.routing_replay: auto`` decision."""
import math

import pytest
import torch

from gspo_megatron.megatron.routing import agreement_fractions, reduce_drift, replay_for_step, routing_agreement


def test_agreement_is_the_shared_fraction_of_the_engines_top_k_per_layer():
    # layer 0: token 0 shares {0, 1} (2/2, order differs), token 1 shares {2} of {2, 3} (1/2) -> 3/4
    # layer 1: token 0 shares nothing (0/2), token 1 both (2/2) -> 1/2; layer 2 is dense (not recorded)
    engine = {0: torch.tensor([[0, 1], [2, 3]]), 1: torch.tensor([[0, 1], [0, 1]])}
    trainer = {0: torch.tensor([[1, 0], [2, 0]]), 1: torch.tensor([[2, 3], [1, 0]])}
    fractions = agreement_fractions(reduce_drift(routing_agreement(engine, trainer, num_layers=3)))
    assert fractions["per_layer"][:2].tolist() == [0.75, 0.5]
    assert math.isnan(float(fractions["per_layer"][2]))
    assert float(fractions["overall"]) == pytest.approx(5 / 8)  # (2 + 1 + 0 + 2) / (4 tokens x 2)


def test_agreement_is_one_for_identical_routing_and_zero_for_disjoint():
    a = {0: torch.tensor([[0, 3], [1, 2], [0, 1]])}
    assert float(agreement_fractions(routing_agreement(a, a))["overall"]) == 1.0
    b = {0: torch.tensor([[1, 2], [0, 3], [2, 3]])}
    assert float(agreement_fractions(routing_agreement(a, b))["overall"]) == 0.0


def test_agreement_nothing_compared_is_nan():
    empty = {0: torch.empty(0, 2, dtype=torch.long)}
    assert math.isnan(float(agreement_fractions(routing_agreement(empty, empty))["overall"]))


@pytest.mark.parametrize("mode, agreement, threshold, expected", [
    ("auto", 0.80, 0.9, "r3"), ("auto", 0.95, 0.9, "off"), ("auto", 0.9, 0.9, "off"),  # strictly below switches
    ("auto", 1.0, 1.0, "off"), ("auto", 0.0, 0.0, "off"), ("auto", float("nan"), 0.9, "off"),
    ("off", 0.1, 0.9, "off"), ("r2", 0.1, 0.9, "r2"), ("r3", 0.99, 0.9, "r3")])
def test_replay_for_step(mode, agreement, threshold, expected):
    assert replay_for_step(mode, agreement, threshold) == expected


def test_auto_config_checks():
    from pathlib import Path

    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.typed_config import ConfigError

    demo = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
    cfg = load_config(demo, ["train.routing_replay=auto", "train.routing_agreement_threshold=0.8"])
    assert (cfg.train.routing_replay, cfg.train.routing_agreement_threshold) == ("auto", 0.8)
    with pytest.raises(ConfigError, match=r"^train\.routing_agreement_threshold: must be in \[0, 1\]"):
        load_config(demo, ["train.routing_agreement_threshold=1.5"])
    with pytest.raises(ConfigError, match=r"^train\.routing_replay: auto compares"):
        load_config(demo, ["train.routing_replay=auto", "rollout.logprobs_from=engine"])
    with pytest.raises(ConfigError, match=r"^train\.routing_replay: auto replays MoE routing"):
        load_config(demo, ["train.routing_replay=auto", "model.config.num_experts=0"])
