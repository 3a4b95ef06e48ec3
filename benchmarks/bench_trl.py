"""Our trainer vs Hugging Face TRL's GRPOTrainer in GSPO mode: one RL step, phase by phase, in one run.

Both sides train the same tiny Qwen3-MoE (``examples/cpu_demo.yaml``: 2 layers, hidden 64, 4 experts
top-2, vocab 100) from the same random initial weights (written once with ``save_pretrained``, loaded
by both), on the same sort prompts in the same order, with the same batch: 16 prompts x 8 samples =
128 responses of at most 8 new tokens, four optimizer steps per rollout batch, no KL, GSPO clipping
3e-4 / 4e-4, fp32 on CPU, no warm start, no evaluation, no checkpoints.

Each side runs in its own long-lived process; TRL in a separate virtualenv (``.venv-trl``, created
here when missing) so it cannot change the project's torch/transformers. The driver alternates steps:
ours, TRL, ours, TRL, ... (the side that is not stepping blocks on a pipe, so they never compete for
the cores). After ``--warmup`` steps each, ``--steps`` steps are timed and the medians are reported.

Phases (what each figure covers):
  generation  ours: ``time_rollout_s`` (engine.generate + decode + rewards);
              TRL: ``_generate_and_score_completions`` minus the old-log-prob forward inside it
              (model.generate + decode + rewards + group advantages)
  logprobs    old-policy log-probs of the 128 responses (ours: ``time_logprobs_s``; TRL: the no-grad
              ``_get_per_token_logps_and_entropies`` call inside ``_generate_and_score_completions``)
  update      the four optimizer steps (ours: ``time_update_s``; TRL: the rest of its four
              ``Trainer`` optimizer steps: forward, loss, backward, clipping, AdamW, callbacks)
  sync        ours only: pushing the new weights into the rollout engine (TRL samples with the
              training model itself)
  step        wall time of the whole step (ours: ``time_step_s``; TRL: four optimizer steps). With
              ``--override train.rollout_mode=overlap`` ours is the pipeline's period: the step plus the
              wait for the batch the engine process generates ahead (``overlap_drain``), so our engine
              never runs during TRL's step; ``generation`` is then the wait for a batch, not its cost

    .venv/bin/python benchmarks/bench_trl.py [--steps 40] [--warmup 3] [--threads 1]
                                             [--out benchmarks/results/trl.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "cpu_demo.yaml"
TRL_SIDE = Path(__file__).resolve().parent / "trl_side.py"
TRL_REQUIREMENT = "trl==1.16.0"  # the release this benchmark was written against (works with transformers 5.24)
MARKER = "@@BENCH "  # protocol lines on a worker's stdout; anything else is the libraries' chatter
PHASES = ("generation", "logprobs", "update", "step")

# Our trainer in the benchmark's shape: no warm start, no evaluation, no checkpoints, no log files
# (``train_step`` is called directly, so ``train.steps`` only sizes the LR schedule).
OUR_OVERRIDES = ["sft.steps=0", "eval.every_steps=0", "checkpoint.every_steps=0", "train.steps=1000",
                 "logging.tensorboard=false", "logging.console=false", "rewards.num_workers=0"]


# ---- set-up ------------------------------------------------------------------------------------
def ensure_trl_venv(venv: Path, torch_version: str) -> Path:
    """Create ``venv`` with the CPU torch wheel and TRL when it has no python yet; return its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} (torch=={torch_version}, {TRL_REQUIREMENT})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # torch first, pinned, so the local CPU wheel is used rather than a CUDA build pulled in by trl
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", TRL_REQUIREMENT], check=True)
    return python


def package_versions(python: Path, packages: tuple[str, ...]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; "
            f"print(json.dumps({{p: m.version(p) for p in {list(packages)!r}}}))")
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def write_hf_model(config, directory: Path) -> None:
    """The demo model's random initial weights (seeded by ``model.init_seed``) and the demo tokenizer,
    as a Hugging Face folder both sides load."""
    import torch
    import transformers

    from gspo_megatron.data.tokenizer import demo_tokenizer_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_tokenizer_path())
    hf_config = config.model.config.to_hf_config()
    # generation on both sides ends at the tokenizer's end-of-turn and pads with <pad>
    hf_config.pad_token_id, hf_config.eos_token_id, hf_config.bos_token_id = (tokenizer.pad_token_id,
                                                                              tokenizer.eos_token_id, None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.model.init_seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_prompt_order(config, tokenizer, num_steps: int, path: Path) -> None:
    """The prompts our trainer draws in its first ``num_steps`` steps, in order, as JSONL for TRL (which
    then reads them unshuffled): same prompts per step on both sides."""
    from gspo_megatron.data.dataset import load_prompt_datasets
    from gspo_megatron.data.iterator import PromptIterator

    train, _ = load_prompt_datasets(config.data, tokenizer)
    prompts = PromptIterator(train, config.train.prompts_per_step, seed=config.data.seed, shuffle=config.data.shuffle)
    with open(path, "w") as f:
        for _ in range(num_steps):
            for sample in next(prompts):
                row = {"prompt": sample.prompt_text, "prompt_ids": list(sample.prompt_ids),
                       "answer": sample.answer, "meta": sample.meta}
                f.write(json.dumps(row) + "\n")


def trl_settings(config) -> dict:
    """What the TRL side needs to mirror our config (one source of truth: the loaded TrainConfig)."""
    return {
        "prompts_per_step": config.train.prompts_per_step,
        "samples_per_prompt": config.rollout.samples_per_prompt,
        "minibatches_per_step": config.train.minibatches_per_step,
        "max_new_tokens": config.rollout.max_new_tokens,
        "temperature": config.rollout.temperature,
        "top_p": config.rollout.top_p,
        "top_k": config.rollout.top_k,
        "lr": config.optimizer.lr,
        "weight_decay": config.optimizer.weight_decay,
        "adam_beta1": config.optimizer.adam_beta1,
        "adam_beta2": config.optimizer.adam_beta2,
        "adam_eps": config.optimizer.adam_eps,
        "clip_grad": config.optimizer.clip_grad,
        "clip_low": config.loss.clip_low,
        "clip_high": config.loss.clip_high,
        "seed": config.train.seed,
    }


def describe_model(m) -> str:
    return (f"{m.architecture}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / "
            f"{m.num_key_value_heads} KV heads (head {m.head_dim}), {m.num_experts} experts top-{m.moe_router_topk} "
            f"(expert FFN {m.moe_ffn_hidden_size}), vocab {m.vocab_size}, fp32, the same random initial weights "
            "on both sides")


def batch_title(settings: dict) -> str:
    return (f"{settings['prompts_per_step']} prompts x {settings['samples_per_prompt']} samples x <= "
            f"{settings['max_new_tokens']} tokens, {settings['minibatches_per_step']} optimizer steps")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- worker protocol ---------------------------------------------------------------------------
def emit(message: dict) -> None:
    print(MARKER + json.dumps(message), flush=True)


def write_report(out: Path, report: dict) -> None:
    """``report`` as JSON to ``out``, through a temporary file renamed at the end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


class Worker:
    """A side's process: send ``step`` / ``stop`` on stdin, read one marker line of JSON per step. A
    thread drains its stdout (the libraries' chatter goes to ``<log>.stdout``, stderr to ``<log>``)."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_path
        self.stderr = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, bufsize=1, env=env, cwd=REPO)
        self.messages: queue.Queue[dict | None] = queue.Queue()
        self.reader = threading.Thread(target=self._drain, args=(log_path.with_name(log_path.name + ".stdout"),),
                                       daemon=True)
        self.reader.start()

    def _drain(self, chatter_path: Path) -> None:
        with open(chatter_path, "w") as chatter:
            for line in self.proc.stdout:
                if line.startswith(MARKER):
                    self.messages.put(json.loads(line[len(MARKER):]))
                else:
                    chatter.write(line)
        self.messages.put(None)  # end of output: the process is exiting

    def read(self, timeout_s: float) -> dict:
        try:
            message = self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no answer within {timeout_s:.0f} s (log: {self.log_path})") from None
        if message is None:
            raise RuntimeError(f"{self.name}: exited with {self.proc.wait()} (log: {self.log_path})")
        return message

    def step(self, timeout_s: float) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def stop(self, timeout_s: float = 120) -> None:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        self.read(timeout_s)  # the final acknowledgement
        self.proc.wait(timeout=timeout_s)
        self.reader.join(timeout_s)
        self.stderr.close()


# ---- our side ----------------------------------------------------------------------------------
def run_ours(args: argparse.Namespace) -> None:
    """Worker: build our Trainer on the shared HF folder and run ``train_step`` on command."""
    import torch

    from gspo_megatron.megatron import parallel
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.launch_env import export_for_torch, resolve_launch
    from gspo_megatron.trainer.loop import Trainer

    torch.set_num_threads(args.threads)
    launch = resolve_launch(os.environ)
    os.environ.update(export_for_torch(launch, os.environ))
    overrides = OUR_OVERRIDES + json.loads(args.overrides_json) + [f"model.hf_dir={args.hf_dir}", "model.config=null"]
    config = load_config(CONFIG, overrides)
    parallel.init_process_group(launch.rank, launch.world_size, launch.master_addr, launch.master_port)
    trainer = Trainer(config, args.run_dir)
    # time the bare sampling inside the rollout phase (the rest is decode + rewards)
    engine_generate = trainer.engine.generate
    generate_s = [0.0]

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        out = engine_generate(*a, **kw)
        generate_s[0] += time.perf_counter() - t
        return out

    trainer.engine.generate = timed_generate
    emit({"ready": True, "torch_threads": torch.get_num_threads()})
    for command in sys.stdin:
        if command.strip() == "stop":
            break
        generate_s[0] = 0.0
        t = time.perf_counter()
        metrics = trainer.train_step()
        drain = time.perf_counter()
        if trainer.driver.busy_during_update:
            # overlap: the engine process must be idle before the other side steps, so the batch it generates
            # ahead is finished inside our step (the next step then finds it ready): step = the pipeline's period
            trainer.driver.drain()
        drain = time.perf_counter() - drain
        wall = time.perf_counter() - t
        trainer.step += 1
        emit({"generation": metrics["time_rollout_s"], "generate_only": generate_s[0],
              "logprobs": metrics["time_logprobs_s"], "update": metrics["time_update_s"],
              "sync": metrics["time_sync_s"], "step": wall if trainer.driver.busy_during_update else metrics["time_step_s"],
              "wall": wall, "overlap_drain": drain,
              "engine_generate": metrics.get("time_engine_generate_s"), "overlap_hidden": metrics.get("overlap_hidden_frac"),
              "reward_mean": metrics["reward_mean"], "response_length_mean": metrics["response_length_mean"],
              "clip_frac_seq": metrics["clip_frac_seq"]})
    trainer.close()
    parallel.destroy()
    emit({"stopped": True})


# ---- report ------------------------------------------------------------------------------------
def summarize(ours: list[dict], trl: list[dict]) -> dict:
    """Medians per phase and the median of per-step ratios TRL / ours (steps paired in run order)."""
    out = {}
    for phase in PHASES:
        a, b = [s[phase] for s in ours], [s[phase] for s in trl]
        out[phase] = {"ours_median_s": statistics.median(a), "trl_median_s": statistics.median(b),
                      "ratio_trl_over_ours": statistics.median([y / x for x, y in zip(a, b)]),
                      "ratio_min": min(y / x for x, y in zip(a, b)), "ratio_max": max(y / x for x, y in zip(a, b))}
    out["ours_sync_median_s"] = statistics.median(s["sync"] for s in ours)
    out["ours_generate_only_median_s"] = statistics.median(s["generate_only"] for s in ours)
    out["trl_generate_only_median_s"] = statistics.median(s["generate_only"] for s in trl)
    overlapped = [s for s in ours if s.get("engine_generate") is not None]
    if overlapped:
        # overlap mode: the engine process's own generation time, and the share of it the trainer did not wait for
        out["ours_engine_generate_median_s"] = statistics.median(s["engine_generate"] for s in overlapped)
        out["ours_overlap_hidden_median"] = statistics.median(s["overlap_hidden"] for s in overlapped)
    return out


def print_table(summary: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one GSPO step, {title} (CPU, medians; ratio > 1: ours faster)")
    for column in ("phase", "ours s", "TRL s", "TRL / ours (median)", "min", "max"):
        table.add_column(column)
    for phase in PHASES:
        p = summary[phase]
        table.add_row(phase, f"{p['ours_median_s']:.3f}", f"{p['trl_median_s']:.3f}",
                      f"{p['ratio_trl_over_ours']:.2f}x", f"{p['ratio_min']:.2f}x", f"{p['ratio_max']:.2f}x")
    table.add_row("sync (ours only)", f"{summary['ours_sync_median_s']:.3f}", "-", "", "", "")
    table.add_row("  of generation: sampling", f"{summary['ours_generate_only_median_s']:.3f}",
                  f"{summary['trl_generate_only_median_s']:.3f}", "", "", "")
    if "ours_engine_generate_median_s" in summary:
        table.add_row("engine process generating", f"{summary['ours_engine_generate_median_s']:.3f}", "-",
                      f"{summary['ours_overlap_hidden_median']:.0%} hidden", "", "")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on both sides (1: stable on a shared machine)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override of examples/cpu_demo.yaml (repeatable). The TRL side mirrors the "
                             "loaded config, so model.config.*, rollout.*, train.prompts_per_step/"
                             "minibatches_per_step, optimizer.* and loss clipping change both sides; "
                             "trainer-only keys such as train.measure_routing_drift=false change ours only")
    parser.add_argument("--trl-venv", default=str(REPO / ".venv-trl"))
    parser.add_argument("--step-timeout-s", type=float, default=600.0)
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temp folder (model, prompts, logs)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "trl.json"))
    # internal: the worker mode of our side
    parser.add_argument("--ours-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--overrides-json", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ours_worker:
        run_ours(args)
        return

    import torch
    import transformers
    from rich.progress import track

    from gspo_megatron.trainer.config import load_config

    trl_python = ensure_trl_venv(Path(args.trl_venv), torch.__version__.split("+")[0])
    loadavg_at_start = list(os.getloadavg())
    ours_overrides = OUR_OVERRIDES + args.override
    config = load_config(CONFIG, ours_overrides)
    total = args.warmup + args.steps
    work = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    hf_dir, prompts = work / "hf", work / "prompts.jsonl"
    write_hf_model(config, hf_dir)
    write_prompt_order(config, transformers.AutoTokenizer.from_pretrained(hf_dir), total, prompts)
    settings = trl_settings(config)

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    ours = Worker("ours", [sys.executable, __file__, "--ours-worker", "--hf-dir", str(hf_dir),
                           "--run-dir", str(work / "run"), "--threads", str(args.threads),
                           "--overrides-json", json.dumps(args.override)], work / "ours.log", env)
    trl = Worker("trl", [str(trl_python), str(TRL_SIDE), "--hf-dir", str(hf_dir), "--prompts", str(prompts),
                         "--steps", str(total), "--threads", str(args.threads), "--settings", json.dumps(settings),
                         "--out-dir", str(work / "trl")], work / "trl.log", env)
    ready = {"ours": ours.read(args.step_timeout_s), "trl": trl.read(args.step_timeout_s)}
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for i in track(range(total), description="ours / TRL steps"):
        for side in (ours, trl):  # alternate: one step each
            results[side.name].append(side.step(args.step_timeout_s))
    ours.stop()
    trl.stop()

    timed = {name: steps[args.warmup:] for name, steps in results.items()}
    summary = summarize(timed["ours"], timed["trl"])
    report = {
        "command": "python benchmarks/bench_trl.py " + " ".join(sys.argv[1:]),
        "setup": {
            "model": describe_model(config.model.config),
            "task": "examples/data/sort/train.jsonl, same prompts in the same order on both sides",
            "batch": batch_title(settings) + " per rollout batch",
            "ours": "gspo_megatron Trainer.train_step, examples/cpu_demo.yaml with " + " ".join(ours_overrides),
            "trl": ready["trl"]["grpo_config"],
            "phases": __doc__.split("Phases (what each figure covers):\n")[1].split("\n\n")[0],
        },
        "environment": {
            "python": platform.python_version(),
            "ours": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "megatron-core": package_versions(Path(sys.executable), ("megatron-core",))["megatron-core"],
                     "torch_threads": ready["ours"]["torch_threads"]},
            "trl_venv": {**package_versions(trl_python, ("trl", "torch", "transformers", "accelerate")),
                         "torch_threads": ready["trl"]["torch_threads"]},
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": loadavg_at_start,
            "loadavg_at_end": list(os.getloadavg()),
        },
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "summary": summary,
        "steps": results,
    }
    print_table(summary, batch_title(settings))
    write_report(Path(args.out), report)
    if args.keep_workdir:
        print(f"kept {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
