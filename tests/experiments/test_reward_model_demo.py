"""The reward-model demonstration: its script's policy samples are read from both formats a run writes and
refused by file and line otherwise; at CI size the warm start, its samples, two rounds of reward models and
GSPO runs train through the real CLI, and ``report`` draws the figure and rewrites the docs block."""
import json
from pathlib import Path

import pytest

from gspo_megatron.testing.experiment_runs import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "experiments" / "reward_model_demo.py"
MAKE_RM = REPO / "examples" / "make_demo_reward_model.py"


def _dataset():
    from gspo_megatron.data.dataset import load_prompt_datasets
    from gspo_megatron.trainer.components import load_tokenizer
    from gspo_megatron.trainer.config import load_config

    config = load_config(REPO / "examples" / "cpu_demo_reward_model.yaml")
    return config, load_prompt_datasets(config.data, load_tokenizer(config.model))[0]


def test_policy_samples_are_read_from_completions_and_eval_outputs_and_labelled_by_the_verifier(tmp_path):
    make_rm = load_script(MAKE_RM)
    _, train_set = _dataset()
    first, second = train_set[0], train_set[1]
    completions = tmp_path / "completions.jsonl"
    completions.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "prompt": first.prompt_text, "answer": str(first.answer), "response": str(first.answer), "reward": 1},
        {"step": 2, "prompt": first.prompt_text, "answer": str(first.answer), "response": str(first.answer), "reward": 1},
    ]))
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text(json.dumps({"prompt": second.prompt_text, "answer": str(second.answer), "greedy": "9 9",
                                   "greedy_reward": 0.0, "samples": [str(second.answer), "9 9"]}) + "\n")
    pairs = make_rm.policy_pairs([completions, outputs], train_set)
    # the repeated pair is kept once; the greedy response and the samples are all read
    assert [(m["prompt_text"], r) for m, r in pairs] == [(first.prompt_text, str(first.answer)),
                                                        (second.prompt_text, "9 9"),
                                                        (second.prompt_text, str(second.answer))]
    from gspo_megatron.rewards.synthetic import synthetic_reward
    assert [synthetic_reward(m, r).correct for m, r in pairs] == [True, False, True]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(completions.read_text() + json.dumps({"prompt": "sort 1 2 x", "response": "1"}) + "\n")
    with pytest.raises(SystemExit, match=f"{bad}:3: prompt 'sort 1 2 x' is not a training prompt"):
        make_rm.policy_pairs([bad], train_set)


@pytest.mark.slow
def test_reward_model_demo_pipeline_at_ci_scale(tmp_path):
    driver = load_script(SCRIPT)
    results = tmp_path / "results.json"
    driver.main(["run", "--scale", "ci", "--out", str(tmp_path / "runs"), "--results", str(results)])
    data = json.loads(results.read_text())
    assert sorted(data["rounds"]) == ["0", "1"] and data["seeds"] == {}
    rm0, rm1 = data["reward_models"]["0"], data["reward_models"]["1"]
    # round 1's reward model also trained on what round 0's policy wrote: one response per prompt per step,
    # less any it had already (each distinct pair counts once)
    steps, prompts = 2, 4
    assert 0 < rm1["policy_samples"] - rm0["policy_samples"] <= steps * prompts
    assert rm0["policy_samples"] > 0  # the warm start's samples, from gspo-megatron eval --outputs
    for run in data["rounds"].values():
        assert run["steps"] == [0, 1, 2] and all(v is not None for v in run["reward_mean"][1:])
    doc = tmp_path / "page.md"
    doc.write_text(f"before\n{driver.BEGIN}\nold\n{driver.END}\nafter\n")
    driver.main(["report", "--results", str(results), "--figures", str(tmp_path / "fig"), "--doc", str(doc)])
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| 1 | " in text and (tmp_path / "fig" / "score_vs_accuracy.png").stat().st_size > 10_000


def test_the_reward_model_scores_in_the_term_what_its_script_trained_it_on(tmp_path):
    """The script's own forward (its tokenizer, its padding) and the ``reward_model`` term reading the saved
    folder give the same scores. They did not when the folder held a Qwen2 model: transformers 5 then loads
    the folder's tokenizer as ``Qwen2Tokenizer``, which drops the demo text's spaces."""
    import torch
    import transformers

    from gspo_megatron.rewards import RewardConfig, RewardPool
    from gspo_megatron.typed_config import build

    make_rm = load_script(MAKE_RM)
    out = tmp_path / "rm"
    make_rm.main(["--out", str(out), "--steps", "3"])
    config, train_set = _dataset()
    (term,) = [t for t in config.rewards.terms if t.name == "reward_model"]
    pairs = make_rm.candidate_pairs(train_set[:8], __import__("random").Random(0))
    from gspo_megatron.trainer.components import load_tokenizer
    tokenizer = load_tokenizer(config.model)
    rows, _ = make_rm.labelled(pairs, term.reward_model, tokenizer)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    ids, mask = make_rm.padded(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        direct = torch.sigmoid(model(input_ids=ids, attention_mask=mask).logits[:, 0]).tolist()
    rm = {"path": str(out), "chat_template": term.reward_model.chat_template,
          "max_length": term.reward_model.max_length, "normalize": term.reward_model.normalize}
    with RewardPool(build(RewardConfig, {"terms": [{"name": "reward_model", "reward_model": rm}], "num_workers": 0},
                          "rewards")) as pool:
        scored, _ = pool.score(pairs)
    assert scored == pytest.approx(direct, abs=1e-5)
    assert max(direct) - min(direct) > 1e-4  # the scores differ between responses: equal ones would prove nothing


def test_a_folder_whose_tokenizer_loads_differently_is_not_saved(tmp_path):
    """The upstream fact behind the Qwen3 choice (transformers 5.25, tokenization_auto.py
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): the demo tokenizer saved beside a ``qwen2`` config loads as
    ``Qwen2Tokenizer`` and splits "sort 8 4 2" otherwise; ``save_model_folder`` refuses such a folder, naming it."""
    import transformers

    from gspo_megatron.data.tokenizer import demo_tokenizer_path
    from gspo_megatron.testing.experiment_runs import save_model_folder

    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_tokenizer_path())
    tiny = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(SystemExit, match=r"qwen2_rm: the saved folder's tokenizer \(Qwen2Tokenizer\) splits 'sort 8 4 2'"):
        save_model_folder(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**tiny)), tokenizer, {},
                          tmp_path / "qwen2_rm", ["sort 8 4 2"])
    assert not (tmp_path / "qwen2_rm").exists()
    save_model_folder(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**tiny)), tokenizer, {"x": 1},
                      tmp_path / "qwen3_rm", ["sort 8 4 2"])
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "qwen3_rm")("sort 8 4 2") == tokenizer("sort 8 4 2")


def test_candidates_include_sorted_answers_with_other_digits():
    """The near misses a policy finds first when rewarded for looking sorted (digits in order, not the prompt's)
    are in the reward model's data, labelled wrong: one digit off by one, each way, then sorted."""
    import random

    from gspo_megatron.rewards.synthetic import synthetic_reward

    make_rm = load_script(MAKE_RM)
    answer = "2 4 8"
    texts = [t.removesuffix(make_rm.EOS) for t in make_rm.candidates(answer, random.Random(0))]
    sorted_wrong = {t for t in texts if t.split() == sorted(t.split()) and len(t.split()) == 3 and t != answer}
    sums = {sum(map(int, t.split())) for t in sorted_wrong}
    assert {13, 15} <= sums  # 14 - 1 and 14 + 1: a digit off by one each way
    mapping = {"prompt": "sort 8 2 4", "answer": answer, "meta": {"difficulty": 1, "task": "sort"}}
    assert not any(synthetic_reward(mapping, t).correct for t in sorted_wrong)
    assert synthetic_reward(mapping, answer).correct
