"""Prompt datasets, chat rendering, validation, resumable iteration and the demo tokenizer
(see docs/data.md).

Public API (what the trainer calls):
  DataConfig, FieldMap                         the ``data:`` config section
  load_prompt_datasets(cfg, tokenizer)         -> (train PromptDataset, eval PromptDataset | None)
  PromptIterator(train, prompts_per_step, seed, shuffle)   next(it) -> list[PromptSample];
                                               state_dict() / load_state_dict()
  render_prompt, tokenize_sft_pair             the same prompt rendering for RL and SFT
  build_demo_tokenizer, save_demo_tokenizer, demo_tokenizer_path, load_demo_tokenizer

Synthetic tasks (generation, SFT pairs, JSONL writer, reward) live in ``gspo_megatron.rewards.synthetic``.
transformers is imported only by the tokenizer builders.
"""
from gspo_megatron.data.chat import render_prompt, tokenize_sft_pair
from gspo_megatron.data.config import DataConfig, FieldMap
from gspo_megatron.data.dataset import PromptDataset, PromptSample, load_prompt_datasets
from gspo_megatron.data.iterator import PromptIterator
from gspo_megatron.data.readers import DatasetError, read_rows
from gspo_megatron.data.tokenizer import (build_demo_tokenizer, demo_tokenizer_path, load_demo_tokenizer,
                                          save_demo_tokenizer)

__all__ = [
    "DataConfig", "DatasetError", "FieldMap", "PromptDataset", "PromptIterator", "PromptSample",
    "build_demo_tokenizer", "demo_tokenizer_path", "load_demo_tokenizer", "load_prompt_datasets", "read_rows",
    "render_prompt", "save_demo_tokenizer", "tokenize_sft_pair",
]
