"""The on-policy distillation teacher (``distill.teacher_dir``): a frozen model beside the KL reference that
gives per-token log-probs of the student's own samples once per step (trainer step 5); the loss term is
``algorithms.losses.distill_penalty`` (docs/algorithms.md, "On-policy distillation").

The teacher may have another shape and family than the student, but must read the same token ids: its
vocabulary size and, where its folder names a tokenizer, that tokenizer's vocabulary must equal the
student's, or the run is refused naming ``distill.teacher_dir``. It runs in the student's parallel layout
(tensor / pipeline / expert / context parallel sizes), which must divide its own dimensions; a layout it
cannot take is refused by name (``check_layout``) rather than given a second set of process groups. A
dense teacher of an MoE student runs the student's expert-parallel ranks as data parallel
(``teacher_parallel``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.typed_config import ConfigError

FIELD = "distill.teacher_dir"


@dataclass(frozen=True)
class TeacherSource:
    """What ``distill.teacher_dir`` holds: ``kind`` hf (a Hugging Face folder) or checkpoint (one of our
    torch_dist checkpoint folders, converted or from training), its model config and the folder of its
    tokenizer (None: none is known; the vocabulary size alone is compared)."""

    folder: Path
    kind: str
    model_config: ModelConfig
    tokenizer_dir: Path | None


def teacher_source(teacher_dir: str | Path) -> TeacherSource:
    """Read the teacher folder's kind, model config and tokenizer folder; a folder that is neither kind is
    refused naming the field."""
    from gspo_megatron.conversion.errors import ConversionError
    from gspo_megatron.conversion.offline import export_config, template_source, tokenizer_source

    folder = Path(teacher_dir)
    if not folder.is_dir():
        raise ConfigError(f"{FIELD}: {folder} is not a folder")
    if (folder / "metadata.json").is_file():  # a dist_checkpointing checkpoint (megatron/checkpoint.py)
        try:  # the conversion's own reading of a checkpoint's model; its error, said of this field
            template, origin = template_source(folder, None)
            config, _ = export_config(folder, None)
        except ConversionError as err:
            raise ConfigError(f"{FIELD}: {err}") from None
        tokenizer, _ = tokenizer_source(folder, template, origin)
        return TeacherSource(folder, "checkpoint", config, tokenizer)
    if (folder / "config.json").is_file():
        return TeacherSource(folder, "hf", ModelConfig.from_hf_dir(folder), folder)
    raise ConfigError(f"{FIELD}: {folder} is neither a Hugging Face folder (config.json) nor a checkpoint folder "
                      "(metadata.json, from gspo-megatron convert hf-to-megatron or a training run)")


def check_same_vocabulary(source: TeacherSource, student: ModelConfig, tokenizer) -> None:
    """The teacher's log-probs are of the student's token ids only if both read the same vocabulary: the
    model's vocabulary size, and the tokenizers' token -> id maps where the teacher's is known."""
    if source.model_config.vocab_size != student.vocab_size:
        raise ConfigError(f"{FIELD}: the teacher's vocabulary has {source.model_config.vocab_size} entries, the "
                          f"student's {student.vocab_size}: distillation needs the student's tokenizer and vocabulary "
                          f"(teacher {source.folder})")
    if source.tokenizer_dir is None:
        return
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(source.tokenizer_dir)).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(f"{FIELD}: the teacher's tokenizer ({source.tokenizer_dir}, {len(theirs)} tokens) differs "
                          f"from the student's ({len(ours)} tokens; first differences {differ}): distillation "
                          "compares log-probs of the same token ids, so the teacher needs the student's tokenizer")


def teacher_parallel(parallel, teacher: ModelConfig):
    """The student's layout as the teacher runs it: unchanged for an MoE teacher; for a dense one, expert
    parallelism 1. Megatron's expert groups are carved out of the data-parallel ranks (parallel_state in
    megatron-core 0.16.1), so a dense model simply runs data-parallel over them, but its TransformerConfig
    refuses expert_model_parallel_size > 1 without experts (transformer_config.py, "num_moe_experts must
    be non None to use expert-parallel")."""
    if teacher.is_moe or parallel.expert_parallel == 1:
        return parallel
    return dataclasses.replace(parallel, expert_parallel=1, expert_tensor_parallel=None)


def build_teacher(config, student: ModelConfig, tokenizer):
    """The frozen teacher PolicyModel in the student's layout with its weights loaded, or None when
    ``distill.teacher_dir`` is unset. Its log-probs are of softmax(logits / rollout.temperature), like the
    student's."""
    from gspo_megatron.megatron import checkpoint as ckpt
    from gspo_megatron.megatron.policy_model import PolicyModel
    from gspo_megatron.trainer import checkpointing
    from gspo_megatron.trainer.config import check_layout

    if not config.distill.enabled:
        return None
    source = teacher_source(config.distill.teacher_dir)
    check_same_vocabulary(source, student, tokenizer)
    parallel = teacher_parallel(config.parallel, source.model_config)
    check_layout(parallel, source.model_config, f"{FIELD} {source.folder}:")
    teacher = PolicyModel(source.model_config, parallel, config.optimizer, config.loss, frozen=True,
                          max_tokens_per_microbatch=config.train.max_tokens_per_microbatch,
                          temperature=config.rollout.temperature, runtime=config.model.runtime)
    if source.kind == "checkpoint":
        ckpt.verify(source.folder)
        checkpointing.load_weights_only(teacher, source.folder)
    else:
        checkpointing.load_hf_weights(teacher, source.model_config, source.folder)
    return teacher
