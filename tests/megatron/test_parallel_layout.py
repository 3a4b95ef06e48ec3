"""ParallelConfig's layout rule is Megatron-Core 0.16.1's (parallel_state.initialize_model_parallel): the dense
grid TP x CP x PP and the expert grid ETP x EP x PP must each divide the world; expert_tensor_parallel (null:
TP) reaches Megatron's process groups and its TransformerConfig."""
import re
from pathlib import Path

import pytest

from gspo_megatron.megatron.model import transformer_config
from gspo_megatron.megatron.parallel import ParallelConfig
from gspo_megatron.testing.models import tiny_moe_config
from gspo_megatron.trainer.config import load_config
from gspo_megatron.typed_config import ConfigError

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"


def test_tp4_ep8_with_whole_experts_fits_one_node_of_eight():
    """The one-node Qwen3-30B-A3B layout: dense TP4 x DP2, experts ETP1 x EP8 over the same 8 ranks."""
    layout = ParallelConfig(tensor_parallel=4, expert_parallel=8, expert_tensor_parallel=1)
    assert layout.data_parallel(8) == 2
    assert layout.expert_data_parallel(8) == 1
    assert ParallelConfig(tensor_parallel=4, expert_parallel=8, expert_tensor_parallel=1).data_parallel(32) == 8


@pytest.mark.parametrize("etp, hint", [
    (4, ""), (None, "; expert_tensor_parallel is null, which means tensor_parallel=4: 1 keeps each expert whole")])
def test_tp4_ep8_with_experts_split_over_tp_needs_32_ranks(etp, hint):
    """ETP4 x EP8 = 32 expert ranks: Megatron's default (ETP = TP) cannot start on 8 GPUs."""
    layout = ParallelConfig(tensor_parallel=4, expert_parallel=8, expert_tensor_parallel=etp)
    message = ("parallel.expert_tensor_parallel x expert_parallel x pipeline_parallel = 4 x 8 x 1 = 32 must divide "
               f"the world size 8 (Megatron's expert grid{hint})")
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        layout.data_parallel(8)
    assert layout.data_parallel(32) == 8 and layout.expert_data_parallel(32) == 1


@pytest.mark.parametrize("sizes, world, dp, expert_dp", [
    (dict(expert_parallel=2), 2, 2, 1),  # EP folded into DP
    (dict(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1), 2, 1, 1),  # EP across the TP ranks
    (dict(tensor_parallel=2, expert_parallel=2), 4, 2, 1),  # ETP2 x EP2 over TP2 x DP2
    (dict(context_parallel=2, expert_parallel=2), 2, 1, 1),  # EP folded into CP
    (dict(pipeline_parallel=2, tensor_parallel=2, expert_parallel=4, expert_tensor_parallel=1), 8, 2, 1),
    (dict(tensor_parallel=2, expert_tensor_parallel=1), 4, 2, 4),  # whole experts, replicated over 4 ranks
])
def test_dense_and_expert_data_parallel_sizes(sizes, world, dp, expert_dp):
    layout = ParallelConfig(**sizes)
    assert (layout.data_parallel(world), layout.expert_data_parallel(world)) == (dp, expert_dp)


def test_expert_tensor_parallel_is_validated_and_reaches_megatron_config():
    with pytest.raises(ConfigError, match=r"^parallel\.expert_tensor_parallel: must be >= 1 \(or null"):
        load_config(DEMO, ["parallel.expert_tensor_parallel=0"])
    assert load_config(DEMO).parallel.expert_tensor_parallel is None
    model = tiny_moe_config()
    assert transformer_config(model, ParallelConfig(tensor_parallel=2)).expert_tensor_parallel_size == 2
    assert transformer_config(model, ParallelConfig(tensor_parallel=2, expert_tensor_parallel=1)
                              ).expert_tensor_parallel_size == 1


def test_the_expert_ffn_is_split_by_expert_tensor_parallel():
    """Each expert's FFN splits over ETP, not TP: an FFN of 63 fits TP2 with whole experts only."""
    overrides = ["parallel.tensor_parallel=2", "model.config.moe_ffn_hidden_size=63"]
    assert load_config(DEMO, overrides + ["parallel.expert_tensor_parallel=1"]).parallel.expert_tensor_parallel == 1
    with pytest.raises(ConfigError, match=r"^parallel\.expert_tensor_parallel: 2 \(null: tensor_parallel\) does not "
                                          r"divide model\.config\.moe_ffn_hidden_size=63"):
        load_config(DEMO, overrides)
