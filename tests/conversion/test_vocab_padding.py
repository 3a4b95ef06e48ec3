"""Vocabulary padding as Megatron-LM does it (``make_vocab_size_divisible_by`` x TP): the Megatron model
holds the padded vocabulary, HF -> Megatron writes the padding rows as zeros, Megatron -> HF and the live
export strip them (round trips stay byte-identical), and the padded logits take no probability mass.

Vocabularies: 301 (odd; at TP=2 its 211 padding rows sit on the last TP rank, next to 45 real ones) and
97 (prime, smaller than TP x divisor: at TP=2 the last rank's slice is all padding)."""
import dataclasses
import json

import pytest
import torch

from gspo_megatron.conversion import cli, dcp_io, offline
from gspo_megatron.conversion.check import model_config_for_check, run_check
from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config
from gspo_megatron.typed_config import ConfigError
from tests.conversion import hf_models
from tests.conversion.hf_models import make_hf_dir, read_all, weight_files
from tests.conversion.vocab_padding_workers import hf_token_logprobs, padded_checks, train_and_export

ATOL = 1e-4  # fp32 logits, as tests/conversion/test_distributed.py
LOGPROB_ATOL = 1e-5


def _least_multiple_at_least(value: int, step: int) -> int:
    """By counting up: the reference the closed form in padded_vocab_size must equal."""
    padded = step
    while padded < value:
        padded += step
    return padded


@pytest.mark.parametrize("vocab", [1, 5, 97, 128, 301, 151_936, 151_937])
@pytest.mark.parametrize("divisor", [1, 3, 128])
def test_padded_vocab_size_is_the_least_multiple_of_divisor_times_tp(vocab, divisor):
    config = tiny_moe_config(vocab_size=vocab, make_vocab_size_divisible_by=divisor)
    for tp in (1, 2, 4, 8):
        padded = config.padded_vocab_size(tp)
        assert padded == _least_multiple_at_least(vocab, divisor * tp)
        assert padded >= vocab and padded % tp == 0 and (padded // tp) % divisor == 0


def test_divisor_is_validated_and_recorded():
    with pytest.raises(ConfigError, match=r"model\.make_vocab_size_divisible_by: must be >= 1, got 0"):
        ModelConfig(make_vocab_size_divisible_by=0).validate("model")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        tiny_moe_config().padded_vocab_size(0)
    assert dataclasses.asdict(tiny_moe_config())["make_vocab_size_divisible_by"] == 128  # Megatron-LM's default


# name -> (family of tests/conversion/hf_models.FAMILIES, vocabulary)
PADDED = {"qwen3_moe_v301": ("qwen3_moe", 301), "qwen3_moe_tied_v301": ("qwen3_moe_tied", 301),
          "llama_tied_v97": ("llama_tied", 97)}


def make_padded_hf_dir(name: str, directory, **kwargs):
    family, vocab = PADDED[name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(hf_models.FAMILIES, name, dict(hf_models.FAMILIES[family], vocab_size=vocab))
        return make_hf_dir(name, directory, **kwargs)


def _stored_vocab(megatron_dir, config: ModelConfig, rows: int) -> torch.Tensor:
    """The embedding as stored, all ``rows`` rows (padding included)."""
    with dcp_io.CheckpointReader(megatron_dir) as reader:
        dtype = reader.tensor_keys()[dcp_io.EMBEDDING_KEY][1]
        h = config.hidden_size
        request = dcp_io.Request("embedding", dcp_io.EMBEDDING_KEY, (0, 0), (rows, h), (rows, h), dtype)
        return reader.read([request], reader.plan([request]))["embedding"]


@pytest.mark.parametrize("name", PADDED)
@pytest.mark.parametrize("tp", [1, 2])
def test_conversion_pads_with_zero_rows_and_round_trips_byte_identical(name, tp, tmp_path):
    hf = make_padded_hf_dir(name, tmp_path / "hf")
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", tensor_parallel=tp, progress=False)
    config = ModelConfig.from_hf_dir(hf)
    padded = config.padded_vocab_size(tp)
    assert padded > config.vocab_size and dcp_io.stored_vocab_rows(meg) == padded
    meta = json.loads((meg / "gspo_meta.json").read_text())["vocab_padding"]
    assert meta == {"vocab_size": config.vocab_size, "padded_vocab_size": padded, "tensor_parallel": tp,
                    "make_vocab_size_divisible_by": 128}
    stored, theirs = _stored_vocab(meg, config, padded), read_all(hf)
    assert torch.equal(stored[:config.vocab_size], theirs["model.embed_tokens.weight"])
    assert torch.count_nonzero(stored[config.vocab_size:]) == 0
    if not config.tie_word_embeddings:
        with dcp_io.CheckpointReader(meg) as reader:
            assert reader.tensor_keys()["model.output_layer.weight"][0] == (padded, config.hidden_size)
    back = offline.megatron_to_hf(meg, tmp_path / "back", hf_template=hf, progress=False)
    for file in weight_files(hf):
        assert (back / file).read_bytes() == (hf / file).read_bytes(), file


def test_a_non_default_divisor_is_kept_by_the_checkpoint(tmp_path):
    """The divisor is a Megatron setting that config.json does not carry: it lives in the checkpoint's
    model_config.json, and export against the HF template does not call that a different model."""
    hf = make_padded_hf_dir("qwen3_moe_v301", tmp_path / "hf")
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", tensor_parallel=2, make_vocab_size_divisible_by=8,
                                 progress=False)
    assert dcp_io.stored_vocab_rows(meg) == 304  # 301 up to a multiple of 8 x 2
    assert json.loads((meg / offline.MODEL_CONFIG_NAME).read_text())["make_vocab_size_divisible_by"] == 8
    config, _ = offline.export_config(meg, hf)
    assert config.make_vocab_size_divisible_by == 8 and config.padded_vocab_size(2) == 304
    back = offline.megatron_to_hf(meg, tmp_path / "back", hf_template=hf, progress=False)
    assert read_all(back).keys() == read_all(hf).keys()
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by: must be >= 1"):
        offline.hf_to_megatron(hf, tmp_path / "bad", make_vocab_size_divisible_by=0, progress=False)


def test_command_line_divisor(tmp_path, capsys):
    hf = make_padded_hf_dir("llama_tied_v97", tmp_path / "hf")
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(tmp_path / "meg"), "--tp", "2",
                     "--make-vocab-size-divisible-by", "3", "--no-progress"]) == 0
    assert dcp_io.stored_vocab_rows(tmp_path / "meg") == 102  # 97 up to a multiple of 3 x 2
    assert cli.main(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(tmp_path / "bad"),
                     "--make-vocab-size-divisible-by", "0"]) == 2
    assert "make_vocab_size_divisible_by: must be >= 1, got 0" in capsys.readouterr().err


def test_check_refuses_a_checkpoint_of_a_smaller_vocabulary(tmp_path):
    """Megatron would zero-fill the rows it lacks (allow_shape_mismatch): `convert check` says so instead."""
    hf = make_padded_hf_dir("llama_tied_v97", tmp_path / "hf")
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)  # 128 rows stored
    for path in (hf / "config.json", meg / offline.MODEL_CONFIG_NAME):
        path.write_text(json.dumps(dict(json.loads(path.read_text()), vocab_size=200)))
    with pytest.raises(ConversionError, match=r"embedding\.word_embeddings\.weight has 128 rows, fewer than the "
                                              r"model config's vocab_size=200"):
        model_config_for_check(hf, meg)


@pytest.mark.slow
def test_convert_check_at_tp2_on_a_vocabulary_of_301(tmp_path):
    """The issue's failing command: `convert check --tp 2` refused vocab_size=301."""
    hf = make_padded_hf_dir("qwen3_moe_v301", tmp_path / "hf")
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", tensor_parallel=2, progress=False)
    assert run_check(hf, meg, tensor_parallel=2) < ATOL


# ---- on two gloo ranks: TP=2, PP=2, EP=2 ---------------------------------------------------------

# label -> (HF model, TP the conversion pads for, layouts checked)
CASES = {"qwen3_moe_v301": ("qwen3_moe_v301", 2, ["tp2", "pp2", "ep2"]),
         # padded for TP=1 (128 rows), loaded at TP=2 (256): Megatron zero-fills the rows the checkpoint lacks
         "llama_tied_v97": ("llama_tied_v97", 1, ["tp2", "pp2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab_padding")
    folders = {}
    for label, (name, tp, _) in CASES.items():
        hf = make_padded_hf_dir(name, root / f"{label}-hf")
        folders[label] = (hf, offline.hf_to_megatron(hf, root / f"{label}-meg", tensor_parallel=tp, progress=False))
    cases = [(label, str(hf), str(meg), CASES[label][2]) for label, (hf, meg) in folders.items()]
    return folders, run_distributed(padded_checks, 2, (cases,))


CASE_LAYOUTS = [(label, layout) for label, (_, _, layouts) in CASES.items() for layout in layouts]


@pytest.mark.slow
@pytest.mark.parametrize("label, layout", CASE_LAYOUTS)
def test_padded_model_logits_and_export_equal_the_hf_models(runs, label, layout):
    _, results = runs
    diffs = [r[label]["logits"][layout] for r in results if r[label]["logits"][layout] is not None]
    assert len(diffs) == (1 if layout == "pp2" else 2) and max(diffs) < ATOL
    for r in results:
        out = r[label][layout]["export"]
        assert out["names"] == out["reference_names"] and out["different"] == []


@pytest.mark.slow
@pytest.mark.parametrize("label, layout", CASE_LAYOUTS)
def test_padded_logits_take_no_probability_mass(runs, label, layout):
    """PolicyModel's log-probs and entropies (vocab-parallel at TP=2) equal the transformers model's,
    although the padding logits are 0, larger than many real ones."""
    _, results = runs
    for r in results:
        assert r[label][layout]["logprob_diff"] < LOGPROB_ATOL
        assert r[label][layout]["entropy_diff"] < LOGPROB_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("label, layout", CASE_LAYOUTS)
def test_padding_rows_are_zero_and_sit_on_the_last_tp_rank(runs, label, layout):
    folders, results = runs
    config = ModelConfig.from_hf_dir(folders[label][0])
    tp = 2 if layout == "tp2" else 1
    padded = config.padded_vocab_size(tp)
    held = [r[label][layout]["padding"] for r in results]
    for per_rank in held:
        for param in per_rank.values():
            assert param["rows"] == padded // tp and param["max_abs"] == 0.0
    if layout == "tp2":
        first, last = (h["embedding.word_embeddings.weight"]["padding"] for h in held)
        assert first == max(0, padded // 2 - config.vocab_size) and first + last == padded - config.vocab_size
        assert last == (padded // 2 if config.vocab_size <= padded // 2 else padded - config.vocab_size)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The issue's done-when: a Qwen3-MoE-shaped model with a vocabulary of 301 converted at TP=2, two
    GSPO steps at TP=2, then exported live and from its saved checkpoint."""
    root = tmp_path_factory.mktemp("vocab_padding_train")
    hf = make_padded_hf_dir("qwen3_moe_v301", root / "hf")
    meg = offline.hf_to_megatron(hf, root / "meg", tensor_parallel=2, progress=False)
    saved = root / "trained"
    results = run_distributed(train_and_export, 2, (str(meg), "tp2", 2, str(saved)))
    back = offline.megatron_to_hf(saved, root / "back", hf_template=hf, progress=False)
    return hf, back, results


@pytest.mark.slow
def test_trained_at_tp2_the_padding_stays_zero_and_the_exports_agree(trained):
    hf, back, results = trained
    for r in results:
        assert all(m["update_skipped"] == 0.0 for m in r["metrics"])
        for param in r["padding"].values():
            assert param["max_abs"] == 0.0  # no gradient reaches the padding rows
    live, offline_export, start = results[0]["export"], read_all(back), read_all(hf)
    assert live.keys() == offline_export.keys() == start.keys()
    assert all(torch.equal(live[k], offline_export[k]) for k in live)
    assert not torch.equal(live["lm_head.weight"], start["lm_head.weight"])  # it did train
    assert not torch.equal(live["model.embed_tokens.weight"], start["model.embed_tokens.weight"])


@pytest.mark.slow
def test_trained_model_log_probs_match_its_hf_export(trained):
    _, back, results = trained
    reference = hf_token_logprobs(str(back), results[0]["seqs"])
    for r in results:
        for ours, theirs in zip(r["trained"], reference):
            torch.testing.assert_close(ours["logprobs"], theirs["logprobs"], rtol=0, atol=LOGPROB_ATOL)
            torch.testing.assert_close(ours["entropy"], theirs["entropy"], rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.slow
def test_trained_export_round_trips_byte_identical_at_tp2(trained, tmp_path):
    _, back, _ = trained
    meg = offline.hf_to_megatron(back, tmp_path / "meg", tensor_parallel=2, progress=False)
    again = offline.megatron_to_hf(meg, tmp_path / "again", hf_template=back, progress=False)
    for file in weight_files(back):
        assert (again / file).read_bytes() == (back / file).read_bytes(), file
