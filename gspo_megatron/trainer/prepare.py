"""`gspo-megatron prepare`: a math dataset (GSM8K- or MATH-like rows in JSONL, Parquet or a ``datasets``
``save_to_disk`` folder) as the prompt JSONL a run reads with the default ``data.fields``:
``{"prompt": ..., "answer": ...}``, the answer being what the math reward compares a response's final answer
with (rewards/math.py).

    gspo-megatron prepare gsm8k/train.parquet --out data/gsm8k_train.jsonl \
        --prompt-field question --answer-field answer --answer-rule gsm8k
    gspo-megatron prepare math_saved/ --split train --out data/math_train.jsonl \
        --prompt-field problem --answer-field solution --answer-rule boxed

Answer rules (``ANSWER_RULES``): ``gsm8k`` takes the text after the last ``####`` (thousands commas
dropped: ``1,000`` -> ``1000``); ``boxed`` the content of the last ``\\boxed{...}`` (MATH's solutions);
``field`` the field's value as it is. A row that cannot be converted (a missing or non-text field, no
``####``, no ``\\boxed{}``) is left out, counted and named with its row (file and line / row number); the
output is written to a temporary file beside ``--out`` and renamed, so a failed run leaves no half file.
"""
from __future__ import annotations

# in the trainer layer: it reads rows with data/readers.py and \boxed{} answers as rewards/math.py does

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from gspo_megatron.data.readers import DatasetError, InvalidLine, read_rows


class PrepareError(ValueError):
    """Bad input to ``prepare`` (the message names the file, option or row): exit status 2."""


def _gsm8k(text: str) -> str:
    if "####" not in text:
        raise ValueError("no '####' before the final answer")
    answer = text.rsplit("####", 1)[1].strip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer)


def _boxed(text: str) -> str:
    from gspo_megatron.rewards.math import _last_boxed  # the reward's own reading of \boxed{...}

    found = _last_boxed(text)
    if found is None:
        raise ValueError("no \\boxed{...}")
    return found


def _as_is(text: str) -> str:
    return text.strip()


# rule name -> (answer text -> final answer; raises ValueError saying why it found none)
ANSWER_RULES: dict[str, Callable[[str], str]] = {"gsm8k": _gsm8k, "boxed": _boxed, "field": _as_is}


@dataclasses.dataclass
class Prepared:
    """What ``convert_rows`` made: the output records and each left-out row's (location, reason)."""

    records: list[dict[str, Any]]
    skipped: list[tuple[str, str]]


def convert_row(row: Mapping[str, Any], prompt_field: str, answer_field: str, rule: str,
                template: str) -> dict[str, Any]:
    """One source row as ``{"prompt", "answer"}``; ValueError saying why it cannot be converted."""
    values = {}
    for role, field in (("prompt", prompt_field), ("answer", answer_field)):
        if field not in row:
            raise ValueError(f"no field {field!r} (--{role}-field; the row has {sorted(row)})")
        value = row[field]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"field {field!r} is a {type(value).__name__}, not text")
        values[role] = str(value)
    if not values["prompt"].strip():
        raise ValueError(f"field {prompt_field!r} is empty")
    answer = ANSWER_RULES[rule](values["answer"])
    if not answer:
        raise ValueError(f"the {rule} rule found an empty answer")
    return {"prompt": template.format(prompt=values["prompt"]), "answer": answer}


def convert_rows(rows: Iterable[tuple[str, Any]], prompt_field: str, answer_field: str, rule: str,
                 template: str = "{prompt}") -> Prepared:
    """rows: ``(location, row)`` as ``data/readers.py`` yields them."""
    out = Prepared([], [])
    for location, row in rows:
        if isinstance(row, InvalidLine):
            out.skipped.append((location, row.reason))
            continue
        try:
            out.records.append(convert_row(row, prompt_field, answer_field, rule, template))
        except ValueError as err:
            out.skipped.append((location, str(err)))
    return out


def write_jsonl(records: list[dict[str, Any]], out: Path) -> None:
    """Write to ``out.tmp`` beside it, then rename: ``out`` is whole or absent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="a .jsonl or .parquet file, or a folder written by datasets' save_to_disk")
    parser.add_argument("--out", required=True, help="the prompt JSONL to write ({prompt, answer} per line)")
    parser.add_argument("--split", default=None, help="the split of a saved DatasetDict folder (train, test, ...)")
    parser.add_argument("--format", default="auto", choices=["auto", "jsonl", "parquet", "hf_disk"],
                        help="the input's format (auto: from the name)")
    parser.add_argument("--prompt-field", default="question", help="the column holding the problem (GSM8K: "
                                                                   "question, MATH: problem)")
    parser.add_argument("--answer-field", default="answer", help="the column the answer is extracted from "
                                                                 "(GSM8K: answer, MATH: solution)")
    parser.add_argument("--answer-rule", required=True, choices=sorted(ANSWER_RULES),
                        help="gsm8k: after the last '####'; boxed: the last \\boxed{...}; field: the value as is")
    parser.add_argument("--prompt-template", default="{prompt}",
                        help="the prompt written, with {prompt} for the problem's text, e.g. "
                             "'{prompt} Put the final answer in \\boxed{{}}.'")


def _check_template(template: str) -> None:
    try:
        template.format(prompt="")
    except (KeyError, IndexError, ValueError) as err:
        raise PrepareError(f"--prompt-template {template!r}: not a template with {{prompt}} only ({err!r}); "
                           "write literal braces as {{ }}") from None


def summary(prepared: Prepared, out: Path, shown: int = 10) -> str:
    """The closing lines: how many rows were written and which were left out, and why."""
    lines = [f"prepare: wrote {len(prepared.records)} rows to {out}"
             + (f"; left out {len(prepared.skipped)} rows:" if prepared.skipped else "")]
    lines += [f"  {where}: {why}" for where, why in prepared.skipped[:shown]]
    if len(prepared.skipped) > shown:
        lines.append(f"  ... and {len(prepared.skipped) - shown} more")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    _check_template(args.prompt_template)
    out = Path(args.out)
    if out.resolve() == Path(args.input).resolve():
        raise PrepareError(f"--out {out}: is the input itself")
    try:
        rows = read_rows(args.input, args.format, args.split)
        prepared = convert_rows(rows, args.prompt_field, args.answer_field, args.answer_rule, args.prompt_template)
    except DatasetError as err:
        raise PrepareError(str(err)) from None
    if not prepared.records:
        first = f" (first: {prepared.skipped[0][0]}: {prepared.skipped[0][1]})" if prepared.skipped else ""
        raise PrepareError(f"{args.input}: no row could be converted, {len(prepared.skipped)} left out{first}; "
                           "nothing written")
    write_jsonl(prepared.records, out)
    print(summary(prepared, out), flush=True)
    return 0


__all__ = ["ANSWER_RULES", "PrepareError", "Prepared", "add_arguments", "convert_row", "convert_rows", "run",
           "summary", "write_jsonl"]
