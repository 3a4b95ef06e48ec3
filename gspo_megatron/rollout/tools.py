"""Tools a response may call mid-generation (``rollout.multi_turn``), and the registry that runs them.

Three kinds, each ``tool(arguments: dict) -> str``:

  calculator   ``{"expression": "12*(3+4)"}``: integer/float arithmetic with + - * / // % and parentheses,
               parsed with ``ast`` (no names, no calls, no powers: nothing can run long or grow huge; a
               literal or result that is not finite or beyond 1e30 is an error);
               runs in the calling process.
  python       ``{"code": "print(6*7)"}``: the program runs in the rewards sandbox with the code reward's
               isolation and limits (``rewards.code.sandbox``); the trainer hands the registry that runner
               (``rewards.sandbox.python_tool``: rollout does not import rewards); the answer is its stdout
               (or its error).
  user tools   ``module.path:function``, a plain ``f(**arguments) -> str`` loaded like a user reward
               (imported at start-up: trainer/config.py ``check_tool_imports``); it runs in a separate
               worker interpreter (``_worker_main``), the leader of its own process group, so that one
               which hangs is killed at ``tool_timeout_s`` with everything it started, and the worker is
               restarted.

Faults never leave the registry: an unknown tool or a name that is not a string, malformed arguments, a tool
that raises or times out, an answer that is not valid text becomes an error message (``error: ...``) that the
model reads as the tool's answer, and is counted in
``ToolResult`` (the agent loop sums them into the ``tool_errors`` / ``tool_timeouts`` metrics). A tool's
answer is cut to ``max_output_chars`` before it leaves the worker, then to the configured number of tokens
by the agent loop, so a tool that floods its output costs a bounded message.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import os
import select
import signal
import subprocess
import sys
from typing import Any, Callable

from gspo_megatron.print_cap import PrintCap
from gspo_megatron.typed_config import check

BUILTIN_TOOLS = ("calculator", "python")


@dataclasses.dataclass
class ToolConfig:
    """One tool. ``name``: a built-in (``calculator``, ``python``) or ``module.path:function``; ``key``: the
    name the model calls it by (default the built-in name or the function name)."""

    name: str
    key: str | None = None

    def validate(self, path: str) -> None:
        check(self.name in BUILTIN_TOOLS or (":" in self.name and all(self.name.split(":", 1))), f"{path}.name",
              f"must be one of {list(BUILTIN_TOOLS)} or 'module.path:function', got {self.name!r}")

    @property
    def call_name(self) -> str:
        return self.key or self.name.rsplit(":", 1)[-1]


@dataclasses.dataclass
class ToolResult:
    """A tool's answer as the model will read it, and what went wrong (for the metrics)."""

    text: str
    error: bool = False
    timed_out: bool = False
    truncated: bool = False


class ToolError(Exception):
    """A tool rejected its arguments: the message becomes the tool's answer."""


# ---------------------------------------------------------------------------------------------------------
# calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_MAX_CALCULATOR_CHARS = 200
_MAX_MAGNITUDE = 10**30


def _bounded(value: int | float) -> int | float:
    """``value`` if it is finite and within ``_MAX_MAGNITUDE``; literals and results alike (``1e309`` is inf,
    ``inf - inf`` is nan, a 199-digit literal is no result the model should learn to read)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("not a finite number")
    if abs(value) > _MAX_MAGNITUDE:
        raise ToolError("number too large")
    return value


def _calc(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _calc(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _calc(node.left), _calc(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ToolError(f"unsupported expression element {type(node).__name__}")


def calculator(arguments: dict[str, Any]) -> str:
    """``{"expression": str}`` -> its value (an int when integral), e.g. ``"7+5*2"`` -> ``"17"``."""
    expression = arguments.get("expression")
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError('calculator needs {"expression": "<arithmetic>"}')
    if len(expression) > _MAX_CALCULATOR_CHARS:
        raise ToolError(f"expression longer than {_MAX_CALCULATOR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse expression: {err.msg}") from err
    value = _calc(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


# (code, timeout_s) -> (text, error, timed_out, truncated): how the python tool runs a program
PythonRunner = Callable[[str, float], tuple[str, bool, bool, bool]]


# ---------------------------------------------------------------------------------------------------------
# user tools in a worker interpreter


def _worker_main() -> None:
    """The user-tool worker: JSON lines in on stdin, JSON lines out on the original stdout (the tools'
    own prints go to stderr, so they cannot corrupt the replies; the registry caps what reaches the log)."""
    import importlib
    import traceback

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    functions: dict[str, Callable[..., Any]] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "sys_path" in request:
            sys.path[:] = request["sys_path"]
            continue
        path, limit = request["function"], request["max_chars"]
        try:
            if path not in functions:
                module, _, attr = path.partition(":")
                functions[path] = getattr(importlib.import_module(module), attr)
            text = str(functions[path](**request["arguments"]))
            reply = {"text": text[:limit], "truncated": len(text) > limit}
        except Exception as err:  # noqa: BLE001 - the tool's fault becomes its answer, counted by the parent
            reply = {"error": f"{type(err).__name__}: {err}"[:limit], "trace": traceback.format_exc()[-2000:]}
        replies.write(json.dumps(reply) + "\n")


class ToolWorker:
    """One worker interpreter for user tools; killed and restarted when a call exceeds its time limit."""

    def __init__(self, timeout_s: float, max_output_chars: int, prints: PrintCap):
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.prints = prints  # where the tools' own prints go: the log, capped per rollout
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def _start(self) -> subprocess.Popen:
        code = ("from gspo_megatron.processes import die_with_parent; die_with_parent(%d); "
                "from gspo_megatron.rollout.tools import _worker_main; _worker_main()" % os.getpid())
        # its own session: the worker leads a process group that holds whatever the tools start, so a timeout
        # kills them too (close); the reward pool's workers are started the same way
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=self.prints.fd, start_new_session=True)
        proc.stdin.write((json.dumps({"sys_path": sys.path}) + "\n").encode())
        proc.stdin.flush()
        self._buffer = b""
        return proc

    def call(self, function: str, arguments: dict[str, Any]) -> ToolResult:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        request = {"function": function, "arguments": arguments, "max_chars": self.max_output_chars}
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            return ToolResult("error: the tool worker died", error=True)
        line = self._read_line()
        if line is None:
            timed_out = self._proc.poll() is None
            self.close()
            if timed_out:
                return ToolResult(f"error: timed out after {self.timeout_s:g} s", error=True, timed_out=True)
            return ToolResult("error: the tool worker died", error=True)
        reply = json.loads(line)
        if "error" in reply:
            return ToolResult(f"error: {reply['error']}", error=True)
        return ToolResult(reply["text"], truncated=reply["truncated"])

    def _read_line(self) -> bytes | None:
        """One reply line within the time limit, or None (timed out, or the worker exited)."""
        import time

        deadline = time.monotonic() + self.timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def close(self) -> None:
        """Kill the worker's process group (the worker and every process a tool started in it), then reap."""
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # the group id is the worker's pid (start_new_session)
            except ProcessLookupError:
                pass  # the worker and all its children have exited already
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                stream.close()
            self._proc = None


# ---------------------------------------------------------------------------------------------------------
# the registry


class ToolRegistry:
    """The configured tools by the name the model calls them; ``call`` never raises for a tool's fault."""

    def __init__(self, tools: list[ToolConfig], *, timeout_s: float = 5.0, max_output_chars: int = 4096,
                 run_python: PythonRunner | None = None, max_print_bytes: int = 65536):
        self.max_output_chars = max_output_chars
        self.timeout_s = timeout_s
        self.run_python = run_python
        self._tools = {t.call_name: t.name for t in tools}
        if len(self._tools) != len(tools):
            raise ValueError("rollout.multi_turn.tools: two tools have the same name; set a distinct 'key'")
        if "python" in self._tools.values() and run_python is None:
            raise ValueError("rollout.multi_turn.tools: the python tool needs a sandbox runner (run_python)")
        self._prints = PrintCap(max_print_bytes, "the tools' output", "rollout.multi_turn.max_print_bytes")
        self._worker = (ToolWorker(timeout_s, max_output_chars, self._prints) if any(":" in t.name for t in tools)
                        else None)

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def call(self, name: Any, arguments: Any) -> ToolResult:
        """Run tool ``name`` on ``arguments`` (a dict); faults come back as an error ``ToolResult``. Both come
        from the model's text: any JSON value, so neither is trusted to be hashable or the right type. The
        answer is at most ``max_output_chars`` characters of text a tokenizer accepts: an answer holding a
        lone surrogate (which JSON's ``"\\ud800"`` makes, and a tool may echo back) is a failed call."""
        result = self._run(name, arguments)
        try:
            result.text.encode("utf-8")
        except UnicodeEncodeError as err:
            return ToolResult(f"error: the tool's answer is not valid text ({err.reason} at character {err.start})",
                              error=True)
        if len(result.text) > self.max_output_chars:
            return dataclasses.replace(result, text=result.text[:self.max_output_chars], truncated=True)
        return result

    def _run(self, name: Any, arguments: Any) -> ToolResult:
        if not isinstance(name, str):
            return ToolResult(f"error: a tool name is a string, not a {type(name).__name__}", error=True)
        if name not in self._tools:
            return ToolResult(f"error: unknown tool {name[:64]!r} (tools: {', '.join(self.names)})", error=True)
        if not isinstance(arguments, dict):
            return ToolResult("error: 'arguments' must be a JSON object", error=True)
        kind = self._tools[name]
        if kind == "python":
            if not isinstance(arguments.get("code"), str):
                return ToolResult('error: python needs {"code": "<program>"}', error=True)
            return ToolResult(*self.run_python(arguments["code"], self.timeout_s))
        if kind == "calculator":
            try:
                return ToolResult(calculator(arguments))
            except ToolError as err:
                return ToolResult(f"error: {err}", error=True)
        return self._worker.call(kind, arguments)

    def end_print_window(self) -> int:
        """End a rollout's window of the tools' prints: the bytes cut in it (a log line says so when > 0)."""
        return self._prints.end_window()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._prints.close()


__all__ = ["BUILTIN_TOOLS", "PythonRunner", "ToolConfig", "ToolError", "ToolRegistry", "ToolResult", "ToolWorker",
           "calculator"]
