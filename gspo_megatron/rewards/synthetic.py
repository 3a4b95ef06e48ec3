"""Synthetic verifiable tasks for demos and tests: generation (deterministic from a seed) and checking.

Four tasks, each with a ``difficulty`` knob from 1 (trivial) to 5; prompts and answers are short so a
tiny character-level model can learn them (``chain`` has the long responses, 30-60 characters):

  arithmetic  "12+7="          -> "19"      difficulty: operand digits and operators
  sort        "sort 3 1 2"     -> "1 2 3"   difficulty: list length and number range
  countdown   "3 5 7 -> 22"    -> "3*5+7"   any expression using every number exactly once with + - *
                                             (and parentheses) that evaluates to the target is correct
  chain       "chain 7 +5 *2 -4"  -> "7+5=12 12*2=24 24-4=20"   multi-step arithmetic worked step by step;
                                             the response must be a well-formed chain of steps starting
                                             from the prompt's number whose last value is the answer

A problem is ``Problem(prompt, answer, meta)``; ``meta`` carries what the checker needs (the task name,
and for countdown the numbers and target) and travels through the dataset loader to the reward.

Generation uses ``random.Random(seed)`` only (stable across CPython 3.x for the calls used here);
prompts are unique within a call and splits are disjoint, so held-out accuracy is on unseen problems.
Only the standard library is imported: reward workers load this module.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import random
import re
from typing import Any, Literal, Mapping

from gspo_megatron.rewards.types import Verdict

TaskName = Literal["arithmetic", "sort", "countdown", "chain"]

# difficulty -> (digits per operand, operators)
ARITHMETIC_LEVELS = {1: (1, "+"), 2: (2, "+"), 3: (2, "+-"), 4: (3, "+-"), 5: (2, "+-*")}
# difficulty -> (list length, largest value)
SORT_LEVELS = {1: (3, 9), 2: (4, 9), 3: (5, 99), 4: (6, 99), 5: (8, 999)}
# difficulty -> (how many numbers, largest number, operators)
COUNTDOWN_LEVELS = {1: (2, 9, "+"), 2: (3, 9, "+-"), 3: (3, 9, "+-*"), 4: (4, 12, "+-*"), 5: (4, 25, "+-*")}
# difficulty -> (steps, largest operand, operators); values stay in [0, 999]
CHAIN_LEVELS = {1: (4, 9, "+-"), 2: (6, 9, "+-"), 3: (6, 9, "+-*"), 4: (7, 12, "+-*"), 5: (8, 19, "+-*")}
_LEVELS = {"arithmetic": ARITHMETIC_LEVELS, "sort": SORT_LEVELS, "countdown": COUNTDOWN_LEVELS, "chain": CHAIN_LEVELS}
_STOP_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    task: TaskName = "arithmetic"
    difficulty: int = 2

    def __post_init__(self) -> None:
        if self.task not in _LEVELS:
            raise ValueError(f"task must be one of {sorted(_LEVELS)}, got {self.task!r}")
        if self.difficulty not in _LEVELS[self.task]:
            raise ValueError(f"difficulty must be one of {sorted(_LEVELS[self.task])}, got {self.difficulty!r}")


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    meta: dict[str, Any]

    def to_row(self) -> dict[str, Any]:
        """The JSONL row the dataset loader reads with its default field names."""
        return {"prompt": self.prompt, "answer": self.answer, "meta": self.meta}


# ---------------------------------------------------------------------------------------------------
# Generation

def _arithmetic(rng: random.Random, difficulty: int) -> Problem:
    digits, ops = ARITHMETIC_LEVELS[difficulty]
    high = 10**digits - 1
    a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(f"{a}{op}{b}=", str(value), {"task": "arithmetic", "difficulty": difficulty})


def _sort(rng: random.Random, difficulty: int) -> Problem:
    length, high = SORT_LEVELS[difficulty]
    values = [rng.randint(0, high) for _ in range(length)]
    return Problem("sort " + " ".join(map(str, values)), " ".join(map(str, sorted(values))),
                   {"task": "sort", "difficulty": difficulty})


def _render(tree: Any) -> tuple[str, str]:
    """(text, top operator) of a left-deep expression tree, parenthesised only where needed."""
    if isinstance(tree, int):
        return str(tree), ""
    op, left, right = tree
    left_text, left_op = _render(left)
    right_text, _ = _render(right)
    if op == "*" and left_op in ("+", "-"):
        left_text = f"({left_text})"
    return f"{left_text}{op}{right_text}", op


def _countdown(rng: random.Random, difficulty: int) -> Problem:
    count, high, ops = COUNTDOWN_LEVELS[difficulty]
    while True:
        numbers = [rng.randint(1, high) for _ in range(count)]
        order = numbers[:]
        rng.shuffle(order)
        tree: Any = order[0]
        for n in order[1:]:
            tree = (rng.choice(ops), tree, n)
        text, _ = _render(tree)
        target = _evaluate(ast.parse(text, mode="eval").body)
        if 0 < target <= 999:
            return Problem(f"{' '.join(map(str, numbers))} -> {target}", text,
                           {"task": "countdown", "difficulty": difficulty, "numbers": numbers, "target": target})


def _apply(value: int, op: str, operand: int) -> int:
    return value + operand if op == "+" else value - operand if op == "-" else value * operand


def _chain(rng: random.Random, difficulty: int) -> Problem:
    steps, high, ops = CHAIN_LEVELS[difficulty]
    while True:
        value = start = rng.randint(1, high)
        moves, worked = [], []
        for _ in range(steps):
            op, operand = rng.choice(ops), rng.randint(2, high)
            result = _apply(value, op, operand)
            if not 0 <= result <= 999:
                break
            moves.append(f"{op}{operand}")
            worked.append(f"{value}{op}{operand}={result}")
            value = result
        if len(moves) == steps:
            return Problem(f"chain {start} {' '.join(moves)}", " ".join(worked),
                           {"task": "chain", "difficulty": difficulty, "start": start, "target": value})


_GENERATORS = {"arithmetic": _arithmetic, "sort": _sort, "countdown": _countdown, "chain": _chain}


def generate(spec: TaskSpec, n: int, seed: int, exclude: frozenset[str] | set[str] = frozenset()) -> list[Problem]:
    """``n`` problems with distinct prompts, none of them in ``exclude``; the same for the same seed."""
    rng = random.Random(f"{spec.task}:{spec.difficulty}:{seed}")
    seen = set(exclude)
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"{spec.task} difficulty {spec.difficulty} has too few distinct problems for "
                             f"{n} (found {len(out)}); ask for fewer or raise the difficulty")
        problem = _GENERATORS[spec.task](rng, spec.difficulty)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            out.append(problem)
    return out


@dataclasses.dataclass
class TaskSplits:
    train: list[Problem]
    eval: list[Problem]
    sft: list[Problem]


def make_splits(spec: TaskSpec, num_train: int, num_eval: int, num_sft: int = 0, seed: int = 0) -> TaskSplits:
    """Disjoint RL-train, held-out eval and SFT warm-start problems (no prompt appears in two splits)."""
    problems = generate(spec, num_eval + num_train + num_sft, seed)
    return TaskSplits(eval=problems[:num_eval], train=problems[num_eval:num_eval + num_train],
                      sft=problems[num_eval + num_train:])


def sft_pairs(problems: list[Problem]) -> list[tuple[str, str]]:
    """(user prompt, target response) pairs for a supervised warm start; the response is the reference
    answer without end-of-sequence marker (``data.chat.tokenize_sft_pair`` appends the tokenizer's eos)."""
    return [(p.prompt, p.answer) for p in problems]


def write_jsonl(problems: list[Problem], path: str | os.PathLike[str]) -> str:
    """Write problems as JSONL rows {prompt, answer, meta} (temp file, then rename). Returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(p.to_row(), sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def write_task_splits(spec: TaskSpec, out_dir: str | os.PathLike[str], num_train: int, num_eval: int,
                      num_sft: int = 0, seed: int = 0) -> dict[str, str]:
    """``make_splits`` written to ``out_dir/{train,eval,sft}.jsonl``; returns {split: path}."""
    splits = make_splits(spec, num_train, num_eval, num_sft, seed)
    paths = {"train": write_jsonl(splits.train, os.path.join(out_dir, "train.jsonl")),
             "eval": write_jsonl(splits.eval, os.path.join(out_dir, "eval.jsonl"))}
    if num_sft:
        paths["sft"] = write_jsonl(splits.sft, os.path.join(out_dir, "sft.jsonl"))
    return paths


# ---------------------------------------------------------------------------------------------------
# Checking

def final_answer(response: str) -> str:
    """The answer part of a response: up to the first end-of-turn marker, first line, stripped."""
    for marker in _STOP_MARKERS:
        response = response.split(marker, 1)[0]
    lines = response.strip().splitlines()
    return lines[0].strip() if lines else ""


def _evaluate(node: ast.AST) -> int:
    """Integer value of an expression made only of non-negative int literals and + - *."""
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) else left * right
    raise ValueError(f"not allowed in a countdown answer: {ast.dump(node)[:80]}")


def _literals(node: ast.AST) -> list[int]:
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.BinOp):
        return _literals(node.left) + _literals(node.right)
    return []


_CHAIN_STEP = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)")


def _check_chain(meta: Mapping[str, Any], answer: str) -> bool | None:
    """A chain answer: steps "a<op>b=c" separated by single spaces, the first starting from the prompt's
    number and each from the previous result; correct when the last result is the target (the verifier
    checks the answer, the steps only for form: a wrong intermediate value is wrong at the end anyway)."""
    steps = [_CHAIN_STEP.fullmatch(part) for part in answer.split(" ")]
    if not answer or len(answer) > 400 or not all(steps):
        return None
    previous = str(meta["start"])
    for step in steps:
        if step.group(1) != previous:
            return None
        previous = step.group(4)
    return int(previous) == int(meta["target"])


def check_answer(meta: Mapping[str, Any], reference: str, answer: str) -> bool | None:
    """True/False for a well-formed answer, None when ``answer`` is malformed for the task."""
    task = meta["task"]
    if task == "arithmetic":
        return int(answer) == int(reference) if re.fullmatch(r"-?\d+", answer) else None
    if task == "sort":
        return answer.split() == reference.split() if re.fullmatch(r"\d+( \d+)*", answer) else None
    if task == "countdown":
        if len(answer) > 100 or not re.fullmatch(r"[\d+\-*() ]+", answer):
            return None
        try:
            tree = ast.parse(answer, mode="eval").body
            value = _evaluate(tree)
        except (SyntaxError, ValueError):
            return None
        return sorted(_literals(tree)) == sorted(meta["numbers"]) and value == meta["target"]
    if task == "chain":
        return _check_chain(meta, answer)
    raise ValueError(f"unknown synthetic task {task!r} in sample meta")


def synthetic_reward(sample: Mapping[str, Any], response: str) -> Verdict:
    """1.0 when the response answers the synthetic problem in ``sample`` (needs ``answer`` and ``meta``)."""
    meta = sample.get("meta")
    if not isinstance(meta, Mapping) or "task" not in meta:
        raise ValueError("synthetic reward needs sample['meta'] with a 'task' key (write tasks with write_jsonl "
                         "and map the 'meta' field in data.fields)")
    verdict = check_answer(meta, str(sample["answer"]), final_answer(response))
    if verdict is None:
        return Verdict(0.0, ("malformed",), correct=False)
    return Verdict(float(verdict), ("correct",) if verdict else (), correct=bool(verdict))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write synthetic task splits as JSONL for the dataset loader.")
    parser.add_argument("--task", choices=sorted(_LEVELS), default="arithmetic")
    parser.add_argument("--difficulty", type=int, default=2)
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--num-sft", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    paths = write_task_splits(TaskSpec(args.task, args.difficulty), args.out, args.num_train, args.num_eval,
                              args.num_sft, args.seed)
    print(json.dumps(paths, indent=2))


if __name__ == "__main__":
    main()


__all__ = ["Problem", "TaskSpec", "TaskSplits", "check_answer", "final_answer", "generate", "make_splits",
           "sft_pairs", "synthetic_reward", "write_jsonl", "write_task_splits"]
