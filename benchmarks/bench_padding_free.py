"""What skipping padded tokens in the MoE layers saves: the update phase (``Trainer._update``: four optimizer
steps) with ``cpu_modules.PaddingFreeMoELayer`` given the batch's padding mask, against the same layer with
the mask withheld (every position routed to its experts, Megatron's own behaviour), alternated A/B/B/A in one
process on the same rollout batch, so the machine's noise hits both arms alike.

    .venv/bin/python benchmarks/bench_padding_free.py --model larger --threads 1 --pairs 8

``--model larger`` is the larger MoE of docs/benchmark-trl.md (hidden 256, 4 layers, 16 experts top-4,
responses of up to 48 tokens), ``demo`` the cpu_demo model. Prints and writes (``--out``) the medians, the
median per-pair ratio and the share of padded positions in the batch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_update  # noqa: E402  (the demo Trainer and one step's mini-batch shares)

LARGER = ["model.config.hidden_size=256", "model.config.num_layers=4", "model.config.num_experts=16",
          "model.config.moe_router_topk=4", "model.config.moe_ffn_hidden_size=128", "model.config.head_dim=64",
          "rollout.max_new_tokens=48"]


def padded_share(trainer, shares) -> float:
    """Padded positions / all positions over the micro-batches the update runs."""
    real = padded = 0
    for share in shares:
        for mb in trainer.policy._microbatches(share):
            padded += int(mb["padding_mask"].sum())
            real += int((~mb["padding_mask"]).sum())
    return padded / (real + padded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["demo", "larger"], default="larger")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=8, help="A/B pairs after one untimed pair")
    parser.add_argument("--out", default=str(profile_update.REPO / "benchmarks" / "results" / "padding_free.json"))
    args = parser.parse_args()

    import torch

    from gspo_megatron.megatron import cpu_modules, parallel

    torch.set_num_threads(args.threads)
    route = cpu_modules.PaddingFreeMoELayer.route
    skip = [True]

    def switched(self, hidden_states, padding_mask=None):
        return route(self, hidden_states, padding_mask if skip[0] else None)

    cpu_modules.PaddingFreeMoELayer.route = switched
    overrides = (LARGER if args.model == "larger" else []) + ["train.measure_routing_drift=false"]
    with tempfile.TemporaryDirectory() as run_dir:
        trainer, shares = profile_update.build_trainer(run_dir, overrides)
        times = {True: [], False: []}
        for k in range(args.pairs + 1):
            for arm in ((True, False) if k % 2 else (False, True)):
                skip[0] = arm
                times[arm].append(profile_update.timed(trainer, trainer.policy, shares))
        share = padded_share(trainer, shares)
        trainer.close()
    parallel.destroy()
    ratios = [a / b for a, b in zip(times[True][1:], times[False][1:])]
    result = {"command": " ".join(sys.argv), "model": args.model, "threads": args.threads, "pairs": args.pairs,
              "padded_share": share, "skip_median_s": statistics.median(times[True][1:]),
              "all_tokens_median_s": statistics.median(times[False][1:]),
              "ratio_skip_over_all_median": statistics.median(ratios), "ratio_min": min(ratios),
              "ratio_max": max(ratios)}
    print(f"{args.model} model, {args.threads} thread(s): {share:.0%} of the positions are padding; update phase "
          f"{result['skip_median_s'] * 1e3:.0f} ms skipping them vs {result['all_tokens_median_s'] * 1e3:.0f} ms "
          f"routing every position: {result['ratio_skip_over_all_median']:.3f}x (per-pair min "
          f"{result['ratio_min']:.3f}, max {result['ratio_max']:.3f})")
    out = Path(args.out)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)


if __name__ == "__main__":
    main()
