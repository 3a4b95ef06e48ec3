"""Model terms through the real reward pool: a tiny random Qwen2 sequence-classification reward model and a tiny
random Qwen2 generative judge, saved with transformers' own classes and the demo tokenizer, scored with 0 and 1
workers. The reward model's scores must equal its own unbatched forward; the judge's random verdicts check
parsing, batching and failure counts; bad folders, templates and rules are refused naming their field."""
import shutil

import pytest
import torch
import transformers

from gspo_megatron.data.tokenizer import demo_tokenizer_path
from gspo_megatron.rewards import RewardConfig, RewardPool
from gspo_megatron.rewards.terms import RewardSetupError
from gspo_megatron.rewards.verdicts import parse_verdict
from gspo_megatron.typed_config import ConfigError, build

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=2)
SAMPLES = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "3+40=", "answer": "43"}]
RESPONSES = ["19", "20", "a much longer response to pad the batch: 19", "", "43", "4 3"]
BATCH = [(SAMPLES[i % 2], r) for i, r in enumerate(RESPONSES)]


def _save(model, folder):
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = f"{demo_tokenizer_path()}/{f}"
        if __import__("os").path.exists(src):
            shutil.copy(src, folder / f)
    return str(folder)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**TINY, num_labels=1)
    return _save(transformers.Qwen2ForSequenceClassification(config), tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    torch.manual_seed(1)
    return _save(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)), tmp_path_factory.mktemp("judge"))


def _rewards(terms, workers=0, **extra):
    return build(RewardConfig, {"terms": terms, "num_workers": workers, "startup_timeout_s": 300, **extra}, "rewards")


def _own_scores(folder, texts):
    """The model's own forward, one text at a time (no padding): what the term must reproduce."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])).logits[0, 0].item()
                for t in texts]


def _chat(folder, sample, response):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template([{"role": "user", "content": sample["prompt"]},
                                    {"role": "assistant", "content": response}], tokenize=False)


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_model_scores_equal_its_own_forward(reward_model, workers):
    term = {"name": "reward_model", "range": [-100, 100],
            "reward_model": {"path": reward_model, "batch_size": 4}}  # 6 responses: a full and a partial batch
    with RewardPool(_rewards([term], workers)) as pool:
        scores = pool.score_verdicts(BATCH)
    expected = _own_scores(reward_model, [_chat(reward_model, s, r) for s, r in BATCH])
    assert scores.rewards == pytest.approx(expected, abs=1e-5)
    assert len(set(round(x, 6) for x in expected)) == len(expected)  # distinct texts, distinct scores
    assert scores.metrics["rewards/reward_model/errors"] == 0
    assert scores.correct == [None] * len(BATCH)  # a preference score judges no correctness


def test_reward_model_normalisation_truncation_and_plain_text(reward_model):
    sample = {"prompt": "12+7=", "prompt_text": "Q: 12+7=", "answer": "19"}
    term = {"name": "reward_model", "reward_model": {"path": reward_model, "chat_template": False,
                                                     "normalize": "sigmoid", "max_length": 6}}
    long, short = "0123456789", "19"
    with RewardPool(_rewards([term])) as pool:
        left = pool.score_verdicts([(sample, long), (sample, short)])
    # "Q: 12+7=" + response, its last 6 tokens (one character each)
    raw = _own_scores(reward_model, [("Q: 12+7=" + long)[-6:], ("Q: 12+7=" + short)[-6:]])
    assert left.rewards == pytest.approx(torch.sigmoid(torch.tensor(raw)).tolist(), abs=1e-5)
    term["reward_model"]["truncation"] = "error"
    with RewardPool(_rewards([term])) as pool:
        cut = pool.score_verdicts([(sample, long), (sample, short)])
    assert cut.metrics["rewards/reward_model/errors"] == 2  # both texts exceed 6 tokens
    term["reward_model"]["max_length"] = 10
    with RewardPool(_rewards([term])) as pool:
        one = pool.score_verdicts([(sample, long), (sample, short)])
    assert one.metrics["rewards/reward_model/errors"] == 1  # only the long one: the short one scores
    assert one.rewards[1] == pytest.approx(torch.sigmoid(torch.tensor(_own_scores(reward_model, ["Q: 12+7=19"])[0])).item(),
                                           abs=1e-5)


def test_bad_reward_model_folders_are_refused_by_name(reward_model, judge_model, tmp_path):
    def refused(rm, **term):
        with pytest.raises((RewardSetupError, ConfigError)) as err:
            RewardPool(_rewards([{"name": "reward_model", "reward_model": rm, **term}]))
        return str(err.value)

    assert "rewards.terms[0].reward_model.path" in refused({"path": str(tmp_path / "none")}, range=[0, 1])
    assert "no score head" in refused({"path": judge_model}, range=[0, 1])
    torch.manual_seed(0)
    two = _save(transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**TINY, num_labels=2)),
                tmp_path / "two")
    assert "rewards.terms[0].reward_model.label: the model" in refused({"path": two}, range=[0, 1])
    assert "rewards.terms[0].range" in refused({"path": reward_model})  # raw logits with no declared range
    assert "rewards.terms[0].reward_model" in refused(None, range=[0, 1])
    with RewardPool(_rewards([{"name": "reward_model", "reward_model": {"path": two, "label": 1,
                                                                        "normalize": "softmax"}}])) as pool:
        probs = pool.score_verdicts(BATCH).rewards
    assert all(0 < p < 1 for p in probs)


JUDGE_TEMPLATE = "Question: {prompt}\nAnswer: {response}\nReference: {answer}\nVerdict (yes/no):"


@pytest.mark.parametrize("workers", [0, 1])
def test_judge_verdicts_are_parsed_batched_and_failures_counted(judge_model, workers):
    from gspo_megatron.rewards.config import JudgeConfig
    from gspo_megatron.rewards.scoring_models import JudgeTerm, judge_prompt_ids

    judge = {"path": judge_model, "template": JUDGE_TEMPLATE, "pattern": "([0-9])", "test_verdict": "score 7",
             "max_new_tokens": 8, "batch_size": 4}
    with RewardPool(_rewards([{"name": "judge", "range": [0, 9], "judge": judge}], workers)) as pool:
        scores = pool.score_verdicts(BATCH)
    # the same judge, one response at a time: its greedy verdicts do not depend on the batch
    direct = JudgeTerm(build(JudgeConfig, judge, "judge"), "judge")
    texts = [direct.verdicts([judge_prompt_ids(direct.tokenizer, direct.cfg, s, r)])[0] for s, r in BATCH]
    parsed = [parse_verdict(direct.cfg, t) for t in texts]
    assert scores.rewards == [0.0 if p is None else p for p in parsed]
    assert scores.metrics["rewards/judge/errors"] == sum(p is None for p in parsed)
    assert scores.metrics["rewards/judge/timeouts"] == 0


def test_judge_malformed_verdicts_are_counted_failures(judge_model):
    # a rule its random verdicts cannot match (the demo tokenizer has no token for it): every response fails,
    # counted, and nothing raises
    judge = {"path": judge_model, "template": "{response}", "labels": {"<<GOOD>>": 1.0, "<<BAD>>": 0.0},
             "test_verdict": "... <<GOOD>>", "max_new_tokens": 4}
    with RewardPool(_rewards([{"name": "judge", "judge": judge}])) as pool:
        scores = pool.score_verdicts(BATCH)
    assert scores.metrics["rewards/judge/errors"] == len(BATCH)
    assert "malformed verdict" in pool.first_failures["judge"]
    assert scores.correct == [False] * len(BATCH)


@pytest.mark.parametrize("judge, field, message", [
    ({"template": "Grade this.", "pattern": "([0-9])", "test_verdict": "7"}, "template", "{response}"),
    ({"template": "{response} {reason}", "pattern": "([0-9])", "test_verdict": "7"}, "template", "'reason'"),
    ({"template": "{response}", "pattern": "Score: ([0-9]+)", "test_verdict": "I give it 7"}, "test_verdict",
     "finds no verdict"),
    ({"template": "{response}", "labels": {"yes": 1.0, "no": 0.0}, "test_verdict": "nope"}, "test_verdict",
     "finds no verdict"),
    ({"template": "{response}", "pattern": "[0-9]", "test_verdict": "7"}, "pattern", "group"),
    ({"template": "{response}", "test_verdict": "7"}, "pattern", "exactly one"),
])
def test_bad_judge_configs_are_refused_by_field(judge, field, message):
    with pytest.raises(ConfigError) as err:
        _rewards([{"name": "judge", "range": [0, 9], "judge": {"path": "/nowhere", **judge}}])
    assert f"rewards.terms[0].judge.{field}" in str(err.value) and message in str(err.value)


def test_verdict_rule_reads_the_last_match_and_whole_labels():
    from gspo_megatron.rewards.config import JudgeConfig

    labels = build(JudgeConfig, {"path": "x", "template": "{response}", "labels": {"correct": 1.0, "incorrect": 0.0},
                                 "test_verdict": "correct"}, "judge")
    assert parse_verdict(labels, "it looks correct at first, but it is incorrect") == 0.0
    assert parse_verdict(labels, "incorrectly formatted") is None
    number = build(JudgeConfig, {"path": "x", "template": "{response}", "pattern": r"Score: (\S+)",
                                 "test_verdict": "Score: 3"}, "judge")
    assert parse_verdict(number, "Score: 3 ... Score: 8") == 8.0
    assert parse_verdict(number, "Score: high") is None and parse_verdict(number, "Score: nan") is None


@pytest.mark.slow
def test_a_training_run_with_a_failing_judge_continues_and_logs_its_failures(judge_model, tmp_path):
    """The demo trains 2 steps with the synthetic verifier and a judge (weight 0) whose random verdicts the
    rule never parses: every judged response is a counted failure, the run goes on to its end."""
    import json
    import subprocess

    from tests.reliability.helpers import REPO, tagged_env, train_command

    judge = (f"{{name: judge, weight: 0.0, judge: {{path: '{judge_model}', template: '{{response}}', "
             f"labels: {{'<<GOOD>>': 1.0, '<<BAD>>': 0.0}}, test_verdict: '<<GOOD>>', max_new_tokens: 4}}}}")
    run_dir = tmp_path / "run"
    env, _ = tagged_env()
    proc = subprocess.run(train_command(run_dir, "train.steps=2", "sft.steps=0", "eval.every_steps=0",
                                        "checkpoint.every_steps=0", f"rewards.terms=[{{name: synthetic}}, {judge}]"),
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/judge/errors" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["reward/judge/errors"] == m["reward/responses"] > 0
    # the fault counter (which also counts the start-up evaluation's judged responses) grows by each step's failures
    assert steps[1]["faults/reward_failures"] - steps[0]["faults/reward_failures"] == steps[1]["reward/responses"]


def test_model_folders_in_a_config_file_are_relative_to_it(tmp_path):
    from gspo_megatron.trainer.config import load_config
    from tests.trainer.test_user_config import _user_config

    terms = [{"name": "synthetic"},
             {"name": "reward_model", "key": "rm", "reward_model": {"path": "rm", "normalize": "tanh"}},
             {"name": "judge", "judge": {"path": "judge", "tokenizer": "tok", "template": "{response}",
                                         "labels": {"yes": 1.0, "no": 0.0}, "test_verdict": "yes"}}]
    config = load_config(_user_config(tmp_path / "cfg", rewards={"terms": terms}))
    base = (tmp_path / "cfg").resolve()
    rm, judge = config.rewards.terms[1], config.rewards.terms[2]
    assert rm.reward_model.path == str(base / "rm") and rm.declared_range == (-1.0, 1.0)
    assert (judge.judge.path, judge.judge.tokenizer) == (str(base / "judge"), str(base / "tok"))
    assert judge.declared_range == (0.0, 1.0)


def test_a_verifier_at_weight_0_beside_a_reward_model_gives_correctness(reward_model):
    """The reward model alone judges nothing; the synthetic verifier kept at weight 0 as a monitor decides."""
    sample = {"prompt": "sort 3 1 2", "answer": "1 2 3", "meta": {"task": "sort"}}
    batch = [(sample, "1 2 3"), (sample, "3 2 1")]
    rm = {"name": "reward_model", "reward_model": {"path": reward_model, "normalize": "sigmoid"}}
    with RewardPool(_rewards([rm])) as pool:
        assert pool.score_verdicts(batch).correct == [None, None]
    with RewardPool(_rewards([rm, {"name": "synthetic", "weight": 0.0}])) as pool:
        scores = pool.score_verdicts(batch)
    assert scores.correct == [True, False]
    assert scores.rewards == pytest.approx([scores.metrics["rewards/reward_model/mean"] * 2 - scores.rewards[1],
                                            scores.rewards[1]])  # the monitor adds nothing to the reward
