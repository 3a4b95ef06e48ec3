"""The supervised warm start (``sft``): a short supervised stage on reference answers before RL (the CPU
demo's documented first stage), or on tool-using traces for a multi-turn run (``sft.traces``)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from gspo_megatron.batching import TrainSequence, split_for_data_parallel
from gspo_megatron.trainer.metrics_log import SFT_METRICS_FILE, append_record, truncate_after


def warm_start_sequence(config, tokenizer) -> Callable[[object], TrainSequence]:
    """How the warm start turns a prompt sample into a supervised sequence: the prompt, its reference answer
    and EOS; or, with ``sft.traces`` (a multi-turn run), the prompt and its tool-using trace (tool calls, tool
    answers, final answer), of which only the model's tokens are trained (``TrainSequence.response_mask``)."""
    from gspo_megatron.data.chat import encode

    eos = tokenizer.eos_token_id
    if config.sft.traces is None:
        return lambda s: TrainSequence(torch.tensor(s.prompt_ids + encode(tokenizer, str(s.answer)) + [eos]),
                                       len(s.prompt_ids))
    from gspo_megatron.rewards.terms import import_function
    from gspo_megatron.rollout.agent_loop import ToolTurnRenderer, trace_tokens

    trace = import_function(config.sft.traces, "sft.traces", config.rewards.import_dirs)
    renderer = ToolTurnRenderer(tokenizer, config.data.chat_template, config.rollout.multi_turn.max_tool_output_tokens)

    def sequence(s) -> TrainSequence:
        ids, mask = trace_tokens(renderer, trace(s), eos)
        return TrainSequence(torch.tensor(s.prompt_ids + ids), len(s.prompt_ids), response_mask=torch.tensor(mask))

    return sequence


def run_warm_start(policy, config, tokenizer, train_data, run_dir: Path, start: int, dp_size: int, dp_rank: int,
                   is_main: bool, stop_requested: Callable[[], bool]) -> int | None:
    """Warm-start steps ``start`` .. ``sft.steps`` (a resume continues at ``start`` with its optimizer loaded;
    the batches are those of the uninterrupted run). Returns the step a stop signal ended it after (the
    caller checkpoints it), or None when it finished (RL then starts from a fresh Adam state)."""
    cfg = config.sft
    samples = list(train_data)
    sequence = warm_start_sequence(config, tokenizer)
    if start == 0:
        policy.reset_optimizer(lr=cfg.lr)
    if is_main:  # a resumed warm start keeps the losses of the steps it has
        truncate_after(run_dir, start, SFT_METRICS_FILE)
    gen = torch.Generator().manual_seed(config.train.seed)
    for _ in range(start):  # the same picks as the uninterrupted warm start from here on
        torch.randint(0, len(samples), (cfg.batch_size,), generator=gen)
    for step in range(start, cfg.steps):
        picks = torch.randint(0, len(samples), (cfg.batch_size,), generator=gen).tolist()
        mine = split_for_data_parallel([sequence(samples[i]) for i in picks], dp_size, dp_rank)
        raw = policy.sft_forward_backward(mine)
        policy.optimizer_step()
        if is_main:
            append_record(run_dir / SFT_METRICS_FILE, step + 1, {"sft_loss": float(raw["loss"])})
        if is_main and (step % 20 == 0 or step == cfg.steps - 1):
            print(f"sft step {step + 1}/{cfg.steps}: nll {float(raw['loss']):.4f}", flush=True)
        if step + 1 < cfg.steps and stop_requested():
            return step + 1
    policy.reset_optimizer()  # RL starts from a fresh Adam state and the RL schedule
    return None
