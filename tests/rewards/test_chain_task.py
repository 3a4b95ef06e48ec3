"""The ``chain`` synthetic task (multi-step arithmetic with long worked responses): generation is
deterministic and correct, responses are >= 32 tokens of the demo tokenizer at difficulty 3, and the
verifier accepts exactly the well-formed chains that end on the target."""
import pytest

from gspo_megatron.rewards.synthetic import TaskSpec, check_answer, generate, synthetic_reward


def test_generated_chains_are_correct_and_deterministic():
    problems = generate(TaskSpec("chain", 3), 200, seed=4)
    assert [p.prompt for p in problems] == [p.prompt for p in generate(TaskSpec("chain", 3), 200, seed=4)]
    for p in problems:
        value = p.meta["start"]
        for move in p.prompt.split()[2:]:
            value = {"+": value + int(move[1:]), "-": value - int(move[1:]), "*": value * int(move[1:])}[move[0]]
            assert 0 <= value <= 999
        assert value == p.meta["target"] and p.answer.endswith(f"={value}") and len(p.answer.split()) == 6
        assert check_answer(p.meta, p.answer, p.answer) is True


def test_responses_are_long_for_the_demo_tokenizer():
    from transformers import AutoTokenizer

    from gspo_megatron.data.tokenizer import demo_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_path())
    lengths = [len(tokenizer.encode(p.answer, add_special_tokens=False)) for p in generate(TaskSpec("chain", 3), 300, 0)]
    assert min(lengths) >= 32


@pytest.mark.parametrize("answer,verdict", [
    ("7+5=12 12*2=24 24-4=20", True),
    ("7+5=12 12*2=24 24-4=21", False),      # wrong final value
    ("7+5=13 13*2=26 26-6=20", True),       # the steps are checked for form only; the answer is the target
    ("7+5=12 11*2=22 22-2=20", None),       # a step that does not continue the chain
    ("8+4=12 12*2=24 24-4=20", None),       # does not start from the prompt's number
    ("7+5=12  12*2=24", None),              # two spaces
    ("20", None),
    ("", None),
])
def test_verifier(answer, verdict):
    meta = {"task": "chain", "difficulty": 1, "start": 7, "target": 20}
    assert check_answer(meta, "7+5=12 12*2=24 24-4=20", answer) is verdict


def test_reward_reads_the_first_line_up_to_the_end_marker():
    sample = {"answer": "7+5=12 12*2=24 24-4=20", "meta": {"task": "chain", "difficulty": 1, "start": 7, "target": 20}}
    assert synthetic_reward(sample, "7+5=12 12*2=24 24-4=20<|im_end|>junk").reward == 1.0
    assert synthetic_reward(sample, "7+5=12 12*2=24\n24-4=20").reward == 0.0
