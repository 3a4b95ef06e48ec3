"""Verifiers and the reward worker pool (see docs/rewards.md).

Public API (what the trainer calls):
  RewardConfig, RewardTermConfig            the ``rewards:`` config section
  RewardPool(cfg) / build_reward_pool(cfg)  ``.score([(sample, response), ...]) -> (rewards, metrics)``
  math_reward, code_reward, synthetic_reward built-in verifiers (sample, response) -> Verdict
  run_in_sandbox, probe_isolation           the code sandbox
  synthetic                                 generated verifiable tasks (TaskSpec, make_splits, ...)

Importing this package loads neither torch nor sympy (math-verify is imported by the math term).
"""
from gspo_megatron.rewards.code import CodeRewardConfig, code_reward, extract_code, parse_tests
from gspo_megatron.rewards.config import RewardConfig, RewardTermConfig
from gspo_megatron.rewards.math import MathRewardConfig, answers_equivalent, extract_answer, math_reward
from gspo_megatron.rewards.pool import RewardPool, build_reward_pool
from gspo_megatron.rewards.sandbox import SandboxConfig, SandboxUnavailable, probe_isolation, run_in_sandbox
from gspo_megatron.rewards.synthetic import Problem, TaskSpec, make_splits, sft_pairs, synthetic_reward
from gspo_megatron.rewards.terms import RewardSetupError
from gspo_megatron.rewards.types import Verdict

__all__ = [
    "CodeRewardConfig", "MathRewardConfig", "Problem", "RewardConfig", "RewardPool", "RewardSetupError",
    "RewardTermConfig", "SandboxConfig", "SandboxUnavailable", "TaskSpec", "Verdict", "answers_equivalent",
    "build_reward_pool", "code_reward", "extract_answer", "extract_code", "make_splits", "math_reward",
    "parse_tests", "probe_isolation", "run_in_sandbox", "sft_pairs", "synthetic_reward",
]
