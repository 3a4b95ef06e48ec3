"""The one typed config tree of a training run, loaded from YAML with dotted command-line overrides.

    gspo-megatron train --config examples/cpu_demo.yaml train.steps=40 loss.algorithm=grpo

Every section is a dataclass validated at start-up; an error names the dotted field
(``train.minibatches_per_step: must divide ...``). The resolved config is saved as
``RUN_DIR/config.yaml`` with every run.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import yaml

from gspo_megatron.algorithms.config import DistillConfig, LossConfig
from gspo_megatron.data.config import DataConfig
from gspo_megatron.megatron.model import ModelRuntime
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.parallel import ParallelConfig
from gspo_megatron.megatron.optimizer import OptimizerConfig, offload_refusal
from gspo_megatron.rewards.config import RewardConfig
from gspo_megatron.rollout.agent_loop import MultiTurnConfig
from gspo_megatron.rollout.partial import steps_in_flight
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.typed_config import ConfigError, build, check, to_dict


# any of these makes a folder loadable by transformers' AutoTokenizer
MAX_GENERATION_ROUNDS = 64  # rollout.max_generation_rounds: rounds of dynamic sampling in one step
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass
class ModelSection:
    """Either ``hf_dir`` (a Hugging Face folder: config.json, safetensors, tokenizer) or an inline
    ``config`` with random initialisation (the CPU demo). ``tokenizer_dir`` defaults to ``hf_dir``, and
    to the repository's demo tokenizer when neither is set. ``precision`` (fp32 | bf16 | fp16),
    ``recompute`` (none | selective | full) and ``layer_spec`` (auto | te | local): how the model runs
    (megatron/model.py ModelRuntime; docs/gpu.md)."""

    hf_dir: str | None = None
    config: ModelConfig | None = None
    tokenizer_dir: str | None = None
    init_seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    recompute: Literal["none", "selective", "full"] = "none"
    layer_spec: Literal["auto", "te", "local"] = "auto"
    # gradient buffers and their all-reduce in fp32 (Megatron's grad_reduce_in_fp32), or in the model's
    # precision when false (bf16 gradients: 2 B instead of 4 B per parameter; tools/slurm/memory_plan.py)
    grad_reduce_in_fp32: bool = True

    def validate(self, path: str) -> None:
        check((self.hf_dir is None) != (self.config is None), f"{path}.hf_dir",
              "set exactly one of model.hf_dir and model.config")
        if self.hf_dir is not None and self.tokenizer_dir is None and Path(self.hf_dir).is_dir():
            check(any((Path(self.hf_dir) / name).is_file() for name in TOKENIZER_FILES), f"{path}.hf_dir",
                  f"{self.hf_dir} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); add it or set "
                  f"{path}.tokenizer_dir")

    @property
    def runtime(self) -> ModelRuntime:
        return ModelRuntime(precision=self.precision, recompute=self.recompute, layer_spec=self.layer_spec,
                            grad_reduce_in_fp32=self.grad_reduce_in_fp32)


@dataclasses.dataclass
class RolloutSection:
    """How responses are sampled. ``engine``: hf (in-process transformers, CPU default) or sglang (GPU).
    ``logprobs_from``: pi_old for the ratio: ``recompute`` with the training model (default) or take
    the ``engine``'s log-probs (paper section 5.4)."""

    engine: Literal["hf", "sglang"] = "hf"
    samples_per_prompt: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    logprobs_from: Literal["recompute", "engine"] = "recompute"
    engine_threads: int = 1  # torch threads of the engine process (train.rollout_mode: overlap)
    # niceness added to the engine process (overlap): the trainer is the critical path, so the engine takes a
    # core only when the trainer leaves it idle (its serial Python between parallel ops); 0: equal priority
    engine_nice: int = 19
    sglang: SGLangConfig | None = None  # required with engine: sglang
    # dynamic sampling (trainer/batch_filling.py, DAPO): zero_variance drops groups whose rewards are all equal
    # and generates further rounds of prompts_per_step prompts until the step holds prompts_per_step
    # informative groups, at most max_generation_rounds rounds (then it trains on what it has)
    filter_groups: Literal["none", "zero_variance"] = "none"
    max_generation_rounds: int = 3
    # responses cut at max_new_tokens: mask takes them out of the loss; soft_penalty adds DAPO's linear length
    # penalty (0 down to -1) over the last overlong_buffer_tokens tokens before max_new_tokens to every reward
    overlong: Literal["none", "mask", "soft_penalty"] = "none"
    overlong_buffer_tokens: int = 0
    # tool calls during a response (rollout/agent_loop.py, docs/multi-turn.md); max_new_tokens bounds each turn
    multi_turn: MultiTurnConfig | None = None
    # partial rollouts (rollout/partial.py): each step gives every unfinished response at most
    # partial_token_budget new tokens; groups not finished by then continue next step under the new weights
    partial: bool = False
    partial_token_budget: int = 0

    def validate(self, path: str) -> None:
        check(self.samples_per_prompt >= 2, f"{path}.samples_per_prompt",
              f"must be >= 2 (group advantages need a group), got {self.samples_per_prompt}")
        check(self.max_new_tokens >= 1, f"{path}.max_new_tokens", "must be >= 1")
        check(self.temperature > 0, f"{path}.temperature", "must be > 0 for RL sampling")
        check(0 < self.top_p <= 1, f"{path}.top_p", "must be in (0, 1]")
        check(self.engine_threads >= 1, f"{path}.engine_threads", f"must be >= 1, got {self.engine_threads}")
        check(0 <= self.engine_nice <= 19, f"{path}.engine_nice", f"must be in 0..19, got {self.engine_nice}")
        check(self.engine != "sglang" or self.sglang is not None, f"{path}.sglang",
              "required with engine: sglang (urls of running servers, or launch settings)")
        check(self.max_generation_rounds >= 1, f"{path}.max_generation_rounds",
              f"must be >= 1, got {self.max_generation_rounds}")
        # each round generates prompts_per_step x samples_per_prompt responses again inside one step: a step
        # that needs more than this many rounds has data that is almost never informative
        check(self.max_generation_rounds <= MAX_GENERATION_ROUNDS, f"{path}.max_generation_rounds",
              f"must be in 1..{MAX_GENERATION_ROUNDS} (each round generates the step's whole batch again; a step "
              f"needing more rounds has data that is almost never informative), got {self.max_generation_rounds}")
        check(self.overlong != "soft_penalty" or 1 <= self.overlong_buffer_tokens <= self.max_new_tokens,
              f"{path}.overlong_buffer_tokens", f"must be in 1..rollout.max_new_tokens ({self.max_new_tokens}) "
              f"with overlong: soft_penalty, got {self.overlong_buffer_tokens}")
        check(self.overlong == "soft_penalty" or self.overlong_buffer_tokens == 0, f"{path}.overlong_buffer_tokens",
              f"has no effect with rollout.overlong: {self.overlong} (only soft_penalty reads it): set it to 0 or "
              f"use soft_penalty, got {self.overlong_buffer_tokens}")
        check(not self.partial or 1 <= self.partial_token_budget <= self.max_new_tokens,
              f"{path}.partial_token_budget", f"must be in 1..rollout.max_new_tokens ({self.max_new_tokens}) "
              f"with partial: true, got {self.partial_token_budget}")
        check(self.partial or self.partial_token_budget == 0, f"{path}.partial_token_budget",
              f"has no effect without rollout.partial: true: set it to 0 or turn partial on, got "
              f"{self.partial_token_budget}")


@dataclasses.dataclass
class TrainSection:
    """steps: RL steps; prompts_per_step x samples_per_prompt responses per step, split into
    minibatches_per_step optimizer steps (the paper uses 4). routing_replay: off | r2 | r3 | auto (per
    step: r3 when the engine/trainer routing agreement is below routing_agreement_threshold, else off)."""

    steps: int = 20
    prompts_per_step: int = 8
    minibatches_per_step: int = 4
    max_tokens_per_microbatch: int = 2048
    routing_replay: Literal["off", "r2", "r3", "auto"] = "off"
    routing_agreement_threshold: float = 0.9  # auto: fraction of the engine's top-k experts the trainer shares
    measure_routing_drift: bool = True
    seed: int = 0
    # sync: generate, then train on it. overlap: the engine (its own process) generates the next steps'
    # batches while the trainer updates; a batch is at most max_staleness updates old (trainer/schedule/overlap.py)
    rollout_mode: Literal["sync", "overlap"] = "sync"
    max_staleness: int = 1
    # torch threads of each trainer process in overlap mode; 0: the process's share of the cores minus
    # rollout.engine_threads. More can pay: the engine is idle once its batch is ahead.
    trainer_threads: int = 0
    # seconds the scheduler leaves between its stop signal and SIGKILL (Slurm: KillWait, or the --signal
    # lead time); a step then stops between mini-batches when finishing it and saving would not fit (its
    # rest is saved and resumed exactly). 0: unknown, every step is finished before the save (docs/slurm.md)
    preemption_grace_s: float = 0.0

    def validate(self, path: str) -> None:
        check(self.steps >= 0, f"{path}.steps", "must be >= 0")
        check(self.prompts_per_step >= 1, f"{path}.prompts_per_step", "must be >= 1")
        check(self.minibatches_per_step >= 1, f"{path}.minibatches_per_step", "must be >= 1")
        check(self.max_tokens_per_microbatch >= 1, f"{path}.max_tokens_per_microbatch", "must be >= 1")
        check(self.max_staleness >= 0, f"{path}.max_staleness", f"must be >= 0, got {self.max_staleness}")
        check(self.trainer_threads >= 0, f"{path}.trainer_threads", f"must be >= 0, got {self.trainer_threads}")
        check(0.0 <= self.routing_agreement_threshold <= 1.0, f"{path}.routing_agreement_threshold",
              f"must be in [0, 1] (a fraction of top-k experts), got {self.routing_agreement_threshold}")
        check(self.preemption_grace_s >= 0, f"{path}.preemption_grace_s", f"must be >= 0, got {self.preemption_grace_s}")


@dataclasses.dataclass
class SFTSection:
    """Supervised warm start before RL (the paper starts RL from a cold-start fine-tuned model).
    ``steps: 0`` skips it. Trained on ``examples`` (prompt, reference answer) pairs of the train split."""

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    # multi-turn warm start: 'module:function' mapping a prompt sample to the chat messages after its prompt
    # (assistant turns that call tools, the tool answers, the final answer); tool and template tokens are
    # masked out of the loss like in RL (rollout/agent_loop.py trace_tokens)
    traces: str | None = None

    def validate(self, path: str) -> None:
        check(self.steps >= 0, f"{path}.steps", "must be >= 0")
        check(self.batch_size >= 1, f"{path}.batch_size", "must be >= 1")
        check(self.lr > 0, f"{path}.lr", "must be > 0")


@dataclasses.dataclass
class EvalSection:
    """Held-out evaluation every ``every_steps`` (0: only at the start and the end): greedy pass@1 and
    sampled pass@k on up to ``num_prompts`` prompts."""

    every_steps: int = 5
    num_prompts: int = 64
    pass_k: int = 4
    temperature: float = 1.0

    def validate(self, path: str) -> None:
        check(self.every_steps >= 0, f"{path}.every_steps", "must be >= 0")
        check(self.num_prompts >= 1, f"{path}.num_prompts", "must be >= 1")
        check(self.pass_k >= 1, f"{path}.pass_k", "must be >= 1")
        check(self.temperature > 0, f"{path}.temperature", f"must be > 0, got {self.temperature}")


@dataclasses.dataclass
class LoggingSection:
    """Metrics go to RUN_DIR/metrics.jsonl always; also TensorBoard (RUN_DIR/tensorboard), Weights &
    Biases when ``wandb_project`` is set (pip install wandb), and a live console display."""

    tensorboard: bool = True
    wandb_project: str | None = None
    console: bool = True
    # sampled completions (prompt, response, reward) per step to RUN_DIR/completions.jsonl and TensorBoard
    # text (0: none), and one printed every console_completion_every steps (0: never)
    completions_per_step: int = 4
    console_completion_every: int = 10

    def validate(self, path: str) -> None:
        check(self.completions_per_step >= 0, f"{path}.completions_per_step", "must be >= 0")
        check(self.console_completion_every >= 0, f"{path}.console_completion_every", "must be >= 0")


@dataclasses.dataclass
class CheckpointSection:
    """Save every ``every_steps`` (0: only at the end and on preemption), keep the last ``keep_last``.
    ``export_hf``: also write a complete Hugging Face folder (weights, config, generation config,
    tokenizer) to RUN_DIR/hf/step_NNNNNN: never, at the ``end`` of the run, or at ``every_save``."""

    every_steps: int = 10
    keep_last: int = 2
    export_hf: Literal["never", "end", "every_save"] = "never"

    def validate(self, path: str) -> None:
        check(self.every_steps >= 0, f"{path}.every_steps", "must be >= 0")
        check(self.keep_last >= 1, f"{path}.keep_last", "must be >= 1")


@dataclasses.dataclass
class TrainConfig:
    data: DataConfig
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    rewards: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)

    def validate(self, path: str) -> None:
        # context parallelism: what has not been run with it is refused by name (docs/megatron.md)
        check(self.parallel.context_parallel == 1 or self.model.recompute == "none", "model.recompute",
              f"must be none with parallel.context_parallel={self.parallel.context_parallel} (activation "
              "recomputation has not been run with context parallelism)")
        check(self.train.routing_replay != "r2" or self.rollout.logprobs_from == "recompute",
              "train.routing_replay", "r2 records the experts in the recomputed old-policy forward: "
              "needs rollout.logprobs_from: recompute (or use r3, the engine's experts)")
        if self.train.routing_replay != "off" and self.model.config is not None:
            check(self.model.config.is_moe, "train.routing_replay",
                  f"{self.train.routing_replay} replays MoE routing; model.config.num_experts is 0 (dense)")
        launch = self.rollout.sglang.launch if self.rollout.sglang is not None else None
        check(self.train.routing_replay != "auto" or self.rollout.logprobs_from == "recompute",
              "train.routing_replay", "auto compares the engine's experts with the recomputed old-policy "
              "forward's: needs rollout.logprobs_from: recompute")
        if self.train.routing_replay in ("r3", "auto") and self.rollout.engine == "sglang" and launch is not None:
            check(launch.enable_return_routed_experts, "rollout.sglang.launch.enable_return_routed_experts",
                  f"must be true with train.routing_replay: {self.train.routing_replay} (the servers must return the routed experts)")
        if self.rollout.engine == "sglang" and launch is not None:
            # the trainer's log-probs are of softmax(logits / T): the engine must report that distribution
            check(not launch.return_original_logprob or self.rollout.temperature == 1.0,
                  "rollout.sglang.launch.return_original_logprob",
                  f"must be false at rollout.temperature {self.rollout.temperature} (it reports log-probs "
                  "before temperature, not of the distribution sampled from)")
        # overlap with SGLang: the servers must keep their memory while the trainer trains
        sglang = self.rollout.sglang
        check(self.train.rollout_mode == "sync" or self.rollout.engine != "sglang" or sglang is None
              or not (sglang.weight_sync == "tensor" and sglang.release_memory), "rollout.sglang.release_memory",
              "must be false with train.rollout_mode: overlap (the servers generate the next batch while the trainer "
              "trains, so they cannot give their GPU memory back meanwhile)")
        check_reward_imports(self.rewards)
        if self.rollout.multi_turn is not None:
            check_tool_imports(self.rollout.multi_turn.tools, self.rewards.import_dirs)
        # auto replays r3 in the steps whose agreement is low, so it needs what r3 needs
        check(self.rollout.multi_turn is None or self.train.routing_replay not in ("r3", "auto"), "train.routing_replay",
              f"{self.train.routing_replay} is not supported with rollout.multi_turn (the engine's experts of the tool "
              "tokens are not recorded): use off or r2")
        check(self.sft.traces is None or self.rollout.multi_turn is not None, "sft.traces",
              "needs rollout.multi_turn (the traces' tool turns are rendered by its chat template)")
        if self.sft.traces is not None:
            check_import(self.sft.traces, "sft.traces", self.rewards.import_dirs)
        multi_turn = self.rollout.multi_turn
        if multi_turn is not None and self.model.config is not None:
            need = self.data.max_prompt_tokens + multi_turn.max_trajectory_tokens
            check(self.model.config.max_position_embeddings >= need, "rollout.multi_turn.max_trajectory_tokens",
                  f"data.max_prompt_tokens + max_trajectory_tokens = {need} exceeds "
                  f"model.config.max_position_embeddings ({self.model.config.max_position_embeddings})")
        if self.rollout.partial:
            check_partial(self)
        offload = offload_refusal(self.optimizer.cpu_offload_fraction, self.parallel.distributed_optimizer,
                                  self.model.precision)
        check(offload is None, "optimizer.cpu_offload_fraction", offload or "")
        responses = self.train.prompts_per_step * self.rollout.samples_per_prompt
        check(responses >= self.train.minibatches_per_step, "train.minibatches_per_step",
              f"must be <= prompts_per_step x samples_per_prompt = {responses}")
        model, where = self.model.config, "model.config"
        if model is None and self.model.hf_dir is not None and (Path(self.model.hf_dir) / "config.json").is_file():
            model, where = ModelConfig.from_hf_dir(self.model.hf_dir), f"{self.model.hf_dir}/config.json:"
        if model is not None:
            check_layout(self.parallel, model, where)
            longest = self.data.max_prompt_tokens + self.rollout.max_new_tokens
            check(longest <= model.max_position_embeddings, "rollout.max_new_tokens",
                  f"data.max_prompt_tokens={self.data.max_prompt_tokens} + rollout.max_new_tokens="
                  f"{self.rollout.max_new_tokens} = {longest} is beyond {where}{'' if where.endswith(':') else '.'}"
                  f"max_position_embeddings={model.max_position_embeddings}")


def check_partial(config: "TrainConfig") -> None:
    """What ``rollout.partial`` needs of the rest of the config, and the combination it refuses (by name,
    with the reason; docs/training.md, "Partial rollouts")."""
    r, t = config.rollout, config.train
    check(r.multi_turn is None, "rollout.multi_turn",
          "is refused with rollout.partial: a trajectory's tool turns and turn count are not carried across steps "
          "(the agent loop runs whole trajectories inside one engine call; docs/training.md, \"Partial rollouts\")")
    # the ratio needs the behaviour policy of every token: as pi_old, or through truncated importance sampling
    check(r.logprobs_from == "engine" or config.loss.tis_mode != "none", "rollout.logprobs_from",
          "with rollout.partial the tokens of a response come from several weight versions: use engine (pi_old = "
          "each token's behaviour log-prob) or keep recompute with loss.tis_mode: sequence/token (the recomputed "
          "pi_old corrected towards the behaviour log-probs)")
    # a response runs over up to steps_in_flight steps; in overlap mode each round is also generated one
    # update behind the step that takes it
    lag = int(t.rollout_mode == "overlap")
    steps = steps_in_flight(r.max_new_tokens, r.partial_token_budget)
    age = steps - 1 + lag
    check(age <= t.max_staleness, "rollout.partial_token_budget",
          f"{r.partial_token_budget} lets a response run over {steps} steps, so its first tokens would be {age} "
          f"updates old{' (overlap mode: one more)' if lag else ''}, beyond train.max_staleness={t.max_staleness}: "
          + (f"raise the budget to at least {-(-r.max_new_tokens // (t.max_staleness + 1 - lag))} or "
             if t.max_staleness >= lag else "") + f"train.max_staleness to {age}")


def smallest_world(parallel: ParallelConfig) -> int:
    """The fewest processes the layout runs on: both grids (TP x PP x CP and ETP x EP x PP) divide it."""
    import math

    return math.lcm(parallel.tensor_parallel * parallel.pipeline_parallel * parallel.context_parallel,
                    parallel.expert_tensor_parallel_size * parallel.expert_parallel * parallel.pipeline_parallel)


def check_world_size(parallel: ParallelConfig, world_size: int, local: bool = False) -> None:
    """The layout fits ``world_size`` processes (checked before any rank starts: Megatron's own check is a
    traceback in every rank): TP x PP x CP divides it, and so does ETP x EP x PP (the expert grid).
    ``local``: the processes are ``--nproc``'s, so the refusal names the ``--nproc`` that fits."""
    smallest = smallest_world(parallel)
    if world_size % smallest == 0:
        return
    fits = -(-world_size // smallest) * smallest
    hint = f"; this layout runs on a multiple of {smallest} processes" + (f": --nproc {fits}" if local else "")
    try:
        parallel.data_parallel(world_size)  # its message names the grid that does not divide
    except ConfigError as err:
        raise ConfigError(f"{err}{hint}") from None


def check_reward_imports(rewards: RewardConfig) -> None:
    """Import each ``module:function`` reward term now, in this process: a failure is one line naming the
    term (rewards.import_dirs first on the path), not a reward worker's traceback."""
    from gspo_megatron.rewards.config import BUILTIN_TERMS, MODEL_TERMS

    for i, term in enumerate(rewards.terms):
        if term.name not in BUILTIN_TERMS + MODEL_TERMS:
            check_import(term.name, f"rewards.terms[{i}].name", rewards.import_dirs)


def check_tool_imports(tools: list, import_dirs: list[str]) -> None:
    """Import each ``module:function`` tool of ``rollout.multi_turn.tools`` now, like a user reward (rewards.
    import_dirs first on the path, which the tool worker inherits): a bad path is one line naming the tool."""
    from gspo_megatron.rollout.tools import BUILTIN_TOOLS

    for i, tool in enumerate(tools):
        if tool.name not in BUILTIN_TOOLS:
            check_import(tool.name, f"rollout.multi_turn.tools[{i}].name", import_dirs)


def check_import(path: str, field: str, import_dirs: list[str]) -> None:
    """Import the ``module:function`` at ``path`` now (``import_dirs`` first on the path): a failure is a
    ConfigError naming ``field`` (exit 2), not a traceback once the model is built."""
    from gspo_megatron.rewards.terms import RewardSetupError, import_function

    try:
        import_function(path, field, import_dirs)
    except RewardSetupError as err:
        raise ConfigError(str(err)) from None


def check_layout(parallel: ParallelConfig, model: ModelConfig, where: str) -> None:
    """Each parallel size must divide the model dimension it splits; the error names both fields (Megatron's
    own check is a bare assertion deep in model construction)."""
    splits = [("tensor_parallel", "num_attention_heads"), ("tensor_parallel", "num_key_value_heads"),
              ("pipeline_parallel", "num_layers")]
    # each expert's FFN is split over the expert-TP group, the dense and shared-expert FFNs over TP
    splits.append(("expert_tensor_parallel", "moe_ffn_hidden_size") if model.is_moe
                  else ("tensor_parallel", "ffn_hidden_size"))
    if model.is_moe:
        splits.append(("expert_parallel", "num_experts"))
        if model.first_dense_layers:
            splits.append(("tensor_parallel", "ffn_hidden_size"))
        if model.moe_shared_expert_intermediate_size:
            splits.append(("tensor_parallel", "moe_shared_expert_intermediate_size"))
    else:
        check(parallel.expert_parallel == 1, "parallel.expert_parallel",
              f"must be 1 for a dense model ({where} num_experts is 0), got {parallel.expert_parallel}")
    check(parallel.context_parallel == 1 or not model.is_mla, "parallel.context_parallel",
          f"must be 1 for multi-latent attention ({where}{'' if where.endswith(':') else '.'}kv_lora_rank="
          f"{model.kv_lora_rank}): MLA's rotary split has not been run with context parallelism")
    if parallel.context_parallel > 1 and parallel.cp_comm_type == "a2a":
        check_a2a_heads(parallel, model, where)
    if model.is_mla:  # MLA's latent down-projections are column-parallel too
        splits += [("tensor_parallel", "kv_down_proj_rows")] + ([("tensor_parallel", "q_lora_rank")] if model.q_lora_rank else [])
    sep = "" if where.endswith(":") else "."
    for size_field, model_field in splits:
        size, value = getattr(parallel, size_field), getattr(model, model_field)
        shown = size
        if size_field == "expert_tensor_parallel" and size is None:
            size = parallel.expert_tensor_parallel_size
            shown = f"{size} (null: tensor_parallel)"
        check(value % size == 0, f"parallel.{size_field}",
              f"{shown} does not divide {where}{sep}{model_field}={value}")


def check_a2a_heads(parallel: ParallelConfig, model: ModelConfig, where: str) -> None:
    """Transformer Engine's all-to-all context parallelism scatters each TP rank's attention heads over the
    CP ranks: its ``attn_forward_func_with_cp`` (A2A branch, transformer_engine/pytorch/attention/
    dot_product_attention/context_parallel.py) asserts that the query heads and the key/value groups per TP
    rank both divide by the CP size, at the first forward. Checked here at start-up instead (on CPU too,
    where the CP attention all-gathers and would not notice: the same config must run on both)."""
    sep = "" if where.endswith(":") else "."
    tp, cp = parallel.tensor_parallel, parallel.context_parallel
    for field in ("num_attention_heads", "num_key_value_heads"):
        per_rank = getattr(model, field) // tp
        check(per_rank % cp == 0, "parallel.cp_comm_type",
              f"a2a needs the heads of each TP rank to divide by parallel.context_parallel={cp}, got "
              f"{where}{sep}{field}={getattr(model, field)} / parallel.tensor_parallel={tp} = {per_rank}: "
              "use p2p or all_gather, or another context_parallel")


def _model_identity(section: dict) -> dict:
    """hf_dir and the inline model config with every default filled in (a field added since the checkpoint
    was saved compares equal at its default)."""
    config = section.get("config")
    if isinstance(config, dict):
        config = dataclasses.asdict(build(ModelConfig, config, "model.config"))
    return {"hf_dir": section.get("hf_dir"), "config": config}


def check_resumable(saved: dict, current: dict, checkpoint: Path) -> None:
    """A resume continues the run the checkpoint belongs to: the same model, and the same expert-parallel
    size (the optimizer state does not move between EP sizes: Megatron builds a different optimizer
    structure for expert parameters; weights do). ``saved``/``current``: to_dict of the two configs."""
    old_model, new_model = _model_identity(saved.get("model", {})), _model_identity(current["model"])
    diff = [k for k in ("hf_dir", "config") if old_model.get(k) != new_model.get(k)]
    if diff:
        fields = [f"model.{k}" for k in diff]
        if diff == ["config"] and isinstance(old_model.get("config"), dict) and isinstance(new_model["config"], dict):
            fields = [f"model.config.{k}" for k in sorted(set(old_model["config"]) | set(new_model["config"]))
                      if old_model["config"].get(k) != new_model["config"].get(k)]
        raise ConfigError(f"{checkpoint}: the checkpoint holds another model ({', '.join(fields)} differ); resume "
                          f"with the run's own model section (its config.yaml), or start a new run in another "
                          f"--run-dir")
    old_ep = saved.get("parallel", {}).get("expert_parallel", 1)
    new_ep = current["parallel"]["expert_parallel"]
    if old_ep != new_ep:
        raise ConfigError(
            f"{checkpoint}: saved at parallel.expert_parallel={old_ep}, this run asks for {new_ep}: the optimizer "
            f"state cannot move between expert-parallel sizes. Resume with parallel.expert_parallel={old_ep}, or "
            f"move the weights only: gspo-megatron convert megatron-to-hf --megatron-dir {checkpoint} --out HF_DIR, "
            f"then a new run with model.hf_dir=HF_DIR (Adam state and LR schedule start over)")


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], YAML-parsed value); a list item is addressed by its index, as the
    errors name it: ``rewards.terms[0].weight=0.5`` -> (["rewards", "terms", 0, "weight"], 0.5)."""
    import re

    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    keys: list[str | int] = []
    for part in key.split("."):
        match = re.fullmatch(r"([^\[\]]+)((?:\[\d+\])*)", part)
        if match is None:
            raise ConfigError(f"override {text!r}: malformed key {key!r}")
        keys += [match[1], *(int(i) for i in re.findall(r"\d+", match[2]))]
    return keys, yaml.safe_load(raw) if raw != "" else ""


def dotted_key(keys: list[str | int]) -> str:
    """["rewards", "terms", 0, "weight"] -> "rewards.terms[0].weight" (the spelling of errors and overrides)."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".")


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node: Any = data
        for i, key in enumerate(keys[:-1]):
            if isinstance(key, int):
                if not isinstance(node, list):
                    raise ConfigError(f"override {text!r}: {dotted_key(keys[:i])} is not a list")
                if key >= len(node):
                    raise ConfigError(f"override {text!r}: {dotted_key(keys[:i])} has {len(node)} items, no item {key}")
                node = node[key]
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {dotted_key(keys[:i])} is not a section")
            if isinstance(keys[i + 1], int):
                node = node.get(key)
                if not isinstance(node, list):
                    raise ConfigError(f"override {text!r}: {dotted_key(keys[:i + 1])} is not a list")
                continue
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {dotted_key(keys[:i + 1])} is not a section")
            node = child
        if isinstance(keys[-1], int):
            raise ConfigError(f"override {text!r}: set a field of the item ({dotted_key(keys)}.FIELD=...) or the whole "
                              f"list ({dotted_key(keys[:-1])}=[...])")
        if not isinstance(node, dict):
            raise ConfigError(f"override {text!r}: {dotted_key(keys[:-1])} is not a section")
        node[keys[-1]] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read YAML ``path`` (relative data paths are resolved against the file's folder), apply
    ``overrides``, build and validate."""
    data: dict = {}
    text = ""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        text = path.read_text()
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)  # absent on YAML errors without a position
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            raise ConfigError(f"{where}: YAML syntax error: {getattr(err, 'problem', None) or err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded or {}
    data = apply_overrides(data, list(overrides))
    if path is not None:
        resolve_paths(data, path, command_line=overridden_path_fields(overrides))
    if "data" not in data:
        raise ConfigError("data: required section is missing (data.train_files at least)")
    if not isinstance(data.get("model"), dict):
        raise ConfigError("model: required section is missing (model.hf_dir: a Hugging Face folder, or model.config: "
                          "an inline architecture as in examples/cpu_demo.yaml)")
    try:
        return build(TrainConfig, data, "")
    except ConfigError as err:
        line = unknown_key_line(str(err), text, overrides)
        if line is None:
            raise
        raise ConfigError(f"{path}:{line}: {err}") from None


def yaml_key_line(text: str, dotted: str) -> int | None:
    """The 1-based line of the key ``dotted`` (``a.b``, ``rewards.terms[0].wieght``) in the YAML ``text``;
    None when the text does not hold it."""
    import re

    node, line = yaml.compose(text), None
    for part in re.findall(r"\[\d+\]|[^.\[\]]+", dotted):
        if part.startswith("["):
            index = int(part[1:-1])
            if not isinstance(node, yaml.SequenceNode) or index >= len(node.value):
                return None
            node = node.value[index]
            continue
        if not isinstance(node, yaml.MappingNode):
            return None
        match = [(k, v) for k, v in node.value if k.value == part]
        if not match:
            return None
        line, node = match[0][0].start_mark.line + 1, match[0][1]
    return line


def unknown_key_line(message: str, text: str, overrides) -> int | None:
    """For an "unknown field" ConfigError (``message``), the config file's line of that key; None for other
    errors and for a key an override set (its line in the file, if any, is not where the value came from)."""
    key, _, rest = message.partition(": ")
    if not rest.startswith("unknown field") or not text:
        return None
    from_overrides = [dotted_key(parse_override(o)[0]) for o in overrides]
    if any(key == k or key.startswith((f"{k}.", f"{k}[")) for k in from_overrides):
        return None
    return yaml_key_line(text, key)


# path fields, relative to the config file's folder (command-line overrides too): one rule for all
PATH_FIELDS = (("data", "train_files"), ("data", "eval_files"), ("model", "hf_dir"), ("model", "tokenizer_dir"),
               ("rewards", "import_dirs"), ("distill", "teacher_dir"))
MUST_EXIST = (("model", "hf_dir"), ("model", "tokenizer_dir"), ("distill", "teacher_dir"))  # read at start-up; never taken as Hub names


def overridden_path_fields(overrides: list[str] | tuple[str, ...]) -> set[tuple[str, str]]:
    """The PATH_FIELDS that ``overrides`` (``a.b=value`` strings) set, directly or with their whole section."""
    keys = [parse_override(text)[0] for text in overrides]
    return {(section, key) for section, key in PATH_FIELDS for k in keys if k in ([section, key], [section])}


def check_unambiguous(field: str, value: str, config_file: Path, cwd: Path) -> None:
    """A relative path typed on the command line is relative to the config file's folder, like in the file; when
    it also names something relative to the current folder, which one was meant cannot be told: refuse it,
    naming both (it used to take the config folder's silently)."""
    beside, here = (config_file.parent / value).resolve(), (cwd / value).resolve()
    if beside != here and beside.exists() and here.exists():
        raise ConfigError(f"{field}: {value!r} names both {beside} (relative to the folder of the config file "
                          f"{config_file}, the rule for relative paths) and {here} (relative to the current folder); "
                          f"give the one you mean as an absolute path")


def resolve_paths(data: dict, config_file: Path, command_line: set[tuple[str, str]] = frozenset()) -> None:
    """Make the PATH_FIELDS of ``data`` absolute against ``config_file``'s folder (so a config runs from any
    folder) and default rewards.import_dirs to that folder. ``command_line``: the fields set by overrides,
    whose relative paths must not also name something relative to the current folder (check_unambiguous)."""
    base = config_file.parent
    rewards = data.setdefault("rewards", {}) if isinstance(data.get("rewards", {}), dict) else None
    if rewards is not None and "import_dirs" not in rewards:
        rewards["import_dirs"] = ["."]
    for section, key in PATH_FIELDS:
        node = data.get(section)
        if not isinstance(node, dict) or node.get(key) is None:
            continue
        value = node[key]
        relative = [v for v in (value if isinstance(value, list) else [value])
                    if isinstance(v, str) and not Path(v).is_absolute()]
        if (section, key) in command_line:
            for v in relative:
                check_unambiguous(f"{section}.{key}", v, config_file, Path.cwd())
        absolute = lambda v: str((base / v).resolve()) if v in relative else v
        node[key] = [absolute(v) for v in value] if isinstance(value, list) else absolute(value)
    resolve_model_term_paths(rewards, base)


def resolve_model_term_paths(rewards: dict | None, base: Path) -> None:
    """The model folders of reward_model / judge terms (``path``, ``tokenizer``), relative to ``base`` (the config
    file's folder) like the other path fields."""
    terms = rewards.get("terms") if rewards is not None else None
    for term in terms if isinstance(terms, list) else ():
        for section in ("reward_model", "judge"):
            node = term.get(section) if isinstance(term, dict) else None
            for key in ("path", "tokenizer"):
                value = node.get(key) if isinstance(node, dict) else None
                if isinstance(value, str) and not Path(value).is_absolute():
                    node[key] = str((base / value).resolve())


def check_model_folders(config: TrainConfig, config_file: str | Path | None) -> None:
    """At the start of a run (not at load: the cluster examples name folders of other machines): the model
    folders must exist; a name such as ``Qwen/Qwen3-8B`` is a folder beside the config, never a Hub request."""
    for section, key in MUST_EXIST:
        value = getattr(getattr(config, section), key)
        if value is not None and not Path(value).is_dir():
            where = f"relative paths are relative to the config file {config_file}; " if config_file else ""
            raise ConfigError(f"{section}.{key}: {value} is not a folder ({where}Hub names are not downloaded: "
                              f"download the model first, e.g. huggingface-cli download NAME --local-dir DIR)")


def save_config(config: TrainConfig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    tmp.replace(path)
