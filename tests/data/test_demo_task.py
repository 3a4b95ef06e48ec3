"""The demo tokenizer and task: the shipped tokenizer is what the builder makes, and a generated task
split goes through the ordinary loader and scores 1 on its reference answers."""
from __future__ import annotations

import filecmp
import os

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gspo_megatron.data import (DataConfig, build_demo_tokenizer, demo_tokenizer_path, load_demo_tokenizer,
                                load_prompt_datasets, save_demo_tokenizer, tokenize_sft_pair)
from gspo_megatron.rewards.synthetic import TaskSpec, make_splits, sft_pairs, synthetic_reward, write_task_splits
from gspo_megatron.typed_config import build


def test_shipped_tokenizer_matches_a_fresh_build(tmp_path):
    fresh = save_demo_tokenizer(tmp_path / "tok")
    shipped = demo_tokenizer_path()
    names = sorted(os.listdir(shipped))
    assert names == sorted(os.listdir(fresh)) and "tokenizer.json" in names
    match, mismatch, errors = filecmp.cmpfiles(shipped, fresh, names, shallow=False)
    assert mismatch == [] and errors == []
    assert all(os.path.getsize(os.path.join(shipped, n)) < 10_000 for n in names)


def test_demo_tokenizer_properties():
    tok = load_demo_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast) and isinstance(build_demo_tokenizer(), PreTrainedTokenizerFast)
    assert len(tok) == 100 < 256
    assert (tok.pad_token_id, tok.eos_token_id, tok.eos_token) == (0, 2, "<|im_end|>")
    text = "sort 31 2 17\n3*(5+7) -> 36"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text  # one token per character, lossless
    assert tok.unk_token_id in tok("é", add_special_tokens=False)["input_ids"]
    assert AutoTokenizer.from_pretrained(demo_tokenizer_path()).chat_template == tok.chat_template


def test_generated_split_goes_through_the_loader_and_scores(tmp_path):
    paths = write_task_splits(TaskSpec("countdown", 2), tmp_path / "task", num_train=40, num_eval=10, num_sft=5, seed=4)
    assert sorted(paths) == ["eval", "sft", "train"]
    cfg = build(DataConfig, {"train_files": [paths["train"]], "eval_files": [paths["eval"]],
                             "fields": {"meta": "meta"}, "max_prompt_tokens": 64}, "data")
    tok = load_demo_tokenizer()
    train, evaluation = load_prompt_datasets(cfg, tok)
    assert (len(train), len(evaluation)) == (40, 10)
    for sample in list(train) + list(evaluation):
        assert synthetic_reward(sample.__dict__, sample.answer).reward == 1.0
        assert synthetic_reward(sample.__dict__, "1+1").reward == 0.0
    splits = make_splits(TaskSpec("countdown", 2), num_train=40, num_eval=10, num_sft=5, seed=4)
    assert [s.prompt for s in train] == [p.prompt for p in splits.train]  # same seed, same problems
    prompt_ids, response_ids = tokenize_sft_pair(tok, cfg, *sft_pairs(splits.sft)[0])
    assert prompt_ids == tok(tok.apply_chat_template([{"role": "user", "content": splits.sft[0].prompt}],
                                                     tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]
    assert response_ids[-1] == tok.eos_token_id


def test_shipped_tool_tokenizer_matches_a_fresh_build(tmp_path):
    """The tool demo's tokenizer: the demo tokenizer plus Qwen3's four tool tags (ids 100-103) and a template
    that renders tool messages in Qwen3's layout."""
    from gspo_megatron.data.tokenizer import CALCULATOR_FRAME, TOOL_CHAT_TEMPLATE, TOOL_TOKENS, tool_demo_tokenizer_path

    fresh = save_demo_tokenizer(tmp_path / "tok", tool_tokens=True)
    shipped = tool_demo_tokenizer_path()
    names = sorted(os.listdir(shipped))
    assert names == sorted(os.listdir(fresh))
    match, mismatch, errors = filecmp.cmpfiles(shipped, fresh, names, shallow=False)
    assert mismatch == [] and errors == []
    tok = AutoTokenizer.from_pretrained(shipped)
    assert len(tok) == 106 and tok.convert_tokens_to_ids(list(TOOL_TOKENS)) == [100, 101, 102, 103]
    assert tok.convert_tokens_to_ids(list(CALCULATOR_FRAME)) == [104, 105]
    assert tok.chat_template == TOOL_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "c"},
                                    {"role": "tool", "content": "3"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("c<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_a_calculator_call_is_nine_tool_tokenizer_tokens_that_decode_to_the_same_call():
    """The warm start's call (compact JSON) hits the frame tokens exactly: <tool_call>, the opening, the
    expression's characters, the closing, </tool_call>. It decodes to the same text, so the agent loop's
    parser reads the same call; JSON spelled another way (spaces) still tokenizes, character by character."""
    from gspo_megatron.data.tokenizer import tool_demo_tokenizer_path
    from gspo_megatron.data.tool_traces import calculator_call
    from gspo_megatron.rollout.agent_loop import parse_tool_calls

    tok = AutoTokenizer.from_pretrained(tool_demo_tokenizer_path())
    call = calculator_call("58-96")
    ids = tok(call, add_special_tokens=False)["input_ids"]
    assert ids == [100, 104] + tok("58-96", add_special_tokens=False)["input_ids"] + [105, 101]
    assert tok.decode(ids, skip_special_tokens=False) == call
    assert parse_tool_calls(tok.decode(ids, skip_special_tokens=False)) == [("calculator", {"expression": "58-96"})]
    spaced = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    spaced_ids = tok(spaced, add_special_tokens=False)["input_ids"]
    assert 104 not in spaced_ids and tok.decode(spaced_ids, skip_special_tokens=False) == spaced
