"""Spawned-rank functions of tests/conversion/test_vocab_padding.py (module-level so spawn can import them)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gspo_megatron.algorithms.config import LossConfig
from gspo_megatron.batching import split_for_data_parallel
from gspo_megatron.conversion.check import compare_layouts, model_config_for_check
from gspo_megatron.conversion.export import export_hf_tensors
from gspo_megatron.conversion.tables import VOCAB_PARAMS
from gspo_megatron.megatron import checkpoint, sharding
from gspo_megatron.megatron.optimizer import OptimizerConfig
from gspo_megatron.megatron.parallel import initialize_model_parallel
from gspo_megatron.megatron.policy_model import PolicyModel
from tests.conversion.workers import LAYOUTS, _export
from tests.megatron.train_workers import make_sequences


def hf_token_logprobs(hf_dir: str, seqs) -> list[dict[str, torch.Tensor]]:
    """Per sequence, the response tokens' log-probs and entropies under the transformers model (fp32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for q in seqs:
            logsm = torch.log_softmax(model(input_ids=q.tokens[None]).logits[0].float(), dim=-1)
            p, n = q.prompt_len, q.tokens.numel()
            rows = logsm[p - 1:n - 1]
            out.append({"logprobs": rows.gather(1, q.tokens[p:n, None]).squeeze(1),
                        "entropy": -(rows.exp() * rows).sum(-1)})
    return out


def _max_diff(ours: list[dict], theirs: list[dict], key: str) -> float:
    return max((a[key] - b[key]).abs().max().item() for a, b in zip(ours, theirs))


def padding_rows(module, vocab_size: int) -> dict[str, dict]:
    """Per vocabulary parameter held here: this rank's rows at or beyond ``vocab_size`` (how many, and
    the largest |value| among them), from the rank's TP slice [tp_rank * V_local, (tp_rank + 1) * V_local)."""
    out = {}
    for info, param in sharding.shard_infos(module):
        if info.canonical_name not in VOCAB_PARAMS:
            continue
        rows = param.shape[0]
        first_padding = max(0, min(rows, vocab_size - info.tp_rank * rows))
        padding = param.detach()[first_padding:]
        out[info.canonical_name] = {"rows": rows, "padding": padding.shape[0],
                                    "max_abs": padding.abs().max().item() if padding.numel() else 0.0}
    return out


def _frozen_policy(config, layout: str, megatron_dir: str) -> PolicyModel:
    initialize_model_parallel(LAYOUTS[layout])
    policy = PolicyModel(config, LAYOUTS[layout], OptimizerConfig(), LossConfig(), frozen=True)
    checkpoint.load_model(policy.module, megatron_dir)
    return policy


def padded_checks(rank: int, world_size: int, cases: list[tuple[str, str, str, list[str]]]) -> dict:
    """Per case (label, HF folder, converted folder, layouts) and layout: the `convert check` logits
    difference, the live export against the HF tensors, the padding rows of this rank, and the log-probs
    and entropies of PolicyModel.compute_logprobs against the transformers model."""
    results: dict = {}
    for label, hf_dir, megatron_dir, layouts in cases:
        config = model_config_for_check(Path(hf_dir), Path(megatron_dir))
        seqs = make_sequences(config)
        reference = hf_token_logprobs(hf_dir, seqs)
        case = {"logits": compare_layouts(rank, world_size, hf_dir, megatron_dir, {n: LAYOUTS[n] for n in layouts})}
        for layout in layouts:
            policy = _frozen_policy(config, layout, megatron_dir)
            ours = policy.compute_logprobs(seqs, with_entropy=True)
            case[layout] = {"export": _export(hf_dir, megatron_dir, layout),
                            "padding": padding_rows(policy.module, config.vocab_size),
                            "logprob_diff": _max_diff(ours, reference, "logprobs"),
                            "entropy_diff": _max_diff(ours, reference, "entropy")}
        results[label] = case
    return results


def train_and_export(rank: int, world_size: int, megatron_dir: str, layout: str, steps: int, out_dir: str) -> dict:
    """Load the converted checkpoint into a PolicyModel at ``layout``, take ``steps`` GSPO steps, then:
    the padding rows of this rank, the live export (HF tensors), the log-probs and entropies of the
    trained model, and a checkpoint saved to ``out_dir`` (with its model config) for the offline export."""
    from megatron.core import parallel_state as ps

    config = model_config_for_check(Path(megatron_dir) / "hf", Path(megatron_dir))
    initialize_model_parallel(LAYOUTS[layout], seed=0)
    policy = PolicyModel(config, LAYOUTS[layout], OptimizerConfig(lr=1e-2), LossConfig())
    checkpoint.load_model(policy.module, megatron_dir)
    seqs = make_sequences(config)
    metrics = []
    for _ in range(steps):
        for q, old in zip(seqs, policy.compute_logprobs(seqs)):
            q.old_logprobs = old["logprobs"] + 0.002  # ratios != 1: a non-zero gradient
        mine = split_for_data_parallel(seqs, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
        metrics.append(policy.train_minibatch(mine))
    exported = {name: t for bucket in export_hf_tensors(policy.module, config, bucket_bytes=1 << 20)
                for name, t in bucket}
    trained = policy.compute_logprobs(seqs, with_entropy=True)
    checkpoint.save_model(policy.module, out_dir, common={"model_config": dataclasses.asdict(config)})
    return {"metrics": metrics, "padding": padding_rows(policy.module, config.vocab_size),
            "export": exported if rank == 0 else None, "seqs": seqs, "trained": trained}
