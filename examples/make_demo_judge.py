"""Write the CPU judge demo's judge: a tiny Qwen3 causal LM on the demo tokenizer that answers in the verdict
format but knows nothing, in Hugging Face format.

    python examples/make_demo_judge.py             # writes runs/demo_judge (under a minute)
    gspo-megatron train --config examples/cpu_demo_judge.yaml --run-dir runs/demo_judge_run

The judge is taught the format, not the task: for judge prompts built exactly as the config's ``judge`` term
builds them (``rewards/scoring_models.py judge_prompt_ids``) over random responses to the demo's training
prompts, its target is the response's first digit (the verdict rule's score: meaningless) or, for a response of
one digit, the word "unsure" (no score: a malformed verdict, counted as a failure). So examples/cpu_demo_judge.yaml shows a
judge's plumbing -- the template, the rule, batching, failure counts and a run that goes on through
malformed verdicts -- not a judge worth its cost. A real judge is any causal LM of a family the in-process
engine serves (docs/rewards.md). The script prints how many of the eval prompts' verdicts the rule parses.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import transformers

from gspo_megatron.rewards.scoring_models import judge_prompt_ids
from gspo_megatron.rewards.verdicts import parse_verdict
from gspo_megatron.testing.experiment_runs import config_term, save_model_folder

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "cpu_demo_judge.yaml"


def target(response: str) -> str:
    """The verdict taught for ``response`` (digits and spaces): its first digit, "unsure" for a single digit."""
    digits = response.split()
    return digits[0] if len(digits) > 1 else "unsure"


def judge_rows(dataset, cfg, tokenizer, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(judge prompt ids, target ids ending in eos) for one random response per prompt of ``dataset``."""
    rows = []
    for s in dataset:
        mapping = {"prompt": s.prompt, "prompt_text": s.prompt_text, "answer": s.answer, "meta": s.meta,
                   "messages": s.messages}
        response = " ".join(str(rng.randrange(10)) for _ in range(rng.randrange(1, 5)))
        prompt = judge_prompt_ids(tokenizer, cfg, mapping, response)
        if isinstance(prompt, Exception):
            raise SystemExit(f"{CONFIG}: a judge prompt does not fit judge.max_length: {prompt}")
        rows.append((prompt, tokenizer(target(response), add_special_tokens=False)["input_ids"]
                     + [tokenizer.eos_token_id]))
    return rows


def fit(model, rows, pad: int, steps: int, batch_size: int, lr: float, rng: random.Random) -> list[float]:
    """Next-token cross-entropy on the targets only (the prompts are context), right-padded batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        batch = [rows[i] for i in rng.sample(range(len(rows)), batch_size)]
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.tensor([p + t + [pad] * (width - len(p) - len(t)) for p, t in batch])
        labels = torch.tensor([[-100] * len(p) + t + [-100] * (width - len(p) - len(t)) for p, t in batch])
        mask = (labels != -100) | (torch.arange(width)[None] < torch.tensor([[len(p)] for p, _ in batch]))
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}: loss {sum(losses[-50:]) / 50:.4f}", flush=True)
    return losses


def parsed_fraction(model, rows, cfg, tokenizer) -> float:
    """The fraction of ``rows``' prompts whose greedy verdict the term's rule parses."""
    hits = 0
    with torch.no_grad():
        for prompt, _ in rows:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
            hits += parse_verdict(cfg, text) is not None
    return hits / len(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "demo_judge")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    term, tokenizer, train_set, eval_set = config_term(CONFIG, "judge")
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    # Qwen3, not Qwen2: transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, not the demo's
    # (experiment_runs.save_model_folder checks it)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id))
    rows = judge_rows(train_set, term.judge, tokenizer, rng)
    losses = fit(model, rows, tokenizer.pad_token_id, args.steps, args.batch_size, args.lr, rng)
    model.eval()
    held_out = judge_rows(eval_set, term.judge, tokenizer, rng)[:64]
    result = {"steps": args.steps, "final_loss": losses[-1],
              "eval_parsed_fraction": parsed_fraction(model, held_out, term.judge, tokenizer)}
    save_model_folder(model, tokenizer, result, args.out, [tokenizer.decode(p) for p, _ in rows[:500]])
    print(json.dumps(result, indent=2))
    print(f"saved the judge to {args.out}")
    return result


if __name__ == "__main__":
    main()
