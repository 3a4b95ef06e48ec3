"""`gspo-megatron prepare`: GSM8K- and MATH-like rows in Parquet and in a save_to_disk folder (the layout
datasets writes, made here with pyarrow as tests/data/test_loading.py does) become prompt JSONL whose answers the
math reward accepts; rows that cannot be converted are counted and named by their row."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_megatron.data import DataConfig, build_demo_tokenizer, load_prompt_datasets
from gspo_megatron.rewards.config import RewardConfig, RewardTermConfig
from gspo_megatron.rewards.pool import RewardPool
from gspo_megatron.typed_config import build
from tests.data.test_loading import _write_hf_folder

GSM8K = [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
         {"question": "A farm sells 1000 eggs, then 234 more.", "answer": "1000 + 234 = 1234\n#### 1,234"},
         {"question": "No marker here.", "answer": "the answer is 5"},
         {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"}]
MATH = [{"problem": "Simplify $\\frac{6}{8}$.", "solution": "Divide by 2: $\\boxed{\\frac{3}{4}}$.", "level": "1"},
        {"problem": "What is $2^{10}$?", "solution": "It is $\\boxed{1024}$.", "level": "1"},
        {"problem": "Find x.", "solution": "Unboxed: x = 3.", "level": "2"},
        {"problem": None, "solution": "$\\boxed{1}$", "level": "2"}]


def _prepare(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "prepare", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gsm8k_parquet(tmp_path):
    src, out = tmp_path / "gsm8k.parquet", tmp_path / "out" / "train.jsonl"
    pq.write_table(pa.Table.from_pylist(GSM8K), src)
    proc = _prepare(src, "--out", out, "--prompt-field", "question", "--answer-field", "answer",
                    "--answer-rule", "gsm8k")
    assert proc.returncode == 0, proc.stderr
    assert _lines(out) == [{"prompt": GSM8K[0]["question"], "answer": "7"},
                           {"prompt": GSM8K[1]["question"], "answer": "1234"},
                           {"prompt": GSM8K[3]["question"], "answer": "42"}]
    assert proc.stdout.splitlines() == [f"prepare: wrote 3 rows to {out}; left out 1 rows:",
                                        f"  {src} row 3: no '####' before the final answer"]
    assert [p.name for p in out.parent.iterdir()] == ["train.jsonl"]  # the temporary file was renamed


def test_math_save_to_disk_folder_with_a_template_and_what_the_reward_makes_of_it(tmp_path):
    folder, out = tmp_path / "math" / "train", tmp_path / "math.jsonl"
    _write_hf_folder(folder, MATH)
    (tmp_path / "math" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    proc = _prepare(tmp_path / "math", "--split", "train", "--out", out, "--prompt-field", "problem",
                    "--answer-field", "solution", "--answer-rule", "boxed",
                    "--prompt-template", "{prompt} Put the final answer in \\boxed{{}}.")
    assert proc.returncode == 0, proc.stderr
    rows = _lines(out)
    assert rows == [{"prompt": "Simplify $\\frac{6}{8}$. Put the final answer in \\boxed{}.", "answer": "\\frac{3}{4}"},
                    {"prompt": "What is $2^{10}$? Put the final answer in \\boxed{}.", "answer": "1024"}]
    shard = folder / "data-00001-of-00002.arrow"  # rows 3-4 are the second shard's rows 1-2
    assert proc.stdout.splitlines()[1:] == [f"  {shard} row 1: no \\boxed{{...}}",
                                            f"  {shard} row 2: field 'problem' is a NoneType, not text"]
    # the file loads with the default data.fields, and the math reward scores a right answer 1 and a wrong one 0
    train, _ = load_prompt_datasets(build(DataConfig, {"train_files": [str(out)], "use_chat_template": False},
                                          "data"), build_demo_tokenizer())
    with RewardPool(RewardConfig(terms=[RewardTermConfig("math")], num_workers=0)) as pool:
        rewards, _ = pool.score([(train[0], "so it is \\boxed{0.75}"), (train[1], "\\boxed{1000}")])
    assert rewards == [1.0, 0.0]


def test_nothing_convertible_writes_nothing_and_says_why(tmp_path):
    src, out = tmp_path / "g.jsonl", tmp_path / "o.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\nnot json\n")
    proc = _prepare(src, "--out", out, "--answer-rule", "gsm8k")
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip() == (f"gspo-megatron prepare: error: {src}: no row could be converted, 2 left out "
                                   f"(first: {src}:1: no '####' before the final answer); nothing written")
    wrong = _prepare(src, "--out", out, "--answer-rule", "gsm8k", "--prompt-field", "problem")
    assert "no field 'problem' (--prompt-field; the row has ['answer', 'question'])" in wrong.stderr


@pytest.mark.parametrize("text, rule, expected", [("x\n#### -3", "gsm8k", "-3"), ("#### 1,000,000", "gsm8k", "1000000"),
                                                  ("a \\boxed{2} then \\boxed{x^{2}}", "boxed", "x^{2}"),
                                                  (" 17 ", "field", "17")])
def test_answer_rules(text, rule, expected):
    from gspo_megatron.trainer.prepare import convert_row

    assert convert_row({"q": "p", "a": text}, "q", "a", rule, "{prompt}")["answer"] == expected
