"""The TRL side of ``bench_trl.py``: GRPOTrainer in GSPO mode, one RL step per ``step`` line on stdin.

Runs in the separate TRL virtualenv (``.venv-trl``), started by ``bench_trl.py``; it imports nothing
from our package but the stdlib-only reward checker ``gspo_megatron/rewards/synthetic.py``.

GSPO in TRL: ``importance_sampling_level="sequence"`` with ``loss_type="grpo"`` (the sequence ratio is
exp of the mean per-token log-ratio, Eq. 7 of arXiv 2507.18071), ``beta=0`` (no KL, no reference model).
One of our RL steps (128 responses, ``minibatches_per_step`` = 4 optimizer steps) is, in TRL's terms,
``per_device_train_batch_size`` = 128 / 4 = 32, ``gradient_accumulation_steps=1``,
``steps_per_generation=4`` (one generation of 128 completions feeds four optimizer steps),
``num_iterations=1``. With generation and optimizer steps misaligned like this, TRL recomputes the
old-policy log-probs after generation, as we do.

Timing: ``_generate_and_score_completions`` (generation + rewards + advantages + old log-probs) and the
no-grad ``_get_per_token_logps_and_entropies`` call inside it are timed by overriding them in a
subclass; a callback closes a step after every fourth optimizer step, reports, and blocks on stdin
until the driver asks for the next step.

    python trl_side.py --hf-dir DIR --prompts FILE --steps N --threads T --settings JSON --out-dir DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for the stdlib-only reward checker only
from gspo_megatron.rewards.synthetic import synthetic_reward  # noqa: E402

MARKER = "@@BENCH "


def emit(message: dict) -> None:
    print(MARKER + json.dumps(message), flush=True)


def wait_for_command() -> str:
    line = sys.stdin.readline()
    if not line:
        raise RuntimeError("trl_side: stdin closed by the driver")
    return line.strip()


def sort_reward(completions: list[str], answer: list[str], meta: list[dict], **_) -> list[float]:
    """The same verifier our trainer uses (``synthetic_reward``), one float per completion."""
    return [synthetic_reward({"answer": a, "meta": m}, c).reward for c, a, m in zip(completions, answer, meta)]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with the generation batch and its old-policy log-prob pass timed (seconds, summed
    until ``take_timings``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_generation = False
        self._timings = {"generate_and_score": 0.0, "old_logprobs": 0.0, "generate_only": 0.0}

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        self._in_generation = True
        out = super()._generate_and_score_completions(inputs)
        self._in_generation = False
        self._timings["generate_and_score"] += time.perf_counter() - start
        return out

    def _generate_single_turn(self, *args, **kwargs):
        start = time.perf_counter()
        out = super()._generate_single_turn(*args, **kwargs)
        self._timings["generate_only"] += time.perf_counter() - start
        return out

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        start = time.perf_counter()
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._in_generation:  # the old-policy pass; the loss's own forward runs outside generation
            self._timings["old_logprobs"] += time.perf_counter() - start
        return out

    def take_timings(self) -> dict[str, float]:
        out, self._timings = self._timings, dict.fromkeys(self._timings, 0.0)
        return out


class StepGate(TrainerCallback):
    """After every ``optimizer_steps_per_rl_step`` optimizer steps: report the step, wait for the next."""

    def __init__(self, trainer: TimedGRPOTrainer, optimizer_steps_per_rl_step: int):
        self.trainer = trainer
        self.every = optimizer_steps_per_rl_step
        self.start = 0.0

    def begin(self) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return control
        wall = time.perf_counter() - self.start
        t = self.trainer.take_timings()
        metrics = self.trainer._metrics["train"]
        emit({"generation": t["generate_and_score"] - t["old_logprobs"], "generate_only": t["generate_only"],
              "logprobs": t["old_logprobs"], "update": wall - t["generate_and_score"], "step": wall, "wall": wall,
              "reward_mean": metrics["reward"][-1] if metrics.get("reward") else float("nan"),
              "response_length_mean": metrics["completions/mean_length"][-1]
              if metrics.get("completions/mean_length") else float("nan"),
              "optimizer_steps": state.global_step})
        if wait_for_command() == "stop":
            control.should_training_stop = True
        self.start = time.perf_counter()
        return control


def grpo_config(settings: dict, steps: int, threads: int, out_dir: str) -> GRPOConfig:
    responses = settings["prompts_per_step"] * settings["samples_per_prompt"]
    minibatches = settings["minibatches_per_step"]
    return GRPOConfig(
        output_dir=out_dir,
        # batch: one generation of `responses` completions, `minibatches` optimizer steps on it
        num_generations=settings["samples_per_prompt"],
        per_device_train_batch_size=responses // minibatches,
        gradient_accumulation_steps=1,
        steps_per_generation=minibatches,
        num_iterations=1,
        max_steps=steps * minibatches,
        shuffle_dataset=False,  # the driver wrote the prompts in our trainer's order
        # sampling
        max_completion_length=settings["max_new_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=settings["top_k"],
        use_vllm=False,
        # GSPO: sequence-level ratio, no KL
        importance_sampling_level="sequence",
        loss_type="grpo",
        beta=0.0,
        epsilon=settings["clip_low"],
        epsilon_high=settings["clip_high"],
        scale_rewards="group",
        # optimizer as ours: Adam, constant LR, no warm-up, clip 1.0
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=settings["weight_decay"],
        adam_beta1=settings["adam_beta1"],
        adam_beta2=settings["adam_beta2"],
        adam_epsilon=settings["adam_eps"],
        max_grad_norm=settings["clip_grad"],
        # fp32 on CPU, no activation recompute (TRL defaults to bf16 and gradient checkpointing)
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        # nothing else during the timed steps
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        log_completions=False,
        disable_dropout=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=settings["seed"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL: prompt, prompt_ids, answer, meta (in step order)")
    parser.add_argument("--steps", type=int, required=True, help="RL steps (the driver stops after these)")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--settings", required=True, help="JSON from bench_trl.trl_settings")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    settings = json.loads(args.settings)
    torch.set_num_threads(args.threads)

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    for i, row in enumerate(rows):
        ids = tokenizer(text=row["prompt"])["input_ids"]  # as GRPOTrainer tokenizes a plain-text prompt
        if ids != row["prompt_ids"]:
            raise ValueError(f"{args.prompts}:{i + 1}: TRL would tokenize the prompt as {ids}, "
                             f"ours as {row['prompt_ids']}")
    dataset = Dataset.from_list([{k: row[k] for k in ("prompt", "answer", "meta")} for row in rows])
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32, local_files_only=True)
    config = grpo_config(settings, args.steps, args.threads, args.out_dir)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=sort_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer)
    gate = StepGate(trainer, settings["minibatches_per_step"])
    trainer.add_callback(gate)
    torch.set_num_threads(args.threads)  # in case accelerate changed it
    described = {k: getattr(config, k) for k in (
        "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
        "generation_batch_size", "num_iterations", "max_completion_length", "importance_sampling_level",
        "loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "learning_rate", "lr_scheduler_type",
        "max_grad_norm", "use_vllm", "use_cpu", "bf16", "gradient_checkpointing", "temperature", "top_p", "top_k")}
    described["optim"] = config.optim.value  # an OptimizerNames enum after __post_init__
    emit({"ready": True, "torch_threads": torch.get_num_threads(), "grpo_config": described})
    if wait_for_command() != "step":
        return
    gate.begin()
    trainer.train()
    emit({"stopped": True})


if __name__ == "__main__":
    main()
