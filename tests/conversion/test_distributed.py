"""Converted checkpoints at TP=2, PP=2 and EP=2 on two gloo ranks: the Megatron logits equal the
transformers logits, the live export returns the HF checkpoint's tensors on every rank, and a checkpoint
saved at one layout loads at another and converts back to the original HF tensors."""
import pytest

from gspo_megatron.conversion import dcp_io, offline
from gspo_megatron.megatron.spawn import run_distributed
from tests.conversion.hf_models import FAMILIES, family_config, make_hf_dir, read_all
from tests.conversion.workers import EXPORT_BUCKET_BYTES, conversion_checks

pytestmark = pytest.mark.slow

ATOL = 1e-4  # fp32
CASES = {"qwen3_moe": ["tp2", "pp2", "ep2"], "llama_tied": ["tp2", "pp2"], "qwen2_moe": ["tp2", "pp2", "ep2"],
         "glm4_moe": ["tp2", "pp2", "ep2"], "deepseek_v3": ["tp2", "pp2", "ep2"],
         "deepseek_v3_plain_q": ["tp2", "ep2"], "deepseek_v3_grouped": ["ep2"],
         "deepseek_v3_yarn": ["tp2"]}
CASES = {name: layouts for name, layouts in CASES.items() if name in FAMILIES}  # MLA needs megatron-core 0.16.1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    folders = {}
    for name in CASES:
        hf = make_hf_dir(name, root / f"{name}-hf")
        folders[name] = (hf, offline.hf_to_megatron(hf, root / f"{name}-meg", tensor_parallel=2, progress=False))
    resaved = root / "qwen3_moe-tp2-saved"
    cases = [(name, str(hf), str(meg), CASES[name]) for name, (hf, meg) in folders.items()]
    resave = (str(folders["qwen3_moe"][0]), str(folders["qwen3_moe"][1]), "tp2", str(resaved), ["ep2", "pp2"])
    results = run_distributed(conversion_checks, 2, (cases, resave))
    return folders, resaved, results


def _logit_diffs(results, key, layout):
    diffs = [r[key]["logits"][layout] if key in CASES else r[key][layout] for r in results]
    return [d for d in diffs if d is not None]


@pytest.mark.parametrize("name, layout", [(n, l) for n, layouts in CASES.items() for l in layouts])
def test_megatron_logits_match_transformers(runs, name, layout):
    _, _, results = runs
    diffs = _logit_diffs(results, name, layout)
    assert len(diffs) == (1 if layout == "pp2" else 2)  # only the last pipeline stage has logits
    assert max(diffs) < ATOL


@pytest.mark.parametrize("name, layout", [(n, l) for n, layouts in CASES.items() for l in layouts])
def test_live_export_equals_the_hf_checkpoint_on_every_rank(runs, name, layout):
    _, _, results = runs
    exports = [r[name]["export"][layout] for r in results]
    for out in exports:
        assert out["names"] == out["reference_names"]  # every HF tensor, nothing else
        assert out["different"] == []
        assert len(out["bucket_names"]) > 1
        assert all(size <= max(EXPORT_BUCKET_BYTES, out["largest_tensor_bytes"]) for size in out["bucket_bytes"])
        flat = [n for bucket in out["bucket_names"] for n in bucket]
        assert len(flat) == len(set(flat))
    assert exports[0]["bucket_names"] == exports[1]["bucket_names"]  # the same buckets on both ranks
    assert ("lm_head.weight" in exports[0]["names"]) == (not family_config(name).tie_word_embeddings)


@pytest.mark.parametrize("layout", ["ep2", "pp2"])
def test_checkpoint_saved_at_tp2_loads_at_another_layout(runs, layout):
    _, _, results = runs
    assert max(_logit_diffs(results, "resaved", layout)) < ATOL


def test_checkpoint_saved_by_megatron_at_tp2_converts_back_to_the_same_tensors(runs, tmp_path, monkeypatch):
    folders, resaved, _ = runs
    hf = folders["qwen3_moe"][0]
    # the saved checkpoint is really split the TP=2 way (not our one-chunk-per-tensor layout)
    with dcp_io.CheckpointReader(resaved) as reader:
        chunks = reader.metadata.state_dict_metadata["model.decoder.layers.self_attention.linear_qkv.weight"].chunks
    assert len(chunks) == 4 and {tuple(c.sizes) for c in chunks} == {(1, 64, 64)}
    segmented, loaded = {}, []
    real_segments, real_read = dcp_io.CheckpointReader.segments, dcp_io.CheckpointReader.read

    def recording_segments(self, request, items):
        out = real_segments(self, request, items)
        if out is not None:
            segmented[request.name] = len(out)
        return out

    def recording_read(self, requests, items):
        loaded.extend(r.name for r in requests)
        return real_read(self, requests, items)

    monkeypatch.setattr(dcp_io.CheckpointReader, "segments", recording_segments)
    monkeypatch.setattr(dcp_io.CheckpointReader, "read", recording_read)
    back = offline.megatron_to_hf(resaved, tmp_path / "back", hf_template=hf, progress=False)
    ours, theirs = read_all(back), read_all(hf)
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and (ours[k] == theirs[k]).all() for k in theirs)
    # TP row slices (qkv: 2 records; fc1: the gate and up halves of 2 ranks) are copied as bytes, column
    # slices (the row-parallel linear_proj and expert fc2) are loaded
    assert segmented["decoder.layers.0.self_attention.linear_qkv.weight"] == 2
    assert segmented["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == 4
    assert {"decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"} <= set(loaded)
    assert set(segmented).isdisjoint(loaded)
