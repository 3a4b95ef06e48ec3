"""The ``data:`` config section."""
from __future__ import annotations

import dataclasses
from typing import Literal

from gspo_megatron.typed_config import check


@dataclasses.dataclass
class FieldMap:
    """Which column holds what. A column named here is required in every row.

    prompt: a string column, sent as one user message (or as raw text when use_chat_template is false);
    messages: instead of prompt, a column of chat messages [{"role": ..., "content": ...}, ...];
    answer: the reference answer (string or number) for math / synthetic rewards, or None;
    tests: unit tests for the code reward (list, mapping or JSON string), or None;
    meta: a mapping column passed to rewards as ``sample["meta"]`` (synthetic tasks need it), or None;
    extra: more columns copied into ``sample["meta"]`` under their own names.
    """

    prompt: str | None = "prompt"
    messages: str | None = None
    answer: str | None = "answer"
    tests: str | None = None
    meta: str | None = None
    extra: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str) -> None:
        check((self.prompt is None) != (self.messages is None), f"{path}.prompt",
              "set exactly one of 'prompt' and 'messages'")


@dataclasses.dataclass
class DataConfig:
    """Prompt datasets: where they are, how rows map to samples, how prompts are rendered and checked.

    train_files / eval_files: JSONL (.jsonl/.ndjson), Parquet (.parquet) or a folder written by
        ``datasets.Dataset.save_to_disk`` (``format`` picks the reader when the suffix does not tell).
    hf_split / eval_hf_split: the split to read from a saved ``DatasetDict`` folder.
    eval_holdout: with no eval_files, hold out this many training prompts (chosen by ``seed``).
    use_chat_template: render prompts with the tokenizer's chat template (or ``chat_template``, a Jinja
        string that overrides it; required when the tokenizer has none). ``system_prompt`` is prepended
        as a system message when the row has none.
    max_prompt_tokens: a longer rendered prompt is an invalid row.
    on_invalid_row: "error" stops at the first invalid row naming file and line; "skip" drops invalid
        rows, counts them per reason and logs the counts (nothing is dropped silently).
    shuffle, seed: the order of training prompts (one permutation per epoch, derived from seed).
    """

    train_files: list[str]
    eval_files: list[str] = dataclasses.field(default_factory=list)
    format: Literal["auto", "jsonl", "parquet", "hf_disk"] = "auto"
    hf_split: str | None = None
    eval_hf_split: str | None = None
    fields: FieldMap = dataclasses.field(default_factory=FieldMap)
    eval_holdout: int = 0
    use_chat_template: bool = True
    chat_template: str | None = None
    system_prompt: str | None = None
    max_prompt_tokens: int = 1024
    on_invalid_row: Literal["error", "skip"] = "error"
    # a prompt holding the tokenizer's control tokens (<|im_end|>\n<|im_start|>assistant...) would inject a
    # real chat turn: such a row is invalid unless this is true
    allow_control_tokens: bool = False
    shuffle: bool = True
    seed: int = 0

    def validate(self, path: str) -> None:
        check(len(self.train_files) > 0, f"{path}.train_files", "needs at least one file")
        check(self.eval_holdout >= 0, f"{path}.eval_holdout", "must be >= 0")
        check(not (self.eval_files and self.eval_holdout), f"{path}.eval_holdout",
              "use either eval_files or eval_holdout, not both")
        check(self.max_prompt_tokens >= 1, f"{path}.max_prompt_tokens", "must be >= 1")
        check(self.use_chat_template or self.fields.messages is None, f"{path}.use_chat_template",
              "chat messages (fields.messages) need a chat template")
        check(self.use_chat_template or self.system_prompt is None, f"{path}.system_prompt",
              "needs use_chat_template: true")


__all__ = ["DataConfig", "FieldMap"]
