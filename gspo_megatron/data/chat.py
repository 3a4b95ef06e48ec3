"""Prompt rendering through the tokenizer's chat template, shared by RL prompts and SFT pairs so the
warm start and the RL rollouts see byte-identical prompts."""
from __future__ import annotations

from typing import Any

from gspo_megatron.data.config import DataConfig
from gspo_megatron.data.readers import DatasetError

Message = dict[str, str]


def check_template(tokenizer: Any, cfg: DataConfig) -> None:
    """Fail at load time (not per row) when a chat template is needed and there is none."""
    if cfg.use_chat_template and cfg.chat_template is None and not tokenizer.chat_template:
        raise DatasetError(f"the tokenizer ({type(tokenizer).__name__}, {tokenizer.name_or_path!r}) has no chat "
                           "template: set data.chat_template (a Jinja string) or data.use_chat_template: false")


def to_messages(prompt: str | None, messages: list[Message] | None, system_prompt: str | None) -> list[Message]:
    msgs = list(messages) if messages is not None else [{"role": "user", "content": prompt or ""}]
    if system_prompt is not None and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def render_prompt(tokenizer: Any, cfg: DataConfig, prompt: str | None = None,
                  messages: list[Message] | None = None) -> str:
    """The text the policy continues: the chat template with the generation prompt appended, or the raw
    prompt when ``use_chat_template`` is false."""
    if not cfg.use_chat_template:
        if prompt is None:
            raise DatasetError("chat messages need use_chat_template: true")
        return prompt
    return tokenizer.apply_chat_template(to_messages(prompt, messages, cfg.system_prompt), tokenize=False,
                                         add_generation_prompt=True, chat_template=cfg.chat_template)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already-rendered text; the template carries any BOS, so none is added here."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_sft_pair(tokenizer: Any, cfg: DataConfig, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) for supervised warm start; the response ends with the eos token, the
    token RL generation stops on, so SFT teaches the model to stop."""
    if tokenizer.eos_token_id is None:
        raise DatasetError("the tokenizer has no eos token; SFT targets need one to end the response")
    return encode(tokenizer, render_prompt(tokenizer, cfg, prompt=prompt)), encode(tokenizer, response) + [tokenizer.eos_token_id]


__all__ = ["check_template", "encode", "render_prompt", "to_messages", "tokenize_sft_pair"]
