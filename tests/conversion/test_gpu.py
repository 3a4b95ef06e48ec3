"""On a GPU, with the Transformer Engine spec: a converted checkpoint loads and gives the transformers
logits, and the live export of the TE-spec model returns the HF tensors (TE names translated by
megatron/te_names.py). Skipped without CUDA; it has not run on this project's CPU machines."""
import pytest
import torch

from gspo_megatron.conversion import offline
from gspo_megatron.conversion.check import model_config_for_check, run_check
from tests.conversion.hf_models import make_hf_dir, read_all

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["qwen3_moe", "llama"])
def test_converted_checkpoint_on_the_transformer_engine_spec(tmp_path, name):
    from gspo_megatron.conversion.dcp_io import single_process_megatron
    from gspo_megatron.conversion.export import export_hf_tensors
    from gspo_megatron.megatron import checkpoint
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import ParallelConfig

    hf = make_hf_dir(name, tmp_path / "hf")
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
    assert run_check(hf, meg) < 1e-3  # TE kernels may reorder fp32 sums
    config = model_config_for_check(hf, meg)
    with single_process_megatron():
        model = build_model(config, ParallelConfig())
        checkpoint.load_model(model, meg)
        exported = {n: t.cpu() for bucket in export_hf_tensors(model, config, 2**20) for n, t in bucket}
    reference = read_all(hf)
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
