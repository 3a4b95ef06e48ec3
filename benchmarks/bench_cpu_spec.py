"""Megatron's CPU (local) layer spec with its own core attention and experts ("old") against the same spec
with ``megatron/cpu_modules.py``'s ``SDPAttention`` and ``FunctionalSequentialMLP`` ("new"), side by side.

    .venv/bin/python benchmarks/bench_cpu_spec.py [--repeats 40] [--threads 1] [--models demo,larger]

Models: ``demo`` is ``examples/cpu_demo.yaml``'s model (2 layers, hidden 64, 4 heads / 2 KV heads, 4 experts
top-2, expert FFN 64, vocab 100); ``larger`` is the larger model of docs/benchmark-trl.md (hidden 256,
4 layers, 8 experts, expert FFN 128, head_dim 64). Both specs are built in one process and load the same
weights (``testing/models.canonical_weights``); the agreement of logits and gradients is checked and stored.

Batch: 32 sequences as the trainer's log-prob pass sees them: the first 32 prompts of
``examples/data/sort/train.jsonl`` through the demo tokenizer (10 tokens each) plus a random response of
1..8 tokens (``demo``) or 1..32 tokens (``larger``), right-padded by ``batching.collate``, with the
causal mask of ``megatron/policy_model.causal_mask``: the forward ``PolicyModel.compute_logprobs`` runs.

Measured on the bare GPTModel (no DDP, whose hooks cost both specs the same): (1) a no-grad forward,
(2) forward + backward of the summed response-token cross-entropy. The two specs alternate within every
repeat so load from other processes hits both alike; the figure is the median over ``--repeats`` after
warm-up, and the ratio old / new (above 1: the new spec is faster).

Writes benchmarks/results/cpu_spec.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gspo_megatron.megatron.model_config import ModelConfig  # noqa: E402
from gspo_megatron.typed_config import build  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "cpu_spec.json"
DEMO_YAML = ROOT / "examples" / "cpu_demo.yaml"
PROMPTS = ROOT / "examples" / "data" / "sort" / "train.jsonl"
BATCH = 32
LARGER = dict(hidden_size=256, num_layers=4, num_experts=8, moe_ffn_hidden_size=128, head_dim=64)


def model_configs(names: list[str]) -> dict[str, tuple[ModelConfig, int]]:
    """name -> (model config, longest response in tokens)."""
    demo = yaml.safe_load(DEMO_YAML.read_text())["model"]["config"]
    table = {"demo": (demo, 8), "larger": ({**demo, **LARGER}, 32)}
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"--models: unknown model {unknown[0]!r} (known: {sorted(table)})")
    return {n: (build(ModelConfig, table[n][0], f"{DEMO_YAML.name}:model.config"), table[n][1]) for n in names}


def make_batch(vocab_size: int, max_response: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The collated micro-batch of 32 prompt + response sequences (see module doc)."""
    from transformers import AutoTokenizer

    from gspo_megatron.data.tokenizer import demo_tokenizer_path
    from gspo_megatron.batching import TrainSequence, collate
    from gspo_megatron.megatron.policy_model import causal_mask

    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_path())
    lines = PROMPTS.read_text().splitlines()[:BATCH]
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for line in lines:
        prompt = tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]
        length = int(torch.randint(1, max_response + 1, (), generator=gen))
        response = torch.randint(0, vocab_size, (length,), generator=gen)
        seqs.append(TrainSequence(tokens=torch.cat([torch.tensor(prompt), response]), prompt_len=len(prompt)))
    batch = collate(seqs)
    batch["attention_mask"] = causal_mask(batch["input_ids"].shape[1])
    return batch


def forward(model, batch) -> torch.Tensor:
    return model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])


def loss_of(logits: torch.Tensor, batch, vocab_size: int) -> torch.Tensor:
    """Summed cross-entropy of the response tokens ([b, s, V_padded] logits, labels at label positions)."""
    ce = torch.nn.functional.cross_entropy(logits[..., :vocab_size].transpose(1, 2), batch["labels"], reduction="none")
    return (ce * batch["loss_mask"]).sum()


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def run_model(config: ModelConfig, max_response: int, repeats: int, warmup: int, progress, task) -> dict:
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig
    from gspo_megatron.testing.models import canonical_weights

    weights = canonical_weights(config, seed=0)
    models = {}
    for spec, fast in (("old", False), ("new", True)):
        models[spec] = build_model(config, ParallelConfig(), fast_cpu_modules=fast)
        sharding.load_full_state_dict(models[spec], weights)
    batch = make_batch(config.vocab_size, max_response)

    def no_grad(model):
        with torch.no_grad():
            forward(model, batch)

    def fwd_bwd(model):
        model.zero_grad(set_to_none=True)
        loss_of(forward(model, batch), batch, config.vocab_size).backward()

    # agreement of the two specs on this batch: logits and every parameter's gradient
    outputs = {}
    for spec, model in models.items():
        model.zero_grad(set_to_none=True)
        logits = forward(model, batch)
        loss_of(logits, batch, config.vocab_size).backward()
        outputs[spec] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    grads_old, grads_new = outputs["old"][1], outputs["new"][1]
    rel = {n: float((grads_new[n] - g).norm() / g.norm()) for n, g in grads_old.items()}
    worst = max(rel, key=rel.get)
    agreement = {"max_abs_logit_diff": float((outputs["new"][0] - outputs["old"][0]).abs().max()),
                 "max_abs_logit": float(outputs["old"][0].abs().max()),
                 "max_rel_grad_diff": rel[worst], "max_rel_grad_diff_param": worst}

    times: dict[str, dict[str, list[float]]] = {mode: {"old": [], "new": []} for mode in ("forward_nograd", "forward_backward")}
    for mode, fn in (("forward_nograd", no_grad), ("forward_backward", fwd_bwd)):
        for i in range(warmup + repeats):
            for spec, model in models.items():
                t = timed_ms(lambda: fn(model))
                if i >= warmup:
                    times[mode][spec].append(t)
            progress.advance(task)
    rows = {}
    for mode, by_spec in times.items():
        old, new = statistics.median(by_spec["old"]), statistics.median(by_spec["new"])
        rows[mode] = {"old_ms": old, "new_ms": new, "old_over_new": old / new,
                      "per_repeat_ratio_median": statistics.median(o / n for o, n in zip(by_spec["old"], by_spec["new"]))}
    return {"model": dataclass_dict(config), "tokens": list(batch["input_ids"].shape),
            "response_tokens": int(batch["loss_mask"].sum()), "agreement": agreement, "rows": rows, "raw_ms": times}


def dataclass_dict(obj) -> dict:
    from gspo_megatron.typed_config import to_dict

    return to_dict(obj)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--models", default="demo,larger", help="comma-separated: demo, larger")
    parser.add_argument("--out", default=str(RESULT), help="result JSON path")
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    torch.set_num_threads(args.threads)

    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.spawn import free_port

    parallel.init_process_group(0, 1, master_port=free_port())
    initialize_model_parallel(ParallelConfig())
    configs = model_configs([m.strip() for m in args.models.split(",") if m.strip()])
    results = {}
    with Progress(transient=True) as progress:
        for name, (config, max_response) in configs.items():
            task = progress.add_task(name, total=2 * (args.warmup + args.repeats))
            results[name] = run_model(config, max_response, args.repeats, args.warmup, progress, task)
    parallel.destroy()

    table = Table(title=f"CPU layer spec: Megatron's modules (old) vs cpu_modules (new), {args.threads} thread(s), "
                        f"median of {args.repeats}")
    for column in ("model", "batch [b, s]", "measure", "old (ms)", "new (ms)", "old / new", "max |logit diff|",
                   "max rel grad diff"):
        table.add_column(column)
    for name, res in results.items():
        for mode, row in res["rows"].items():
            table.add_row(name, str(res["tokens"]), mode, f"{row['old_ms']:.2f}", f"{row['new_ms']:.2f}",
                          f"{row['old_over_new']:.2f}x", f"{res['agreement']['max_abs_logit_diff']:.1e}",
                          f"{res['agreement']['max_rel_grad_diff']:.1e}")
    Console(width=160).print(table)

    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "threads": args.threads,
              "repeats": args.repeats, "warmup": args.warmup,
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "cpus": os.cpu_count(), "load_average": list(os.getloadavg())},
              "models": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
