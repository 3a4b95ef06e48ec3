"""Dataset loading: JSONL, Parquet and saved HF folders; field mapping; chat templates; validation
errors that name the file and line; counted skips; train / eval splits."""
from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_megatron.data import (DataConfig, DatasetError, build_demo_tokenizer, load_prompt_datasets, render_prompt,
                                tokenize_sft_pair)
from gspo_megatron.typed_config import ConfigError, build

ROWS = [{"question": f"{i}+{i}=", "solution": str(2 * i), "info": {"task": "arithmetic"}} for i in range(10)]


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(files, **kw) -> DataConfig:
    fields = kw.pop("fields", {"prompt": "question", "answer": "solution", "meta": "info"})
    return build(DataConfig, {"train_files": files, "fields": fields, **kw}, "data")


def _write_hf_folder(folder, rows, shards=2):
    """The layout datasets' save_to_disk writes: Arrow IPC stream shards listed in state.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    per = -(-len(rows) // shards)
    names = []
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(k * per, per))
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "x", "_format_columns": None,
                                                   "_format_kwargs": {}, "_format_type": None,
                                                   "_output_all_columns": False, "_split": None}))
    (folder / "dataset_info.json").write_text("{}")


def test_jsonl_parquet_and_hf_folder_load_the_same(tmp_path, tok):
    jsonl = _jsonl(tmp_path / "d.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    _write_hf_folder(tmp_path / "hf", ROWS)
    loaded = [load_prompt_datasets(_cfg([p]), tok)[0] for p in (jsonl, str(tmp_path / "d.parquet"), str(tmp_path / "hf"))]
    for ds in loaded:
        assert [s.prompt for s in ds] == [r["question"] for r in ROWS]
        assert [s.answer for s in ds] == [r["solution"] for r in ROWS]
        assert ds[3].meta == {"task": "arithmetic"}
        assert ds.fingerprint == loaded[0].fingerprint
    sample = loaded[0][2]
    assert sample.prompt_text == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(sample.prompt_ids) == sample.prompt_text
    assert sample.source == f"{jsonl}:3"
    assert "row 3" in loaded[2][2].source and loaded[2][2].source.endswith(".arrow row 3")


def test_hf_dataset_dict_folder_needs_a_split(tmp_path, tok):
    root = tmp_path / "dd"
    _write_hf_folder(root / "train", ROWS[:6], shards=1)
    _write_hf_folder(root / "test", ROWS[6:], shards=1)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DatasetError, match="set data.hf_split"):
        load_prompt_datasets(_cfg([str(root)]), tok)
    train, evaluation = load_prompt_datasets(_cfg([str(root)], hf_split="train", eval_files=[str(root)],
                                                  eval_hf_split="test"), tok)
    assert (len(train), len(evaluation)) == (6, 4)
    with pytest.raises(DatasetError, match="no split 'valid'"):
        load_prompt_datasets(_cfg([str(root)], hf_split="valid"), tok)


@pytest.mark.parametrize("row, message", [
    ({"solution": "1", "info": {}}, r"d.jsonl:3: missing field 'question' \(data.fields.prompt\)"),
    ({"question": ["1+1="], "solution": "2", "info": {}}, r"d.jsonl:3: field 'question' must be a string, got list"),
    ({"question": "   ", "solution": "2", "info": {}}, r"d.jsonl:3: empty prompt in field 'question'"),
    ({"question": "1+1=", "solution": None, "info": {}}, r"d.jsonl:3: field 'solution' must be a string or a number"),
    ({"question": "1+1=", "solution": "2", "info": [1]}, r"d.jsonl:3: field 'info' must be a mapping, got list"),
    ({"question": "x" * 200, "solution": "2", "info": {}}, r"d.jsonl:3: prompt is 219 tokens, over data.max_prompt_tokens=128"),
])
def test_invalid_rows_name_file_and_line(tmp_path, tok, row, message):
    path = _jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[1], row, ROWS[2]])
    with pytest.raises(DatasetError, match=message):
        load_prompt_datasets(_cfg([path], max_prompt_tokens=128), tok)


def test_bad_json_and_non_object_lines(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:3: invalid JSON"):
        load_prompt_datasets(_cfg([str(path)]), tok)
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:2: expected a JSON object, got list"):
        load_prompt_datasets(_cfg([str(path)]), tok)


def test_skip_mode_counts_every_dropped_row(tmp_path, tok, caplog):
    bad = [{"solution": "1", "info": {}}, {"question": "", "solution": "1", "info": {}}, {"solution": "2", "info": {}}]
    path = _jsonl(tmp_path / "d.jsonl", ROWS[:4] + bad)
    with caplog.at_level(logging.WARNING):
        train, _ = load_prompt_datasets(_cfg([path], on_invalid_row="skip"), tok)
    assert len(train) == 4
    assert train.skipped == {"missing field 'question' (data.fields.prompt)": 2, "empty prompt in field 'question'": 1}
    assert "skipped 3 invalid rows" in caplog.text and "d.jsonl:5" in caplog.text


def test_chat_messages_system_prompt_and_custom_template(tmp_path, tok):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
             "answer": 2}]
    path = _jsonl(tmp_path / "m.jsonl", rows)
    fields = {"prompt": None, "messages": "messages", "answer": "answer"}
    train, _ = load_prompt_datasets(_cfg([path], fields=fields), tok)
    assert train[0].prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=")
    assert train[0].answer == "2"
    plain = _jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    cfg = _cfg([plain], fields={}, chat_template="Q: {{ messages[-1]['content'] }}\nA:", system_prompt="ignored")
    assert load_prompt_datasets(cfg, tok)[0][0].prompt_text == "Q: 2+2=\nA:"
    raw = _cfg([plain], fields={}, use_chat_template=False)
    assert load_prompt_datasets(raw, tok)[0][0].prompt_text == "2+2="
    bad_role = _jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "robot", "content": "hi"}], "answer": "1"}])
    with pytest.raises(DatasetError, match=r"r.jsonl:1: field 'messages'\[0\] has role 'robot'"):
        load_prompt_datasets(_cfg([bad_role], fields=fields), tok)


def test_tokenizer_without_template_needs_one_in_the_config(tmp_path, tok):
    bare = build_demo_tokenizer()
    bare.chat_template = None
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    with pytest.raises(DatasetError, match="no chat template: set data.chat_template"):
        load_prompt_datasets(_cfg([path], fields={}), bare)
    cfg = _cfg([path], fields={}, chat_template="<|im_start|>{{ messages[0]['content'] }}")
    assert load_prompt_datasets(cfg, bare)[0][0].prompt_ids[0] == bare.convert_tokens_to_ids("<|im_start|>")


def test_eval_holdout_is_disjoint_and_deterministic(tmp_path, tok):
    rows = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(50)]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    train, evaluation = load_prompt_datasets(_cfg([path], fields={}, eval_holdout=10, seed=3), tok)
    again = load_prompt_datasets(_cfg([path], fields={}, eval_holdout=10, seed=3), tok)[1]
    assert (len(train), len(evaluation)) == (40, 10)
    assert {s.prompt for s in train}.isdisjoint({s.prompt for s in evaluation})
    assert [s.prompt for s in evaluation] == [s.prompt for s in again]
    assert [s.index for s in evaluation] == list(range(10))
    assert [len(b) for b in evaluation.batches(4)] == [4, 4, 2]


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match=r"data.fields.prompt: set exactly one"):
        build(DataConfig, {"train_files": ["a.jsonl"], "fields": {"messages": "m"}}, "data")
    with pytest.raises(ConfigError, match=r"data.eval_holdout"):
        build(DataConfig, {"train_files": ["a.jsonl"], "eval_files": ["b.jsonl"], "eval_holdout": 3}, "data")
    with pytest.raises(DatasetError, match="cannot tell the format"):
        load_prompt_datasets(build(DataConfig, {"train_files": [__file__]}, "data"), build_demo_tokenizer())


def test_sft_pair_uses_the_rl_prompt_and_ends_with_eos(tok):
    cfg = build(DataConfig, {"train_files": ["unused.jsonl"]}, "data")
    prompt_ids, response_ids = tokenize_sft_pair(tok, cfg, "12+7=", "19")
    assert tok.decode(prompt_ids) == render_prompt(tok, cfg, prompt="12+7=")
    assert response_ids == [tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("9"), tok.eos_token_id]
