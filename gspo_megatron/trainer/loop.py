"""The GSPO training loop. One step, in the paper's order:

    rollout -> rewards -> group advantages -> old log-probs -> reference (KL > 0) and teacher log-probs
            -> mini-batch updates -> weight sync -> metrics -> checkpoint

Every rank runs this loop. When rollouts run (sync, overlapped, partial; dynamic sampling around any of
them) is the schedule's business: ``trainer/schedule/``, whose driver gives each step its whole, scored
groups, the same on every rank. Each rank computes the group advantages itself and trains on its share of
each mini-batch. On CPU the transformers rollout engine lives in each training process (colocated) and
receives the new weights after every step without touching disk.

Randomness is a pure function of (train.seed, step, rank): every step reseeds, so a run resumed from a
checkpoint draws exactly the samples the uninterrupted run would have drawn. Sampling does not depend on
the rank: each response has its own seed from (train.seed, step, global prompt index, sample index).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.advantages import group_advantages
from gspo_megatron.algorithms.metrics import combine_minibatches
from gspo_megatron.batching import TrainSequence, iter_minibatches, split_for_data_parallel
from gspo_megatron.megatron import checkpoint as ckpt
from gspo_megatron.megatron.parallel import initialize_model_parallel
from gspo_megatron.megatron.routing import replay_for_step
from gspo_megatron.rollout.agent_loop import tool_metrics
from gspo_megatron.trainer import checkpointing, completions
from gspo_megatron.trainer import components as parts
from gspo_megatron.trainer.config import TrainConfig, check_resumable, save_config
from gspo_megatron.trainer.finite import check_advantages, check_reward_failures, check_some_update_applied
from gspo_megatron.trainer.metrics_log import truncate_after
from gspo_megatron.trainer.preemption import StoppedUpdate, fits_in_grace
from gspo_megatron.trainer.resume import resume_changes
from gspo_megatron.trainer.routing_exchange import RoutingHold
from gspo_megatron.trainer.run_dir import claim as claim_run_dir
from gspo_megatron.trainer.run_dir import on_main_rank
from gspo_megatron.trainer.schedule import build_driver
from gspo_megatron.trainer.schedule.base import RolloutGroup, step_seed
from gspo_megatron.trainer.schedule.rollouts import Rollouts
from gspo_megatron.trainer.teacher import build_teacher
from gspo_megatron.typed_config import to_dict


class Trainer:
    """Builds everything from a ``TrainConfig`` and runs the loop (see the module docstring)."""

    def __init__(self, config: TrainConfig, run_dir: str | Path, resume: bool = False,
                 init_checkpoint: str | Path | None = None):
        """resume: continue from the newest checkpoint in ``run_dir``; init_checkpoint: take the weights
        (only) of that checkpoint folder instead of the configured initialisation (``gspo-megatron eval``)."""
        from gspo_megatron.data.dataset import load_prompt_datasets
        from gspo_megatron.data.iterator import PromptIterator
        from gspo_megatron.rewards.pool import build_reward_pool
        from gspo_megatron.trainer.metrics_log import MetricsLogger
        from gspo_megatron.trainer.preemption import PreemptionFlag

        self.config = config
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        # one run per folder, locked while in use (trainer/run_dir.py); config.yaml is written only once
        # the set-up below succeeded, so a failed start or resume never replaces the run's saved config
        self.run_lock = on_main_rank(lambda: claim_run_dir(self.run_dir, resume), self.is_main)
        initialize_model_parallel(config.parallel, seed=config.model.init_seed)

        self.tokenizer = parts.load_tokenizer(config.model)
        self.model_config = parts.model_config_of(config.model)
        self.policy = parts.policy_model(config, self.model_config, frozen=False)
        self.dp_size, self.dp_rank = self.policy.groups.dp_size, self.policy.groups.dp_rank
        self.routing_hold = RoutingHold(self.dp_rank, self.dp_size, self.policy.groups.data_parallel)
        # a frozen copy of the initial weights; built only when the KL term is on
        self.reference = parts.policy_model(config, self.model_config, frozen=True) if config.loss.kl_coef > 0 else None
        # the on-policy distillation teacher (distill.teacher_dir; trainer/teacher.py), frozen, loaded once
        self.teacher = build_teacher(config, self.model_config, self.tokenizer)
        self.faults = {"skipped_updates": 0, "reward_failures": 0, "engine_restarts": 0}
        self.supervisor = parts.engine_supervisor(config, self.model_config, self.tokenizer, self.policy, self.faults,
                                                  self.rank)
        self.train_data, self.eval_data = load_prompt_datasets(config.data, self.tokenizer)
        self.prompts = PromptIterator(self.train_data, config.train.prompts_per_step, seed=config.data.seed,
                                      shuffle=config.data.shuffle)
        self.rewards = build_reward_pool(config.rewards, on_failures=self._count_reward_failures)
        score = parts.reward_scorer(self.tokenizer, self.rewards, self.routing_hold.keep, self.model_config.num_experts)
        self.rollouts = Rollouts(self.supervisor, self.prompts, self.train_data, parts.sampling_rule(config, self.tokenizer),
                                 score, self.policy.groups.data_parallel, self.dp_size, self.dp_rank)
        self.preemption = PreemptionFlag()
        self.preemption.install()
        self.driver = build_driver(config, self.rollouts, progress=self.is_main, stop_requested=self.preempted)
        self.supervisor.on_restart = self.driver.resubmit
        self.step = 0
        self.reward_streaks: dict[str, int] = {}  # failing batches in a row per reward term (trainer/finite.py)
        # where a stop left the run (trainer/preemption.py): the metrics of step self.step still to be
        # evaluated and logged (None: none), the rest of an update stopped between mini-batches, whether a
        # signal stopped the run in its warm start, the step last saved and how long saves take
        self.pending: dict[str, float] | None = {}
        self.stopped_update: StoppedUpdate | None = None
        self.stopped = False
        self.saved_step, self.save_s = -1, 0.0

        latest = checkpointing.latest_checkpoint(self.run_dir, self.is_main) if resume else None
        if resume and latest is None and self.is_main:
            print(f"--resume: {self.run_dir} holds no checkpoint yet; starting its run from the beginning", flush=True)
        warm_from = None  # the supervised warm start continues from this step (None: no warm start to run)
        if latest is not None:
            warm_from = self.load_checkpoint(latest)
        elif init_checkpoint is not None:
            ckpt.verify(init_checkpoint)  # a missing or cut checkpoint is named, not a DCP traceback
            checkpointing.load_weights_only(self.policy, Path(init_checkpoint))
            if self.reference is not None:
                checkpointing.copy_weights(self.policy, self.reference)
        else:
            checkpointing.initialise_weights(self.policy, self.model_config, config.model)
            warm_from = 0
        if warm_from is not None:
            if warm_from < config.sft.steps:
                self.warm_start(warm_from)
            elif warm_from > 0:  # resumed in a warm start that sft.steps now ends: RL's own optimizer
                self.policy.reset_optimizer()
            if self.reference is not None and not self.stopped:
                # the frozen reference is the policy RL starts from (after the warm start)
                checkpointing.copy_weights(self.policy, self.reference)
        self.sync_weights(self.step)
        if self.is_main:
            truncate_after(self.run_dir, self.step if latest is not None else -1)
            completions.truncate_completions(self.run_dir, self.step if latest is not None else -1)
        self.logger = MetricsLogger(self.run_dir, enabled=self.is_main, tensorboard=config.logging.tensorboard,
                                    wandb_project=config.logging.wandb_project, total_steps=config.train.steps,
                                    console=config.logging.console)
        if self.is_main:
            save_config(config, self.run_dir / "config.yaml")

    @property
    def engine(self):
        """The rollout engine the schedule drives (owned by ``supervisor``)."""
        return self.supervisor.engine

    def _count_reward_failures(self, n: int) -> None:
        self.faults["reward_failures"] += n

    def warm_start(self, start: int = 0) -> None:
        """The supervised warm start from step ``start`` (trainer/warm_start.py). A signal stops it after any
        step with a checkpoint of that step (``warm_start`` in its metadata)."""
        from gspo_megatron.trainer.warm_start import run_warm_start

        stopped_at = run_warm_start(self.policy, self.config, self.tokenizer, self.train_data, self.run_dir, start,
                                    self.dp_size, self.dp_rank, self.is_main, self.preempted)
        if stopped_at is not None:
            self.save_checkpoint({"warm_start": {"step": stopped_at}})
            self._report_stop(f"in the warm start at sft step {stopped_at}")
            self.stopped = True

    # ---- one RL step -----------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One GSPO step, the paper's order: 1-2 rollout of G samples per prompt and their rewards (the
        schedule's driver); 3 group advantages (Eq. 6); 4 old-policy log-probs; 5 reference log-probs (KL >
        0) and the distillation teacher's (distill.teacher_dir); 6 one optimizer step per mini-batch; 7 weight
        sync to the rollout engine; 8 metrics. Routing Replay (R2/R3) and routing drift live inside steps 4
        and 6 (``_old_logprobs``, ``_update``)."""
        cfg = self.config
        torch.manual_seed(step_seed(cfg.train.seed, self.step, self.rank))
        clock = _Clock()
        # 1-2. rollout and rewards
        rollout = self.driver.step_groups(self.step)
        clock.lap("time_rollout_s")
        self.supervisor.release_for_update(self.driver.busy_during_update)
        # 3. group advantages (Eq. 6) over whole groups
        rewards, adv = self._advantages(rollout)
        replay = cfg.train.routing_replay  # off | r2 (old-policy forward's experts) | r3 (the engine's) | auto
        seqs = _training_sequences(rollout.groups, adv.advantages, with_routing=replay in ("r3", "auto"),
                                   keep=rollout.keep)
        shares = self._shares(seqs, with_routing=replay in ("r3", "auto"))
        # 4. old log-probs: recomputed by the training model (default) in one call for the whole step, or
        #    the engine's (paper section 5.4)
        my_seqs = [q for share in shares for q in share]
        replay, routing_metrics = self._old_logprobs(my_seqs, replay)  # auto: this step's r3 or off
        # 5. reference log-probs when the KL term is on; the distillation teacher's when it is set
        if self.reference is not None:
            _set_logprobs(my_seqs, "ref_logprobs", self.reference.compute_logprobs(my_seqs))
        if self.teacher is not None:
            _set_logprobs(my_seqs, "teacher_logprobs", self.teacher.compute_logprobs(my_seqs))
        clock.lap("time_logprobs_s")
        # 6. one optimizer step per mini-batch
        update_metrics, drift_metrics = self._update(shares, replay)
        self.faults["skipped_updates"] = self.policy.skipped_steps
        check_some_update_applied(update_metrics, self.step + 1, self.policy.skipped_steps)
        clock.lap("time_update_s")
        # 7. weight sync to the rollout engine
        sync = self.sync_weights(self.step + 1)
        clock.lap("time_sync_s")
        # 8. metrics
        metrics = {**drift_metrics, "sync_bytes_per_s": sync["sync_bytes_per_s"], **combine_minibatches(update_metrics),
                   **_batch_metrics(rollout.groups, rewards, adv.zero_variance), **routing_metrics}
        metrics.update(self._schedule_metrics(rollout, metrics))
        metrics.update(clock.timings(tokens=sum(q.tokens.numel() for q in seqs)))
        metrics.update({f"faults/{k}": float(v) for k, v in self.faults.items()})
        self.log_completions(rollout.groups)
        return metrics

    def _advantages(self, rollout) -> tuple[torch.Tensor, object]:
        """Step 3: the rewards [B, G] and the group advantages (Eq. 6) of the step's groups; a run whose rewards
        cannot train (non-finite advantages, a reward term failing) stops here, naming the term."""
        cfg = self.config
        rewards = torch.tensor([r for g in rollout.groups for r in g.rewards],
                               dtype=torch.float32).view(len(rollout.groups), cfg.rollout.samples_per_prompt)
        adv = group_advantages(rewards, estimator=cfg.loss.advantage_estimator, eps=cfg.loss.advantage_eps,
                               batch_norm=cfg.loss.advantage_batch_norm)
        check_advantages(rewards, adv.advantages, cfg.rewards.terms, self.step + 1)
        self.reward_streaks = check_reward_failures(rollout.reward_metrics, cfg.rewards, self.reward_streaks,
                                                    self.step + 1, self.rewards.first_failures, self.run_dir, self.rank)
        return rewards, adv

    def _shares(self, seqs: list[TrainSequence], with_routing: bool) -> list[list[TrainSequence]]:
        """Step 3's mini-batches, each cut into this rank's share; under R3 every rank receives the engine's
        experts of the sequences it trains (trainer/routing_exchange.py)."""
        minibatches = list(iter_minibatches(seqs, self.config.train.minibatches_per_step))
        if with_routing:
            self.routing_hold.deliver([[q for mb in minibatches for q in split_for_data_parallel(mb, self.dp_size, r)]
                                       for r in range(self.dp_size)])
        return [split_for_data_parallel(mb, self.dp_size, self.dp_rank) for mb in minibatches]

    def _schedule_metrics(self, rollout, metrics: dict[str, float]) -> dict[str, float]:
        """The schedule's metrics: staleness (clip fractions by staleness when overlapped), filter/overlong,
        overlap timing or partial-rollout counts, and the reward terms."""
        out = {"staleness": float(rollout.staleness), **rollout.metrics, **reward_metric_keys(rollout.reward_metrics)}
        if self.driver.busy_during_update:  # overlapped: the clip fractions by the batch's age
            out.update({f"{k}/staleness{rollout.staleness}": v for k, v in metrics.items() if k.startswith("clip_frac")})
        return out

    def log_completions(self, batch: list[RolloutGroup]) -> None:
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
        _set_logprobs(seqs, "old_logprobs", old)
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
                self.stopped_update = StoppedUpdate(shares[k:], per_minibatch)
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
    def sync_weights(self, updates: int) -> dict[str, float]:
        """Step 7: the policy's weights, holding ``updates`` RL updates, to the engine (the supervisor's)."""
        return self.supervisor.sync_weights(updates)

    def evaluate(self, stoppable: bool = False) -> dict[str, float] | None:
        """pass@1 and pass@k on the held-out prompts (trainer/components.py); ``stoppable``: None when a stop
        signal came before or between the two rollouts."""
        data = self.eval_data if self.eval_data is not None else self.train_data
        metrics, self.last_eval_rows = parts.evaluate(self.rollouts, self.config, data, self.step, self.tokenizer,
                                                      self.is_main, self.preempted if stoppable else lambda: False)
        return metrics

    def checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def _sharded_state(self, is_loading: bool = False) -> dict:
        state = self.policy.sharded_state_dict(is_loading)
        if self.reference is not None:
            state["reference"] = self.reference.module.sharded_state_dict(prefix="reference.")
        return state

    def save_checkpoint(self, progress: dict | None = None, stopped_update: StoppedUpdate | None = None) -> Path:
        """``progress``: where a stop left the run (``warm_start``, ``pending`` metrics, ``partial_step``), for
        the resume; ``stopped_update``: the rest of an update stopped between mini-batches (one file per rank).
        The schedule's work in flight is finished first and saved with it (``RolloutDriver.drain``)."""
        started = time.perf_counter()
        self.driver.drain()
        meta = {"step": self.step, "data": self.prompts.state_dict(), "faults": self.faults,
                "config": to_dict(self.config), **(progress or {}), **self.driver.state_dict()}
        rank_files = None if stopped_update is None else lambda folder: stopped_update.write(folder, self.rank)
        path = ckpt.save(self._sharded_state(), self.checkpoint_dir(self.step), common=meta, overwrite=True,
                         rank_files=rank_files)
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

    def load_checkpoint(self, path: Path) -> int | None:
        """A resume: model, optimizer, schedule, reference, the step, the data position, the fault counters,
        the rollout schedule's state and where a stop left the run; returns the warm-start step to continue
        from when a signal stopped the warm start (else None)."""
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
        self.driver.load_state_dict(meta, path)
        self.saved_step = self.step
        self.pending = {} if warm is not None else meta.get("pending")
        if "partial_step" in meta:
            self.stopped_update = StoppedUpdate.load(path, meta["partial_step"], self.rank, dist.get_world_size())
        if self.is_main:
            print(f"resumed from {path} at step {self.step}"
                  + (f" (in the warm start, sft step {warm['step']})" if warm is not None else "")
                  + (f" (in the update, {len(self.stopped_update.update_metrics)} mini-batches done)"
                     if self.stopped_update else ""), flush=True)
        return None if warm is None else int(warm["step"])

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
        continue exactly: the step's metrics still to evaluate and log, the rest of a step (StoppedUpdate)."""
        cfg = self.config
        last: dict[str, float] = {}
        while not self.stopped:
            if self.stopped_update is not None and self.stopped_update.restored:
                self.pending = self._finish_step_update()
            if self.stopped_update is not None:  # a signal stopped the step between mini-batches
                if self.stopped_update.metrics is None:
                    self.stopped_update.metrics = self.pending  # the step's metrics but the update's
                self.save_checkpoint({"pending": self.pending, "partial_step": self.stopped_update.meta()},
                                     self.stopped_update)
                self._report_stop(f"between mini-batches of step {self.step} "
                                  f"({len(self.stopped_update.update_metrics)} of them done)")
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
                checkpointing.export_hf(self.run_dir, saved, self.is_main)
        return metrics

    def _finish_step_update(self) -> dict[str, float]:
        """A resumed step that a signal stopped between mini-batches: the rest of its update (step 6), weight
        sync (7) and its metrics (8) with every mini-batch's, as the uninterrupted step would have logged."""
        stopped, self.stopped_update = self.stopped_update, None
        more, _ = self._update(stopped.shares, self.config.train.routing_replay)
        self.sync_weights(self.step)
        metrics = dict(stopped.metrics)
        metrics.update(combine_minibatches(stopped.update_metrics + more))
        if self.stopped_update is not None:  # stopped again: the rest of the rest
            self.stopped_update.update_metrics = stopped.update_metrics + self.stopped_update.update_metrics
            self.stopped_update.metrics = stopped.metrics
        return metrics

    def close(self) -> None:
        self.logger.close()
        self.rewards.close()
        self.supervisor.shutdown()
        self.preemption.uninstall()
        if self.run_lock is not None:
            self.run_lock.release()


class _Clock:
    """Step timings: ``lap(name)`` records the seconds since the last lap under ``name``."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = now - self.last, now

    def timings(self, tokens: int) -> dict[str, float]:
        """The laps, the whole step's seconds and its throughput over ``tokens`` trained tokens."""
        total = time.perf_counter() - self.start
        return {**self.laps, "time_step_s": total, "tokens_per_s": float(tokens) / max(total, 1e-9)}


def reward_metric_keys(reward_metrics: dict[str, float]) -> dict[str, float]:
    """The reward pool's ``rewards/<term>/mean`` ... as the documented ``reward/<term>/mean`` (docs/training.md)."""
    return {f"reward/{k.removeprefix('rewards/')}": v for k, v in reward_metrics.items()}


def _training_sequences(batch, advantages: torch.Tensor, with_routing: bool,
                        keep: list[list[bool]] | None = None) -> list[TrainSequence]:
    """Step 3's output: one TrainSequence per sample with a non-empty response, in prompt-major order;
    ``with_routing``: each carries the engine's experts (R3); ``keep`` [B][G]: False leaves a sample out
    (overlong masking, trainer/batch_filling.py)."""
    seqs = []
    keep = keep if keep is not None else [[True] * len(g.samples) for g in batch]
    for g, group, kept in zip(batch, advantages, keep):
        prompt = g.prompt
        for sample, a, k in zip(g.samples, group.tolist(), kept):
            if not k:
                continue
            tokens = torch.tensor(list(prompt.prompt_ids) + list(sample.response_ids), dtype=torch.long)
            mask = None if sample.response_mask is None else torch.tensor(sample.response_mask, dtype=torch.bool)
            seqs.append(TrainSequence(tokens, len(prompt.prompt_ids), advantage=a,
                                      rollout_logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
                                      routed_experts=sample.all_routed_experts() if with_routing else None,
                                      routing_key=sample.routing_key if with_routing else None, response_mask=mask))
    return [q for q in seqs if q.loss_tokens > 0]


def _set_logprobs(seqs: list[TrainSequence], field: str, outputs: list[dict]) -> None:
    """Each sequence's ``field`` := its log-probs from ``compute_logprobs`` ``outputs`` (one per sequence)."""
    for q, o in zip(seqs, outputs):
        setattr(q, field, o["logprobs"])


def _batch_metrics(batch, rewards: torch.Tensor, zero_variance: torch.Tensor) -> dict[str, float]:
    """Reward, accuracy (the verifiers' verdicts) and response-length statistics of a rollout batch (rewards [B, G])."""
    samples = [s for g in batch for s in g.samples]
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    out = {**tool_metrics(samples),
           "reward_mean": float(rewards.mean()),
           "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
           "accuracy": parts.fraction([ok for g in batch for ok in g.verdicts]),
           "zero_variance_group_frac": float(zero_variance.float().mean()),
           "response_length_mean": float(lengths.mean())}
    return {k: v for k, v in out.items() if v is not None}
