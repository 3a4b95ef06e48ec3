"""What the model writes: a few sampled completions per step (prompt, response, reward) in
RUN_DIR/completions.jsonl and TensorBoard text, one on the console every ``logging.console_completion_every``
steps; and the per-prompt outputs of an evaluation (``gspo-megatron eval --outputs``).

The rows are the first ``n`` prompts' first samples of the step's batch (the batch is in prompt order on
every rank, so the choice does not depend on the layout). A resumed run drops the rows of steps after
its checkpoint first, as for metrics.jsonl.

A multi-turn response (``rollout.multi_turn``: the sample has a ``response_mask``) keeps its structure: the row's
``turns`` lists ``{"role": "assistant" | "tool", "text": ...}`` in order (assistant: tokens the model sampled;
tool: the tool answers with the chat-template tokens around them), decoded with their special tokens so the
``<tool_call>`` / ``<tool_response>`` tags stay visible, and ``response`` is their concatenation.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

COMPLETIONS_NAME = "completions.jsonl"


def turns(sample, tokenizer) -> list[dict[str, str]]:
    """The turns of a multi-turn ``sample``: ``response_mask``'s runs of equal values, in order, as
    ``{"role": "assistant" (mask True: sampled) or "tool" (mask False: inserted), "text": decoded with special
    tokens}``."""
    mask, ids = list(sample.response_mask), list(sample.response_ids)
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            out.append({"role": "assistant" if mask[start] else "tool",
                        "text": tokenizer.decode(ids[start:end], skip_special_tokens=False)})
            start = end
    return out


def response_fields(sample, tokenizer, name: str = "response") -> dict[str, Any]:
    """``{name: text}`` of a sample; a multi-turn one also gives ``{name}_turns`` -> ``turns`` (``turns`` for
    ``name="response"``), its text their concatenation."""
    if sample.response_mask is None:
        return {name: tokenizer.decode(list(sample.response_ids), skip_special_tokens=True)}
    parts = turns(sample, tokenizer)
    return {name: "".join(t["text"] for t in parts), "turns" if name == "response" else f"{name}_turns": parts}


def completion_rows(batch, tokenizer, n: int, step: int) -> list[dict[str, Any]]:
    """Up to ``n`` rows {step, prompt, answer, response, reward} (and ``turns`` for a multi-turn response) from a
    rollout batch (``schedule.base.RolloutGroup`` s)."""
    rows = []
    for g in batch[:n]:
        rows.append({"step": int(step), "prompt": tokenizer.decode(list(g.prompt.prompt_ids), skip_special_tokens=True),
                     "answer": None if g.prompt.answer is None else str(g.prompt.answer),
                     **response_fields(g.samples[0], tokenizer), "reward": float(g.rewards[0])})
    return rows


def eval_rows(greedy, sampled, tokenizer) -> list[dict[str, Any]]:
    """Per prompt of an evaluation: the greedy response (``greedy_turns`` for a multi-turn one) and reward, and the
    pass@k samples' responses and rewards (``sampled`` None without pass@k)."""
    rows = []
    for i, g in enumerate(greedy):
        row = {"prompt": tokenizer.decode(list(g.prompt.prompt_ids), skip_special_tokens=True),
               "answer": None if g.prompt.answer is None else str(g.prompt.answer),
               **response_fields(g.samples[0], tokenizer, "greedy"), "greedy_reward": float(g.rewards[0])}
        if sampled is not None:
            row["samples"] = [response_fields(s, tokenizer)["response"] for s in sampled[i].samples]
            row["sample_rewards"] = [float(r) for r in sampled[i].rewards]
        rows.append(row)
    return rows


def append_rows(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    path = Path(run_dir) / COMPLETIONS_NAME
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())


def truncate_completions(run_dir: Path, step: int) -> None:
    """Keep the rows of steps <= ``step`` (a resume from that step's checkpoint); temp file + rename."""
    path = Path(run_dir) / COMPLETIONS_NAME
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a last line cut by a kill
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def as_text(rows: list[dict[str, Any]]) -> str:
    """Markdown for TensorBoard's text tab (a multi-turn response: one line per turn, named by its role)."""
    return "\n\n".join(f"**prompt** `{r['prompt']}`  \n{_response_markdown(r)}  \n"
                       f"**answer** `{r['answer']}` **reward** {r['reward']:.3g}" for r in rows)


def _response_markdown(row: dict[str, Any]) -> str:
    if "turns" not in row:
        return f"**response** `{row['response']}`"
    return "  \n".join(f"**{t['role']}** `{t['text']}`" for t in row["turns"])


def console_line(row: dict[str, Any]) -> str:
    """One line: a multi-turn response as ``[role] 'text'`` per turn (``repr``, so newlines show as ``\\n``)."""
    if "turns" in row:
        response = " ".join(f"[{t['role']}] {t['text']!r}" for t in row["turns"])
    else:
        response = repr(row["response"])
    return (f"step {row['step']} sample: {row['prompt']!r} -> {response} "
            f"(answer {row['answer']!r}, reward {row['reward']:.3g})")


__all__ = ["COMPLETIONS_NAME", "append_rows", "as_text", "completion_rows", "console_line", "eval_rows",
           "response_fields", "truncate_completions", "turns"]
