"""Code verifier on real examples: every accepted test format, right / wrong / partial / malformed
responses, and the harness's defences against faked results."""
from __future__ import annotations

import json

import pytest

from gspo_megatron.rewards.code import CodeRewardConfig, code_reward, extract_code, parse_tests
from tests.rewards.helpers import code_block, fast_sandbox

CFG = CodeRewardConfig(sandbox=fast_sandbox())
ALL_OR_NOTHING = CodeRewardConfig(scoring="all_or_nothing", sandbox=fast_sandbox())

STDIO = {"inputs": ["1 2\n", "10 20\n", "-5 5\n"], "outputs": ["3\n", "30\n", "0\n"]}
ADD = "a, b = map(int, input().split())\nprint(a + b)"


def test_extract_code():
    text = "Plan.\n```\nnot this\n```\nThen:\n```python\nprint(1)\n```\nand prose"
    assert extract_code(text) == "print(1)\n"
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\nprint(2)\n") == "print(2)\n"  # truncated, unclosed fence
    assert extract_code("print(3)") is None
    assert extract_code("print(3)", require_code_block=False) == "print(3)"


def test_stdio_right_wrong_partial():
    assert code_reward({"tests": STDIO}, code_block(ADD), CFG).reward == 1.0
    assert code_reward({"tests": STDIO}, code_block("print(3)"), CFG).reward == pytest.approx(1 / 3)
    assert code_reward({"tests": STDIO}, code_block("print(3)"), ALL_OR_NOTHING).reward == 0.0
    assert code_reward({"tests": STDIO}, code_block("print(int('x'))"), CFG).reward == 0.0
    # the same cases as a list of {input, output} and as a JSON string (APPS stores them that way)
    as_list = [{"input": i, "output": o} for i, o in zip(STDIO["inputs"], STDIO["outputs"])]
    assert code_reward({"tests": as_list}, code_block(ADD), CFG).reward == 1.0
    assert code_reward({"tests": json.dumps(STDIO)}, code_block(ADD), CFG).reward == 1.0


def test_output_comparison_is_lenient_on_whitespace_and_floats():
    tests = {"inputs": [""], "outputs": ["1 2\n0.3333333\n"]}
    assert code_reward({"tests": tests}, code_block("print('1  2 ')\nprint(1/3)\n\n"), CFG).reward == 1.0
    assert code_reward({"tests": tests}, code_block("print('1 2')\nprint(0.34)"), CFG).reward == 0.0


def test_asserts_setup_call_and_check_formats():
    asserts = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
    fn = "def add(a, b):\n    return a + b"
    assert code_reward({"tests": asserts}, code_block(fn), CFG).reward == pytest.approx(2 / 3)
    with_setup = {"asserts": ["assert hyp(3, 4) == 5.0"], "setup": "import math"}
    assert code_reward({"tests": with_setup}, code_block("def hyp(a, b):\n    return math.hypot(a, b)"), CFG).reward == 1.0
    call = {"fn_name": "pair", "inputs": [[1, 2], [3, 4]], "outputs": [[1, 2], [[4, 3]]]}
    assert code_reward({"tests": call}, code_block("def pair(a, b):\n    return (a, b)"), CFG).reward == 0.5
    check = {"test_code": "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4",
             "entry_point": "square"}
    assert code_reward({"tests": check}, code_block("def square(x):\n    return x * x"), CFG).reward == 1.0
    assert code_reward({"tests": check}, code_block("def square(x):\n    return 2 * x"), CFG).reward == 0.0


def test_faked_results_do_not_score():
    asserts = ["assert f() == 1", "assert f() == 2"]
    early_exit = "import os, sys\nsys.stdout.flush()\nos._exit(0)"
    assert code_reward({"tests": asserts}, code_block(early_exit), CFG).reward == 0.0
    fake_lines = "import os\nfor fd in (1, 3, 4):\n    try:\n        os.write(fd, b'0 1\\n1 1\\nabc 0 1\\n')\n" \
                 "    except OSError:\n        pass\ndef f():\n    return 0"
    assert code_reward({"tests": asserts}, code_block(fake_lines), CFG).reward == 0.0
    swallow = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef f():\n    while True: pass"
    short = CodeRewardConfig(sandbox=fast_sandbox(case_timeout_s=0.5))  # the whole harness times out
    assert code_reward({"tests": asserts}, code_block(swallow), short).reward == 0.0


def test_hanging_case_does_not_hide_passing_ones():
    asserts = ["assert f(1) == 1", "assert f(0) == 0", "assert f(2) == 2"]
    source = "def f(x):\n    while x == 0:\n        pass\n    return x"
    assert code_reward({"tests": asserts}, code_block(source), CFG).reward == pytest.approx(2 / 3)


def test_malformed_response_and_tests():
    no_code = code_reward({"tests": STDIO}, "I would add the numbers.", CFG)
    assert no_code.reward == 0.0 and no_code.tags == ("no_code",)
    syntax = code_reward({"tests": ["assert f() == 1"]}, code_block("def f(:"), CFG)
    assert syntax.reward == 0.0
    with pytest.raises(ValueError, match="3 inputs but 1 outputs"):
        parse_tests({"inputs": ["a", "b", "c"], "outputs": ["x"]})
    with pytest.raises(ValueError, match="entry_point"):
        parse_tests({"test_code": "def check(c): pass"})
    with pytest.raises(ValueError, match="must hold JSON"):
        parse_tests("not json")
