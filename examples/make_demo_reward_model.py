"""Train the CPU demo's reward model from the sort task's verifier labels and save it in Hugging Face format.

    python examples/make_demo_reward_model.py            # writes runs/demo_reward_model (about two CPU minutes)
    gspo-megatron train --config examples/cpu_demo_reward_model.yaml --run-dir runs/demo_rm

For every training prompt of examples/cpu_demo_reward_model.yaml the script writes candidate responses (the
reference answer and near misses: the digits unsorted or reordered, one digit changed, dropped or added, the
spaces gone), labels each with the synthetic verifier (``rewards/synthetic.py``: correct or not) and fits a
tiny random ``Qwen2ForSequenceClassification`` (the demo tokenizer, one logit) to those labels with a binary
cross-entropy. The inputs are exactly what the config's ``reward_model`` term feeds it at training time
(``rewards/scoring_models.py reward_model_ids``). It prints the held-out agreement with the verifier on the eval
prompts' candidates and saves the model, its tokenizer and ``training.json`` (the numbers) to ``--out``.

The reward model learns what the candidates show it, not the task: a policy finds responses no candidate
resembled, which the model may score high and the verifier wrong (reward hacking). The config keeps the
verifier at weight 0 beside it, so ``reward/synthetic/mean`` and ``eval_accuracy`` show where the two part.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import transformers

from gspo_megatron.data.dataset import load_prompt_datasets
from gspo_megatron.rewards.scoring_models import reward_model_ids
from gspo_megatron.rewards.synthetic import synthetic_reward
from gspo_megatron.trainer.components import load_tokenizer
from gspo_megatron.trainer.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "cpu_demo_reward_model.yaml"
EOS = "<|im_end|>"


def candidates(answer: str, rng: random.Random) -> list[str]:
    """The reference answer and near misses of a sort answer such as "2 4 8", each with and without eos."""
    digits = answer.split()
    shuffled = digits[:]
    rng.shuffle(shuffled)
    changed = digits[:]
    changed[rng.randrange(len(changed))] = str(rng.randrange(10))
    texts = [answer, " ".join(shuffled), " ".join(reversed(digits)), " ".join(changed), " ".join(digits[:-1]),
             " ".join(digits + [str(rng.randrange(10))]), "".join(digits), answer + " " + answer]
    return [t + eos for t in texts for eos in ("", EOS)]


def labelled(dataset, cfg, tokenizer, rng: random.Random) -> tuple[list[list[int]], list[float]]:
    """(token ids, verifier label 0/1) of every candidate response of every prompt in ``dataset``."""
    rows, labels = [], []
    for sample in dataset:
        mapping = {"prompt": sample.prompt, "prompt_text": sample.prompt_text, "answer": sample.answer,
                   "meta": sample.meta, "messages": sample.messages}
        for response in candidates(str(sample.answer), rng):
            ids = reward_model_ids(tokenizer, cfg, mapping, response)
            if isinstance(ids, Exception):
                raise SystemExit(f"a candidate does not fit the term's max_length: {ids}")
            rows.append(ids)
            labels.append(float(synthetic_reward(mapping, response).correct))
    return rows, labels


def padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] right-padded ids and their attention mask (the term pads the same way)."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    return ids, torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])


def agreement(model, rows, labels, pad: int) -> float:
    """The fraction of candidates where the model's sign (logit > 0) matches the verifier's label."""
    with torch.no_grad():
        hits = 0
        for start in range(0, len(rows), 256):
            ids, mask = padded(rows[start:start + 256], pad)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
            hits += int(((logits > 0).float() == torch.tensor(labels[start:start + 256])).sum())
    return hits / len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "demo_reward_model"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config = load_config(CONFIG)
    (term,) = [t for t in config.rewards.terms if t.name == "reward_model"]
    tokenizer = load_tokenizer(config.model)
    train_set, eval_set = load_prompt_datasets(config.data, tokenizer)
    rng = random.Random(args.seed)
    train_rows, train_labels = labelled(train_set, term.reward_model, tokenizer, rng)
    eval_rows, eval_labels = labelled(eval_set, term.reward_model, tokenizer, rng)

    torch.manual_seed(args.seed)
    pad = tokenizer.pad_token_id
    model = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    positives = sum(train_labels) / len(train_labels)
    # one right answer among many near misses: weigh the positives up so "always wrong" is not the optimum
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - positives) / positives))
    losses = []
    for step in range(args.steps):
        batch = rng.sample(range(len(train_rows)), args.batch_size)
        ids, mask = padded([train_rows[i] for i in batch], pad)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        loss = loss_fn(logits, torch.tensor([train_labels[i] for i in batch]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {sum(losses[-100:]) / 100:.4f}", flush=True)
    model.eval()
    result = {"train_candidates": len(train_rows), "eval_candidates": len(eval_rows),
              "positive_fraction": positives, "steps": args.steps,
              "train_agreement": agreement(model, train_rows, train_labels, pad),
              "eval_agreement": agreement(model, eval_rows, eval_labels, pad), "final_loss": losses[-1]}
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"saved the reward model to {out}")


if __name__ == "__main__":
    main()
