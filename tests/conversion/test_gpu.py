"""On a GPU: a converted checkpoint loads and gives the transformers logits, and the live export returns the
HF tensors, on the spec ``model.layer_spec`` picks there. ``auto`` (what ``run_check`` builds) is the
Transformer Engine spec only where megatron-core imports TE (its ``HAVE_TE``); on a GPU without TE (the
lent check machine has none) it is the local spec, so the TE spec is tested by its own case, ``te``, which
skips without TE (its export goes through megatron/te_names.py's translation). Skipped without CUDA; it has
not run on this project's CPU machines."""
import pytest
import torch

from gspo_megatron.conversion import offline
from gspo_megatron.conversion.check import model_config_for_check, run_check
from tests.conversion.hf_models import make_hf_dir, read_all

pytestmark = pytest.mark.gpu


def _spec_or_skip(layer_spec: str) -> str:
    """``auto`` resolves on this machine; ``te`` skips where megatron-core has no Transformer Engine."""
    from gspo_megatron.megatron.model import resolve_layer_spec, transformer_engine_available

    if layer_spec == "te" and not transformer_engine_available():
        pytest.skip("megatron-core does not import Transformer Engine here (HAVE_TE is False)")
    return resolve_layer_spec(layer_spec)


@pytest.mark.parametrize("layer_spec", ["auto", "te"])
@pytest.mark.parametrize("name", ["qwen3_moe", "llama"])
def test_converted_checkpoint_loads_and_exports_on_the_gpu(tmp_path, name, layer_spec):
    from gspo_megatron.conversion.dcp_io import single_process_megatron
    from gspo_megatron.conversion.export import export_hf_tensors
    from gspo_megatron.megatron import checkpoint
    from gspo_megatron.megatron.model import ModelRuntime, build_model
    from gspo_megatron.megatron.parallel import ParallelConfig

    spec = _spec_or_skip(layer_spec)
    hf = make_hf_dir(name, tmp_path / "hf")
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
    if layer_spec == "auto":  # run_check builds the auto spec
        assert run_check(hf, meg) < 1e-3  # TE kernels may reorder fp32 sums
    config = model_config_for_check(hf, meg)
    with single_process_megatron():
        model = build_model(config, ParallelConfig(), runtime=ModelRuntime(layer_spec=spec))
        checkpoint.load_model(model, meg)
        exported = {n: t.cpu() for bucket in export_hf_tensors(model, config, 2**20) for n, t in bucket}
    reference = read_all(hf)
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
