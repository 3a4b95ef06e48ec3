"""Released checkpoint formats: block-scaled FP8 (dequantized exactly, against an independent per-block
dequantization), transformers 5's fused experts (read as the per-expert tensors), and their errors."""
import json
import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gspo_megatron.conversion import fp8, offline, release_formats
from gspo_megatron.conversion.errors import ConversionError
from tests.conversion.hf_models import family_config, make_hf_dir, read_all

QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def reference_bf16(x: np.ndarray) -> torch.Tensor:
    """float64 -> bf16, round to nearest even, by integer arithmetic on the float64 bits (normal values)."""
    bits = x.view(np.int64)
    shift = 52 - 7  # bf16 keeps 7 of float64's 52 mantissa bits
    low, base = bits & ((1 << shift) - 1), bits >> shift
    half = 1 << (shift - 1)
    up = (low > half) | ((low == half) & ((base & 1) == 1))
    return torch.from_numpy(((base + up.astype(np.int64)) << shift).view(np.float64)).to(torch.bfloat16)


def reference_dequantize(q: torch.Tensor, s: torch.Tensor, block, dtype=torch.bfloat16) -> torch.Tensor:
    """Block by block: every element of block (i, j) times s[i, j], in float64, then rounded once to bf16
    (or, for fp32, by numpy)."""
    b0, b1 = block
    values = q.to(torch.float32).double().numpy()
    out = np.empty_like(values)
    for lead in np.ndindex(*values.shape[:-2]):
        for i in range(math.ceil(values.shape[-2] / b0)):
            for j in range(math.ceil(values.shape[-1] / b1)):
                box = lead + (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
                out[box] = values[box] * float(s[lead + (i, j)])
    return reference_bf16(out) if dtype == torch.bfloat16 else torch.from_numpy(out.astype(np.float32))


def random_fp8(shape, block, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 values over their whole range and scales spread over 2^-14 .. 2^-2 with full mantissas."""
    q = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(fp8.FP8)
    s = torch.exp2(torch.randint(-14, -2, fp8.scale_shape(shape, block), generator=gen).float())
    return q, s * (1 + torch.rand(s.shape, generator=gen))


@pytest.mark.parametrize("shape, block", [((1000, 1000), (4, 4)), ((300, 200), (128, 128)),
                                          ((56, 64), (16, 24)), ((3, 40, 50), (16, 16))])
def test_dequantize_matches_an_independent_per_block_dequantization(shape, block):
    q, s = random_fp8(shape, block, torch.Generator().manual_seed(sum(shape)))
    ours = fp8.dequantize(q, s, block)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, reference_dequantize(q, s, block))
    if shape == (1000, 1000):  # 62,500 scales: products that rounding through fp32 sends to the wrong neighbour
        twice = (q.float() * fp8.expand_scales(s, *shape, block)).to(torch.bfloat16)
        assert (twice != ours).sum() > 0
    assert torch.equal(fp8.dequantize(q, s, block, torch.float32), reference_dequantize(q, s, block, torch.float32))


def test_dequantize_rows_from_inside_a_block():
    q, s = random_fp8((70, 30), (16, 16), torch.Generator().manual_seed(1))
    whole = fp8.dequantize(q, s, (16, 16))
    assert torch.equal(fp8.dequantize(q[21:50], s[1:4], (16, 16), first_row=21), whole[21:50])
    with pytest.raises(ValueError, match="expected"):
        fp8.dequantize(q[21:50], s[0:4], (16, 16), first_row=21)


def test_quantize_round_trips_through_dequantize():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(2)) * 0.05
    w[:128, :128] = 0  # an all-zero block gets scale 1
    q, s = fp8.quantize(w, (128, 128))
    assert q.dtype == fp8.FP8 and s.shape == (3, 2) and s[0, 0] == 1
    back = fp8.dequantize(q, s, (128, 128), torch.float32)
    assert torch.allclose(back, w, rtol=0.07, atol=1e-6)  # e4m3 keeps 3 mantissa bits
    assert torch.equal(fp8.dequantize(*fp8.quantize(back, (128, 128)), (128, 128), torch.float32), back)


def quantize_checkpoint(hf, block, gen, names=None) -> dict[str, torch.Tensor]:
    """Replace the projection weights of ``hf`` (2-D ``*_proj.weight`` and fused 3-D experts) by random FP8
    values with scales, as DeepSeek-V3's release stores them; returns each one's expected dequantization."""
    (file,) = list(hf.glob("*.safetensors"))
    tensors = load_file(file)
    expected = {}
    for name in list(tensors):
        if names is not None and name not in names or names is None and not (
                name.endswith("_proj.weight") or name.endswith("experts.gate_up_proj")
                or name.endswith("experts.down_proj")):
            continue
        q, s = random_fp8(tensors[name].shape, block, gen)
        tensors[name], tensors[name + "_scale_inv"] = q, s
        expected[name] = reference_dequantize(q, s, block)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION, weight_block_size=list(block))
    (hf / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("name, fused", [("deepseek_v3", False), ("qwen3_moe", True)])
def test_fp8_checkpoint_converts_to_its_dequantization(tmp_path, monkeypatch, name, fused):
    """A tiny FP8 release (blocks 16 x 24, so that most blocks are partial and none of the shapes divides):
    hf -> megatron -> hf gives every quantized tensor as the independent dequantization and the rest as they
    were; the DeepSeek-V3 one has an FP8 MTP layer, kept aside dequantized and restored. Windows of 100
    weights make the streaming dequantization start and stop inside blocks."""
    monkeypatch.setattr(release_formats, "WINDOW_ELEMENTS", 100)
    hf = make_hf_dir(name, tmp_path / "hf", dtype=torch.bfloat16, fused_experts=fused)
    if name == "deepseek_v3":
        layer = family_config(name).num_layers
        extra = {f"model.layers.{layer}.eh_proj.weight": torch.randn(64, 128).to(torch.bfloat16),
                 f"model.layers.{layer}.enorm.weight": torch.ones(64, dtype=torch.bfloat16)}
        (file,) = list(hf.glob("*.safetensors"))
        save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})
    original = read_all(hf)
    expected = quantize_checkpoint(hf, (16, 24), torch.Generator().manual_seed(3))
    assert any(t.dim() == 3 for t in original.values() if t is not None) == fused
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
    meta = json.loads((meg / "gspo_meta.json").read_text())
    assert meta["source_formats"][0] == "fp8-block-16x24" and ("fused-experts" in meta["source_formats"]) == fused
    back = read_all(offline.megatron_to_hf(meg, tmp_path / "back", progress=False))
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    experts = family_config(name).num_experts
    for stored, tensor in original.items():
        if tensor.dim() == 3:  # fused [E, k x rows, cols] -> the per-expert tensors of its parts
            parts = ("gate_proj", "up_proj") if stored.endswith("gate_up_proj") else ("down_proj",)
            value = expected[stored]
            rows = value.shape[1] // len(parts)
            for e in range(experts):
                for j, part in enumerate(parts):
                    key = stored.replace("experts.gate_up_proj", f"experts.{e}.{part}.weight").replace(
                        "experts.down_proj", f"experts.{e}.{part}.weight")
                    assert torch.equal(back.pop(key), value[e, j * rows:(j + 1) * rows]), key
            continue
        assert torch.equal(back.pop(stored), expected.get(stored, tensor)), stored
    assert not back  # nothing else, no scales
    if name == "deepseek_v3":
        assert any(k.startswith(f"model.layers.{layer}.") for k in expected)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_fused_experts_convert_as_the_per_expert_checkpoint(tmp_path, name):
    """transformers 5's fused layout (Mixtral's also renames block_sparse_moe to mlp) converts to the same
    Megatron tensors as the hub's per-expert layout of the same model: the export of either is the per-expert
    checkpoint, byte for byte."""
    per_expert = make_hf_dir(name, tmp_path / "hf")
    fused = make_hf_dir(name, tmp_path / "fused", fused_experts=True)
    assert any(t.dim() == 3 for t in read_all(fused).values())
    outs = []
    for hf in (per_expert, fused):
        meg = offline.hf_to_megatron(hf, tmp_path / f"{hf.name}-meg", progress=False)
        outs.append(offline.megatron_to_hf(meg, tmp_path / f"{hf.name}-back", hf_template=per_expert, progress=False))
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()
    assert (outs[1] / "model.safetensors").read_bytes() == (per_expert / "model.safetensors").read_bytes()


def test_fp8_errors_name_the_tensor_or_field(tmp_path):
    hf = make_hf_dir("qwen3_moe", tmp_path / "hf", dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.o_proj.weight"
    quantize_checkpoint(hf, (16, 16), torch.Generator().manual_seed(4), names={name})
    (file,) = list(hf.glob("*.safetensors"))
    tensors = load_file(file)
    config = json.loads((hf / "config.json").read_text())
    cases = [
        (dict(tensors, **{name + "_scale_inv": tensors[name + "_scale_inv"][:1]}), config,
         f"{name}_scale_inv: \\[1, 4\\].*expected \\[4, 4\\]"),
        ({k: v for k, v in tensors.items() if k != name + "_scale_inv"}, config, f"{name}: a float8_e4m3fn tensor needs"),
        (tensors, {k: v for k, v in config.items() if k != "quantization_config"}, "quantization_config: missing"),
        (tensors, dict(config, quantization_config=dict(QUANTIZATION, quant_method="gptq")), "quant_method: unsupported"),
        (tensors, dict(config, quantization_config=dict(QUANTIZATION, weight_block_size=None)), "weight_block_size"),
        (tensors, dict(config, quantization_config=dict(QUANTIZATION, weight_block_size=[16, 16],
                                                        activation_scheme="static")), "activation_scheme"),
    ]
    for i, (stored, conf, message) in enumerate(cases):
        save_file(stored, file, metadata={"format": "pt"})
        (hf / "config.json").write_text(json.dumps(conf))
        with pytest.raises(ConversionError, match=message):
            offline.hf_to_megatron(hf, tmp_path / f"meg{i}", progress=False)
        assert not (tmp_path / f"meg{i}").exists()


def test_fp8_export_in_the_release_block_scheme_reads_back(tmp_path):
    """megatron -> hf with --fp8-block writes every projection matrix as e4m3 plus its 128x128 scales (norms,
    router, embeddings as they were) and a quantization_config; that folder converts back to a checkpoint
    whose tensors are the FP8 ones dequantized, and exporting it again in FP8 gives the same bytes."""
    from gspo_megatron.conversion.cli import main as cli_main

    hf = make_hf_dir("deepseek_v3", tmp_path / "hf", dtype=torch.bfloat16)
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
    assert cli_main(["megatron-to-hf", "--megatron-dir", str(meg), "--out", str(tmp_path / "fp8"), "--fp8-block",
                     "128x128", "--no-progress"]) == 0
    exported, original = read_all(tmp_path / "fp8"), read_all(hf)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == dict(QUANTIZATION, weight_block_size=[128, 128])
    for name, tensor in original.items():
        if release_formats.exported_as_fp8(name, tuple(tensor.shape)):
            q, s = exported.pop(name), exported.pop(name + "_scale_inv")
            assert q.dtype == fp8.FP8 and s.shape == fp8.scale_shape(tensor.shape, (128, 128))
            assert torch.allclose(reference_dequantize(q, s, (128, 128)).float(), tensor.float(), rtol=0.07, atol=1e-3)
        else:
            assert torch.equal(exported.pop(name), tensor), name
    assert not exported
    again = offline.hf_to_megatron(tmp_path / "fp8", tmp_path / "meg2", progress=False)
    offline.megatron_to_hf(again, tmp_path / "fp8-again", fp8_block=(128, 128), progress=False)
    assert (tmp_path / "fp8-again" / "model.safetensors").read_bytes() == \
        (tmp_path / "fp8" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_fp8_scale_is_refused_naming_the_tensor(tmp_path, bad):
    """A NaN or inf scale used to dequantize silently into NaN / inf weights."""
    hf = make_hf_dir("qwen3_moe", tmp_path / "hf", dtype=torch.bfloat16)
    name = "model.layers.1.self_attn.o_proj.weight"
    quantize_checkpoint(hf, (16, 16), torch.Generator().manual_seed(4), names={name})
    (file,) = list(hf.glob("*.safetensors"))
    tensors = load_file(file)
    tensors[name + "_scale_inv"][1, 2] = bad
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=re.escape(f"{name}_scale_inv[1, 2]: {bad} is not finite")):
        offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
    assert not (tmp_path / "meg").exists()
