"""Multi-turn rollouts: responses that call tools mid-generation (``rollout.multi_turn``).

``AgentLoop`` wraps any ``RolloutEngine`` and keeps its interface. One trajectory per (prompt, sample):

    turn 0:  the engine continues the prompt (the same call, seeds and log-probs as a single-turn rollout)
    turn k:  the model's turn ended with a stop token and holds ``<tool_call>{json}</tool_call>`` blocks
             (Qwen3's format: ``{"name": ..., "arguments": {...}}``) -> each call runs in the tool registry,
             the answers are rendered as tool messages by the chat template (the end of the assistant turn,
             the tool turn and the next generation prompt), and the engine continues the whole trajectory
             from its token ids (both engines take token ids: transformers in-process or in the overlap
             process, SGLang through ``input_ids``)
    end:     a turn without a tool call (the answer), ``max_turns`` model turns, or ``max_trajectory_tokens``

The returned ``Sample`` is the whole trajectory after the prompt: ``response_ids`` hold model, tool and
template tokens in order, ``response_mask`` is True exactly on the tokens the model sampled (the others have
log-prob 0 and are masked out of the loss, the log-ratios, the KL and |y_i|: ``batching.TrainSequence``),
and ``tool_stats`` counts turns, tool calls and faults. The reward reads the final model turn
(``final_turn_ids``).

Seeds. Turn 0 uses the caller's seeds (a trajectory without tool calls is the single-turn response).
Turn k >= 1 of trajectory (global prompt i, sample j) is seeded by ``sample_seed(turn_seed(seed, k),
i * G + j, 0)`` through ``SamplingParams.prompt_indices``, so a trajectory does not depend on the batch,
rank or which other trajectories are still running. Turns are generated as one batch per turn with the
largest remaining budget, and each trajectory's turn is cut to its own budget afterwards: with per-sample
seeds that equals generating it with its own limit.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
from typing import Any, Sequence

import torch

from gspo_megatron.rollout.base import EngineDecorator, RolloutEngine, Sample, SamplingParams
from gspo_megatron.rollout.sampling import sample_seed
from gspo_megatron.rollout.tools import PythonRunner, ToolConfig, ToolRegistry, ToolResult
from gspo_megatron.typed_config import check

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
STAT_KEYS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated", "turn_limit")
_MARK = "\x00ASSISTANT\x00"
_SLOT = "\x00TOOL{}\x00"  # where the template puts tool message k's content (tokenised apart, as data)
_SLOTS = re.compile("\x00TOOL([0-9]+)\x00")
MAX_TOOL_TIMEOUT_S = 3600


@dataclasses.dataclass
class MultiTurnConfig:
    """``rollout.multi_turn``: tool calls during a response (docs/multi-turn.md).

    tools: what the model may call (``calculator``; ``python``, run in the rewards sandbox with the limits of
        ``rewards.code.sandbox``; ``module:function``).
    max_turns: model turns per trajectory (a tool call in the last one is not run).
    max_tool_output_tokens: a tool's answer is cut to this many tokens before it is rendered.
    max_trajectory_tokens: every token after the prompt (model, tool and template); ``rollout.max_new_tokens``
        bounds each model turn.
    tool_timeout_s: per call of a user tool or the python tool (the sandbox's case limit).
    max_tool_calls_per_turn: more calls in one turn are answered with an error, not run.
    max_print_bytes: what the user tools may print (their worker's stdout and stderr) per rollout, all
        together; the rest is cut and one log line says how much (gspo_megatron/print_cap.py).
    """

    tools: list[ToolConfig] = dataclasses.field(default_factory=lambda: [ToolConfig("calculator")])
    max_turns: int = 4
    max_tool_output_tokens: int = 64
    max_trajectory_tokens: int = 256
    tool_timeout_s: float = 5.0
    max_tool_calls_per_turn: int = 4
    max_print_bytes: int = 65536

    def validate(self, path: str) -> None:
        check(len(self.tools) > 0, f"{path}.tools", "needs at least one tool")
        names = [t.call_name for t in self.tools]
        for i, n in enumerate(names):
            check(names.index(n) == i, f"{path}.tools[{i}].key", f"tool name {n!r} is used twice; set a distinct 'key'")
        check(self.max_turns >= 1, f"{path}.max_turns", "must be >= 1")
        check(self.max_tool_output_tokens >= 1, f"{path}.max_tool_output_tokens", "must be >= 1")
        check(self.max_trajectory_tokens >= 2, f"{path}.max_trajectory_tokens", "must be >= 2")
        # an hour bounds what one call can hold up its whole rollout batch (and keeps deadlines finite)
        check(0 < self.tool_timeout_s <= MAX_TOOL_TIMEOUT_S, f"{path}.tool_timeout_s",
              f"must be in (0, {MAX_TOOL_TIMEOUT_S}] seconds (a call holds up its whole rollout batch), "
              f"got {self.tool_timeout_s:g}")
        check(self.max_tool_calls_per_turn >= 1, f"{path}.max_tool_calls_per_turn", "must be >= 1")
        check(self.max_print_bytes >= 0, f"{path}.max_print_bytes", f"must be >= 0, got {self.max_print_bytes}")


def turn_seed(seed: int, turn: int) -> int:
    """The call seed of turn ``turn >= 1`` (turn 0 uses ``seed`` itself); distinct from every sample seed
    of ``seed`` because sample indices are never negative."""
    return sample_seed(seed, -turn, -1)


MAX_ARGUMENT_DEPTH = 32  # nesting of a call's arguments; deeper is refused (JSON recursion costs a C stack each)


def json_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and objects (a scalar: 0); iterative, so no depth can
    raise RecursionError here."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """The ``<tool_call>`` blocks of one model turn: (name, arguments) per well-formed call, or the reason a
    block is malformed (a string, answered as an error). The model's text is untrusted: no block raises."""
    calls: list[tuple[str, dict] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(f"error: the tool call is not valid JSON ({err.msg})")
            continue
        except RecursionError:
            calls.append("error: the tool call nests too deeply")
            continue
        except ValueError as err:  # a number beyond Python's int-string limit (4,300 digits)
            calls.append(f"error: the tool call cannot be read ({str(err)[:80]})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('error: a tool call is {"name": "<tool>", "arguments": {...}}')
            continue
        arguments = call.get("arguments", {})
        if json_depth(arguments) > MAX_ARGUMENT_DEPTH:
            calls.append(f"error: the arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels")
            continue
        calls.append((call["name"], arguments))
    return calls


class ToolTurnRenderer:
    """Token ids of what follows a model turn that called tools: the rest of the assistant turn, the tool
    messages as the chat template renders them, and the next generation prompt."""

    def __init__(self, tokenizer: Any, chat_template: str | None, max_tool_output_tokens: int):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_tool_output_tokens = max_tool_output_tokens

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  chat_template=self.chat_template)

    def _data_ids(self, text: str) -> list[int]:
        """Token ids of a tool's text as data: a control token spelled in it (``<|im_end|>``) is tokenised as
        its characters, never as the control token (a tool's answer is no more trusted than a data row)."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def bound(self, text: str) -> tuple[str, bool]:
        """``text`` cut to ``max_tool_output_tokens`` tokens; and whether it was cut."""
        ids = self._data_ids(text)
        if len(ids) <= self.max_tool_output_tokens:
            return text, False
        return self.tokenizer.decode(ids[:self.max_tool_output_tokens], skip_special_tokens=False), True

    def render(self, results: list[str], stop_text: str) -> list[int]:
        """``stop_text``: the text of the stop token that ended the model turn (already in the trajectory).
        The template's own text is tokenised with its control tokens; each result on its own, as data."""
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        before = self._render(base, False)
        after = self._render(base + [{"role": "tool", "content": _SLOT.format(k)} for k in range(len(results))], True)
        if not after.startswith(before):
            raise ValueError("the chat template renders an assistant turn differently once tool messages follow "
                             "it; multi-turn rollouts need a template whose earlier turns do not change")
        closing = before[before.index(_MARK) + len(_MARK):]
        if stop_text and closing.startswith(stop_text):
            closing = closing[len(stop_text):]
        # pieces: template text, slot number, template text, ... (a slot per result, in order)
        pieces = _SLOTS.split(closing + after[len(before):])
        if pieces[1::2] != [str(k) for k in range(len(results))]:
            raise ValueError("the chat template does not render each tool message's content once, in order")
        ids = []
        for k, piece in enumerate(pieces):
            ids += self._data_ids(results[int(piece)]) if k % 2 else \
                self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids


@dataclasses.dataclass
class _Trajectory:
    prompt: list[int]
    index: int  # global trajectory index (prompt * G + sample): its seed from turn 1 on
    response: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    finish_reason: str = "length"
    done: bool = False
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, sampled: bool) -> None:
        self.response += list(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.mask += [sampled] * len(ids)


class AgentLoop(EngineDecorator):
    """A ``RolloutEngine`` whose ``generate`` runs multi-turn trajectories on ``engine`` (module docstring).

    Weight updates, memory and shutdown pass through to ``engine``. Overlapped, it runs inside the
    transformers engine's child process, or (SGLang) inside ``ahead.ThreadedEngine``, which generates
    whole trajectories on a background thread.
    """

    def __init__(self, engine: RolloutEngine, config: MultiTurnConfig, tokenizer: Any, chat_template: str | None,
                 stop_token_ids: Sequence[int] = (), run_python: PythonRunner | None = None):
        super().__init__(engine)
        self.config = config
        self.tokenizer = tokenizer
        self.tools = ToolRegistry(config.tools, timeout_s=config.tool_timeout_s, run_python=run_python,
                                  max_print_bytes=config.max_print_bytes)
        self.renderer = ToolTurnRenderer(tokenizer, chat_template, config.max_tool_output_tokens)
        self.stop_token_ids = list(stop_token_ids)

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 params: SamplingParams) -> list[Sample]:
        cfg, G = self.config, samples_per_prompt
        budget = cfg.max_trajectory_tokens
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        trajectories = [_Trajectory(list(p), (params.prompt_index(i)) * G + j) for i, p in enumerate(prompts)
                        for j in range(G)]
        first = dataclasses.replace(params, seed=seed, max_new_tokens=min(params.max_new_tokens, budget))
        outputs = self.engine.generate(prompts, G, first)
        active = trajectories
        for turn in range(cfg.max_turns):
            for t, out in zip(active, outputs):
                self._take_turn(t, out, turn)
            active = [t for t in trajectories if not t.done]
            if not active:
                break
            active, outputs = self._continue(active, params, turn_seed(seed, turn + 1), max(len(p) for p in prompts))
        samples = []
        for k, t in enumerate(trajectories):
            stats = {key: int(t.stats[key]) for key in STAT_KEYS}
            samples.append(Sample(prompt_index=k // G, response_ids=t.response, logprobs=t.logprobs,
                                  finish_reason=t.finish_reason, response_mask=t.mask, tool_stats=stats))
        self.tools.end_print_window()
        return samples

    def _continue(self, active: list[_Trajectory], params: SamplingParams, seed: int,
                  longest_prompt: int) -> tuple[list[_Trajectory], list[Sample]]:
        """The next model turn of every running trajectory, in as few engine calls as keep each call within
        longest prompt + ``max_trajectory_tokens`` positions (a call's length limit is its largest remaining
        budget, its longest context sets the width). Returns (trajectories in call order, their turns)."""
        limit = longest_prompt + self.config.max_trajectory_tokens
        order = sorted(active, key=lambda t: -len(t.response))
        new_tokens = [min(params.max_new_tokens, self.config.max_trajectory_tokens - len(t.response)) for t in order]
        groups: list[list[int]] = []
        current: list[int] = []
        for k in range(len(order)):
            candidate = current + [k]
            context = max(len(order[i].prompt) + len(order[i].response) for i in candidate)
            width = context + max(new_tokens[i] for i in candidate)
            if current and width > limit:  # a trajectory alone always fits: its context + budget <= limit
                groups.append(current)
                candidate = [k]
            current = candidate
        groups.append(current)
        trajectories, outputs = [], []
        for group in groups:
            members = [order[k] for k in group]
            call = dataclasses.replace(params, seed=seed, prompt_offset=0, prompt_indices=[t.index for t in members],
                                       max_new_tokens=max(new_tokens[k] for k in group))
            outputs += self.engine.generate([t.prompt + t.response for t in members], 1, call)
            trajectories += members
        return trajectories, outputs

    def _take_turn(self, t: _Trajectory, out: Sample, turn: int) -> None:
        """Append one model turn (cut to the trajectory's budget); run its tool calls or end the trajectory."""
        cfg = self.config
        room = cfg.max_trajectory_tokens - len(t.response)
        ids, logprobs, finish = out.response_ids, out.logprobs, out.finish_reason
        if len(ids) > room:
            ids, logprobs, finish = ids[:room], logprobs[:room], "length"
        t.add(ids, logprobs, sampled=True)
        t.stats["turns"] += 1
        t.finish_reason = finish
        calls = parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=False)) if finish == "stop" else []
        if not calls:
            t.done = True
            return
        if turn + 1 >= cfg.max_turns:
            t.stats["turn_limit"] += 1
            t.done = True
            return
        answers = [self._run_tool(t, call, k) for k, call in enumerate(calls)]
        stop_text = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ids[-1] in self.stop_token_ids else ""
        appended = self.renderer.render(answers, stop_text)
        if len(t.response) + len(appended) >= cfg.max_trajectory_tokens:
            t.finish_reason, t.done = "length", True  # no room left for the model to read the answer and reply
            return
        t.add(appended, None, sampled=False)

    def _run_tool(self, t: _Trajectory, call: tuple[Any, Any] | str, k: int) -> str:
        t.stats["tool_calls"] += 1
        if k >= self.config.max_tool_calls_per_turn:
            limit = self.config.max_tool_calls_per_turn
            result = ToolResult(f"error: more than {limit} tool calls in one turn", error=True)
        elif isinstance(call, str):
            result = ToolResult(call, error=True)
        else:
            result = self.tools.call(*call)
        text, cut = self.renderer.bound(result.text)
        t.stats["tool_errors"] += int(result.error)
        t.stats["tool_timeouts"] += int(result.timed_out)
        t.stats["tool_truncated"] += int(result.truncated or cut)
        return text

    def shutdown(self) -> None:
        self.tools.close()
        super().shutdown()


def final_turn_ids(sample: Sample) -> list[int]:
    """The tokens of the last model turn (what the reward reads): the response after its last non-model
    token, or the whole response of a single-turn sample."""
    if sample.response_mask is None:
        return list(sample.response_ids)
    start = len(sample.response_mask)
    while start > 0 and sample.response_mask[start - 1]:
        start -= 1
    return list(sample.response_ids[start:])


def tool_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-response means of the agent loop's counters (``tool_calls_per_response``, ``turns_per_response``,
    ...) and the fraction of responses that called a tool at all; {} for single-turn samples."""
    stats = [s.tool_stats for s in samples if s.tool_stats is not None]
    if not stats:
        return {}
    n = float(len(stats))
    out = {f"{key}_per_response": sum(s[key] for s in stats) / n for key in STAT_KEYS}
    out["tool_use_frac"] = sum(1.0 for s in stats if s["tool_calls"] > 0) / n
    return out


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    """How to build the agent loop around an engine; picklable, so the overlap engine process builds its own
    (``rollout/process_engine.py``) and whole trajectories are generated ahead of the trainer."""

    config: MultiTurnConfig
    tokenizer: Any
    chat_template: str | None
    stop_token_ids: tuple[int, ...]
    run_python: PythonRunner | None = None  # picklable (a functools.partial of rewards.sandbox.python_tool)

    def wrap(self, engine: RolloutEngine) -> AgentLoop:
        return AgentLoop(engine, self.config, self.tokenizer, self.chat_template, self.stop_token_ids,
                         self.run_python)


def trace_tokens(renderer: ToolTurnRenderer, messages: Sequence[dict[str, str]],
                 eos_id: int) -> tuple[list[int], list[bool]]:
    """Token ids and model-token mask of a supervised multi-turn trace (the chat messages after the prompt):
    each assistant message is its content plus ``eos_id`` (what a turn stops on, mask True); the tool
    messages that follow one are rendered exactly as the agent loop renders them (mask False). The same
    layout as a sampled trajectory, so the warm start teaches the turns RL will see."""
    tokenizer = renderer.tokenizer
    ids: list[int] = []
    mask: list[bool] = []
    k = 0
    while k < len(messages):
        message = messages[k]
        if message["role"] != "assistant":
            raise ValueError(f"trace message {k}: expected an assistant turn, got role {message['role']!r}")
        turn = list(tokenizer(message["content"], add_special_tokens=False)["input_ids"]) + [eos_id]
        ids += turn
        mask += [True] * len(turn)
        k += 1
        results = []
        while k < len(messages) and messages[k]["role"] == "tool":
            results.append(renderer.bound(messages[k]["content"])[0])
            k += 1
        if results:
            inserted = renderer.render(results, tokenizer.decode([eos_id], skip_special_tokens=False))
            ids += inserted
            mask += [False] * len(inserted)
    return ids, mask


__all__ = ["AgentLoop", "AgentSpec", "MultiTurnConfig", "STAT_KEYS", "ToolTurnRenderer", "final_turn_ids",
           "parse_tool_calls", "tool_metrics", "trace_tokens", "turn_seed"]
