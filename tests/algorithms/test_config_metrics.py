"""LossConfig (typed, validated, paper defaults), the table of policy losses and the reducible metrics."""
import importlib
import inspect
import math
import pkgutil

import pytest
import torch

from gspo_megatron.algorithms import DERIVED, METRICS, LossConfig, combine_minibatches, finalize_metrics, merge_metrics
from gspo_megatron.typed_config import ConfigError, build, to_dict


def test_paper_defaults():
    gspo = build(LossConfig, {}, "loss")
    assert (gspo.algorithm, gspo.clip_low, gspo.clip_high, gspo.kl_coef) == ("gspo", 3e-4, 4e-4, 0.0)
    grpo = build(LossConfig, {"algorithm": "grpo"}, "loss")
    assert (grpo.clip_low, grpo.clip_high) == (0.2, 0.27)
    assert build(LossConfig, {"algorithm": "gspo_token"}, "loss").clip_high == 4e-4
    explicit = build(LossConfig, {"algorithm": "grpo", "clip_low": 0.1}, "loss")
    assert (explicit.clip_low, explicit.clip_high) == (0.1, 0.27)
    assert to_dict(gspo)["clip_low"] == 3e-4  # the resolved value is what gets saved
    cispo = build(LossConfig, {"algorithm": "cispo"}, "loss")
    assert (cispo.clip_low, cispo.clip_high, cispo.aggregation) == (1.0, 4.0, "token_mean")
    sapo = build(LossConfig, {"algorithm": "sapo"}, "loss")
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg, sapo.aggregation) == (1.0, 1.05, "seq_mean_token_mean")
    assert gspo.aggregation == "seq_mean_token_mean" and gspo.dual_clip_c is None and not gspo.rollout_correction.active


@pytest.mark.parametrize(
    "mapping, field",
    [
        ({"algorithm": "ppo"}, "loss.algorithm"),
        ({"clip_low": 1.5}, "loss.clip_low"),
        ({"clip_high": 0.0}, "loss.clip_high"),
        ({"aggregation": "token_mean"}, "loss.aggregation"),
        ({"algorithm": "grpo", "aggregation": "token_sum"}, "loss.constant_length_tokens"),
        ({"kl_coef": -0.1}, "loss.kl_coef"),
        ({"kl_estimator": "k4"}, "loss.kl_estimator"),
        ({"entropy_coef": -1.0}, "loss.entropy_coef"),
        ({"tis_mode": "token"}, "loss.tis_mode"),
        ({"tis_cap": 0.0}, "loss.tis_cap"),
        ({"advantage_eps": 0.0}, "loss.advantage_eps"),
        ({"advantage_estimator": "rloo"}, "loss.advantage_estimator"),
        ({"clip_lo": 0.1}, "loss.clip_lo"),
        ({"algorithm": "sapo", "aggregation": "token_mean"}, "loss.aggregation"),
        ({"algorithm": "sapo", "sapo_tau_neg": 0.0}, "loss.sapo_tau_neg"),
        ({"algorithm": "grpo", "clip_low": 1.0}, "loss.clip_low"),
        ({"algorithm": "cispo", "clip_low": 1.5}, "loss.clip_low"),
        ({"dual_clip_c": 1.0}, "loss.dual_clip_c"),
        ({"algorithm": "cispo", "dual_clip_c": 3.0}, "loss.dual_clip_c"),
        ({"rollout_correction": {"icepop": True}}, "loss.rollout_correction.icepop"),
        ({"algorithm": "grpo", "tis_mode": "token", "rollout_correction": {"icepop": True}}, "loss.rollout_correction.icepop"),
        ({"rollout_correction": {"seq_mask": "token"}}, "loss.rollout_correction.seq_mask"),
        ({"rollout_correction": {"seq_mask_high": 0.9}}, "loss.rollout_correction.seq_mask_high"),
        ({"rollout_correction": {"icepop_low": 1.0}}, "loss.rollout_correction.icepop_low"),
        ({"rollout_correction": {"opsm_delta": -1.0}}, "loss.rollout_correction.opsm_delta"),
    ],
)
def test_invalid_settings_name_the_field(mapping, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        build(LossConfig, mapping, "loss")


@pytest.mark.parametrize(
    "mapping",
    [
        {"algorithm": "grpo", "aggregation": "token_sum", "constant_length_tokens": 1024, "tis_mode": "token"},
        {"algorithm": "gspo", "tis_mode": "sequence", "kl_coef": 0.01, "kl_estimator": "k2"},
    ],
)
def test_valid_combinations_build_with_the_given_values(mapping):
    built = to_dict(build(LossConfig, mapping, "loss"))
    assert {key: built[key] for key in mapping} == mapping


def test_merge_and_finalize():
    a = {"tokens": torch.tensor(4.0), "clip_low_tokens": torch.tensor(1.0), "token_ratio_min": torch.tensor(0.9), "adv_sum": torch.tensor(2.0), "adv_sq_sum": torch.tensor(4.0)}
    b = {"tokens": torch.tensor(6.0), "clip_low_tokens": torch.tensor(2.0), "token_ratio_min": torch.tensor(0.8), "adv_sum": torch.tensor(-2.0), "adv_sq_sum": torch.tensor(6.0)}
    merged = merge_metrics([a, b])
    assert merged["tokens"].item() == 10 and merged["token_ratio_min"].item() == pytest.approx(0.8)
    final = finalize_metrics(merged)
    assert final["clip_frac_low_token"].item() == pytest.approx(0.3)
    assert final["adv_mean"].item() == pytest.approx(0.0)
    assert final["adv_std"].item() == pytest.approx(1.0)


def test_finalize_derives_the_total_clip_fractions():
    raw = {"tokens": torch.tensor(10.0), "seqs": torch.tensor(4.0), "clip_low_tokens": torch.tensor(1.0),
           "clip_high_tokens": torch.tensor(2.0), "clip_low_seqs": torch.tensor(0.5), "clip_high_seqs": torch.tensor(0.25)}
    final = finalize_metrics(raw)
    assert final["clip_frac_token"].item() == pytest.approx(0.3)
    assert final["clip_frac_seq"].item() == pytest.approx(0.75 / 4)
    assert "adv_std" not in final  # its inputs are absent


def test_combine_minibatches_keeps_extremes_and_averages_the_rest():
    parts = [{"clip_frac_seq": 0.2, "seq_ratio_min": 0.9, "logprob_gap_max": 0.1, "grad_norm": float("nan")},
             {"clip_frac_seq": 0.4, "seq_ratio_min": 0.7, "logprob_gap_max": 0.3, "grad_norm": 2.0, "lr": 1e-3}]
    combined = combine_minibatches(parts)
    assert combined["clip_frac_seq"] == pytest.approx(0.3)
    assert combined["seq_ratio_min"] == pytest.approx(0.7) and combined["logprob_gap_max"] == pytest.approx(0.3)
    assert combined["grad_norm"] == 2.0 and combined["lr"] == 1e-3  # a skipped update's NaN is left out
    assert math.isnan(combine_minibatches([{"grad_norm": float("nan")}])["grad_norm"])


def test_every_logged_name_is_defined_once():
    finalised = [spec.name for spec in METRICS.values()]
    assert len(finalised) == len(set(finalised))
    assert not set(finalised) & set(DERIVED)
    for name, derived in DERIVED.items():
        assert set(derived.inputs) <= set(finalised), name


def test_finalize_of_an_empty_batch_is_finite():
    empty = {"tokens": torch.tensor(0.0), "seqs": torch.tensor(0.0), "clip_low_tokens": torch.tensor(0.0), "seq_ratio_min": torch.tensor(float("inf")), "seq_ratio_max": torch.tensor(float("-inf"))}
    final = finalize_metrics(empty)
    assert all(torch.isfinite(v) for v in final.values())
    assert final["seq_ratio_min"].item() == 0.0


def test_unknown_metric_key_is_named():
    with pytest.raises(KeyError, match="bogus"):
        merge_metrics([{"bogus": torch.tensor(1.0)}])


def test_every_metric_has_a_valid_spec():
    for key, spec in METRICS.items():
        assert spec.op in ("sum", "min", "max"), key
        assert spec.per in (None, "tokens", "seqs"), key
        assert spec.meaning, key


def test_one_loss_per_algorithm_in_one_table():
    from typing import get_args

    from gspo_megatron.algorithms import PAPER_CLIP, POLICY_LOSSES
    from gspo_megatron.algorithms.config import Algorithm

    assert list(POLICY_LOSSES) == list(PAPER_CLIP) == list(get_args(Algorithm))
    signatures = {name: list(inspect.signature(entry.fn).parameters) for name, entry in POLICY_LOSSES.items()}
    assert all(params == ["batch", "normalisers", "config", "context"] for params in signatures.values()), signatures


def test_clip_values_are_never_signature_defaults():
    import gspo_megatron.algorithms as package

    defaults = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            for param in inspect.signature(fn).parameters.values():
                if param.name in ("clip_low", "clip_high", "tis_cap") and param.default is not inspect.Parameter.empty:
                    defaults.append(f"{info.name}.{name}({param.name}={param.default})")
    assert defaults == []
