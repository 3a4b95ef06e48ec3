"""Supervised multi-turn traces for the tool demo (``sft.traces``, examples/cpu_tool_demo.yaml).

A trace is the chat messages after a prompt: assistant turns (a tool call in Qwen3's format, or the
answer) and the tool answers between them (``rollout/agent_loop.trace_tokens`` tokenizes them as the agent
loop lays out a sampled trajectory).
"""
from __future__ import annotations

import json
from typing import Any


def calculator_call(expression: str) -> str:
    """One assistant turn calling the calculator, in Qwen3's ``<tool_call>`` format. Compact JSON, key order
    name then arguments: the demo tokenizer's frame tokens (``data/tokenizer.py CALCULATOR_FRAME``) are this
    exact text, so a call is 9 tokens."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def calculator_trace(sample: Any) -> list[dict[str, str]]:
    """An arithmetic prompt ``"a+b="``: every other prompt (by dataset index) asks the calculator and copies
    its answer, the rest answer directly; so the warm-started model calls the tool on about half of its
    responses and RL can move that rate either way."""
    if sample.index % 2:
        return [{"role": "assistant", "content": str(sample.answer)}]
    return calculator_only_trace(sample)


def calculator_only_trace(sample: Any) -> list[dict[str, str]]:
    """Every prompt through the calculator (a warm start that makes the model call it from the start)."""
    return [{"role": "assistant", "content": calculator_call(sample.prompt.rstrip("="))},
            {"role": "tool", "content": str(sample.answer)},
            {"role": "assistant", "content": str(sample.answer)}]


__all__ = ["calculator_call", "calculator_only_trace", "calculator_trace"]
