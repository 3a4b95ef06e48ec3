"""Code: run the response's Python program against the sample's unit tests in the sandbox.

``sample["tests"]`` may be (or be a JSON string of) one of:

  stdio    {"inputs": [str, ...], "outputs": [str, ...]}            (APPS / TACO / CodeContests)
           or [{"input": str, "output": str}, ...]
           each case runs the program once with the input on stdin; stdout must match (trailing
           whitespace ignored; otherwise whitespace tokens, numbers to 1e-6).
  call     {"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [value, ...]}   (APPS call-based)
           f(*args) must equal the value (or [value], APPS wraps some outputs in a list).
  asserts  ["assert f(1) == 2", ...] or {"asserts": [...], "setup": "import math"}  (MBPP)
           each statement is one case.
  check    {"test_code": "def check(candidate): ...", "entry_point": "f"}             (HumanEval)
           one case: check(f) must not raise.

Call/assert/check cases run in one process through a harness: the program's module is executed, then
each case with its own time limit; results go to a private file descriptor tagged with a random nonce,
so a program that prints "passed" or exits early does not score. (A program that inspects the
harness's memory could still forge results; the sandbox stops it from harming anything else.)
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Literal, Mapping

from gspo_megatron.rewards.sandbox import Run, SandboxConfig, run_in_sandbox
from gspo_megatron.rewards.types import Verdict
from gspo_megatron.typed_config import check

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclasses.dataclass
class CodeRewardConfig:
    scoring: Literal["pass_fraction", "all_or_nothing"] = "pass_fraction"
    require_code_block: bool = True  # False: a response without a ``` block is taken as code whole
    max_test_cases: int = 0  # run at most this many cases per sample (0: all)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

    def validate(self, path: str) -> None:
        check(self.max_test_cases >= 0, f"{path}.max_test_cases", "must be >= 0")


@dataclasses.dataclass
class TestSuite:
    kind: Literal["stdio", "call", "asserts", "check"]
    cases: list[Any]  # stdio: (input, output); call: (args, expected); asserts: statement; check: test code
    setup: str = ""
    fn_name: str = ""


def extract_code(response: str, require_code_block: bool = True) -> str | None:
    """The last ```python block (else the last fenced block of any language, else — when allowed —
    the whole response). An unclosed final fence (a truncated response) counts up to the end."""
    blocks = _FENCE.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    untagged = [code for lang, code in blocks if not lang]
    for candidates in (python, untagged, [code for _, code in blocks]):
        if candidates and candidates[-1].strip():
            return candidates[-1]
    if require_code_block or not response.strip():
        return None
    return response


def parse_tests(tests: Any, where: str = "tests") -> TestSuite:
    """Normalise the accepted test formats (module docstring); ``ValueError`` names what is wrong."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: a string must hold JSON test cases ({err})") from None
    if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
        return TestSuite("asserts", list(tests))
    if isinstance(tests, list) and all(isinstance(t, Mapping) for t in tests):
        try:
            return TestSuite("stdio", [(str(t["input"]), str(t["output"])) for t in tests])
        except KeyError as err:
            raise ValueError(f"{where}: each stdio case needs 'input' and 'output' (missing {err})") from None
    if not isinstance(tests, Mapping):
        raise ValueError(f"{where}: expected a list or a mapping of tests, got {type(tests).__name__}")
    if "asserts" in tests:
        return TestSuite("asserts", [str(a) for a in tests["asserts"]], setup=str(tests.get("setup", "")))
    if "test_code" in tests:
        if "entry_point" not in tests:
            raise ValueError(f"{where}: 'test_code' needs an 'entry_point' (the function to check)")
        return TestSuite("check", [str(tests["test_code"])], fn_name=str(tests["entry_point"]))
    if "inputs" in tests and "outputs" in tests:
        inputs, outputs = tests["inputs"], tests["outputs"]
        if len(inputs) != len(outputs):
            raise ValueError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
        if tests.get("fn_name"):
            return TestSuite("call", [(i, o) for i, o in zip(inputs, outputs)], fn_name=str(tests["fn_name"]))
        return TestSuite("stdio", [(str(i), str(o)) for i, o in zip(inputs, outputs)])
    raise ValueError(f"{where}: unrecognised test format with keys {sorted(tests)[:6]}")


_HARNESS = r'''
import json, os, signal, sys
NONCE = {nonce!r}
KIND, FN_NAME, SETUP, CASES, CASE_TIMEOUT_S = {kind!r}, {fn_name!r}, {setup!r}, json.loads({cases!r}), {timeout!r}
os.unlink(__file__)  # the nonce is not left on disk for the program to read
report_fd = os.dup(1)
os.set_inheritable(report_fd, False)
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1):
    os.dup2(devnull, fd)
sys.stdout = open(1, "w", closefd=False)

def report(index, ok):
    os.write(report_fd, f"{{NONCE}} {{index}} {{int(ok)}}\n".encode())

class CaseTimeout(BaseException):
    pass

def on_alarm(signum, frame):
    raise CaseTimeout()

signal.signal(signal.SIGALRM, on_alarm)
namespace = {{"__name__": "solution"}}
with open("solution.py", encoding="utf-8") as f:
    source = f.read()
try:
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    exec(compile(SETUP + "\n" + source, "solution.py", "exec"), namespace)
    signal.setitimer(signal.ITIMER_REAL, 0)
    loaded = True
except BaseException:
    loaded = False
for index, case in enumerate(CASES):
    ok = False
    if loaded:
        try:
            signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
            if KIND == "asserts":
                exec(compile(case, "<test>", "exec"), namespace)
                ok = True
            elif KIND == "check":
                scope = dict(namespace)
                exec(compile(case, "<test>", "exec"), scope)
                scope["check"](namespace[FN_NAME])
                ok = True
            else:
                args, expected = case
                got = namespace[FN_NAME](*args)
                got = list(got) if isinstance(got, tuple) else got
                ok = got == expected or [got] == expected
        except BaseException:
            ok = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    report(index, ok)
os._exit(0)
'''


def _harness_source(suite: TestSuite, nonce: str, case_timeout_s: float) -> str:
    return _HARNESS.format(nonce=nonce, kind=suite.kind, fn_name=suite.fn_name, setup=suite.setup,
                           cases=json.dumps(suite.cases), timeout=case_timeout_s)


def _harness_passes(stdout: str, nonce: str, num_cases: int) -> list[bool]:
    passed = [False] * num_cases
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and int(parts[1]) < num_cases:
            passed[int(parts[1])] = parts[2] == "1"
    return passed


def run_tests(code: str, suite: TestSuite, cfg: CodeRewardConfig) -> tuple[list[bool], tuple[str, ...]]:
    """Per-case pass/fail of ``code`` on ``suite`` and outcome tags; never raises for what the code does."""
    cases = suite.cases[:cfg.max_test_cases] if cfg.max_test_cases else suite.cases
    suite = dataclasses.replace(suite, cases=cases)
    stop = cfg.scoring == "all_or_nothing"
    if suite.kind == "stdio":
        runs = [Run(["solution.py"], stdin=i, expected_stdout=o) for i, o in suite.cases]
        reply = run_in_sandbox(cfg.sandbox, {"solution.py": code}, runs, stop_on_failure=stop)
        passed = [bool(r.passed) for r in reply.runs] + [False] * (len(runs) - len(reply.runs))
    else:
        nonce = secrets.token_hex(16)
        files = {"solution.py": code, "harness.py": _harness_source(suite, nonce, cfg.sandbox.case_timeout_s)}
        reply = run_in_sandbox(cfg.sandbox, files, [Run(["harness.py"], return_stdout=True, cases=len(cases) + 1)])
        passed = _harness_passes(reply.runs[0].stdout or "", nonce, len(cases)) if reply.runs else [False] * len(cases)
    tags = set()
    if reply.error is not None:
        tags.add("sandbox_error")
    for r in reply.runs:
        if r.timed_out:
            tags.add("timeout")
        if r.output_overflow:
            tags.add("output_overflow")
        if r.exit_code not in (0, None) or r.signal is not None and not r.timed_out:
            tags.add("runtime_error")
    return passed, tuple(sorted(tags))


def code_reward(sample: Mapping[str, Any], response: str, cfg: CodeRewardConfig | None = None) -> Verdict:
    """Pass fraction (or all-or-nothing) of the response's code on ``sample["tests"]``."""
    cfg = cfg or CodeRewardConfig()
    suite = parse_tests(sample.get("tests"), "sample['tests']")
    if not suite.cases:
        raise ValueError("sample['tests'] has no test cases")
    code = extract_code(response, cfg.require_code_block)
    if code is None:
        return Verdict(0.0, ("no_code",), correct=False)
    passed, tags = run_tests(code, suite, cfg)
    fraction = sum(passed) / len(passed)
    if fraction == 1.0:
        tags = tags + ("all_passed",)
    reward = fraction if cfg.scoring == "pass_fraction" else float(fraction == 1.0)
    return Verdict(reward, tags, correct=fraction == 1.0)


__all__ = ["CodeRewardConfig", "TestSuite", "code_reward", "extract_code", "parse_tests", "run_tests"]
