"""Train the CPU demo's reward model from the sort task's verifier labels and save it in Hugging Face format.

    python examples/make_demo_reward_model.py            # writes runs/demo_reward_model (about ten CPU minutes)
    gspo-megatron train --config examples/cpu_demo_reward_model.yaml --run-dir runs/demo_rm

For every training prompt of examples/cpu_demo_reward_model.yaml the script writes candidate responses (the
reference answer and near misses: the digits unsorted or reordered, one digit changed, dropped or added, the
spaces gone, and sorted answers with other digits: one digit changed or off by one, or random ones), labels
each with the synthetic verifier (``rewards/synthetic.py``: correct or not) and fits a small random
``Qwen3ForSequenceClassification`` (the demo tokenizer, one logit; 4 layers, 64 wide) to those labels with a
binary cross-entropy. The inputs are exactly what the config's ``reward_model`` term feeds it at training time
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

from gspo_megatron.rewards.scoring_models import reward_model_ids, reward_model_text
from gspo_megatron.rewards.synthetic import synthetic_reward
from gspo_megatron.testing.experiment_runs import config_term, save_model_folder

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
    # sorted but with other digits: what a policy rewarded for looking sorted writes (reward_model_demo round 0,
    # late steps: 96 % of its responses sorted, 8 % the prompt's digits), so the model must compare with the prompt
    sorted_changed = sorted(changed)
    sorted_random = sorted(str(rng.randrange(10)) for _ in digits)
    # and one digit off by one, sorted: the near misses a reward model without them scored highest (round 0 again)
    nudged = []
    for step in (-1, 1):
        off = [int(d) for d in digits]
        i = rng.randrange(len(off))
        off[i] = (off[i] + step) % 10
        nudged.append(" ".join(sorted(map(str, off))))
    texts = [answer, " ".join(shuffled), " ".join(reversed(digits)), " ".join(changed), " ".join(digits[:-1]),
             " ".join(digits + [str(rng.randrange(10))]), "".join(digits), answer + " " + answer,
             " ".join(sorted_changed), " ".join(sorted_random), *nudged]
    return [t + eos for t in texts for eos in ("", EOS)]


def _mapping(sample) -> dict:
    """The fields a reward term reads of one dataset sample."""
    return {"prompt": sample.prompt, "prompt_text": sample.prompt_text, "answer": sample.answer,
            "meta": sample.meta, "messages": sample.messages}


def candidate_pairs(dataset, rng: random.Random) -> list[tuple[dict, str]]:
    """(sample fields, response) for every candidate response of every prompt in ``dataset``."""
    return [(_mapping(s), response) for s in dataset for response in candidates(str(s.answer), rng)]


def policy_pairs(paths: list[Path], dataset) -> list[tuple[dict, str]]:
    """(sample fields, response) for every response in the JSONL files at ``paths`` -- a training run's
    ``completions.jsonl`` (``response``) or ``gspo-megatron eval --outputs`` (``greedy`` and ``samples``) of
    this config's policy -- matched to its dataset prompt by the prompt text; each distinct pair once."""
    by_prompt = {s.prompt_text: s for s in dataset}
    pairs, seen = [], set()
    for path in paths:
        for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
            row = json.loads(line)
            sample = by_prompt.get(row["prompt"])
            if sample is None:
                raise SystemExit(f"{path}:{line_no}: prompt {row['prompt']!r} is not a training prompt of {CONFIG}")
            responses = [row["response"]] if "response" in row else [row["greedy"], *(row.get("samples") or [])]
            for response in responses:
                if (row["prompt"], response) not in seen:
                    seen.add((row["prompt"], response))
                    pairs.append((_mapping(sample), response))
    return pairs


def labelled(pairs: list[tuple[dict, str]], cfg, tokenizer) -> tuple[list[list[int]], list[float]]:
    """(token ids the term feeds the model, verifier label 0/1) of every (sample fields, response) pair."""
    rows, labels = [], []
    for mapping, response in pairs:
        ids = reward_model_ids(tokenizer, cfg, mapping, response)
        if isinstance(ids, Exception):
            raise SystemExit(f"a response does not fit the term's max_length: {ids}")
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


def fit(train: tuple[list, list[float]], tokenizer, steps: int, batch_size: int, lr: float, seed: int,
        layers: int = 4, hidden: int = 64):
    """A tiny random ``Qwen3ForSequenceClassification`` (one logit) fitted to (rows, labels) with a binary
    cross-entropy whose positives are weighed up to the negatives' total; returns (model in eval mode, the
    loss of each step)."""
    rows, labels = train
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    # Qwen3, not Qwen2: transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, not the demo's
    # (experiment_runs.save_model_folder checks it)
    model = transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 16, num_key_value_heads=max(1, hidden // 32), head_dim=16,
        max_position_embeddings=128, num_labels=1, pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    positives = sum(labels) / len(labels)
    # one right answer among many near misses: weigh the positives up so "always wrong" is not the optimum
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - positives) / positives))
    losses = []
    for step in range(steps):
        batch = rng.sample(range(len(rows)), min(batch_size, len(rows)))
        ids, mask = padded([rows[i] for i in batch], pad)
        loss = loss_fn(model(input_ids=ids, attention_mask=mask).logits[:, 0], torch.tensor([labels[i] for i in batch]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {sum(losses[-100:]) / 100:.4f}", flush=True)
    return model.eval(), losses


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "demo_reward_model")
    parser.add_argument("--policy-samples", type=Path, nargs="*", default=[],
                        help="responses of this config's policy (completions.jsonl of a run, or eval --outputs on "
                             "the training prompts): labelled by the verifier, they join the candidates")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=64)
    # 1e-3 stalled at "sorted means right" (loss 0.76 after 4000 steps); 2e-3 learns to compare with the prompt
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64, help="model width (a multiple of 32)")
    args = parser.parse_args(argv)

    term, tokenizer, train_set, eval_set = config_term(CONFIG, "reward_model")
    rng = random.Random(args.seed)
    written, sampled = candidate_pairs(train_set, rng), policy_pairs(args.policy_samples, train_set)
    train = labelled(written + sampled, term.reward_model, tokenizer)
    held_out = labelled(candidate_pairs(eval_set, rng), term.reward_model, tokenizer)
    model, losses = fit(train, tokenizer, args.steps, args.batch_size, args.lr, args.seed, args.layers,
                        args.hidden)
    pad = tokenizer.pad_token_id
    result = {"candidates": len(written), "policy_samples": len(sampled),
              "eval_candidates": len(held_out[0]), "positive_fraction": sum(train[1]) / len(train[1]),
              "steps": args.steps, "layers": args.layers, "hidden": args.hidden,
              "train_agreement": agreement(model, *train, pad),
              "eval_agreement": agreement(model, *held_out, pad), "final_loss": losses[-1]}
    save_model_folder(model, tokenizer, result, args.out,
                      [reward_model_text(tokenizer, term.reward_model, m, r) for m, r in (written + sampled)[:2000]])
    print(json.dumps(result, indent=2))
    print(f"saved the reward model to {args.out}")
    return result


if __name__ == "__main__":
    main()
