"""`convert check`: the transformers model and the Megatron model give the same logits on the same tokens.

Both run in fp32 on the same random token ids; the Megatron model is built at the requested TP/PP/EP
layout (``tp * pp * ep`` gloo/NCCL processes, EP folded into data parallelism), loaded from the
torch_dist checkpoint with ``megatron/checkpoint.load_model``, run forward-only through Megatron's
pipeline schedule, and its vocab-parallel logits gathered over TP. The figure reported is
max |logits_megatron - logits_hf| over every token and vocabulary entry.
"""
from __future__ import annotations

from pathlib import Path

import torch

from gspo_megatron.conversion.dcp_io import check_vocab_rows
from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.offline import export_config
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.parallel import ParallelConfig

DEFAULT_ATOL = 1e-4


def check_tokens(config: ModelConfig, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] fp32 logits of the transformers model in ``hf_dir`` (eager attention)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                              attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits(model, config: ModelConfig, tokens: torch.Tensor) -> torch.Tensor | None:
    """[b, s, vocab] logits through Megatron's schedule (forward only), gathered over TP and unpadded;
    None off the last pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq_len = tokens.shape[1]
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    mask = torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand_as(tokens)
    outputs: list[torch.Tensor] = []

    def forward_step(data_iterator, chunk):
        out = chunk(next(data_iterator), positions, mask)

        def loss_func(logits):
            outputs.append(logits.detach().float())
            return logits.sum() * 0, {}

        return out, loss_func

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
                                    num_microbatches=1, seq_length=seq_len, micro_batch_size=tokens.shape[0],
                                    forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = outputs[0]
    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :config.vocab_size].cpu()


def model_config_for_check(hf_dir: Path, megatron_dir: Path) -> ModelConfig:
    """The Megatron checkpoint's model config, which must be the HF folder's, and whose vocabulary the
    checkpoint must hold (Megatron would zero-fill missing rows without a word: ``check_vocab_rows``)."""
    config, _ = export_config(Path(megatron_dir), Path(hf_dir))
    check_vocab_rows(Path(megatron_dir), config)
    return config


def compare_layouts(rank: int, world_size: int, hf_dir: str, megatron_dir: str, layouts: dict[str, ParallelConfig],
                    seq_len: int = 16, seed: int = 0, reference: torch.Tensor | None = None) -> dict[str, float | None]:
    """Per layout, max |Megatron - transformers| logits on this rank (None off the last stage).

    Runs on every rank of a ``run_distributed`` spawn (or in one process); Megatron's groups are rebuilt
    for each layout so one spawn serves many layouts. ``reference``: the transformers logits of
    ``check_tokens(config, seq_len=seq_len, seed=seed)`` computed once by the caller; None: this rank computes
    them (loading the HF model itself).
    """
    from gspo_megatron.megatron import checkpoint
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.parallel import initialize_model_parallel

    config = model_config_for_check(Path(hf_dir), Path(megatron_dir))
    tokens = check_tokens(config, seq_len=seq_len, seed=seed)
    if reference is None:
        reference = hf_logits(hf_dir, tokens)
    diffs: dict[str, float | None] = {}
    for name, layout in layouts.items():
        initialize_model_parallel(layout)
        model = build_model(config, layout)
        checkpoint.load_model(model, megatron_dir)
        logits = megatron_logits(model, config, tokens)
        diffs[name] = None if logits is None else (logits - reference).abs().max().item()
    return diffs


def run_check(hf_dir: str | Path, megatron_dir: str | Path, tensor_parallel: int = 1, pipeline_parallel: int = 1,
              expert_parallel: int = 1, seq_len: int = 16, seed: int = 0) -> float:
    """Max |logit difference| at one layout, spawning ``tp * pp * ep`` processes when that is > 1."""
    from gspo_megatron.conversion.dcp_io import single_process_megatron
    from gspo_megatron.conversion.tables import validate_layout
    from gspo_megatron.megatron.spawn import run_distributed

    config = model_config_for_check(Path(hf_dir), Path(megatron_dir))
    validate_layout(config, tensor_parallel, pipeline_parallel, expert_parallel)
    layout = ParallelConfig(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                            expert_parallel=expert_parallel)
    world = tensor_parallel * pipeline_parallel * expert_parallel
    # the transformers logits once, here: not one HF model (and one "Loading weights" bar) per rank
    reference = hf_logits(hf_dir, check_tokens(config, seq_len=seq_len, seed=seed))
    args = (str(hf_dir), str(megatron_dir), {"layout": layout}, seq_len, seed, reference)
    if world == 1:
        with single_process_megatron():
            results = [compare_layouts(0, 1, *args)]
    else:
        results = run_distributed(compare_layouts, world, args)
    diffs = [r["layout"] for r in results if r["layout"] is not None]
    if not diffs:
        raise ConversionError("check: no rank produced logits")
    return max(diffs)
