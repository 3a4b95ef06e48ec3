"""HFRolloutEngine.generate vs transformers' model.generate, side by side in one run.

Same tiny Qwen3-MoE model (hidden 256, 4 layers, 8 experts top-2, vocab 2048), same batch: 4 prompts of
12/20/28/36 tokens x 8 samples = 32 samples x 64 new tokens, temperature 1, no top-k/top-p. Both produce
what the trainer needs: per sample, the response ids and the log-prob of every sampled token (generate is
asked for ``output_logits=True, return_dict_in_generate=True`` and the log-probs are gathered from them).

Scenarios: ``no_stop`` (every row decodes 64 tokens) and ``stop`` (32 of the 2048 ids end a response, so
rows finish at different steps; generate gets them as ``eos_token_id``). Repeats are interleaved (ours,
theirs, ours, ...) after one warm-up each; the reported figure is the median of per-repeat time ratios.

    python benchmarks/bench_generate.py [--repeats 7] [--threads 1] [--out benchmarks/results/generate.json]

``--sglang PYTHON`` runs the other comparison instead: the transformers engine against a real SGLang server
on CPU (``rollout.sglang.launch.device: cpu``, the server from the interpreter PYTHON, e.g. the venv of
``tools/setup_env.sh sglang``), on the CPU demo's model and on the larger MoE of docs/benchmark-trl.md
(hidden 256, 4 layers, 16 experts top-4). Per model and engine: start-up (the engine built from the saved
folder until it can generate; for SGLang the server's launch until /health answers) and tokens per second
of the same batch, 4 prompts x 8 samples x 64 new tokens, median over repeats after one warm-up. CPU
figures: they say nothing about GPUs.

    python benchmarks/bench_generate.py --sglang ~/.cache/gspo-megatron/sglang-0.5.23/bin/python --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.progress import track
from rich.table import Table

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.hf_engine import HFRolloutEngine

PROMPT_LENGTHS = (12, 20, 28, 36)
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 64
VOCAB = 2048
STOP_IDS = list(range(7, VOCAB, VOCAB // 32))  # 32 ids


def bench_config() -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def make_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def run_hf_generate(
    model, prompts: list[list[int]], stop_ids: list[int], seed: int
) -> list[tuple[list[int], list[float]]]:
    """model.generate on left-padded prompts; returns (response ids, log-probs) per sample."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_NEW_TOKENS,
            num_return_sequences=SAMPLES_PER_PROMPT,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=stop_ids or None,
            pad_token_id=0,
        )
        responses = out.sequences[:, width:]
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)
    results = []
    stops = set(stop_ids)
    for ids, lps in zip(responses.tolist(), logprobs.tolist()):
        n = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        results.append((ids[:n], lps[:n]))
    return results


def run_engine(engine: HFRolloutEngine, prompts: list[list[int]], stop_ids: list[int], seed: int):
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stop_ids, seed=seed)
    return [(s.response_ids, s.logprobs) for s in engine.generate(prompts, SAMPLES_PER_PROMPT, params)]


def timed(fn, *args) -> tuple[float, int]:
    start = time.perf_counter()
    results = fn(*args)
    return time.perf_counter() - start, sum(len(ids) for ids, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sglang", default="", metavar="PYTHON",
                        help="compare with a real SGLang server on CPU run by this interpreter (see the docstring)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads for both (1: stable timings on a shared machine; "
        "OpenMP threads spin badly when cores are oversubscribed)",
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "generate.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.sglang:
        out = args.out if "--out" in sys.argv else os.path.join(os.path.dirname(__file__), "results", "generate_sglang.json")
        sglang_main(args.sglang, args.repeats, out)
        return

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(bench_config()).eval()
    engine = HFRolloutEngine(model)  # holds the very same module: identical weights for both
    prompts = make_prompts(seed=1)
    scenarios = {"no_stop": [], "stop": STOP_IDS}
    report: dict = {
        "command": "python benchmarks/bench_generate.py " + " ".join(sys.argv[1:]),
        "model": (
            "Qwen3-MoE hidden 256, 4 layers, 4 heads / 2 KV heads, 8 experts top-2 (expert FFN 128), vocab 2048, fp32"
        ),
        "batch": {
            "prompt_lengths": list(PROMPT_LENGTHS),
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "max_new_tokens": MAX_NEW_TOKENS,
            "sampling": "temperature 1, top_k 0, top_p 1; per-token log-probs returned by both",
        },
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": list(os.getloadavg()),
        },
        "repeats": args.repeats,
        "scenarios": {},
    }
    work = [(name, r) for name in scenarios for r in range(args.repeats + 1)]
    times = {name: {"generate_s": [], "engine_s": [], "ratio": []} for name in scenarios}
    tokens: dict[str, dict[str, int]] = {name: {} for name in scenarios}
    for name, repeat in track(work, description="generate vs engine"):
        stop_ids = scenarios[name]
        seed = 100 + repeat
        t_engine, n_engine = timed(run_engine, engine, prompts, stop_ids, seed)
        t_hf, n_hf = timed(run_hf_generate, model, prompts, stop_ids, seed)
        if repeat == 0:  # warm-up
            continue
        times[name]["engine_s"].append(t_engine)
        times[name]["generate_s"].append(t_hf)
        times[name]["ratio"].append(t_hf / t_engine)
        tokens[name] = {"engine_tokens_last_repeat": n_engine, "generate_tokens_last_repeat": n_hf}

    table = Table(title="HFRolloutEngine.generate vs model.generate (32 samples x 64 tokens, CPU)")
    for column in ("scenario", "generate median s", "engine median s", "median ratio", "min ratio", "max ratio"):
        table.add_column(column)
    for name, t in times.items():
        summary = {
            "generate_median_s": statistics.median(t["generate_s"]),
            "engine_median_s": statistics.median(t["engine_s"]),
            "median_ratio": statistics.median(t["ratio"]),
            "min_ratio": min(t["ratio"]),
            "max_ratio": max(t["ratio"]),
            **t,
            **tokens[name],
        }
        report["scenarios"][name] = summary
        table.add_row(
            name,
            f"{summary['generate_median_s']:.3f}",
            f"{summary['engine_median_s']:.3f}",
            f"{summary['median_ratio']:.2f}x",
            f"{summary['min_ratio']:.2f}x",
            f"{summary['max_ratio']:.2f}x",
        )
    Console().print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


# ---------------------------------------------------------------- transformers engine vs SGLang on CPU

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "cpu_demo.yaml"
# the larger MoE of docs/benchmark-trl.md (benchmarks/bench_padding_free.py's LARGER)
SGLANG_MODELS = {
    "demo": [],
    "larger": ["model.config.hidden_size=256", "model.config.num_layers=4", "model.config.num_experts=16",
               "model.config.moe_router_topk=4", "model.config.moe_ffn_hidden_size=128", "model.config.head_dim=64"],
}


def save_bench_model(overrides: list[str], folder: Path) -> tuple[str, int]:
    """The demo's ModelConfig with ``overrides``, random weights (the trainer's init seed), saved as a
    HF folder both engines load. Returns (a one-line description, vocabulary size)."""
    import transformers

    from gspo_megatron.trainer.config import load_config

    cfg = load_config(DEMO_CONFIG, overrides).model
    mc = cfg.config
    torch.manual_seed(cfg.init_seed)
    model = transformers.AutoModelForCausalLM.from_config(mc.to_hf_config())
    model.save_pretrained(folder)
    transformers.GenerationConfig.from_model_config(model.config).save_pretrained(folder)
    what = (f"Qwen3-MoE hidden {mc.hidden_size}, {mc.num_layers} layers, {mc.num_experts} experts top-"
            f"{mc.moe_router_topk} (expert FFN {mc.moe_ffn_hidden_size}), vocab {mc.vocab_size}, fp32")
    return what, mc.vocab_size


def sglang_engine_for(python: str, folder: Path, log_dir: Path):
    """A launched CPU SGLang server of ``folder`` (fp32, as the trainer), through the engine's own config."""
    from gspo_megatron.rollout.sglang.config import SGLangConfig
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.rollout.sglang.server import port_is_free
    from gspo_megatron.typed_config import build

    port = next(p for p in range(31000, 32000) if port_is_free("127.0.0.1", p))
    launch = {"model_path": str(folder), "device": "cpu", "python": python, "dtype": "float32",
              "base_port": port, "log_dir": str(log_dir), "startup_timeout_s": 900.0}
    return SGLangEngine.from_config(build(SGLangConfig, {"launch": launch, "release_memory": False}, "rollout.sglang"))


def throughput(engine, prompts: list[list[int]], repeats: int) -> dict:
    """Tokens per second of ``engine.generate`` on ``prompts`` x SAMPLES_PER_PROMPT, no stop tokens: one
    warm-up, then ``repeats`` timed calls (median)."""
    rates, seconds, tokens = [], [], []
    for repeat in range(repeats + 1):
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, seed=100 + repeat)
        start = time.perf_counter()
        samples = engine.generate(prompts, SAMPLES_PER_PROMPT, params)
        elapsed = time.perf_counter() - start
        n = sum(len(s.response_ids) for s in samples)
        if repeat == 0:
            warmup_s = elapsed
            continue
        rates.append(n / elapsed)
        seconds.append(elapsed)
        tokens.append(n)
    return {"tokens_per_s_median": statistics.median(rates), "tokens_per_s": rates, "generate_s": seconds,
            "tokens": tokens, "warmup_generate_s": warmup_s}


def sglang_main(python: str, repeats: int, out: str) -> None:
    """Both engines on both models, one after the other (one server at a time); JSON + PNG to ``out``."""
    import transformers

    report: dict = {
        "command": "python benchmarks/bench_generate.py " + " ".join(sys.argv[1:]),
        "note": "CPU figures (a shared 2-core machine): they say nothing about GPUs",
        "batch": {"prompt_lengths": list(PROMPT_LENGTHS), "samples_per_prompt": SAMPLES_PER_PROMPT,
                  "max_new_tokens": MAX_NEW_TOKENS, "stop_tokens": "none (the model's EOS may end a sample early)",
                  "sampling": "temperature 1, top_k 0, top_p 1; per-token log-probs returned by both"},
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
                        "cpu_count": os.cpu_count(), "loadavg_at_start": list(os.getloadavg()),
                        "sglang_python": python},
        "repeats": repeats,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_generate_sglang_") as tmp:
        for name, overrides in SGLANG_MODELS.items():
            folder = Path(tmp) / name
            what, vocab = save_bench_model(overrides, folder)
            gen = torch.Generator().manual_seed(1)
            prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
            row: dict = {"model": what}
            start = time.perf_counter()
            engine = HFRolloutEngine(str(folder))
            row["transformers"] = {"startup_s": time.perf_counter() - start, **throughput(engine, prompts, repeats)}
            engine.shutdown()
            start = time.perf_counter()
            engine = sglang_engine_for(python, folder, Path(tmp) / "logs")
            try:
                startup = time.perf_counter() - start
                row["sglang_cpu"] = {"startup_s": startup, **throughput(engine, prompts, repeats)}
            finally:
                engine.shutdown()
            row["loadavg_after"] = list(os.getloadavg())
            report["models"][name] = row
            print(name, {k: (v["startup_s"], v["tokens_per_s_median"]) for k, v in row.items()
                         if isinstance(v, dict)}, flush=True)

    table = Table(title="transformers engine vs SGLang CPU server (32 samples x 64 tokens; CPU, not GPU)")
    for column in ("model", "engine", "start-up s", "tokens/s (median)", "warm-up generate s"):
        table.add_column(column)
    for name, row in report["models"].items():
        for engine_name in ("transformers", "sglang_cpu"):
            r = row[engine_name]
            table.add_row(name, engine_name, f"{r['startup_s']:.1f}", f"{r['tokens_per_s_median']:.0f}",
                          f"{r['warmup_generate_s']:.2f}")
    Console().print(table)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp_out = out + ".tmp"
    with open(tmp_out, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp_out, out)
    plot_sglang(report, Path(out).with_suffix(".png"))
    print(f"wrote {out} and {Path(out).with_suffix('.png')}")


def plot_sglang(report: dict, path: Path) -> None:
    """Two bar charts side by side: start-up seconds and tokens per second, per model and engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["models"])
    engines = [("transformers", "transformers engine"), ("sglang_cpu", "SGLang 0.5.23, CPU server")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in zip(axes, ("startup_s", "tokens_per_s_median"), ("start-up (s)", "tokens / s (median)")):
        for j, (engine_key, engine_label) in enumerate(engines):
            values = [report["models"][n][engine_key][key] for n in names]
            xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
            bars = ax.bar(xs, values, width=0.38, label=engine_label)
            ax.bar_label(bars, fmt="%.0f" if key == "tokens_per_s_median" else "%.2f", fontsize=8)
        ax.set_xticks(range(len(names)), names)
        ax.set_yscale("log")  # the engines differ by 10-1000x
        ax.set_ylabel(label + ", log scale")
    axes[0].legend(fontsize=8)
    fig.suptitle("32 samples x 64 tokens, fp32, on a shared 2-core CPU (says nothing about GPUs)", fontsize=10)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
