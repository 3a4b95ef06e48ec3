"""Terms that score with a model: a sequence-classification reward model and a generative judge.

Both are batched terms ``term(samples, responses) -> list[float | Exception]`` built once per reward worker
(``rewards/terms.py build_term``; or in the trainer's process with ``rewards.num_workers: 0``): the model is
loaded at start-up, on the pool's start-up clock, and each scored batch runs under the batched terms' timeout
and fault containment (a crash or hang costs that batch's scores and is counted). A single response that
cannot be scored (a text longer than ``max_length`` under ``truncation: error``, a verdict the rule cannot
parse) is an Exception in the returned list: that response alone scores 0 and is counted as an error.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch
import transformers

from gspo_megatron.rewards.config import JudgeConfig, RewardModelConfig, template_fields
from gspo_megatron.rewards.types import RewardSetupError
from gspo_megatron.rewards.verdicts import parse_verdict


class VerdictError(ValueError):
    """One response the scoring model could not score (its verdict unparsed, its text too long)."""


def prompt_of(sample: Mapping[str, Any]) -> str:
    """The row's prompt as text: ``prompt``, else the last user message of ``messages``, else ``prompt_text``."""
    if sample.get("prompt") is not None:
        return sample["prompt"]
    users = [m["content"] for m in sample.get("messages") or () if m.get("role") == "user"]
    return users[-1] if users else sample.get("prompt_text") or ""


def _folder(path: str, field: str) -> str:
    if not os.path.isdir(path):
        raise RewardSetupError(f"{field}: {path} is not a folder (a model saved with save_pretrained; Hub names "
                               f"are not downloaded)")
    return path


def _tokenizer(folder: str, field: str, needs_template: bool, template_field: str) -> Any:
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise RewardSetupError(f"{field}: no tokenizer in {folder}: {err}") from err
    if needs_template and not tokenizer.chat_template:
        raise RewardSetupError(f"{template_field}: the tokenizer in {folder} has no chat template; set "
                               f"{template_field}: false to read the plain text")
    return tokenizer


class RewardModelTerm:
    """``AutoModelForSequenceClassification`` scores: one logit per text (``RewardModelConfig``)."""

    def __init__(self, cfg: RewardModelConfig, where: str):
        """where: the config path of the ``reward_model:`` section, for errors (``rewards.terms[0].reward_model``)."""
        self.cfg = cfg
        path = _folder(cfg.path, f"{where}.path")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        heads = [a for a in config.architectures or () if a.endswith("ForSequenceClassification")]
        if not heads:
            raise RewardSetupError(f"{where}.path: {path} holds {config.architectures or 'no architecture'}, not a "
                                   f"sequence-classification model (no score head); save an "
                                   f"AutoModelForSequenceClassification there")
        if config.num_labels > 1 and cfg.label is None:
            raise RewardSetupError(f"{where}.label: the model in {path} has {config.num_labels} labels "
                                   f"({config.id2label}); name the one that is the score (label: INDEX)")
        if cfg.label is not None and not cfg.label < config.num_labels:
            raise RewardSetupError(f"{where}.label: {cfg.label} is not a label of the model in {path} "
                                   f"({config.num_labels} labels)")
        if config.num_labels == 1 and cfg.normalize == "softmax":
            raise RewardSetupError(f"{where}.normalize: 'softmax' needs several labels; the model in {path} has one")
        if config.pad_token_id is None:
            # the classification head pools each row's last non-pad token: a batch cannot be padded without it
            raise RewardSetupError(f"{where}.path: {path}/config.json has no pad_token_id; set it to the "
                                   f"tokenizer's pad token id (the head reads each text's last non-pad token)")
        self.num_labels = config.num_labels
        self.model = None  # served: the SGLang server holds the weights
        if cfg.server is None:
            self.model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=True, output_loading_info=True, dtype=torch.float32)
            if info["missing_keys"]:
                # from_pretrained initialises missing weights at random: a missing score head scores noise
                raise RewardSetupError(f"{where}.path: {path} lacks weights {sorted(info['missing_keys'])[:4]}; "
                                       f"a score head initialised at random would score noise")
            self.model.to(cfg.device).eval()
        self.pad_id = config.pad_token_id
        self.tokenizer = _tokenizer(_folder(cfg.tokenizer or path, f"{where}.tokenizer"), f"{where}.tokenizer",
                                    cfg.chat_template, f"{where}.chat_template")

    def token_ids(self, sample: Mapping[str, Any], response: str) -> list[int] | VerdictError:
        return reward_model_ids(self.tokenizer, self.cfg, sample, response)

    @torch.inference_mode()
    def scores(self, rows: Sequence[list[int]]) -> list[float]:
        """The score of each token-id row: one forward per ``batch_size`` rows, right-padded with the model's
        pad id (its head pools each row's last non-pad token), normalised by ``normalize``."""
        out: list[float] = []
        for start in range(0, len(rows), self.cfg.batch_size):
            chunk = rows[start:start + self.cfg.batch_size]
            if self.model is None:
                out.extend(normalize(self.served_logits(chunk), self.cfg).tolist())
                continue
            width = max(len(r) for r in chunk)
            ids = torch.tensor([r + [self.pad_id] * (width - len(r)) for r in chunk], device=self.cfg.device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk], device=self.cfg.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()  # [B, num_labels]
            out.extend(normalize(logits, self.cfg).tolist())
        return out

    def served_logits(self, rows: Sequence[list[int]]) -> torch.Tensor:
        """[B, num_labels] logits of token-id rows from the SGLang server's ``POST /classify``.

        SGLang 0.5.23 (read in its source): the body is ``EmbeddingReqInput`` (``srt/managers/io_struct.py``)
        with ``input_ids`` a list of rows; a classification model (``Qwen3ForSequenceClassification``,
        ``Qwen2ForRewardModel``, ... ``srt/configs/model_config.py is_generation_model``) answers one
        ``{"embedding": [logit per label], "meta_info": ...}`` per row, in order
        (``srt/managers/tokenizer_manager.py``), its head read at the last token (``srt/layers/pooler.py``
        ``PoolingType.LAST``), as the in-process model's is. A server that is down or refuses raises, and the
        pool counts the batch as failed like any reward error."""
        from gspo_megatron.rollout.sglang.http import request

        answer = request(self.cfg.server, "POST", "/classify", {"input_ids": [list(r) for r in rows]},
                         timeout_s=self.cfg.server_timeout_s)
        if isinstance(answer, dict):  # a single input is answered without the list
            answer = [answer]
        if not isinstance(answer, list) or len(answer) != len(rows):
            raise RuntimeError(f"{self.cfg.server}/classify: expected {len(rows)} results, got {str(answer)[:300]}")
        logits = torch.tensor([item["embedding"] for item in answer], dtype=torch.float32)
        if logits.shape != (len(rows), self.num_labels):
            raise RuntimeError(f"{self.cfg.server}/classify: logits of shape {tuple(logits.shape)}, expected "
                               f"{(len(rows), self.num_labels)} ({self.num_labels} labels in {self.cfg.path})")
        return logits

    def __call__(self, samples: Sequence[Mapping[str, Any]], responses: Sequence[str]) -> list[float | Exception]:
        encoded = [self.token_ids(s, r) for s, r in zip(samples, responses)]
        good = [i for i, e in enumerate(encoded) if not isinstance(e, Exception)]
        values: list[float | Exception] = list(encoded)  # errors stay in place
        for i, score in zip(good, self.scores([encoded[i] for i in good]) if good else []):
            values[i] = score
        return values


def reward_model_text(tokenizer: Any, cfg: RewardModelConfig, sample: Mapping[str, Any], response: str) -> str:
    """What the reward model reads for one response: the chat of the prompt and the response through its
    tokenizer's template, or (``chat_template: false``) the policy's rendered prompt followed by the response."""
    if not cfg.chat_template:
        return (sample.get("prompt_text") or prompt_of(sample)) + response
    messages = list(sample.get("messages") or [{"role": "user", "content": prompt_of(sample)}])
    return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)


def reward_model_ids(tokenizer: Any, cfg: RewardModelConfig, sample: Mapping[str, Any],
                     response: str) -> list[int] | VerdictError:
    """The token ids the reward model reads for one response, cut to ``max_length`` by the truncation rule, or
    the error of an over-long text (``truncation: error``). What a script training a reward model for this term
    should feed it (examples/make_demo_reward_model.py)."""
    # a rendered chat template carries its own special tokens; plain text gets the tokenizer's
    ids = tokenizer(reward_model_text(tokenizer, cfg, sample, response),
                    add_special_tokens=not cfg.chat_template)["input_ids"]
    if len(ids) <= cfg.max_length:
        return ids
    if cfg.truncation == "error":
        return VerdictError(f"{len(ids)} tokens, over reward_model.max_length {cfg.max_length} (truncation: error)")
    return ids[-cfg.max_length:] if cfg.truncation == "left" else ids[:cfg.max_length]


def normalize(logits: torch.Tensor, cfg: RewardModelConfig) -> torch.Tensor:
    """[B, num_labels] logits -> [B] scores: the chosen label's logit (``label``, else the only one), raw or
    through sigmoid / tanh, or its softmax probability over the labels."""
    label = cfg.label or 0
    if cfg.normalize == "softmax":
        return torch.softmax(logits, dim=-1)[:, label]
    column = logits[:, label]
    return {"none": column, "sigmoid": torch.sigmoid(column), "tanh": torch.tanh(column)}[cfg.normalize]


def judge_prompt_ids(tokenizer: Any, cfg: JudgeConfig, sample: Mapping[str, Any],
                     response: str) -> list[int] | VerdictError:
    """The token ids of the judge's prompt for one response (the template filled, through the chat template
    when ``cfg.chat_template``), or the error of a row without a field the template names or of a prompt over
    ``max_length``. What a script training a judge for this term should feed it (examples/make_demo_judge.py)."""
    if "answer" in template_fields(cfg.template) and sample.get("answer") is None:
        return VerdictError("the judge template names {answer} but this row has no answer")
    text = cfg.template.format(response=response, prompt=prompt_of(sample), answer=sample.get("answer"))
    if cfg.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    # a rendered chat template carries its own special tokens; plain text gets the tokenizer's
    ids = tokenizer(text, add_special_tokens=not cfg.chat_template)["input_ids"]
    if len(ids) > cfg.max_length:
        return VerdictError(f"judge prompt of {len(ids)} tokens, over judge.max_length {cfg.max_length}")
    return ids


class JudgeTerm:
    """A generative judge (``JudgeConfig``): greedy verdicts from the in-process transformers engine, or from an
    SGLang server (``server``)."""

    def __init__(self, cfg: JudgeConfig, where: str):
        from gspo_megatron.rollout.hf_engine import HFRolloutEngine, SUPPORTED_MODEL_TYPES

        self.cfg = cfg
        path = _folder(cfg.path, f"{where}.path")
        self.engine = None  # served: the SGLang server holds the weights
        if cfg.server is None:
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
            if config.model_type not in SUPPORTED_MODEL_TYPES:
                raise RewardSetupError(f"{where}.path: a {config.model_type!r} model; the in-process engine serves "
                                       f"{list(SUPPORTED_MODEL_TYPES)} (an SGLang server, judge.server, serves more)")
            self.engine = HFRolloutEngine(path, device=cfg.device, max_batch_rows=cfg.batch_size)
        self.tokenizer = _tokenizer(_folder(cfg.tokenizer or path, f"{where}.tokenizer"), f"{where}.tokenizer",
                                    cfg.chat_template, f"{where}.chat_template")
        if self.tokenizer.eos_token_id is None:
            raise RewardSetupError(f"{where}.tokenizer: the tokenizer in {path} has no eos token to end a verdict")

    def verdicts(self, prompts: Sequence[list[int]]) -> list[str]:
        """Greedy verdict texts of token-id prompts, ``batch_size`` at a time (the engine's ``max_batch_rows``)."""
        from gspo_megatron.rollout.base import SamplingParams

        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=0.0,
                                stop_token_ids=[self.tokenizer.eos_token_id], seed=0)
        samples = self.engine.generate(prompts, 1, params) if self.engine is not None else [
            s for start in range(0, len(prompts), self.cfg.batch_size)
            for s in self.served(prompts[start:start + self.cfg.batch_size], params)]
        return [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]

    def served(self, prompts: Sequence[list[int]], params) -> list:
        """One ``POST /generate`` of the SGLang server for ``prompts``, built and read as the rollout engine
        builds and reads its own (rollout/sglang/protocol.py, SGLang 0.5.23 ``GenerateReqInput``: token ids in,
        token ids and log-probs out, one greedy sample per prompt). A server that is down or answers malformed
        raises, and the pool counts the batch as failed like any reward error."""
        from gspo_megatron.rollout.sglang.http import request
        from gspo_megatron.rollout.sglang.protocol import build_generate_request, parse_generate_response

        req = build_generate_request(prompts, range(len(prompts)), 1, params, seeded=False)
        answer = request(self.cfg.server, "POST", "/generate", req.body, timeout_s=self.cfg.server_timeout_s)
        return parse_generate_response(answer, req, prompts, routed_experts_layout=None,
                                       where=f"{self.cfg.server}/generate")

    def __call__(self, samples: Sequence[Mapping[str, Any]], responses: Sequence[str]) -> list[float | Exception]:
        values: list[float | Exception] = []
        prompts: list[list[int]] = []
        for sample, response in zip(samples, responses):
            ids = judge_prompt_ids(self.tokenizer, self.cfg, sample, response)
            values.append(ids if isinstance(ids, Exception) else float("nan"))  # nan: filled below
            if not isinstance(ids, Exception):
                prompts.append(ids)
        texts = iter(self.verdicts(prompts) if prompts else [])
        for i, value in enumerate(values):
            if isinstance(value, Exception):
                continue
            text = next(texts)
            score = parse_verdict(self.cfg, text)
            values[i] = score if score is not None else VerdictError(
                f"malformed verdict (the rule finds no score): {text[:200]!r}")
        return values


__all__ = ["JudgeTerm", "RewardModelTerm", "VerdictError", "judge_prompt_ids", "normalize", "prompt_of",
           "reward_model_ids", "reward_model_text"]
