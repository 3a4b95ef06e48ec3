"""Settings that used to pass the start-up checks and then fail late, run unbounded or be silently ignored
(issue 45, "Unclear, slow or unguarded"): each is refused by ``load_config`` naming its field, and ``train``
exits 2 on it before anything is built."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gspo_megatron.trainer.config import load_config
from gspo_megatron.typed_config import ConfigError
from tests.reliability.helpers import DEMO, REPO

TOOL_DEMO = REPO / "examples" / "cpu_tool_demo.yaml"

REFUSED = {
    "auto routing replay with tools": (TOOL_DEMO, ["train.routing_replay=auto"],
                                       "train.routing_replay: auto is not supported with rollout.multi_turn"),
    "a tool timeout beyond an hour": (TOOL_DEMO, ["rollout.multi_turn.tool_timeout_s=1e12"],
                                      "rollout.multi_turn.tool_timeout_s: must be in (0, 3600]"),
    "a million generation rounds": (DEMO, ["rollout.filter_groups=zero_variance", "rollout.max_generation_rounds=1000000"],
                                    "rollout.max_generation_rounds: must be in 1..64"),
    "partial rollouts with tools": (TOOL_DEMO, ["rollout.partial=true", "rollout.partial_token_budget=8",
                                                "rollout.logprobs_from=engine"],
                                    "rollout.multi_turn: is refused with rollout.partial: a trajectory's tool turns"),
    "a traces module that does not import": (TOOL_DEMO, ["sft.traces=nosuchmod:trace"],
                                             "sft.traces: cannot import module 'nosuchmod'"),
    "a traces function that does not exist": (TOOL_DEMO, ["sft.traces=gspo_megatron.data.tool_traces:nosuch"],
                                              "sft.traces: 'gspo_megatron.data.tool_traces' has no callable 'nosuch'"),
    "a partial budget without partial": (DEMO, ["rollout.partial_token_budget=4"],
                                         "rollout.partial_token_budget: has no effect without rollout.partial: true"),
    "an overlong buffer with overlong: mask": (DEMO, ["rollout.overlong=mask", "rollout.overlong_buffer_tokens=4"],
                                               "rollout.overlong_buffer_tokens: has no effect with rollout.overlong: mask"),
}


@pytest.mark.parametrize("config, overrides, message", list(REFUSED.values()), ids=list(REFUSED))
def test_a_setting_that_would_fail_late_or_be_ignored_is_refused_at_start_up(config, overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(config, overrides)


def test_train_exits_2_naming_a_bad_traces_module(tmp_path):
    """The warm start imported ``sft.traces`` only once the model was built: a typo was a traceback (exit 1)."""
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(TOOL_DEMO), "--run-dir",
                           str(tmp_path / "run"), "sft.traces=nosuchmod:trace"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "sft.traces: cannot import module 'nosuchmod'" in proc.stderr
