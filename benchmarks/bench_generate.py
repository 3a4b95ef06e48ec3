"""HFRolloutEngine.generate vs transformers' model.generate, side by side in one run.

Same tiny Qwen3-MoE model (hidden 256, 4 layers, 8 experts top-2, vocab 2048), same batch: 4 prompts of
12/20/28/36 tokens x 8 samples = 32 samples x 64 new tokens, temperature 1, no top-k/top-p. Both produce
what the trainer needs: per sample, the response ids and the log-prob of every sampled token (generate is
asked for ``output_logits=True, return_dict_in_generate=True`` and the log-probs are gathered from them).

Scenarios: ``no_stop`` (every row decodes 64 tokens) and ``stop`` (32 of the 2048 ids end a response, so
rows finish at different steps; generate gets them as ``eos_token_id``). Repeats are interleaved (ours,
theirs, ours, ...) after one warm-up each; the reported figure is the median of per-repeat time ratios.

    python benchmarks/bench_generate.py [--repeats 7] [--threads 1] [--out benchmarks/results/generate.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

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
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads for both (1: stable timings on a shared machine; "
        "OpenMP threads spin badly when cores are oversubscribed)",
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "generate.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

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


if __name__ == "__main__":
    main()
