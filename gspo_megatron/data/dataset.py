"""Prompt datasets: read rows, validate them, render and tokenize prompts, split train / eval.

    train, eval = load_prompt_datasets(data_cfg, tokenizer)
    it = PromptIterator(train, prompts_per_step=8, seed=data_cfg.seed, shuffle=data_cfg.shuffle)
    prompts = next(it)                      # list[PromptSample], len == prompts_per_step
    state = it.state_dict()                 # goes into the checkpoint; it.load_state_dict(state) resumes

Every row is validated on load. An invalid row (missing field, wrong type, empty prompt, prompt over
``max_prompt_tokens``) raises ``DatasetError("<file>:<line>: <what>")``, or with
``on_invalid_row: skip`` is dropped and counted in ``dataset.skipped`` (reason -> count), which is
logged; nothing is dropped silently.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import random
from typing import Any, Iterator, Mapping, Sequence

from gspo_megatron.data.chat import check_template, render_prompt
from gspo_megatron.data.config import DataConfig, FieldMap
from gspo_megatron.data.readers import DatasetError, InvalidLine, read_rows

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "tool")
_TOKENIZE_CHUNK = 1024


@dataclasses.dataclass
class PromptSample:
    """One prompt, ready for rollout (``prompt_ids``) and for rewards (``answer``, ``tests``, ``meta``).

    index: position in its dataset (stable across epochs and resumption).
    prompt_ids: [P] token ids of the rendered prompt (chat template and generation prompt included).
    prompt_text: the rendered prompt.
    prompt / messages: the row's raw prompt string or chat messages (one of them is None).
    source: "<file>:<line>" or "<file> row <n>" of the row it came from.
    """

    index: int
    prompt_ids: list[int]
    prompt_text: str
    prompt: str | None
    messages: list[dict[str, str]] | None
    answer: str | None
    tests: Any
    meta: dict[str, Any]
    source: str


class PromptDataset(Sequence[PromptSample]):
    def __init__(self, name: str, samples: list[PromptSample], skipped: Mapping[str, int]):
        self.name = name
        self.samples = samples
        self.skipped = dict(skipped)
        self.fingerprint = _fingerprint(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):  # type: ignore[override]
        return self.samples[i]

    def batches(self, batch_size: int) -> Iterator[list[PromptSample]]:
        """In-order batches (the last may be shorter): for evaluation."""
        for start in range(0, len(self.samples), batch_size):
            yield self.samples[start:start + batch_size]


def _fingerprint(samples: list[PromptSample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.prompt_ids, s.answer], separators=(",", ":")).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# Row validation

class _Invalid(Exception):
    """An invalid row; the message is the reason without its location (used for skip counts)."""


def _field(row: Mapping[str, Any], column: str, role: str) -> Any:
    if column not in row:
        raise _Invalid(f"missing field {column!r} (data.fields.{role})")
    return row[column]


def _check_messages(value: Any, column: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"field {column!r} must be a non-empty list of messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Invalid(f"field {column!r}[{i}] must be {{'role': str, 'content': str}}, got {str(m)[:80]}")
        if m["role"] not in _ROLES:
            raise _Invalid(f"field {column!r}[{i}] has role {m['role']!r} (expected one of {list(_ROLES)})")
    if not any(m["content"].strip() for m in value):
        raise _Invalid(f"empty prompt: every message in {column!r} is empty")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _parse_row(row: Mapping[str, Any], fields: FieldMap) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt": None, "messages": None, "answer": None, "tests": None, "meta": {}}
    if fields.prompt is not None:
        prompt = _field(row, fields.prompt, "prompt")
        if not isinstance(prompt, str):
            raise _Invalid(f"field {fields.prompt!r} must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise _Invalid(f"empty prompt in field {fields.prompt!r}")
        out["prompt"] = prompt
    else:
        out["messages"] = _check_messages(_field(row, fields.messages, "messages"), fields.messages)
    if fields.answer is not None:
        answer = _field(row, fields.answer, "answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise _Invalid(f"field {fields.answer!r} must be a string or a number, got {type(answer).__name__}")
        if not str(answer).strip():
            raise _Invalid(f"empty answer in field {fields.answer!r}")
        out["answer"] = str(answer)
    if fields.tests is not None:
        tests = _field(row, fields.tests, "tests")
        if not isinstance(tests, (str, list, dict)) or not tests:
            raise _Invalid(f"field {fields.tests!r} must be a non-empty list, mapping or JSON string, "
                           f"got {type(tests).__name__}")
        out["tests"] = tests
    if fields.meta is not None:
        meta = _field(row, fields.meta, "meta")
        if isinstance(meta, str):  # some writers store nested columns as JSON text
            try:
                meta = json.loads(meta)
            except json.JSONDecodeError:
                raise _Invalid(f"field {fields.meta!r} is a string but not JSON") from None
        if not isinstance(meta, dict):
            raise _Invalid(f"field {fields.meta!r} must be a mapping, got {type(meta).__name__}")
        out["meta"] = dict(meta)
    for column in fields.extra:
        out["meta"][column] = _field(row, column, "extra")
    return out


# ---------------------------------------------------------------------------------------------------
# Loading

def _load_files(name: str, paths: list[str], split: str | None, cfg: DataConfig, tokenizer: Any) -> PromptDataset:
    skipped: collections.Counter[str] = collections.Counter()
    first_location: dict[str, str] = {}

    def invalid(location: str, reason: str) -> None:
        if cfg.on_invalid_row == "error":
            raise DatasetError(f"{location}: {reason}")
        skipped[reason] += 1
        first_location.setdefault(reason, location)

    parsed: list[tuple[str, dict[str, Any], str]] = []  # (location, fields, rendered prompt)
    controls = [] if cfg.allow_control_tokens else _control_tokens(tokenizer)
    for path in paths:
        for location, row in read_rows(path, cfg.format, split):
            if isinstance(row, InvalidLine):
                invalid(location, row.reason)
                continue
            try:
                fields = _parse_row(row, cfg.fields)
            except _Invalid as err:
                invalid(location, str(err))
                continue
            found = _control_token_in(controls, fields["prompt"], fields["messages"])
            if found is not None:
                invalid(location, f"the prompt holds the tokenizer's control token {found!r} (it would become a real "
                                  "chat turn); remove it, or set data.allow_control_tokens: true")
                continue
            text = render_prompt(tokenizer, cfg, fields["prompt"], fields["messages"])
            parsed.append((location, fields, text))

    samples: list[PromptSample] = []
    for start in range(0, len(parsed), _TOKENIZE_CHUNK):
        chunk = parsed[start:start + _TOKENIZE_CHUNK]
        ids_list = tokenizer([text for _, _, text in chunk], add_special_tokens=False)["input_ids"]
        for (location, fields, text), ids in zip(chunk, ids_list):
            if len(ids) > cfg.max_prompt_tokens:
                invalid(location, f"prompt is {len(ids)} tokens, over data.max_prompt_tokens={cfg.max_prompt_tokens}")
                continue
            samples.append(PromptSample(index=len(samples), prompt_ids=list(ids), prompt_text=text,
                                        source=location, **fields))
    if skipped:
        log.warning("data (%s): skipped %d invalid rows: %s", name, sum(skipped.values()),
                    "; ".join(f"{n} x {reason} (first at {first_location[reason]})" for reason, n in skipped.items()))
    if not samples:
        raise DatasetError(f"{', '.join(paths)}: no valid rows" + (f" ({sum(skipped.values())} skipped)" if skipped else ""))
    return PromptDataset(name, samples, skipped)


def _reindexed(name: str, samples: list[PromptSample], skipped: Mapping[str, int]) -> PromptDataset:
    return PromptDataset(name, [dataclasses.replace(s, index=i) for i, s in enumerate(samples)], skipped)


def load_prompt_datasets(cfg: DataConfig, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, eval) prompt datasets; eval is None without eval_files and eval_holdout."""
    check_template(tokenizer, cfg)
    train = _load_files("train", cfg.train_files, cfg.hf_split, cfg, tokenizer)
    if cfg.eval_files:
        return train, _load_files("eval", cfg.eval_files, cfg.eval_hf_split, cfg, tokenizer)
    if not cfg.eval_holdout:
        return train, None
    if cfg.eval_holdout >= len(train):
        raise DatasetError(f"data.eval_holdout={cfg.eval_holdout} leaves no training prompts "
                           f"(the training files hold {len(train)})")
    held = set(random.Random(f"eval_holdout:{cfg.seed}").sample(range(len(train)), cfg.eval_holdout))
    return (_reindexed("train", [s for s in train if s.index not in held], train.skipped),
            _reindexed("eval", [s for s in train if s.index in held], {}))



def _control_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special token strings (chat-turn markers, EOS, ...), which its encoding turns into
    control ids even inside user text."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted(set(tokenizer.all_special_tokens) | set(added), key=len, reverse=True)


def _control_token_in(controls: list[str], prompt: str | None, messages: list | None) -> str | None:
    """The first control token found in the prompt text or the messages' contents, or None."""
    texts = [prompt] if prompt is not None else []
    texts += [str(m.get("content", "")) for m in messages or [] if isinstance(m, dict)]
    for text in texts:
        for token in controls:
            if token and token in text:
                return token
    return None

__all__ = ["PromptDataset", "PromptSample", "load_prompt_datasets"]
