"""Conversion at scale, both ways, against ``cp -r`` + ``sync`` of the same folder, in one run:

    .venv/bin/python benchmarks/bench_convert_scale.py [--bf16-gb 20] [--fp8-gb 4.5] [--workdir DIR]

1. **bf16, Qwen3-MoE-shaped** (Qwen3-30B-A3B's layers, as ``bench_convert.py``; layers added up to
   ``--bf16-gb``): ``cp -r`` + ``sync``; ``hf-to-megatron``; ``megatron-to-hf`` back, whose files must hash
   as the source's. To stay within about 2.1x the checkpoint on disk, the source's files are hashed and
   deleted before the way back (which takes its template from the checkpoint's ``hf/``).
2. **FP8, DeepSeek-V3-shaped** (DeepSeek-V3's tensor shapes: hidden 7168, MLA with q latent 1536 and kv latent
   512 over 128 heads, dense FFN 18432, experts of 2048, a 32k vocabulary; one dense layer, then MoE layers of
   64 experts plus the shared one until ``--fp8-gb``; every ``*_proj.weight`` e4m3 with 128 x 128 scales):
   ``cp -r`` + ``sync``; ``hf-to-megatron`` (dequantized to bf16, about 2x the bytes written);
   ``megatron-to-hf`` (bf16); ``megatron-to-hf --fp8-block 128x128`` (quantized again).
Each conversion runs in its own process (``bench_convert.child``): time around the conversion, peak RSS
(VmHWM) against the process's peak after imports. Outputs are deleted as soon as they are measured.
Writes benchmarks/results/convert_scale.json and prints a table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_convert  # noqa: E402  (this folder)

RESULT = Path(__file__).resolve().parent / "results" / "convert_scale.json"
DEEPSEEK = dict(architecture="deepseek_v3", vocab_size=32000, hidden_size=7168, num_attention_heads=128,
                num_key_value_heads=128, head_dim=192, qk_rope_head_dim=64, q_lora_rank=1536, kv_lora_rank=512,
                v_head_dim=128, ffn_hidden_size=18432, moe_ffn_hidden_size=2048, moe_router_topk=8,
                moe_shared_expert_intermediate_size=2048, first_dense_layers=1, moe_router_score_function="sigmoid",
                moe_router_expert_bias=True, moe_router_topk_scaling_factor=2.5, qk_layernorm=True,
                tie_word_embeddings=False, norm_topk_prob=True)
BLOCK = (128, 128)
_RANDOM = None


def _random_block():
    """256 MiB of random bf16 / e4m3 bytes, reused (at rolling offsets) for every tensor: generating random
    numbers for 20 GB would take longer than everything measured."""
    import torch

    global _RANDOM
    if _RANDOM is None:
        _RANDOM = (torch.randn(2**27, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    return _RANDOM


def _fill(spec, position: int):
    import torch

    from gspo_megatron.conversion import fp8

    pool = _random_block().view(torch.uint8)
    start = (position % (pool.numel() - spec.nbytes)) // 16 * 16 if spec.nbytes < pool.numel() else 0
    raw = pool[start:start + spec.nbytes] if spec.nbytes <= pool.numel() else pool.repeat(
        math.ceil(spec.nbytes / pool.numel()))[:spec.nbytes]
    if spec.dtype == fp8.FP8:  # random bytes include NaNs: clear e4m3's all-ones exponent+mantissa
        raw = raw & 0xF7
    if spec.dtype == torch.float32:  # scales: positive, around 2^-9
        return torch.full(spec.shape, 2.0 ** -9) * (1 + torch.rand(spec.shape))
    return raw.view(spec.dtype).reshape(spec.shape)


def generate(directory: Path, config, fp8_block=None, shards: int = 8) -> int:
    """Synthetic safetensors of ``config`` (HF names, ``shards`` files + index); with ``fp8_block`` the
    projection matrices are e4m3 with fp32 block scales and config.json has the quantization_config."""
    import torch

    from gspo_megatron.conversion import fp8
    from gspo_megatron.conversion.release_formats import exported_as_fp8, fp8_quantization_config
    from gspo_megatron.conversion.safetensors_io import SafetensorsWriter, TensorSpec, plan_shards, write_index
    from gspo_megatron.conversion.tables import expand
    from gspo_megatron.testing.models import canonical_shapes

    directory.mkdir(parents=True)
    hf_config = {**config.to_hf_dict(), "dtype": "bfloat16"}
    if fp8_block:
        hf_config["quantization_config"] = fp8_quantization_config(fp8_block)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
    shapes, specs = canonical_shapes(config), []
    for entry in expand(config):
        for name, shape in zip(entry.hf, entry.transform.hf_shapes(shapes[entry.megatron])):
            if fp8_block and exported_as_fp8(name, tuple(shape)):
                specs += [TensorSpec(name, tuple(shape), fp8.FP8),
                          TensorSpec(name + fp8.SCALE_SUFFIX, fp8.scale_shape(shape, fp8_block), torch.float32)]
            else:
                specs.append(TensorSpec(name, tuple(shape), torch.float32 if "expert_bias" in name or
                                        "e_score_correction_bias" in name else torch.bfloat16))
    total = sum(s.nbytes for s in specs)
    plan = plan_shards(specs, -(-total // shards))
    position = 0
    for file, group in plan.files.items():
        writer = SafetensorsWriter(directory / file, group)
        for spec in group:
            writer.write(spec.name, _fill(spec, position))
            position += spec.nbytes + 4099
        writer.close()
    if plan.index is not None:
        write_index(directory, plan.index)
    return total


def folder_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def hashes(directory: Path) -> dict[str, str]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        digest = hashlib.sha1()
        with open(path, "rb") as f:
            while chunk := f.read(64 * 2**20):
                digest.update(chunk)
        out[path.name] = digest.hexdigest()
    return out


def cp_sync(source: Path, dest: Path) -> dict:
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(dest)], check=True)
    cp_s = time.perf_counter() - start
    subprocess.run(["sync", *map(str, sorted(dest.iterdir()))], check=True)
    total = time.perf_counter() - start
    shutil.rmtree(dest)
    return {"cp_s": cp_s, "cp_sync_s": total}


def convert(args: list[str]) -> dict:
    result = bench_convert.run_child(args)
    print(f"  {args[0]}{' ' + args[-1] if '--fp8-block' in args else ''}: {result['seconds']:.1f} s, peak RSS "
          f"{result['peak_rss_bytes'] / 2**20:.0f} MiB (after imports {result['baseline_rss_bytes'] / 2**20:.0f})",
          flush=True)
    return result


def row(name: str, result: dict, read: int, written: int, baseline: dict) -> dict:
    return {"step": name, "seconds": result["seconds"], "read_bytes": read, "written_bytes": written,
            "written_gb_per_s": written / result["seconds"] / 1e9,
            "ratio_vs_cp_sync": baseline["cp_sync_s"] / result["seconds"],
            "peak_rss_bytes": result["peak_rss_bytes"], "baseline_rss_bytes": result["baseline_rss_bytes"],
            "peak_over_baseline_bytes": result["peak_rss_bytes"] - result["baseline_rss_bytes"]}


def bf16_case(work: Path, size_gb: float) -> dict:
    config = bench_convert.model_config(size_gb)
    hf, meg, back = work / "bf16-hf", work / "bf16-meg", work / "bf16-back"
    print(f"bf16: generating {config.num_layers} Qwen3-30B-A3B layers", flush=True)
    nbytes = generate(hf, config)
    size = folder_bytes(hf)
    baseline = cp_sync(hf, work / "bf16-cp")
    print(f"  cp -r + sync: {baseline['cp_sync_s']:.1f} s ({baseline['cp_s']:.1f} s without sync)", flush=True)
    to_meg = convert(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(meg), "--no-progress"])
    source_hashes, index = hashes(hf), (hf / "model.safetensors.index.json").read_text()
    shutil.rmtree(hf)  # the way back takes its template from the checkpoint's hf/
    meg_size = folder_bytes(meg)
    to_hf = convert(["megatron-to-hf", "--megatron-dir", str(meg), "--out", str(back), "--no-progress"])
    identical = hashes(back) == source_hashes and (back / "model.safetensors.index.json").read_text() == index
    shutil.rmtree(back)
    shutil.rmtree(meg)
    if not identical:
        raise SystemExit("bf16: the round trip changed the checkpoint")
    return {"checkpoint_bytes": nbytes, "num_layers": config.num_layers, "cp": baseline, "round_trip_identical": True,
            "rows": [row("hf -> megatron", to_meg, size, meg_size, baseline),
                     row("megatron -> hf", to_hf, meg_size, size, baseline)]}


def deepseek_config(size_gb: float, experts: int):
    from gspo_megatron.megatron.model_config import ModelConfig

    def fp8_bytes(layers: int) -> int:
        from gspo_megatron.testing.models import canonical_shapes

        config = ModelConfig(num_layers=layers, num_experts=experts, **{**DEEPSEEK, "moe_router_topk": min(8, experts)})
        return sum(math.prod(s) * (1 if len(s) == 2 and "embedding" not in n and "output_layer" not in n
                                   and "router" not in n else 2) for n, s in canonical_shapes(config).items())
    layers = 2
    while fp8_bytes(layers + 1) <= size_gb * 1e9:
        layers += 1
    config = ModelConfig(num_layers=layers, num_experts=experts, **{**DEEPSEEK, "moe_router_topk": min(8, experts)})
    config.validate("bench_convert_scale")
    return config


def fp8_case(work: Path, size_gb: float, experts: int) -> dict:
    config = deepseek_config(size_gb, experts)
    hf, meg, back, again = work / "fp8-hf", work / "fp8-meg", work / "fp8-back", work / "fp8-again"
    print(f"fp8: generating {config.num_layers} DeepSeek-V3-shaped layers ({config.num_experts} experts)", flush=True)
    nbytes = generate(hf, config, fp8_block=BLOCK)
    size = folder_bytes(hf)
    baseline = cp_sync(hf, work / "fp8-cp")
    print(f"  cp -r + sync: {baseline['cp_sync_s']:.1f} s ({baseline['cp_s']:.1f} s without sync)", flush=True)
    to_meg = convert(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(meg), "--no-progress"])
    shutil.rmtree(hf)
    meg_size = folder_bytes(meg)
    to_hf = convert(["megatron-to-hf", "--megatron-dir", str(meg), "--out", str(back), "--no-progress"])
    back_size = folder_bytes(back)
    shutil.rmtree(back)
    to_fp8 = convert(["megatron-to-hf", "--megatron-dir", str(meg), "--out", str(again), "--no-progress",
                      "--fp8-block", "128x128"])
    fp8_size = folder_bytes(again)
    shutil.rmtree(again)
    shutil.rmtree(meg)
    return {"checkpoint_bytes": nbytes, "num_layers": config.num_layers, "num_experts": config.num_experts,
            "cp": baseline,
            "rows": [row("hf (fp8) -> megatron (bf16)", to_meg, size, meg_size, baseline),
                     row("megatron -> hf (bf16)", to_hf, meg_size, back_size, baseline),
                     row("megatron -> hf --fp8-block 128x128", to_fp8, meg_size, fp8_size, baseline)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bf16-gb", type=float, default=20.0)
    parser.add_argument("--fp8-gb", type=float, default=4.5)
    parser.add_argument("--fp8-experts", type=int, default=64, help="routed experts per MoE layer (DeepSeek-V3: 256)")
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gspo-bench-scale-", dir=args.workdir))
    free = shutil.disk_usage(work).free
    need = max(2.1 * args.bf16_gb, 3.2 * args.fp8_gb) * 1e9
    if free < need + 5e9:
        shutil.rmtree(work)
        raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, the benchmark needs about {need / 1e9 + 5:.0f} GB")
    record = {"command": "python benchmarks/bench_convert_scale.py " + " ".join(sys.argv[1:]),
              "cpu_count": os.cpu_count(),
              "note": "one run; this 2-core machine is shared with other jobs, so figures vary from run to run"}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    try:  # the record is written after each case, so an interrupted run keeps what it measured
        if args.bf16_gb > 0:
            record["bf16_qwen3_moe"] = bf16_case(work, args.bf16_gb)
            RESULT.write_text(json.dumps(record, indent=2) + "\n")
        if args.fp8_gb > 0:
            record["fp8_deepseek_v3"] = fp8_case(work, args.fp8_gb, args.fp8_experts)
            RESULT.write_text(json.dumps(record, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for case in ("bf16_qwen3_moe", "fp8_deepseek_v3"):
        if case not in record:
            continue
        c = record[case]
        print(f"\n{case}: {c['checkpoint_bytes'] / 1e9:.2f} GB source, cp -r + sync {c['cp']['cp_sync_s']:.1f} s "
              f"({c['checkpoint_bytes'] / c['cp']['cp_sync_s'] / 1e9:.2f} GB/s)")
        for r in c["rows"]:
            print(f"  {r['step']:<38} {r['seconds']:7.1f} s  {r['written_bytes'] / 1e9:6.2f} GB written  "
                  f"{r['written_gb_per_s']:5.2f} GB/s  x{r['ratio_vs_cp_sync']:.2f} of cp+sync  peak RSS "
                  f"{r['peak_rss_bytes'] / 2**20:6.0f} MiB (+{r['peak_over_baseline_bytes'] / 2**20:.0f} over imports)")
    print(f"results in {RESULT}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        bench_convert.child(sys.argv[2:])
    else:
        main()
