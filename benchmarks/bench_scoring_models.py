"""What models that score the policy cost, as ratios measured side by side in one run.

    .venv/bin/python benchmarks/bench_scoring_models.py [--responses 512] [--repeats 3] [--steps 12]

1. Scoring throughput on the same batch: ``--responses`` sort-task responses of the CPU demo (the candidates
   ``examples/make_demo_reward_model.py`` writes: right answers and near misses) scored in one process
   (``RewardPool(num_workers=0)``) by the demo's verifier (``synthetic``), its reward model
   (``runs/demo_reward_model``) and its judge (``runs/demo_judge``), each made by its script when absent. The
   three are timed in turn, ``--repeats`` times over; reported: the median time and the median over repeats
   of each one's time over the verifier's in the same repeat.
2. The step-time cost of a distillation teacher: the CPU demo (``examples/cpu_demo.yaml``, no warm start,
   ``--steps`` GSPO steps) with and without ``distill.teacher_dir`` -- a random Qwen3-MoE twice the
   student's width and experts (the shape of examples/experiments/distill_demo.py's teacher), saved in
   Hugging Face format -- run in turn, ``--repeats`` times over. Per run the median of ``time_step_s`` and of
   ``time_logprobs_s`` (old-policy and teacher log-probs) over the steps after the first two; the ratio is
   the median over repeats of the teacher run's over the run without, the two run back to back.

Writes benchmarks/results/scoring_models.json and prints both tables.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from gspo_megatron.data.dataset import load_prompt_datasets  # noqa: E402
from gspo_megatron.rewards import RewardConfig, RewardPool  # noqa: E402
from gspo_megatron.testing.experiment_runs import load_script, read_metrics, train_run, write_json  # noqa: E402
from gspo_megatron.trainer.components import load_tokenizer  # noqa: E402
from gspo_megatron.trainer.config import load_config  # noqa: E402
from gspo_megatron.typed_config import build  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "scoring_models.json"
DEMO = REPO / "examples" / "cpu_demo.yaml"


def scoring_terms(rm_dir: Path, judge_dir: Path) -> dict[str, dict]:
    """The term of each scorer, as the shipped demo configs declare it, with the folders given."""
    (rm,) = [t for t in load_config(REPO / "examples" / "cpu_demo_reward_model.yaml").rewards.terms
             if t.name == "reward_model"]
    (judge,) = [t for t in load_config(REPO / "examples" / "cpu_demo_judge.yaml").rewards.terms if t.name == "judge"]
    rm_term = {"name": "reward_model", "reward_model": {
        "path": str(rm_dir), "chat_template": rm.reward_model.chat_template, "max_length": rm.reward_model.max_length,
        "batch_size": rm.reward_model.batch_size, "normalize": rm.reward_model.normalize}}
    judge_term = {"name": "judge", "range": list(judge.range), "judge": {
        "path": str(judge_dir), "chat_template": judge.judge.chat_template, "template": judge.judge.template,
        "pattern": judge.judge.pattern, "test_verdict": judge.judge.test_verdict,
        "max_new_tokens": judge.judge.max_new_tokens, "batch_size": judge.judge.batch_size}}
    return {"verifier": {"name": "synthetic"}, "reward_model": rm_term, "judge": judge_term}


def scoring_batch(n: int) -> list[tuple[dict, str]]:
    make_rm = load_script(REPO / "examples" / "make_demo_reward_model.py")
    config = load_config(DEMO)
    train_set, _ = load_prompt_datasets(config.data, load_tokenizer(config.model))
    pairs = make_rm.candidate_pairs(train_set, random.Random(0))
    return random.Random(1).sample(pairs, n)


def time_scoring(terms: dict[str, dict], batch, repeats: int) -> dict[str, dict]:
    pools = {name: RewardPool(build(RewardConfig, {"terms": [term], "num_workers": 0}, "rewards"))
             for name, term in terms.items()}
    times: dict[str, list[float]] = {name: [] for name in terms}
    errors: dict[str, float] = {}
    try:
        for pool in pools.values():
            pool.score(batch[:8])  # warm-up: first forward
        for _ in range(repeats):
            for name, pool in pools.items():
                start = time.perf_counter()
                _, metrics = pool.score(batch)
                times[name].append(time.perf_counter() - start)
                errors[name] = metrics["rewards/errors"]
    finally:
        for pool in pools.values():
            pool.close()
    # each repeat times the three back to back: the ratio is taken per repeat, then its median
    return {name: {"median_s": statistics.median(t), "all_s": t, "responses_per_s": len(batch) / statistics.median(t),
                   "time_vs_verifier": statistics.median(x / v for x, v in zip(t, times["verifier"])),
                   "failed_responses": errors[name]} for name, t in times.items()}


def random_teacher(out: Path) -> Path:
    """A random Qwen3-MoE with twice the demo student's width and experts, on the demo tokenizer."""
    import torch
    import transformers

    from gspo_megatron.data.tokenizer import demo_tokenizer_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_tokenizer_path())
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def time_teacher(steps: int, repeats: int, work: Path) -> dict[str, dict]:
    teacher = random_teacher(work / "teacher")
    arms = {"no_teacher": [], "teacher": [f"distill.teacher_dir={teacher}"]}
    common = [f"train.steps={steps}", "sft.steps=0", "eval.every_steps=0", "checkpoint.every_steps=0",
              "logging.console=false", "logging.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    per_run: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(repeats):
        for arm, extra in arms.items():
            run_dir = work / f"{arm}_{r}"
            train_run(DEMO, run_dir, common + extra, env, REPO)
            m = read_metrics(run_dir, ("time_step_s", "time_logprobs_s"))
            per_run[arm].append({k: statistics.median([v for s, v in zip(m["steps"], m[k]) if s > 2 and v is not None])
                                 for k in ("time_step_s", "time_logprobs_s")})
    out = {arm: {k: statistics.median(run[k] for run in runs) for k in ("time_step_s", "time_logprobs_s")}
           | {"runs": runs} for arm, runs in per_run.items()}
    for k in ("time_step_s", "time_logprobs_s"):  # paired by repeat (the two runs back to back), then the median
        out["teacher"][f"{k}_vs_no_teacher"] = statistics.median(
            t[k] / n[k] for t, n in zip(per_run["teacher"], per_run["no_teacher"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # like the reward workers and the training runs (OMP_NUM_THREADS=1): one core each

    rm_dir, judge_dir = REPO / "runs" / "demo_reward_model", REPO / "runs" / "demo_judge"
    if not rm_dir.is_dir():
        load_script(REPO / "examples" / "make_demo_reward_model.py").main(["--out", str(rm_dir)])
    if not judge_dir.is_dir():
        load_script(REPO / "examples" / "make_demo_judge.py").main(["--out", str(judge_dir)])
    load_before = os.getloadavg()[0]
    scoring = time_scoring(scoring_terms(rm_dir, judge_dir), scoring_batch(args.responses), args.repeats)
    with tempfile.TemporaryDirectory() as work:
        teacher = time_teacher(args.steps, args.repeats, Path(work))
    record = {"command": " ".join(["python benchmarks/bench_scoring_models.py", *sys.argv[1:]]),
              "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
              "load_average_before_after": [load_before, os.getloadavg()[0]], "responses": args.responses,
              "repeats": args.repeats, "steps": args.steps, "scoring": scoring, "teacher": teacher}
    write_json(args.out, record)

    table = Table(title=f"scoring {args.responses} demo responses in one process (median of {args.repeats})")
    for column in ("scorer", "responses/s", "time vs verifier", "failed responses"):
        table.add_column(column)
    for name, r in scoring.items():
        table.add_row(name, f"{r['responses_per_s']:.0f}", f"{r['time_vs_verifier']:.1f}x", f"{r['failed_responses']:.0f}")
    Console().print(table)
    table = Table(title=f"the demo's GSPO step with and without a teacher ({args.steps} steps, {args.repeats} runs each)")
    for column in ("run", "s / step", "log-prob phase s"):
        table.add_column(column)
    for arm, r in teacher.items():
        table.add_row(arm, f"{r['time_step_s']:.3f}", f"{r['time_logprobs_s']:.3f}")
    t = teacher["teacher"]
    table.add_row("ratio", f"{t['time_step_s_vs_no_teacher']:.2f}x", f"{t['time_logprobs_s_vs_no_teacher']:.2f}x")
    Console().print(table)
    Console().print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
