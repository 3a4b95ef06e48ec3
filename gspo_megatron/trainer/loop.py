"""The GSPO training loop. One step, in the paper's order:

    rollout -> rewards -> group advantages -> old log-probs -> reference log-probs (KL > 0)
            -> mini-batch updates -> weight sync -> metrics -> checkpoint

Every rank runs this loop. Prompts are split over data-parallel ranks by prompt, so groups stay whole;
after rollout and rewards each rank holds the whole rollout batch (it is small: token ids and scalars),
computes the group advantages itself, and trains on its share of each mini-batch. On CPU the
transformers rollout engine lives in each training process (colocated) and receives the new weights
after every step without touching disk.

Randomness is a pure function of (train.seed, step, rank): every step reseeds, so a run resumed from a
checkpoint draws exactly the samples the uninterrupted run would have drawn. Sampling does not depend on
the rank: each response has its own seed from (train.seed, step, global prompt index, sample index).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.advantages import group_advantages
from gspo_megatron.algorithms.metrics import combine_minibatches
from gspo_megatron.megatron import checkpoint as ckpt
from gspo_megatron.megatron import sharding
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.parallel import initialize_model_parallel
from gspo_megatron.batching import TrainSequence, iter_minibatches, split_for_data_parallel
from gspo_megatron.megatron.policy_model import PolicyModel
from gspo_megatron.megatron.routing import replay_for_step
from gspo_megatron.rollout.agent_loop import tool_metrics
from gspo_megatron.rollout.base import RolloutInputError, SamplingParams
from gspo_megatron.rollout.partial import PartialRollouts
from gspo_megatron.trainer.batch_filling import BatchFiller, round_seed
from gspo_megatron.trainer.overlap import InFlight, RolloutAhead, RoundAhead, overlap_timing, staleness, trainer_threads
from gspo_megatron.trainer import completions
from gspo_megatron.trainer.config import TrainConfig, check_resumable, save_config
from gspo_megatron.trainer.finite import check_advantages, check_reward_failures, check_some_update_applied
from gspo_megatron.trainer.preemption import PartialStep, fits_in_grace
from gspo_megatron.trainer.metrics_log import SFT_METRICS_FILE, append_record, truncate_after
from gspo_megatron.trainer.resume import resume_changes, saved_checkpoints
from gspo_megatron.trainer.routing_exchange import RoutingHold
from gspo_megatron.trainer.run_dir import claim as claim_run_dir
from gspo_megatron.trainer.run_dir import on_main_rank
from gspo_megatron.typed_config import ConfigError, to_dict


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**31 - 1)


def deterministic_engine_error(error: Exception | None, previous: Exception | None) -> Exception | None:
    """The error to stop with instead of restarting the engine, or None: an input error (any engine fails
    the same request the same way), or the same error as before the last restart (type and message)."""
    if isinstance(error, RolloutInputError):
        return RolloutInputError(f"rollout: {error} (an input error: the engine was not restarted)")
    if error is not None and previous is not None and (type(error), str(error)) == (type(previous), str(previous)):
        return RuntimeError(f"rollout engine failed the same way after a restart, not restarted again "
                            f"({type(error).__name__}: {error})")
    return None


class Trainer:
    """Builds everything from a ``TrainConfig`` and runs the loop (see the module docstring)."""

    def __init__(self, config: TrainConfig, run_dir: str | Path, resume: bool = False,
                 init_checkpoint: str | Path | None = None):
        """resume: continue from the newest checkpoint in ``run_dir``; init_checkpoint: take the weights
        (only) of that checkpoint folder instead of the configured initialisation (``gspo-megatron eval``)."""
        from gspo_megatron.data.dataset import load_prompt_datasets
        from gspo_megatron.data.iterator import PromptIterator
        from gspo_megatron.rewards.pool import build_reward_pool
        from gspo_megatron.trainer.metrics_log import MetricsLogger, truncate_after
        from gspo_megatron.trainer.preemption import PreemptionFlag

        self.config = config
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        # one run per folder, locked while in use (trainer/run_dir.py); config.yaml is written only once
        # the set-up below succeeded, so a failed start or resume never replaces the run's saved config
        self.run_lock = on_main_rank(lambda: claim_run_dir(self.run_dir, resume), self.is_main)
        initialize_model_parallel(config.parallel, seed=config.model.init_seed)

        self.tokenizer = self._load_tokenizer()
        self.model_config = self._model_config()
        # log-probs of softmax(logits / T), the distribution the rollout samples from
        self.policy = PolicyModel(self.model_config, config.parallel, config.optimizer, config.loss,
                                  max_tokens_per_microbatch=config.train.max_tokens_per_microbatch,
                                  temperature=config.rollout.temperature, runtime=config.model.runtime)
        self.dp_size, self.dp_rank = self.policy.groups.dp_size, self.policy.groups.dp_rank
        self.routing_hold = RoutingHold(self.dp_rank, self.dp_size, self.policy.groups.data_parallel)
        self.reference = None
        if config.loss.kl_coef > 0:
            # a frozen copy of the initial weights; built only when the KL term is on
            self.reference = PolicyModel(self.model_config, config.parallel, config.optimizer, config.loss,
                                         max_tokens_per_microbatch=config.train.max_tokens_per_microbatch,
                                         frozen=True, temperature=config.rollout.temperature,
                                         runtime=config.model.runtime)
        # How this rank reaches SGLang servers: set by the first _build_engine (a collective over all
        # ranks), reused by rebuilds after a failure, which run on the failed ranks only.
        self._sglang_rank = None
        overlap = config.train.rollout_mode == "overlap"
        self.ahead = RolloutAhead(config.train.max_staleness) if overlap else None
        if overlap and config.rollout.engine == "hf":
            # the engine process takes its own cores (rollout/process_engine.py)
            torch.set_num_threads(trainer_threads(torch.get_num_threads(), config.rollout.engine_threads,
                                                  config.train.trainer_threads))
        self.engine = self._build_engine()
        self.train_data, self.eval_data = load_prompt_datasets(config.data, self.tokenizer)
        self.prompts = PromptIterator(self.train_data, config.train.prompts_per_step, seed=config.data.seed,
                                      shuffle=config.data.shuffle)
        self.rewards = build_reward_pool(config.rewards, on_failures=self._count_reward_failures)
        self.filler = BatchFiller.from_config(config.rollout, config.train)
        r = config.rollout  # partial rollouts: the groups in flight on this rank (rollout/partial.py)
        self.in_flight = (PartialRollouts(r.samples_per_prompt, r.partial_token_budget, r.max_new_tokens,
                                          config.train.max_staleness) if r.partial else None)
        self.round_ahead: RoundAhead | None = None  # overlap mode: the next step's first round, generating
        self.engine_version = 0  # the engine's weight version (sync_weights sets it; 1 after the first sync)
        self.preemption = PreemptionFlag()
        self.preemption.install()
        self.step = 0
        self.faults = {"skipped_updates": 0, "reward_failures": 0, "engine_restarts": 0}
        self.reward_streaks: dict[str, int] = {}  # failing batches in a row per reward term (trainer/finite.py)
        # where a stop left the run (trainer/preemption.py): the metrics of step self.step still to be
        # evaluated and logged (None: none), the rest of a step stopped between mini-batches, whether a
        # signal stopped the run in its warm start, the step last saved and how long saves take
        self.pending: dict[str, float] | None = {}
        self.partial: PartialStep | None = None
        self.stopped = False
        self.saved_step, self.save_s = -1, 0.0

        latest = self.latest_checkpoint() if resume else None
        if resume and latest is None and self.is_main:
            print(f"--resume: {self.run_dir} holds no checkpoint yet; starting its run from the beginning", flush=True)
        warm_from = None  # the supervised warm start continues from this step (None: no warm start to run)
        if latest is not None:
            warm_from = self.load_checkpoint(latest)
        elif init_checkpoint is not None:
            ckpt.verify(init_checkpoint)  # a missing or cut checkpoint is named, not a DCP traceback
            self.load_checkpoint(Path(init_checkpoint), restore_progress=False)
        else:
            self._initialise_weights()
            warm_from = 0
        if warm_from is not None:
            if warm_from < config.sft.steps:
                self.warm_start(warm_from)
            elif warm_from > 0:  # resumed in a warm start that sft.steps now ends: RL's own optimizer
                self.policy.reset_optimizer()
            if self.reference is not None and not self.stopped:
                # the frozen reference is the policy RL starts from (after the warm start)
                self._copy_weights(self.policy, self.reference)
        self.sync_weights()
        if self.is_main:
            truncate_after(self.run_dir, self.step if latest is not None else -1)
            completions.truncate_completions(self.run_dir, self.step if latest is not None else -1)
        self.logger = MetricsLogger(self.run_dir, enabled=self.is_main, tensorboard=config.logging.tensorboard,
                                    wandb_project=config.logging.wandb_project, total_steps=config.train.steps,
                                    console=config.logging.console)
        if self.is_main:
            save_config(config, self.run_dir / "config.yaml")

    def _count_reward_failures(self, n: int) -> None:
        self.faults["reward_failures"] += n

    # ---- set-up --------------------------------------------------------------------------------
    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        from gspo_megatron.data.tokenizer import demo_tokenizer_path

        source = self.config.model.tokenizer_dir or self.config.model.hf_dir or demo_tokenizer_path()
        return AutoTokenizer.from_pretrained(source)

    def _model_config(self) -> ModelConfig:
        if self.config.model.hf_dir is not None:
            return ModelConfig.from_hf_dir(self.config.model.hf_dir)
        return self.config.model.config

    def _build_engine(self):
        if self.config.rollout.engine == "hf" and self.ahead is not None:
            from gspo_megatron.rollout.process_engine import EngineSpec, ProcessRolloutEngine

            # multi-turn: the agent loop runs in the engine process, so whole trajectories are generated ahead
            return ProcessRolloutEngine(EngineSpec(self.model_config.to_hf_config(), init_seed=self.config.model.init_seed,
                                                   threads=self.config.rollout.engine_threads,
                                                   nice=self.config.rollout.engine_nice, agent=self._agent_spec()))
        if self.config.rollout.engine == "hf":
            from gspo_megatron.rollout.hf_engine import HFRolloutEngine

            return self._with_tools(HFRolloutEngine(self.model_config.to_hf_config(), init_seed=self.config.model.init_seed))
        from gspo_megatron.trainer.rollout_setup import connect_sglang

        # Every rank drives its share of the rollouts through all servers; who launches them and who
        # posts the weights: trainer/rollout_setup.py (docs/rollout.md, "Several trainer ranks").
        if self._sglang_rank is not None:
            return self._with_tools(self._sglang_rank.build_engine())  # a rebuild: relaunch on the launching rank, else re-attach
        self._sglang_rank, engine = connect_sglang(self.config.rollout.sglang, os.environ, self.model_config)
        return self._with_tools(engine)

    def _agent_spec(self):
        """What the agent loop needs besides the engine (``rollout.multi_turn``), or None for single-turn."""
        from gspo_megatron.rollout.agent_loop import AgentSpec

        if self.config.rollout.multi_turn is None:
            return None
        import functools

        from gspo_megatron.rewards.sandbox import python_tool

        return AgentSpec(self.config.rollout.multi_turn, self.tokenizer, self.config.data.chat_template,
                         tuple(stop_token_ids(self.tokenizer, self.config.model.hf_dir)),
                         run_python=functools.partial(python_tool, self.config.rewards.code.sandbox))

    def _with_tools(self, engine):
        """``engine`` inside the multi-turn agent loop when ``rollout.multi_turn`` is set."""
        spec = self._agent_spec()
        return engine if spec is None else spec.wrap(engine)

    def _initialise_weights(self) -> None:
        """Load HF weights when given; otherwise the canonical random initialisation of model.init_seed
        (the same weights at every parallel layout: megatron/canonical_init.py)."""
        if self.config.model.hf_dir is None:
            from gspo_megatron.megatron.canonical_init import initialise_canonical

            initialise_canonical(self.policy.module, self.model_config, self.config.model.init_seed)
            return
        from gspo_megatron.conversion.safetensors_io import HFCheckpoint, check_declared_dtype
        from gspo_megatron.conversion.tables import expand

        with HFCheckpoint(self.config.model.hf_dir) as hf:
            check_declared_dtype(hf)
            canonical = {e.megatron: e.transform.to_megatron([hf.read(n) for n in e.hf])
                         for e in expand(self.model_config)}
        sharding.load_full_state_dict(self.policy.module, canonical)

    @staticmethod
    def _copy_weights(src: PolicyModel, dst: PolicyModel) -> None:
        with torch.no_grad():
            for p_dst, p_src in zip(dst.module.parameters(), src.module.parameters()):
                p_dst.copy_(p_src)

    # ---- supervised warm start -------------------------------------------------------------------
    def warm_start(self, start: int = 0) -> None:
        """A short supervised stage on reference answers (documented first stage of the CPU demo), from step
        ``start`` (a resume of a warm start a signal stopped: its optimizer is loaded). A signal stops it
        after any step with a checkpoint of that step (``warm_start`` in its metadata)."""
        cfg = self.config.sft
        samples = list(self.train_data)
        sequence = self._warm_start_sequence()
        if start == 0:
            self.policy.reset_optimizer(lr=cfg.lr)
        if self.is_main:  # a resumed warm start keeps the losses of the steps it has (as metrics.jsonl)
            truncate_after(self.run_dir, start, SFT_METRICS_FILE)
        gen = torch.Generator().manual_seed(self.config.train.seed)
        for _ in range(start):  # the same picks as the uninterrupted warm start from here on
            torch.randint(0, len(samples), (cfg.batch_size,), generator=gen)
        for step in range(start, cfg.steps):
            picks = torch.randint(0, len(samples), (cfg.batch_size,), generator=gen).tolist()
            seqs = [sequence(samples[i]) for i in picks]
            mine = split_for_data_parallel(seqs, self.dp_size, self.dp_rank)
            raw = self.policy.sft_forward_backward(mine)
            self.policy.optimizer_step()
            if self.is_main:
                append_record(self.run_dir / SFT_METRICS_FILE, step + 1, {"sft_loss": float(raw["loss"])})
            if self.is_main and (step % 20 == 0 or step == cfg.steps - 1):
                print(f"sft step {step + 1}/{cfg.steps}: nll {float(raw['loss']):.4f}", flush=True)
            if step + 1 < cfg.steps and self.preempted():
                self.save_checkpoint({"warm_start": {"step": step + 1}})
                self._report_stop(f"in the warm start at sft step {step + 1}")
                self.stopped = True
                return
        self.policy.reset_optimizer()  # RL starts from a fresh Adam state and the RL schedule

    def _warm_start_sequence(self):
        """How the warm start turns a prompt into a supervised sequence: the prompt, its reference answer and
        EOS; or, with ``sft.traces`` (a multi-turn run), the prompt and its tool-using trace (tool calls, tool
        answers, final answer), of which only the model's tokens are trained (``TrainSequence.response_mask``)."""
        from gspo_megatron.data.chat import encode

        cfg, eos = self.config.sft, self.tokenizer.eos_token_id
        if cfg.traces is None:
            return lambda s: TrainSequence(torch.tensor(s.prompt_ids + encode(self.tokenizer, str(s.answer)) + [eos]),
                                           len(s.prompt_ids))
        from gspo_megatron.rewards.terms import import_function
        from gspo_megatron.rollout.agent_loop import ToolTurnRenderer, trace_tokens

        trace = import_function(cfg.traces, "sft.traces", self.config.rewards.import_dirs)
        renderer = ToolTurnRenderer(self.tokenizer, self.config.data.chat_template,
                                    self.config.rollout.multi_turn.max_tool_output_tokens)

        def sequence(s) -> TrainSequence:
            ids, mask = trace_tokens(renderer, trace(s), eos)
            return TrainSequence(torch.tensor(s.prompt_ids + ids), len(s.prompt_ids), response_mask=torch.tensor(mask))

        return sequence

    # ---- one RL step -----------------------------------------------------------------------------
    def rollout(self, prompts, seed: int, samples_per_prompt: int, temperature: float, max_new_tokens: int,
                routed_experts: bool = False):
        """Generate this DP rank's share of ``prompts``, score it, and gather the whole batch on every
        rank: a list (in prompt order) of (prompt sample, [sample x G], [reward x G], [correct x G]; correct:
        the verifiers' verdict, rewards/pool.py response_correct, never a threshold). ``routed_experts``:
        the engine also returns the experts of every fed position (Routing Replay R3). ``seed`` must be the
        same on every rank: with the prompts' global indices it seeds each sample (layout-independent)."""
        mine, params = self._sampling(prompts, seed, temperature, max_new_tokens, routed_experts)
        samples = self._generate([p.prompt_ids for p in mine], samples_per_prompt, params)
        return self._score_and_gather(mine, samples, samples_per_prompt)

    def _rl_sampling(self, step: int) -> dict:
        """How the RL batch of ``step`` is sampled, in sync and overlap mode alike (``rollout``'s arguments)."""
        cfg = self.config
        return {"seed": step_seed(cfg.train.seed, step, 1), "temperature": cfg.rollout.temperature,
                "max_new_tokens": cfg.rollout.max_new_tokens, "routed_experts": cfg.train.routing_replay in ("r3", "auto")}

    def _sampling(self, prompts, seed: int, temperature: float, max_new_tokens: int,
                  routed_experts: bool) -> tuple[list, SamplingParams]:
        """This DP rank's share of ``prompts`` and its sampling parameters (``prompt_offset``: the global
        index of its first prompt, so each sample's seed does not depend on the layout)."""
        r = self.config.rollout
        mine = split_for_data_parallel(prompts, self.dp_size, self.dp_rank)
        first = split_for_data_parallel(range(len(prompts)), self.dp_size, self.dp_rank)[:1]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=r.top_p,
                                top_k=r.top_k, stop_token_ids=stop_token_ids(self.tokenizer, self.config.model.hf_dir), seed=seed,
                                prompt_offset=first[0] if first else 0, return_routed_experts=routed_experts)
        return mine, params

    def _score_and_gather(self, mine, samples, samples_per_prompt: int):
        """Rewards of this rank's samples, then the whole batch on every rank (see ``rollout``)."""
        from gspo_megatron.rollout.agent_loop import final_turn_ids
        from gspo_megatron.rollout.base import compact_routed_experts

        # R3 records stay on this rank until the step's shares are cut (routing_exchange.py), one byte per id
        samples = self.routing_hold.keep(compact_routed_experts(samples, self.model_config.num_experts))
        # a multi-turn trajectory is scored on its final model turn (the answer), single-turn on the response
        texts = [self.tokenizer.decode(final_turn_ids(s), skip_special_tokens=True) for s in samples]
        batch = [(mine[i // samples_per_prompt], t) for i, t in enumerate(texts)]
        scores = self.rewards.score_verdicts(batch) if batch else None
        rewards, correct = (scores.rewards, scores.correct) if scores is not None else ([], [])
        reward_metrics = scores.metrics if scores is not None else {}
        local = []
        for k, prompt in enumerate(mine):
            group = slice(k * samples_per_prompt, (k + 1) * samples_per_prompt)
            local.append((prompt, samples[group], rewards[group], correct[group]))
        parts = self._dp_parts((local, reward_metrics))
        gathered = [item for part, _ in parts for item in part]
        merged_metrics: dict[str, float] = {}
        for _, m in parts:
            for key, value in m.items():
                merged_metrics[key] = merged_metrics.get(key, 0.0) + float(value) / self.dp_size
        return gathered, merged_metrics

    MAX_ENGINE_RESTARTS_PER_CALL = 2

    def _generate(self, prompt_ids, samples_per_prompt: int, params: SamplingParams, flight: InFlight | None = None):
        """engine.generate, restarting failed engines (rebuilt, weights re-synced from the policy) up to
        MAX_ENGINE_RESTARTS_PER_CALL times; each rebuilt engine is counted in faults/engine_restarts. When
        it still fails, the last error propagates with the restart count in the message. A deterministic
        error is not restarted (``deterministic_engine_error``): an input error stops at once, the same
        error right after a restart stops then; one line either way.

        Every rank calls this, with or without prompts: the re-sync is a collective over the model's
        groups, so one all-reduce per attempt tells every rank whether any engine failed, the failed ranks
        rebuild theirs, and all ranks re-sync together (the healthy engines get the same weights again).

        ``flight`` (overlap mode): the batch was submitted ahead; its result is taken first. After a restart
        it is generated again with the current weights, and so are the batches queued behind it."""
        previous = None
        for attempt in range(self.MAX_ENGINE_RESTARTS_PER_CALL + 1):
            samples, error = [], None
            if prompt_ids:
                try:
                    if flight is not None and flight.request_id is not None and attempt == 0:
                        flight.take(self.engine.result)
                        samples = flight.samples
                    else:
                        samples = self.engine.generate(prompt_ids, samples_per_prompt, params)
                except Exception as err:  # noqa: BLE001 - contained: counted, engine rebuilt, re-raised at the limit
                    error = err
            stop = deterministic_engine_error(error, previous)
            flags = torch.tensor([0 if error is None else 1, int(stop is not None)])
            dist.all_reduce(flags)  # every rank restarts, or stops, together
            failed, stopping = int(flags[0]), int(flags[1])
            if failed == 0:
                return samples
            if stopping:
                if stop is not None:
                    raise stop from error
                raise RuntimeError(f"the rollout engine of {stopping} other rank(s) failed deterministically "
                                   f"(not restarted)")
            previous = error
            reason = str(error) if error is not None else f"the engine of {int(failed)} other rank(s) failed"
            if attempt == self.MAX_ENGINE_RESTARTS_PER_CALL:
                raise RuntimeError(f"rollout engine failed after {attempt} restarts: {reason}") from error
            if error is not None:
                print(f"rank {self.rank}: rollout engine failed ({type(error).__name__}: {error}); restarting it",
                      flush=True)
                self.engine.shutdown()
                self.engine = self._build_engine()
            self.sync_weights()
            self.faults["engine_restarts"] += int(failed)
            if flight is not None:
                flight.version = self.engine_version  # generated again by the weights just re-synced
            if self.ahead is not None:
                # also after a refill round or an evaluation failed: a rebuilt engine lost the queued requests
                self._resubmit_ahead(rebuilt=error is not None)
        raise AssertionError("unreachable")

    # ---- overlapped rollouts (train.rollout_mode: overlap; trainer/overlap.py) ---------------------
    def _flight_sampling(self, flight: InFlight) -> tuple[list, SamplingParams]:
        return self._sampling(flight.prompts, **self._rl_sampling(flight.step))

    def _submit(self, flight: InFlight) -> int | None:
        mine, params = self._flight_sampling(flight)
        if not mine:
            return None
        return self.engine.submit([p.prompt_ids for p in mine], self.config.rollout.samples_per_prompt, params)

    def _submit_call(self, call) -> int | None:
        """Submit one engine call of a partial round (``partial.RoundCall``); None when it has no prompts."""
        return self.engine.submit(call.prompts, call.samples_per_prompt, call.params) if call.prompts else None

    def _resubmit_ahead(self, rebuilt: bool) -> None:
        """After an engine restart every queued batch (and the calls of a partial round not yet taken) is
        generated again with the current weights (a rebuilt engine lost its requests; a healthy one drops the
        old results), so all ranks stay on one version."""
        queued = [(flight, self._submit) for flight in self.ahead.queue]
        if self.round_ahead is not None:  # the call being taken is out of the lists: _generate redoes it
            queued += [(flight, lambda _, call=call: self._submit_call(call))
                       for call, flight in zip(self.round_ahead.calls, self.round_ahead.flights)]
        for flight, submit in queued:
            if flight.samples is not None:
                continue
            if flight.request_id is not None and not rebuilt:
                self.engine.cancel(flight.request_id)
            flight.request_id, flight.version = submit(flight), self.engine_version

    def _rollout_ahead(self) -> tuple[list, dict[str, float], int, dict[str, float]]:
        """Steps 1-2 in overlap mode: keep the next ``max_staleness`` steps' batches generating, take this
        step's, score it. Returns (batch, reward metrics, staleness, overlap timing)."""
        healthy = torch.tensor([1 if self.engine.healthy() else 0])
        dist.all_reduce(healthy, op=dist.ReduceOp.MIN)
        if not int(healthy):  # an engine process died since the last sync: rebuilt, synced, queue resubmitted
            self.sync_weights()
        self.ahead.top_up(self.step, lambda: next(self.prompts), self._submit)
        flight = self.ahead.pop(self.step)
        mine, params = self._flight_sampling(flight)
        if flight.samples is None:
            flight.samples = self._generate([p.prompt_ids for p in mine], self.config.rollout.samples_per_prompt,
                                            params, flight=flight)
        age = staleness(self.step + 1, flight.version, self.ahead.max_staleness, flight.step)
        batch, reward_metrics = self._score_and_gather(mine, flight.samples, self.config.rollout.samples_per_prompt)
        return batch, reward_metrics, age, overlap_timing(flight)

    def _refill_round(self, round_index: int) -> list:
        """Dynamic sampling's round ``round_index`` >= 1 of this step (trainer/batch_filling.py): the next
        prompts, generated now by the current weights (staleness 0 in overlap mode too), gathered on every rank."""
        sampling = self._rl_sampling(self.step)
        sampling["seed"] = round_seed(sampling["seed"], round_index)
        batch, _ = self.rollout(next(self.prompts), samples_per_prompt=self.config.rollout.samples_per_prompt,
                                **sampling)
        return batch

    def _partial_rollout(self) -> tuple[list, dict[str, float], int, dict[str, float]]:
        """Steps 1-2 with partial rollouts (rollout/partial.py): this step's prompts join the groups in flight,
        every unfinished response gets ``rollout.partial_token_budget`` tokens, the finished groups are scored
        and gathered, the rest is carried. While the finished groups hold fewer than
        ``train.minibatches_per_step`` samples (the first step: no group has had time to finish), further
        rounds continue just the oldest groups that could make up the count, so the rest stays in flight.
        In overlap mode the step's first round was submitted while the last step trained (``round_ahead``;
        its tokens one update older), and the next step's is submitted here, before the update.
        Returns (batch, reward metrics, oldest token's age, counts and overlap timing)."""
        sampling, timing = self._rl_sampling(self.step), {}
        if self.round_ahead is None:  # sync mode and overlap's first step: the first round now
            mine, params = self._sampling(next(self.prompts), **sampling)
            self.in_flight.add(mine, params.prompt_offset, self.step)
            self.in_flight.generate_round(self._generate, params, self.step, 0)
        else:
            if self.round_ahead.step != self.step:
                raise RuntimeError(f"partial rollouts: the round generated ahead is step {self.round_ahead.step}'s, "
                                   f"not step {self.step}'s")
            timing, self.round_ahead = self._take_round_ahead(), None
            params = self._sampling([], **sampling)[1]  # the step's seed and settings, for further rounds
        need, G = self.config.train.minibatches_per_step, self.config.rollout.samples_per_prompt
        rounds = 1
        while True:  # every rank the same number of rounds: the counts are summed over data-parallel ranks
            counts = torch.tensor(self.in_flight.counts(), dtype=torch.long)
            dist.all_reduce(counts, group=self.policy.groups.data_parallel)
            finished, running = counts.tolist()
            if finished >= need or running == 0:
                break
            chosen = self._oldest_unfinished(-(-(need - finished) // G))  # the groups that could make up the count
            self.in_flight.generate_round(self._generate, params, self.step, rounds, chosen)
            rounds += 1
        groups, sums, oldest = self.in_flight.take_finished(self.step)
        if self.ahead is not None:
            self._submit_round_ahead()
        batch, reward_metrics = self._score_and_gather(
            [g.prompt for g in groups], [r.to_sample(g.slot) for g in groups for r in g.responses], G)
        # in the run's group order (start step, prompt index), not rank by rank: the mini-batches, and so
        # the updates, are those of one process at any data-parallel size
        keys = self._gather_lists([g.key for g in groups])
        batch = [batch[i] for i in sorted(range(len(batch)), key=keys.__getitem__)]
        totals, age = torch.tensor(list(sums.values()), dtype=torch.float64), torch.tensor([oldest])
        dist.all_reduce(totals, group=self.policy.groups.data_parallel)
        dist.all_reduce(age, op=dist.ReduceOp.MAX, group=self.policy.groups.data_parallel)
        counts = {**dict(zip(sums, totals.tolist())), "partial/max_token_age": float(age), "partial/rounds": float(rounds)}
        return batch, reward_metrics, int(age), {**counts, **timing}

    def _dp_parts(self, mine) -> list:
        """Every data-parallel rank's ``mine`` (plain data), in rank order (a collective)."""
        parts = [None] * self.dp_size
        dist.all_gather_object(parts, mine, group=self.policy.groups.data_parallel)
        return parts

    def _gather_lists(self, mine: list) -> list:
        """Every data-parallel rank's ``mine``, concatenated in rank order (a collective)."""
        return [item for part in self._dp_parts(mine) for item in part]

    def _oldest_unfinished(self, n: int) -> set[tuple[int, int]]:
        """The keys of the ``n`` oldest unfinished groups over all data-parallel ranks (a collective), so an
        extra round continues the same groups at every layout."""
        return set(sorted(self._gather_lists([g.key for g in self.in_flight.groups if not g.done]))[:n])

    def _submit_round_ahead(self) -> None:
        """Overlap mode with partial rollouts: the next step's prompts join the pool and its first round
        is submitted now, to be generated by the current weights while this step trains."""
        upcoming = self.step + 1
        mine, params = self._sampling(next(self.prompts), **self._rl_sampling(upcoming))
        self.in_flight.add(mine, params.prompt_offset, upcoming)
        calls = self.in_flight.plan_round(params, 0)
        flights = [InFlight(upcoming, [], version=self.engine_version) for _ in calls]
        self.round_ahead = RoundAhead(upcoming, calls, flights)
        for call, flight in zip(calls, flights):
            flight.request_id = self._submit_call(call)

    def _take_round_ahead(self) -> dict[str, float]:
        """The results of the partial round generating ahead into the pool (each call's samples a segment of
        the version that generated it, also after an engine restart generated it again), unless a checkpoint
        took them already (a collective: every rank makes the same calls). Returns its overlap timing."""
        ahead = self.round_ahead
        while ahead.calls:
            call, flight = ahead.calls.pop(0), ahead.flights.pop(0)
            samples = self._generate(call.prompts, call.samples_per_prompt, call.params, flight=flight)
            call.apply(samples, flight.version - 1, self.in_flight.max_new_tokens)
            ahead.taken.append(flight)
        return overlap_timing(*ahead.taken)

    def train_step(self) -> dict[str, float]:
        """One GSPO step, the paper's order: 1-2 rollout of G samples per prompt and their rewards; 3 group
        advantages (Eq. 6); 4 old-policy log-probs; 5 reference log-probs (KL > 0); 6 one optimizer step per
        mini-batch; 7 weight sync to the rollout engine; 8 metrics. Routing Replay (R2/R3) and routing
        drift live inside steps 4 and 6 (``_old_logprobs``, ``_update``)."""
        cfg = self.config
        G = cfg.rollout.samples_per_prompt
        torch.manual_seed(step_seed(cfg.train.seed, self.step, self.rank))
        timings: dict[str, float] = {}
        t0 = time.perf_counter()

        # 1-2. rollout and rewards
        replay = cfg.train.routing_replay  # off | r2 (old-policy forward's experts) | r3 (the engine's) | auto
        if self.in_flight is not None:
            batch, reward_metrics, age, timing = self._partial_rollout()
        elif self.ahead is None:
            batch, reward_metrics = self.rollout(next(self.prompts), samples_per_prompt=G, **self._rl_sampling(self.step))
            age, timing = 0, {}
        else:
            batch, reward_metrics, age, timing = self._rollout_ahead()
        # dynamic sampling and overlong responses (trainer/batch_filling.py): zero-variance groups replaced
        # by further rounds, length penalties in the rewards, truncated samples out of the loss
        filled = self.filler.fill(batch, self._refill_round)
        batch = filled.batch
        timings["time_rollout_s"] = time.perf_counter() - t0
        if self.engine.releases_memory and self.ahead is None:
            # colocated servers give their GPUs back while the trainer works; sync_weights resumes them
            # (the rollout's all-gather has already passed: no rank still generates)
            self.engine.release_memory()

        # 3. group advantages (Eq. 6) over whole groups
        rewards = torch.tensor([r for _, _, rs, _ in batch for r in rs], dtype=torch.float32).view(len(batch), G)
        adv = group_advantages(rewards, estimator=cfg.loss.advantage_estimator, eps=cfg.loss.advantage_eps,
                               batch_norm=cfg.loss.advantage_batch_norm)
        check_advantages(rewards, adv.advantages, cfg.rewards.terms, self.step + 1)
        self.reward_streaks = check_reward_failures(reward_metrics, cfg.rewards, self.reward_streaks, self.step + 1,
                                                    self.rewards.first_failures, self.run_dir, self.rank)
        seqs = _training_sequences(batch, adv.advantages, with_routing=replay in ("r3", "auto"), keep=filled.keep)
        minibatches = list(iter_minibatches(seqs, cfg.train.minibatches_per_step))
        shares = [split_for_data_parallel(mb, self.dp_size, self.dp_rank) for mb in minibatches]
        my_seqs = [q for share in shares for q in share]
        if replay in ("r3", "auto"):  # each rank receives the engine's experts of the sequences it trains
            self.routing_hold.deliver([[q for mb in minibatches for q in split_for_data_parallel(mb, self.dp_size, r)]
                                       for r in range(self.dp_size)])

        # 4. old log-probs: recomputed by the training model (default) in one call for the whole step, or
        #    the engine's (paper section 5.4)
        t1 = time.perf_counter()
        replay, routing_metrics = self._old_logprobs(my_seqs, replay)  # auto: this step's r3 or off
        # 5. reference log-probs when the KL term is on
        if self.reference is not None:
            for q, o in zip(my_seqs, self.reference.compute_logprobs(my_seqs)):
                q.ref_logprobs = o["logprobs"]
        timings["time_logprobs_s"] = time.perf_counter() - t1

        # 6. one optimizer step per mini-batch
        t2 = time.perf_counter()
        update_metrics, metrics = self._update(shares, replay)
        self.faults["skipped_updates"] = self.policy.skipped_steps
        check_some_update_applied(update_metrics, self.step + 1, self.policy.skipped_steps)
        timings["time_update_s"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        # 7. weight sync to the rollout engine
        sync = self.sync_weights(self.step + 1)
        timings["time_sync_s"] = time.perf_counter() - t3
        metrics["sync_bytes_per_s"] = sync["sync_bytes_per_s"]

        # 8. metrics
        metrics.update(combine_minibatches(update_metrics))
        metrics.update(_batch_metrics(batch, rewards, adv.zero_variance))
        metrics["staleness"] = float(age)
        metrics.update(filled.metrics)
        metrics.update(routing_metrics)
        if self.ahead is not None:
            metrics.update({f"{k}/staleness{age}": v for k, v in list(metrics.items()) if k.startswith("clip_frac")})
        metrics.update(timing)  # overlap's timing or partial rollouts' counts ({} otherwise)
        metrics.update(reward_metric_keys(reward_metrics))
        metrics.update(timings)
        total = time.perf_counter() - t0
        metrics["time_step_s"] = total
        metrics["tokens_per_s"] = float(sum(q.tokens.numel() for q in seqs)) / max(total, 1e-9)
        metrics.update({f"faults/{k}": float(v) for k, v in self.faults.items()})
        self.log_completions(batch)
        return metrics

    def log_completions(self, batch) -> None:
        """A few of the step's completions to RUN_DIR/completions.jsonl, TensorBoard and the console (step 8)."""
        cfg = self.config.logging
        if not self.is_main or not cfg.completions_per_step:
            return
        step = self.step + 1  # the step this batch trains (logged under it)
        rows = completions.completion_rows(batch, self.tokenizer, cfg.completions_per_step, step)
        completions.append_rows(self.run_dir, rows)
        self.logger.log_text("completions", completions.as_text(rows), step)
        if cfg.console_completion_every and step % cfg.console_completion_every == 0 and rows:
            print(completions.console_line(rows[0]), flush=True)

    # ---- steps 4 and 6 with Routing Replay and routing drift ----------------------------------------
    def _measures_drift(self, shares: list[list[TrainSequence]]) -> bool:
        """Routing drift "after one gradient update" is read on mini-batch 1 (needs two mini-batches)."""
        cfg = self.config
        return self.model_config.is_moe and cfg.train.measure_routing_drift and len(shares) > 1

    def _old_logprobs(self, seqs: list[TrainSequence], replay: str) -> tuple[str, dict[str, float]]:
        """Step 4: set each sequence's ``old_logprobs``. Recomputed under R3 with the engine's experts; R2
        stores the experts of this forward in the sequences. Under ``auto`` the forward routes freely and
        is compared with the engine's experts (``routing_agreement``); below
        ``train.routing_agreement_threshold`` the old log-probs are recomputed with the engine's experts
        and the step replays them (R3). Returns (this step's replay mode, agreement metrics)."""
        if self.config.rollout.logprobs_from == "engine":
            for q in seqs:
                q.old_logprobs = q.rollout_logprobs
            return replay, {}
        auto = replay == "auto"
        with self.policy.routing_recorder(replay == "r2" or auto) as recorder:
            old = self.policy.compute_logprobs(seqs, replay=replay == "r3")
        metrics: dict[str, float] = {}
        if auto:
            metrics = self.policy.routing_agreement(seqs, recorder)
            replay = replay_for_step(replay, metrics["routing_agreement"], self.config.train.routing_agreement_threshold)
            metrics["routing_replay_active"] = float(replay == "r3")
            if replay == "r3":
                old = self.policy.compute_logprobs(seqs, replay=True)
        for q, o in zip(seqs, old):
            q.old_logprobs = o["logprobs"]
        if replay == "r2":
            self.policy.record_routing(seqs, recorder)
        return replay, metrics

    def _free_routing(self, seqs: list[TrainSequence]):
        """A RoutingRecorder around one no-grad forward of ``seqs`` with free (not replayed) routing."""
        with self.policy.routing_recorder() as recorder:
            self.policy.compute_logprobs(seqs)
        return recorder

    def _update(self, shares: list[list[TrainSequence]], replay: str) -> tuple[list[dict[str, float]], dict[str, float]]:
        """Step 6: one optimizer step per mini-batch (replaying the stored experts under R2/R3). Returns (per
        mini-batch metrics, drift metrics).

        Routing drift, the paper's statistic (section 5.3: the activated experts of the same rollout that
        change after one gradient update), on mini-batch 1: routed freely by a no-grad forward before the
        first update, and after it by its own update forward (same micro-batches, same kernels: a forward
        that changes no weight reads exactly zero, tests/megatron/test_routing.py), so one extra forward.
        Under Routing Replay the update forward is forced, so a second free no-grad forward reads "after"."""
        drift = self._measures_drift(shares)
        per_minibatch, drift_metrics, before = [], {}, None
        clock = time.perf_counter()
        for k, share in enumerate(shares):
            # drift reads mini-batches 0 and 1 together: a stop comes after both
            if k >= (2 if drift else 1) and self._stop_before_minibatch(len(shares) - k, (time.perf_counter() - clock) / k):
                self.partial = PartialStep(shares[k:], per_minibatch)
                break
            if drift and k == 0:
                before = self.policy.sequence_routing(shares[1], self._free_routing(shares[1]))
            after_from_update = drift and k == 1 and replay == "off"
            if drift and k == 1 and not after_from_update:
                drift_metrics = self.policy.routing_drift(share, before, self._free_routing(share))
            with self.policy.routing_recorder(after_from_update) as recorder:
                per_minibatch.append(self.policy.train_minibatch(share, replay=replay != "off"))
            if after_from_update:
                drift_metrics = self.policy.routing_drift(share, before, recorder)
        return per_minibatch, drift_metrics

    # ---- weights, evaluation, checkpoints --------------------------------------------------------
    def _replace_dead_engine(self) -> bool | None:
        """Overlap mode: an engine process killed since its last request (the OOM killer) is rebuilt before
        the weights go to it, counted in faults/engine_restarts. A collective: None when no rank's engine
        died, else whether this rank's was rebuilt."""
        mine_dead = not self.engine.healthy()
        dead = torch.tensor([1 if mine_dead else 0])
        dist.all_reduce(dead)
        if int(dead) == 0:
            return None
        if mine_dead:
            print(f"rank {self.rank}: rollout engine process is gone; restarting it", flush=True)
            self.engine.shutdown()
            self.engine = self._build_engine()
        self.faults["engine_restarts"] += int(dead)
        return mine_dead

    def sync_weights(self, updates: int | None = None) -> dict[str, float]:
        """Step 7: the policy's weights to the engine. ``updates``: how many RL updates they hold (default
        ``self.step``, right between steps; a step's own sync passes ``self.step + 1``), which makes the
        engine's weight version ``updates + 1`` (the initial sync is version 1): the version of every
        generation submitted from now on (overlap mode's staleness, partial rollouts' segments)."""
        from gspo_megatron.megatron import device
        from gspo_megatron.rollout.weight_sync import DEFAULT_BUCKET_BYTES, sync_weights

        rebuilt = self._replace_dead_engine() if self.ahead is not None else None
        device.release_cached_memory()  # the update's cached blocks, free for the servers' resume
        self.engine.resume_memory(["weights"])  # a no-op unless released (RolloutEngine.releases_memory)
        if self.ahead is not None and self.config.rollout.engine == "sglang" and dist.get_world_size() > 1:
            # overlap: the servers are shared, so every rank's batch generated ahead must be finished before
            # any rank posts weights (each engine waits for its own in update_weights; the barrier for all)
            self.engine.wait_submitted()
            dist.barrier()
        # SGLang: one post per bucket of its bucket_bytes (docs/rollout.md, "Bucket size")
        sglang = self.config.rollout.engine == "sglang"
        stats = sync_weights(self.policy.ddp, self.model_config, self.engine,
                             self.config.rollout.sglang.bucket_bytes if sglang else DEFAULT_BUCKET_BYTES)
        if sglang and dist.get_world_size() > 1:
            from gspo_megatron.trainer.rollout_setup import share_sync_report

            # the posting ranks' word on which servers took the weights; also the barrier that keeps every
            # rank from generating before the servers hold them
            share_sync_report(self.engine)
        device.release_cached_memory()  # the sync's buckets, before the KV cache comes back
        self.engine.resume_memory(["kv_cache", "cuda_graph"])
        self.engine_version = (self.step if updates is None else updates) + 1
        if rebuilt is not None:  # the batches queued ahead are generated again, by every rank's engine
            self._resubmit_ahead(rebuilt=rebuilt)
        return stats

    def evaluate(self, stoppable: bool = False) -> dict[str, float] | None:
        """Greedy pass@1 (temperature 0: argmax decoding in both engines) and sampled pass@k on the held-out
        prompts. ``stoppable``: None when a stop signal came before or between the two rollouts."""
        if stoppable and self.preempted():
            return None
        cfg = self.config.eval
        data = self.eval_data if self.eval_data is not None else self.train_data
        prompts = list(data)[:cfg.num_prompts]
        seed = step_seed(self.config.train.seed + 17, self.step, 0)  # the same on every rank (see rollout)
        greedy, _ = self.rollout(prompts, seed, 1, 0.0, self.config.rollout.max_new_tokens)  # 0: greedy
        out = {"eval_accuracy": _fraction([ok[0] for _, _, _, ok in greedy])}
        out.update({f"eval_{k}": v for k, v in tool_metrics([s for _, ss, _, _ in greedy for s in ss]).items()})
        sampled = None
        if cfg.pass_k > 1:
            if stoppable and self.preempted():
                return None
            sampled, _ = self.rollout(prompts, seed + 1, cfg.pass_k, cfg.temperature, self.config.rollout.max_new_tokens)
            out[f"eval_pass@{cfg.pass_k}"] = _fraction([_any_correct(oks) for _, _, _, oks in sampled])
        self.last_eval_rows = completions.eval_rows(greedy, sampled, self.tokenizer) if self.is_main else []
        return {k: v for k, v in out.items() if v is not None}  # None: no reward term judges correctness

    def checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies (ckpt.verify: files, sizes, metadata). Newer damaged ones are
        skipped with a warning naming each and why; none at all is None; only damaged ones is an error."""
        root = self.run_dir / "checkpoints"
        skipped = []
        for path in saved_checkpoints(root):
            try:
                ckpt.verify(path)
            except ckpt.CheckpointError as err:
                skipped.append(str(err))
                if self.is_main:
                    print(f"warning: skipping damaged checkpoint {path.name}: {err}", flush=True)
                continue
            if skipped and self.is_main:
                print(f"warning: resuming from {path.name}, the newest complete checkpoint", flush=True)
            return path
        if skipped:
            raise ckpt.CheckpointError(f"{root}: no complete checkpoint to resume from ({'; '.join(skipped)})")
        return None

    def _sharded_state(self, is_loading: bool = False) -> dict:
        state = self.policy.sharded_state_dict(is_loading)
        if self.reference is not None:
            state["reference"] = self.reference.module.sharded_state_dict(prefix="reference.")
        return state

    def save_checkpoint(self, progress: dict | None = None, partial: PartialStep | None = None) -> Path:
        """``progress``: where a stop left the run (``warm_start``, ``pending`` metrics, ``partial_step``), for
        the resume; ``partial``: the rest of a step stopped between mini-batches (one file per rank)."""
        started = time.perf_counter()
        meta = {"step": self.step, "data": self.prompts.state_dict(), "faults": self.faults,
                "config": to_dict(self.config), **(progress or {})}
        if self.ahead is not None:
            # the batches already generated ahead belong to the run: the resumed run consumes the same ones
            self.ahead.complete(self.engine.result)
            meta["rollout_ahead"] = self._per_dp_rank(self.ahead.state_dict())
        if self.round_ahead is not None:  # overlap: the next step's round joins the pool it is saved with
            self._take_round_ahead()
            meta["partial_round_ahead"] = self.round_ahead.step
        if self.in_flight is not None:  # the partial responses in flight, continued exactly by the resumed run
            meta["partial_rollouts"] = self._per_dp_rank(self.in_flight.state_dict())
        path = ckpt.save(self._sharded_state(), self.checkpoint_dir(self.step), common=meta, overwrite=True,
                         rank_files=None if partial is None else lambda folder: partial.write(folder, self.rank))
        if self.is_main:
            done = sorted(p for p in path.parent.iterdir() if p.name.startswith("step_") and p.suffix == "")
            for old in done[:-self.config.checkpoint.keep_last]:
                shutil.rmtree(old)
        dist.barrier()
        self.saved_step, self.save_s = self.step, time.perf_counter() - started
        grace = self.config.train.preemption_grace_s
        if self.is_main and grace and not fits_in_grace(grace, elapsed_s=0.0, rest_of_step_s=0.0, save_s=self.save_s):
            print(f"warning: train.preemption_grace_s={grace:g} is shorter than this checkpoint save "
                  f"({self.save_s:.1f} s): a save after a signal would be killed; raise it and the scheduler's grace "
                  f"(docs/slurm.md, \"Preemption grace\")", flush=True)
        return path

    def export_hf(self, checkpoint: Path) -> Path:
        """checkpoint.export_hf: ``convert megatron-to-hf`` of a saved checkpoint into RUN_DIR/hf/<step>, in
        its own process (offline conversion needs a process without our process groups); the others wait."""
        import subprocess
        import sys

        out = self.run_dir / "hf" / checkpoint.name

        def export() -> None:
            cmd = [sys.executable, "-m", "gspo_megatron.cli", "convert", "megatron-to-hf", "--megatron-dir",
                   str(checkpoint), "--out", str(out), "--overwrite", "--no-progress"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                raise ValueError(f"checkpoint.export_hf: {' '.join(cmd[2:])} failed: "
                                 f"{lines[-1] if lines else f'exit {proc.returncode}'}")
            print(f"exported {out} (Hugging Face folder; {proc.stdout.strip().splitlines()[0]})", flush=True)

        on_main_rank(export, self.is_main)
        return out

    def load_checkpoint(self, path: Path, restore_progress: bool = True) -> int | None:
        """With ``restore_progress`` (a resume): model, optimizer, schedule, reference, the step, the data
        position, the fault counters and where a stop left the run; returns the warm-start step to continue
        from when a signal stopped the warm start (else None). Without: the policy weights only (a training
        checkpoint or a converted one, which has nothing else), which the reference then copies."""
        if not restore_progress:
            from gspo_megatron.megatron import sharding

            state = ckpt.load({"model": sharding.sharded_state_dict(self.policy.module, prefix="model.",
                                                                    per_layer=ckpt.per_layer_keys(path))}, path)
            sharding.load_module_state(self.policy.module, state["model"], prefix="model.")
            if self.reference is not None:
                self._copy_weights(self.policy, self.reference)
            return
        saved_config = ckpt.read_meta(path).get("config", {})
        check_resumable(saved_config, to_dict(self.config), path)
        changes = resume_changes(saved_config, to_dict(self.config))  # refuses what cannot change, by name
        meta = ckpt.read_meta(path)
        # other data (fingerprint, size, order) is refused before the load and before any change is logged
        self.prompts.load_state_dict(meta["data"])
        warm = meta.get("warm_start")
        if warm is not None:
            self.policy.reset_optimizer(lr=self.config.sft.lr)  # the checkpoint holds the warm start's optimizer
        state = ckpt.load(self._sharded_state(is_loading=True), path)
        self.policy.load_sharded_state_dict(state)
        if self.is_main:
            for field, old, new in changes:
                print(f"resume: {field} {old!r} -> {new!r} (applied)", flush=True)
        if self.reference is not None:
            self.reference.module.load_state_dict(
                {k.removeprefix("reference."): v for k, v in state["reference"].items()}, strict=True)
        self.step = int(meta["step"])
        self.faults.update(meta["faults"])
        self._load_rollout_ahead(meta.get("rollout_ahead"), path)
        self._load_partial_rollouts(meta.get("partial_rollouts"), path)
        if "partial_round_ahead" in meta:  # that step's first round is in the pool already
            self.round_ahead = RoundAhead(int(meta["partial_round_ahead"]), calls=[], flights=[])
        self.saved_step = self.step
        self.pending = {} if warm is not None else meta.get("pending")
        if "partial_step" in meta:
            self.partial = PartialStep.load(path, meta["partial_step"], self.rank, dist.get_world_size())
        if self.is_main:
            print(f"resumed from {path} at step {self.step}"
                  + (f" (in the warm start, sft step {warm['step']})" if warm is not None else "")
                  + (f" (in the update, {len(self.partial.update_metrics)} mini-batches done)" if self.partial else ""),
                  flush=True)
        return None if warm is None else int(warm["step"])

    def _per_dp_rank(self, state: list) -> dict:
        """Each data-parallel rank's ``state`` (plain data) for the checkpoint's metadata (a collective)."""
        return {"dp_size": self.dp_size, "ranks": self._dp_parts(state)}

    def _my_part(self, saved: dict | None, path: Path, what: str, holder, setting: str) -> list | None:
        """This rank's part of ``_per_dp_rank`` data in a checkpoint (None: nothing saved); ``holder`` None
        (the run has no place for ``what``) or another data-parallel size is refused, naming ``setting``."""
        if saved is None or not any(saved["ranks"]):
            return None
        if holder is None:
            raise ConfigError(f"{path}: the checkpoint holds {what}; resume it with {setting}")
        if saved["dp_size"] != self.dp_size:
            raise ConfigError(f"{path}: the {what} were split over {saved['dp_size']} data-parallel "
                             f"ranks, this run has {self.dp_size}; resume at the same data-parallel size")
        return saved["ranks"][self.dp_rank]

    def _load_rollout_ahead(self, saved: dict | None, path: Path) -> None:
        mine = self._my_part(saved, path, "batches generated ahead", self.ahead, "train.rollout_mode=overlap")
        if mine is not None:
            self.ahead.load_state_dict(mine, self.train_data)

    def _load_partial_rollouts(self, saved: dict | None, path: Path) -> None:
        mine = self._my_part(saved, path, "partial responses in flight", self.in_flight, "rollout.partial=true")
        if mine is not None:
            self.in_flight.load_state_dict(mine, self.train_data)

    # ---- the loop --------------------------------------------------------------------------------
    def preempted(self) -> bool:
        """Whether any rank received a stop signal (a collective: every rank calls it at the same point)."""
        flag = torch.tensor([1.0 if self.preemption.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _stop_before_minibatch(self, left: int, minibatch_s: float) -> bool:
        """Between mini-batches: stop the step here when a signal came and the grace it leaves
        (``train.preemption_grace_s``; 0: unknown, finish the step) would not cover the ``left`` mini-batches
        of about ``minibatch_s`` each plus the save. Any rank's word stops all (a collective)."""
        grace = self.config.train.preemption_grace_s
        stop = self.preemption.requested and grace > 0 and not fits_in_grace(
            grace, self.preemption.seconds_since(), left * minibatch_s, self.save_s)
        flag = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _report_stop(self, where: str) -> None:
        if self.is_main:
            print(f"preempted: checkpoint saved at step {self.step}; exiting ({self.preemption.signal_name} {where})",
                  flush=True)

    def run(self) -> dict[str, float]:
        """Steps until ``train.steps`` or a stop signal. Work stops after any step, between the evaluation's
        rollouts and (train.preemption_grace_s) between mini-batches; each stop saves what is needed to
        continue exactly: the step's metrics still to evaluate and log, the rest of a step (PartialStep)."""
        cfg = self.config
        last: dict[str, float] = {}
        while not self.stopped:
            if self.partial is not None and self.partial.restored:
                self.pending = self._finish_step_update()
            if self.partial is not None:  # a signal stopped the step between mini-batches
                if self.partial.metrics is None:
                    self.partial.metrics = self.pending  # the step's metrics but the update's
                self.save_checkpoint({"pending": self.pending, "partial_step": self.partial.meta()}, self.partial)
                self._report_stop(f"between mini-batches of step {self.step} "
                                  f"({len(self.partial.update_metrics)} of them done)")
                break
            if self.pending is not None:
                evaluated = self._evaluate_and_log()
                if evaluated is None:
                    self.save_checkpoint({"pending": self.pending})
                    self._report_stop(f"in the evaluation of step {self.step}")
                    break
                last = evaluated
            if self.preempted():
                if self.saved_step != self.step:
                    self.save_checkpoint()
                self._report_stop(f"after step {self.step}")
                break
            if self.step >= cfg.train.steps:
                break
            self.pending = self.train_step()
            self.step += 1
        return last

    def _evaluate_and_log(self) -> dict[str, float] | None:
        """Step self.step's evaluation (when due), log and checkpoint (when due) of ``self.pending``; None when
        a signal stopped the evaluation (``self.pending`` is kept for the resumed run)."""
        cfg = self.config
        every, final = cfg.eval.every_steps, self.step == cfg.train.steps
        if self.step == 0 or (every and self.step % every == 0) or final:
            evaluated = self.evaluate(stoppable=True)
            if evaluated is None:
                return None
            self.pending.update(evaluated)
        metrics, self.pending = self.pending, None
        self.logger.log(self.step, metrics)
        saving = cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0 and self.step > 0
        if saving or final:  # final at step 0: a warm-start-only run, whose weights --init-from takes
            saved = self.save_checkpoint()
            if cfg.checkpoint.export_hf == "every_save" or (cfg.checkpoint.export_hf == "end" and final):
                self.export_hf(saved)
        return metrics

    def _finish_step_update(self) -> dict[str, float]:
        """A resumed step that a signal stopped between mini-batches: the rest of its update (step 6), weight
        sync (7) and its metrics (8) with every mini-batch's, as the uninterrupted step would have logged."""
        partial, self.partial = self.partial, None
        more, _ = self._update(partial.shares, self.config.train.routing_replay)
        self.sync_weights()
        metrics = dict(partial.metrics)
        metrics.update(combine_minibatches(partial.update_metrics + more))
        if self.partial is not None:  # stopped again: the rest of the rest
            self.partial.update_metrics = partial.update_metrics + self.partial.update_metrics
            self.partial.metrics = partial.metrics
        return metrics

    def close(self) -> None:
        self.logger.close()
        self.rewards.close()
        self.engine.shutdown()
        self.preemption.uninstall()
        if self.run_lock is not None:
            self.run_lock.release()


def stop_token_ids(tokenizer, hf_dir) -> list[int]:
    """Where a response ends, the same in both engines: the tokenizer's EOS and every EOS id of the model's
    generation config (SGLang stops at those too; chat models often list several, e.g. end-of-turn and
    end-of-text)."""
    ids = [tokenizer.eos_token_id]
    config = Path(hf_dir) / "generation_config.json" if hf_dir is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return sorted({int(i) for i in ids if i is not None})


def reward_metric_keys(reward_metrics: dict[str, float]) -> dict[str, float]:
    """The reward pool's ``rewards/<term>/mean`` ... as the documented ``reward/<term>/mean`` (docs/training.md)."""
    return {f"reward/{k.removeprefix('rewards/')}": v for k, v in reward_metrics.items()}


def _training_sequences(batch, advantages: torch.Tensor, with_routing: bool,
                        keep: list[list[bool]] | None = None) -> list[TrainSequence]:
    """Step 3's output: one TrainSequence per sample with a non-empty response, in prompt-major order;
    ``with_routing``: each carries the engine's experts (R3); ``keep`` [B][G]: False leaves a sample out
    (overlong masking, trainer/batch_filling.py)."""
    seqs = []
    keep = keep if keep is not None else [[True] * len(samples) for _, samples, _, _ in batch]
    for (prompt, samples, _, _), group, kept in zip(batch, advantages, keep):
        for sample, a, k in zip(samples, group.tolist(), kept):
            if not k:
                continue
            tokens = torch.tensor(list(prompt.prompt_ids) + list(sample.response_ids), dtype=torch.long)
            mask = None if sample.response_mask is None else torch.tensor(sample.response_mask, dtype=torch.bool)
            seqs.append(TrainSequence(tokens, len(prompt.prompt_ids), advantage=a,
                                      rollout_logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
                                      routed_experts=sample.all_routed_experts() if with_routing else None,
                                      routing_key=sample.routing_key if with_routing else None, response_mask=mask))
    return [q for q in seqs if q.loss_tokens > 0]


def _batch_metrics(batch, rewards: torch.Tensor, zero_variance: torch.Tensor) -> dict[str, float]:
    """Reward, accuracy (the verifiers' verdicts) and response-length statistics of a rollout batch (rewards [B, G])."""
    samples = [s for _, ss, _, _ in batch for s in ss]
    lengths = torch.tensor([len(s.response_ids) for _, samples, _, _ in batch for s in samples], dtype=torch.float32)
    out = {**tool_metrics(samples),
           "reward_mean": float(rewards.mean()),
           "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
           "accuracy": _fraction([ok for _, _, _, oks in batch for ok in oks]),
           "zero_variance_group_frac": float(zero_variance.float().mean()),
           "response_length_mean": float(lengths.mean())}
    return {k: v for k, v in out.items() if v is not None}


def _fraction(correct: list[bool | None]) -> float | None:
    """The fraction of correct responses; None when any is unjudged (no reward term judges correctness)."""
    if any(ok is None for ok in correct):
        return None
    return sum(float(ok) for ok in correct) / max(len(correct), 1)


def _any_correct(group: list[bool | None]) -> bool | None:
    """pass@k of one prompt: any of its k responses correct (None when unjudged)."""
    return None if any(ok is None for ok in group) else any(group)
