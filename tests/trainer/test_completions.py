"""You can read what the model writes: sampled completions per step in completions.jsonl, TensorBoard
text and on the console; `eval --outputs` writes each prompt's outputs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.trainer.completions import truncate_completions
from gspo_megatron.trainer.schedule.base import RolloutGroup

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu_demo.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_a_resume_drops_the_rows_after_its_checkpoint(tmp_path):
    rows = [{"step": s, "prompt": "p", "response": "r", "answer": "a", "reward": 0.0} for s in (1, 1, 2, 3)]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "pro')
    truncate_completions(tmp_path, 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "completions.jsonl").read_text().splitlines()] == [1, 1, 2]


@pytest.mark.slow
def test_completions_are_logged_and_eval_writes_per_prompt_outputs(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir",
                           str(run), "logging.console=false", "sft.steps=20", "train.steps=2", "eval.num_prompts=4",
                           "eval.pass_k=1", "logging.completions_per_step=3", "logging.console_completion_every=2"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert all(r["prompt"].startswith("sort ") and isinstance(r["response"], str) and 0.0 <= r["reward"] <= 1.0
               and len(r["answer"].split()) == 3 for r in rows)
    assert f"step 2 sample: {rows[3]['prompt']!r} -> {rows[3]['response']!r}" in proc.stdout
    events = b"".join(p.read_bytes() for p in (run / "tensorboard").rglob("events.*"))
    assert b"completions" in events and rows[0]["prompt"].encode() in events

    outputs, summary = tmp_path / "outputs.jsonl", tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "eval", "--checkpoint",
                           str(run / "checkpoints" / "step_000002"), "--dataset",
                           str(REPO / "examples" / "data" / "sort" / "eval.jsonl"), "--num-prompts", "6", "--k", "2",
                           "--out", str(summary), "--outputs", str(outputs)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_prompt = [json.loads(line) for line in outputs.read_text().splitlines()]
    result = json.loads(summary.read_text())
    assert len(per_prompt) == 6 and all(len(r["samples"]) == len(r["sample_rewards"]) == 2 for r in per_prompt)
    assert sum(r["greedy_reward"] >= 1.0 for r in per_prompt) / 6 == pytest.approx(result["eval_accuracy"])
    assert sum(max(r["sample_rewards"]) >= 1.0 for r in per_prompt) / 6 == pytest.approx(result["eval_pass@2"])


def _tool_trajectory():
    """A multi-turn sample laid out as the agent loop lays one out (``trace_tokens``: a calculator call, the tool
    turn, the answer) with the tool demo's tokenizer and chat template, and its prompt."""
    from transformers import AutoTokenizer

    from gspo_megatron.data.dataset import PromptSample
    from gspo_megatron.data.tool_traces import calculator_only_trace
    from gspo_megatron.rollout.agent_loop import ToolTurnRenderer, trace_tokens
    from gspo_megatron.rollout.base import Sample

    tokenizer = AutoTokenizer.from_pretrained(REPO / "gspo_megatron" / "assets" / "tool_tokenizer")
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
    prompt = PromptSample(index=0, prompt_ids=list(prompt_ids), prompt_text="", prompt="2+2=", messages=None,
                          answer="4", tests=None, meta=None, source="test:1")
    renderer = ToolTurnRenderer(tokenizer, None, max_tool_output_tokens=16)
    ids, mask = trace_tokens(renderer, calculator_only_trace(prompt), tokenizer.eos_token_id)
    sample = Sample(prompt_index=0, response_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop",
                    response_mask=mask)
    return tokenizer, prompt, sample


def test_a_multi_turn_sample_keeps_its_turns_in_the_row_and_on_the_console():
    """The tool call, the tool's answer and the final answer stay apart: ``turns`` lists them by role, the
    response keeps the call and response tags, and the console and TensorBoard lines mark each turn."""
    from gspo_megatron.trainer.completions import as_text, completion_rows, console_line, eval_rows

    tokenizer, prompt, sample = _tool_trajectory()
    [row] = completion_rows([RolloutGroup(prompt, [sample], [1.0], [True])], tokenizer, n=1, step=3)
    roles = [t["role"] for t in row["turns"]]
    assert roles == ["assistant", "tool", "assistant"]
    call, answer, final = (t["text"] for t in row["turns"])
    assert call.startswith('<tool_call>{"name":"calculator","arguments":{"expression":"2+2"}}</tool_call>')
    assert "<tool_response>\n4\n</tool_response>" in answer
    assert final.startswith("4")
    assert row["response"] == call + answer + final
    line = console_line(row)
    assert f"[assistant] {call!r} [tool] {answer!r} [assistant] {final!r}" in line and "reward 1" in line
    assert "</tool_call>" in as_text([row]) and "**tool**" in as_text([row])
    [evaluated] = eval_rows([RolloutGroup(prompt, [sample], [1.0], [True])], None, tokenizer)
    assert evaluated["greedy_turns"] == row["turns"]


def test_a_single_turn_row_is_unchanged():

    from gspo_megatron.trainer.completions import completion_rows, console_line

    tokenizer, prompt, sample = _tool_trajectory()
    single = type(sample)(prompt_index=0, response_ids=sample.response_ids[-2:], logprobs=[0.0, 0.0],
                          finish_reason="stop")
    [row] = completion_rows([RolloutGroup(prompt, [single], [1.0], [True])], tokenizer, n=1, step=3)
    assert "turns" not in row and row["response"] == "4"
    assert console_line(row) == f"step 3 sample: {row['prompt']!r} -> '4' (answer '4', reward 1)"
