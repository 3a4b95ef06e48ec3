"""On-policy distillation end to end: a teacher of another shape and family (a tiny dense Qwen3 saved with
transformers' own classes, beside the demo's Qwen3-MoE student) gives per-token log-probs of the student's
samples; a run trains on the term, logs the distillation KL and resumes exactly. A teacher that cannot read
the student's token ids, or cannot take the student's layout, is refused naming the field."""
import shutil
import signal
from pathlib import Path

import pytest

from gspo_megatron.data.tokenizer import demo_tokenizer_path
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.parallel import ParallelConfig
from gspo_megatron.trainer.config import check_layout
from gspo_megatron.trainer.teacher import check_same_vocabulary, teacher_source
from gspo_megatron.typed_config import ConfigError

from tests.runs import DEMO, kill_after_checkpoint, train

STUDENT_VOCAB = 100  # examples/cpu_demo.yaml model.config.vocab_size


def save_teacher(folder: Path, vocab_size: int = STUDENT_VOCAB, heads: int = 2, tokenizer: Path | None = None,
                 favourite: int | None = None, kv_heads: int = 1) -> Path:
    """A tiny dense Qwen3 (another family and width than the demo's MoE student) saved by transformers,
    with the demo tokenizer (or ``tokenizer``'s files) beside it; ``favourite``: see ``prefer_one_token``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=24, max_position_embeddings=128,
                         rope_theta=10000.0, tie_word_embeddings=False, dtype="float32")
    model = Qwen3ForCausalLM(config).to(torch.float32)
    if favourite is not None:
        prefer_one_token(model, favourite)
    model.save_pretrained(folder)
    for file in Path(tokenizer or demo_tokenizer_path()).iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def prefer_one_token(model, token: int, logit: float = 6.0) -> None:
    """Weights that make the teacher give token ``token`` logit ``logit`` and every other token 0 in every
    context (p = e^6 / (e^6 + 99) = 0.80 over 100 tokens): every embedding is the first unit vector, the
    layers add nothing to the residual stream, and only the favourite's output row reads it. A teacher the
    near-uniform random student is far from (about 1.6 nats of reverse KL) and can approach in a few steps."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()[:, 0] = 1.0
        model.model.norm.weight.fill_(1.0)  # RMSNorm of the unit vector: sqrt(hidden_size) in dimension 0
        model.lm_head.weight.zero_()[token, 0] = logit / model.config.hidden_size ** 0.5


def student_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_tokenizer_path())


def test_teacher_of_another_family_and_width_is_read_and_accepted(tmp_path):
    source = teacher_source(save_teacher(tmp_path / "teacher"))
    assert source.kind == "hf" and source.model_config.architecture == "qwen3"
    assert source.model_config.hidden_size == 48 and not source.model_config.is_moe
    check_same_vocabulary(source, ModelConfig(vocab_size=STUDENT_VOCAB), student_tokenizer())


def test_teacher_with_another_vocabulary_size_is_refused_by_name(tmp_path):
    source = teacher_source(save_teacher(tmp_path / "teacher", vocab_size=STUDENT_VOCAB + 28))
    with pytest.raises(ConfigError, match=r"distill\.teacher_dir: the teacher's vocabulary has 128 entries, the "
                                          r"student's 100"):
        check_same_vocabulary(source, ModelConfig(vocab_size=STUDENT_VOCAB), student_tokenizer())


def test_teacher_with_another_tokenizer_of_the_same_size_is_refused_by_name(tmp_path):
    import json

    other = tmp_path / "other_tokenizer"
    shutil.copytree(demo_tokenizer_path(), other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]  # two tokens swap ids: same size, other token ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    source = teacher_source(save_teacher(tmp_path / "teacher", tokenizer=other))
    with pytest.raises(ConfigError, match=r"distill\.teacher_dir: the teacher's tokenizer .* differs from the student's"):
        check_same_vocabulary(source, ModelConfig(vocab_size=STUDENT_VOCAB), student_tokenizer())


def test_folder_that_is_no_model_and_layout_the_teacher_cannot_take_are_refused_by_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"distill\.teacher_dir: .* is neither a Hugging Face folder"):
        teacher_source(tmp_path / "empty")
    source = teacher_source(save_teacher(tmp_path / "teacher", heads=3))  # 3 heads: TP=2 cannot split them
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel: 2 does not divide distill\.teacher_dir"):
        check_layout(ParallelConfig(tensor_parallel=2), source.model_config,
                     f"distill.teacher_dir {source.folder}:")


@pytest.mark.slow
def test_distillation_trains_logs_the_kl_and_resumes_exactly(tmp_path):
    teacher = save_teacher(tmp_path / "teacher", favourite=20)
    common = ["sft.steps=0", "train.steps=4", "eval.every_steps=2", "eval.num_prompts=8", "eval.pass_k=1",
              "checkpoint.every_steps=2", "train.prompts_per_step=8", "optimizer.lr=0.01",
              f"distill.teacher_dir={teacher}", "distill.only=true"]
    full = train(tmp_path / "full", *common)
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4]
    kl = [m["distill_kl_mean"] for m in full[1:]]
    assert all(k > 0.0 for k in kl)  # two random models of other shapes disagree
    # about 1.6 nats from the near-uniform student (prefer_one_token), then pulled toward the teacher
    assert kl[0] > 1.0 and kl[-1] < 0.5 * kl[0]
    for m in full[1:]:
        assert "distill_loss" in m and "pg_loss" in m  # the GSPO term is still logged under distill.only
    # SIGKILL once step 2's checkpoint exists, resume: exactly the uninterrupted run's metrics (the teacher
    # is loaded again from its folder; its log-probs are a function of the samples)
    assert kill_after_checkpoint(tmp_path / "split", 2, *common) == -signal.SIGKILL
    resumed = train(tmp_path / "split", *common, resume=True)
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(resumed, full):
        for key in ("distill_kl_mean", "distill_loss", "pg_loss", "grad_norm", "reward_mean", "eval_accuracy"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


@pytest.mark.slow
def test_checkpoint_teacher_equal_to_the_student_gives_zero_kl(tmp_path):
    """A training checkpoint as the teacher (its model config and tokenizer from its gspo_meta.json): the
    student's own initial weights, so the first (only) mini-batch's distillation KL is exactly 0."""
    common = ["sft.steps=0", "eval.num_prompts=4", "eval.pass_k=1", "train.prompts_per_step=4"]
    train(tmp_path / "start", "train.steps=0", *common)  # saves step 0: the student's initial weights
    checkpoint = tmp_path / "start" / "checkpoints" / "step_000000"
    source = teacher_source(checkpoint)
    assert source.kind == "checkpoint" and source.model_config.is_moe and source.tokenizer_dir is not None
    run = train(tmp_path / "distilled", "train.steps=1", "train.minibatches_per_step=1", f"distill.teacher_dir={checkpoint}",
                "distill.coef=0.5", *common)
    assert run[1]["distill_kl_mean"] == 0.0 and run[1]["distill_loss"] == 0.0


def teacher_logprobs_against_transformers(rank, world_size, teacher_dir: str, layout: list[str]) -> float:
    """The teacher built as the trainer builds it (the student's layout) against the same folder in
    transformers: the largest |difference| of response-token log-probs over a few sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_megatron.batching import TrainSequence
    from gspo_megatron.megatron.parallel import initialize_model_parallel
    from gspo_megatron.trainer import components as parts
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.teacher import build_teacher

    config = load_config(DEMO, [f"distill.teacher_dir={teacher_dir}", *layout])
    initialize_model_parallel(config.parallel, seed=config.model.init_seed)
    teacher = build_teacher(config, parts.model_config_of(config.model), parts.load_tokenizer(config.model))
    g = torch.Generator().manual_seed(teacher.groups.dp_rank)  # the ranks of one TP group read the same tokens
    seqs = [TrainSequence(torch.randint(0, STUDENT_VOCAB, (n,), generator=g), prompt_len=4) for n in (9, 12, 7)]
    ours = teacher.compute_logprobs(seqs)
    hf = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for q, o in zip(seqs, ours):
            logp = torch.log_softmax(hf(q.tokens[None]).logits[0] / config.rollout.temperature, -1)
            want = logp[q.prompt_len - 1:-1].gather(1, q.tokens[q.prompt_len:, None])[:, 0]
            worst = max(worst, float((o["logprobs"] - want).abs().max()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("layout,kv_heads", [(["parallel.expert_parallel=2"], 1),
                                             (["parallel.tensor_parallel=2"], 2)])
def test_teacher_in_the_students_layout_matches_transformers(tmp_path, layout, kv_heads):
    """EP=2: a dense teacher of the MoE student runs the expert-parallel ranks as data parallel
    (teacher.teacher_parallel); TP=2 (sequence parallel): the teacher's heads split like the student's."""
    from gspo_megatron.megatron.spawn import run_distributed

    teacher = save_teacher(tmp_path / "teacher", kv_heads=kv_heads)
    worst = run_distributed(teacher_logprobs_against_transformers, 2, (str(teacher), layout))
    assert max(worst) < 1e-4, worst


def test_a_teacher_folder_that_does_not_exist_is_refused_by_name(tmp_path):
    from gspo_megatron.trainer.config import check_model_folders, load_config

    config = load_config(DEMO, [f"distill.teacher_dir={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match=r"distill\.teacher_dir: .*missing is not a folder"):
        check_model_folders(config, DEMO)


def test_a_checkpoint_folder_without_a_model_config_is_refused_by_name(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "metadata.json").write_text("{}")
    (folder / "gspo_meta.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"distill\.teacher_dir: .*the model config is unknown"):
        teacher_source(folder)
