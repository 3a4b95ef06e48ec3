"""TRL-style reward functions (prompts, completions, **columns) run as batched terms."""
import sys

from gspo_megatron.rewards import RewardConfig, RewardPool
from gspo_megatron.typed_config import build

MODULE = '''
from gspo_megatron.rewards.trl import from_trl

def trl_accuracy(prompts, completions, answer, **kwargs):
    assert kwargs["difficulty"] == [1, 2] and "prompt_ids" not in kwargs
    return [float(c.strip() == a) if p.startswith("sort") else None for p, c, a in zip(prompts, completions, answer)]

accuracy = from_trl(trl_accuracy)
'''


def test_trl_reward_function_through_the_pool(tmp_path, monkeypatch):
    name = f"trl_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    cfg = build(RewardConfig, {"terms": [{"name": f"{name}:accuracy", "batched": True}], "num_workers": 0,
                               "import_dirs": [str(tmp_path)]}, "rewards")
    samples = [{"prompt": "sort 3 1 2", "answer": "1 2 3", "meta": {"difficulty": 1}, "prompt_ids": [1]},
               {"prompt": "add 1 1", "answer": "2", "meta": {"difficulty": 2}, "prompt_ids": [2]}]
    try:
        with RewardPool(cfg) as pool:
            rewards, metrics = pool.score([(samples[0], "1 2 3 "), (samples[1], "2")])
    finally:
        sys.modules.pop(name, None)
    assert rewards == [1.0, 0.0] and metrics["rewards/accuracy/errors"] == 0.0
