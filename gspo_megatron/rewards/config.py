"""The ``rewards:`` config section."""
from __future__ import annotations

import dataclasses
import re
import string
from typing import Literal

from gspo_megatron.rewards.code import CodeRewardConfig
from gspo_megatron.rewards.math import MathRewardConfig
from gspo_megatron.typed_config import check

BUILTIN_TERMS = ("math", "code", "synthetic")
MODEL_TERMS = ("reward_model", "judge")  # terms that run a model (rewards/scoring_models.py); always batched
JUDGE_FIELDS = ("response", "prompt", "answer")  # what a judge template may name
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def check_server(server: str | None, timeout_s: float, path: str) -> None:
    """A scoring model's ``server`` (an SGLang URL or null) and ``server_timeout_s``."""
    check(server is None or bool(re.fullmatch(r"https?://[^/\s]+(/[^\s]*)?", server)), f"{path}.server",
          f"must be an http(s) URL such as http://host:30000, got {server!r}")
    check(timeout_s > 0, f"{path}.server_timeout_s", f"must be > 0, got {timeout_s}")


@dataclasses.dataclass
class RewardModelConfig:
    """A Hugging Face sequence-classification reward model (``AutoModelForSequenceClassification``) as a term.

    path: the model folder (``save_pretrained``; a score head and ``pad_token_id`` in its config.json).
    tokenizer: its tokenizer folder (default: ``path``), not the policy's.
    chat_template: render [the prompt's messages, {assistant: response}] with that tokenizer's chat template;
        false: the policy's rendered prompt text followed by the response.
    max_length: tokens the model reads; a longer text is cut by ``truncation``: "left" keeps the end (the
        response), "right" keeps the start, "error" scores that response 0 and counts it as an error.
    batch_size: texts per forward. device: "cpu" or "cuda[:N]".
    label: the logit that is the score when the head has several labels (required then; refused otherwise).
    normalize: "none" (the raw logit: the term must declare ``range``), "sigmoid" (in [0, 1]), "tanh"
        (in [-1, 1]) or "softmax" (the probability of ``label`` over the labels, in [0, 1]).
    server: the URL of an SGLang server (0.5.23) serving the model in ``path`` (``python -m
        sglang.launch_server --model-path PATH``): the logits come from its ``POST /classify``, ``batch_size``
        texts per request, and the term loads no weights (``path`` still gives the labels and the tokenizer);
        ``server_timeout_s`` bounds one request. null: the model runs in the reward worker (``device``).
    """

    path: str
    server: str | None = None
    server_timeout_s: float = 60.0
    tokenizer: str | None = None
    chat_template: bool = True
    max_length: int = 2048
    truncation: Literal["left", "right", "error"] = "left"
    batch_size: int = 8
    device: str = "cpu"
    label: int | None = None
    normalize: Literal["none", "sigmoid", "tanh", "softmax"] = "none"

    def validate(self, path: str) -> None:
        check(self.max_length >= 1, f"{path}.max_length", f"must be >= 1, got {self.max_length}")
        check(self.batch_size >= 1, f"{path}.batch_size", f"must be >= 1, got {self.batch_size}")
        check(bool(_DEVICE.match(self.device)), f"{path}.device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        check(self.label is None or self.label >= 0, f"{path}.label", f"must be >= 0, got {self.label}")
        check(self.normalize != "softmax" or self.label is not None, f"{path}.normalize",
              "'softmax' is the probability of one label: set label")
        check_server(self.server, self.server_timeout_s, path)

    @property
    def output_range(self) -> tuple[float, float] | None:
        """The range ``normalize`` puts scores in; None for raw logits."""
        return {"sigmoid": (0.0, 1.0), "softmax": (0.0, 1.0), "tanh": (-1.0, 1.0)}.get(self.normalize)


def template_fields(template: str) -> set[str]:
    """The ``{name}`` fields of a ``str.format`` template (``{{`` / ``}}`` are literal braces)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@dataclasses.dataclass
class JudgeConfig:
    """A generative judge: an LLM asked through ``template`` to judge a response; its verdict parsed by a rule.

    path: the judge's causal-LM folder (a family the in-process engine serves, rollout/hf_engine.py).
    tokenizer: its tokenizer folder (default: ``path``).
    template: the question, a ``str.format`` template with ``{response}`` and optionally ``{prompt}`` (the
        row's prompt, or its last user message) and ``{answer}`` (the row's reference answer); ``{{``/``}}``
        are literal braces. chat_template: send it as one user turn through the tokenizer's chat template.
    pattern: a regex whose first group captures a number: the score (the last match in the verdict counts).
    labels: {label: score}: the last of these words in the verdict decides. Exactly one of pattern / labels.
    test_verdict: a verdict the rule must parse (checked at start-up: a rule that matches nothing is refused).
    max_new_tokens: the verdict's length (greedy decoding). max_length: prompt tokens; a longer judge prompt
        scores that response 0, counted as an error. batch_size: judge prompts decoded at once.
    device: "cpu" or "cuda[:N]".
    server: the URL of an SGLang server (0.5.23) serving the judge in ``path`` (on GPUs): the verdicts come
        from its ``POST /generate`` (greedy, ``batch_size`` prompts per request) and the term loads no weights;
        ``server_timeout_s`` bounds one request. null: the in-process engine runs it in the reward worker.
    A verdict the rule does not parse scores 0 and is counted (``rewards/<key>/errors``), never a crash.
    """

    path: str
    template: str
    test_verdict: str
    pattern: str | None = None
    labels: dict[str, float] | None = None
    tokenizer: str | None = None
    chat_template: bool = True
    max_new_tokens: int = 32
    max_length: int = 4096
    batch_size: int = 16
    device: str = "cpu"
    server: str | None = None
    server_timeout_s: float = 60.0

    def validate(self, path: str) -> None:
        check_server(self.server, self.server_timeout_s, path)
        try:
            fields = template_fields(self.template)
        except ValueError as err:
            fields = set()
            check(False, f"{path}.template", f"is not a valid format template ({err}); write braces as {{{{ }}}}")
        check("response" in fields, f"{path}.template", "must contain the {response} placeholder")
        unknown = sorted(f for f in fields if f not in JUDGE_FIELDS)
        check(not unknown, f"{path}.template", f"may name {list(JUDGE_FIELDS)} only, got {unknown}")
        check((self.pattern is None) != (self.labels is None), f"{path}.pattern",
              "set exactly one of pattern (a regex capturing a number) and labels ({label: score})")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as err:
                groups = 0
                check(False, f"{path}.pattern", f"is not a valid regex: {err}")
            check(groups >= 1, f"{path}.pattern", "needs a group capturing the number, e.g. 'Score: ([0-9.]+)'")
        else:
            check(len(self.labels) >= 2 and all(self.labels), f"{path}.labels",
                  f"needs two or more non-empty labels, got {self.labels}")
        from gspo_megatron.rewards.verdicts import parse_verdict

        check(parse_verdict(self, self.test_verdict) is not None, f"{path}.test_verdict",
              f"the rule ({'pattern' if self.pattern is not None else 'labels'}) finds no verdict in "
              f"{self.test_verdict!r}")
        check(self.max_new_tokens >= 1, f"{path}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        check(self.max_length >= 1, f"{path}.max_length", f"must be >= 1, got {self.max_length}")
        check(self.batch_size >= 1, f"{path}.batch_size", f"must be >= 1, got {self.batch_size}")
        check(bool(_DEVICE.match(self.device)), f"{path}.device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def output_range(self) -> tuple[float, float] | None:
        """The labels' scores span; None for a pattern (the term declares ``range``)."""
        if self.labels is None:
            return None
        low, high = min(self.labels.values()), max(self.labels.values())
        return (low, high) if low < high else None


@dataclasses.dataclass
class RewardTermConfig:
    """One reward term. ``name`` is a built-in ("math", "code", "synthetic") or ``module:function``.

    A custom function is ``f(sample: dict, response: str) -> float`` (or ``async def``), or with
    ``batched: true`` ``f(samples: list[dict], responses: list[str]) -> list[float]`` (sync or async).
    ``key`` names the term in metrics (default: the built-in name or the function name).
    ``name: reward_model`` with a ``reward_model:`` section, or ``name: judge`` with a ``judge:`` section, scores
    with a model (RewardModelConfig, JudgeConfig; docs/rewards.md): a batched term in the reward workers.
    ``range``: [low, high] the term's rewards lie in (the built-ins: [0, 1]); a reward outside it scores
    0 and is counted as an error naming the term. Correctness (accuracy, pass@k) is the verifier's own
    verdict (``Verdict.correct``); a function that returns a plain number is correct at ``high`` when it
    declares a range, and judges no correctness when it does not (docs/rewards.md, "Correctness").
    """

    name: str
    weight: float = 1.0
    batched: bool = False
    key: str | None = None
    range: tuple[float, float] | None = None
    reward_model: RewardModelConfig | None = None
    judge: JudgeConfig | None = None

    def validate(self, path: str) -> None:
        named = BUILTIN_TERMS + MODEL_TERMS
        check(self.name in named or bool(_IMPORT_PATH.match(self.name)), f"{path}.name",
              f"must be one of {list(named)} or 'module.path:function', got {self.name!r}")
        check(not (self.batched and self.name in named), f"{path}.batched",
              "applies to custom functions only (reward_model and judge are batched already)")
        for section in MODEL_TERMS:
            given = getattr(self, section) is not None
            check(given == (self.name == section), f"{path}.{section}",
                  f"is required with name: {section}" if self.name == section else f"applies to name: {section} only")
        model = self.reward_model or self.judge
        if model is not None and model.output_range is not None:
            check(self.range is None, f"{path}.range",
                  f"the {self.name}'s scores lie in {list(model.output_range)} already; leave range unset")
        elif model is not None:
            what = "reward_model.normalize is 'none' (raw logits)" if self.reward_model else "judge.pattern's number"
            check(self.range is not None, f"{path}.range",
                  f"{what} has no bound: declare range [low, high] (scores outside it fail, counted)"
                  + (" or set reward_model.normalize" if self.reward_model else ""))
        check(self.key is None or bool(re.fullmatch(r"[\w.-]+", self.key)), f"{path}.key",
              "may contain letters, digits, '_', '.', '-' only")
        if self.range is not None:
            check(len(self.range) == 2 and self.range[0] < self.range[1], f"{path}.range",
                  f"must be [low, high] with low < high, got {list(self.range)}")
            check(self.name not in BUILTIN_TERMS, f"{path}.range",
                  f"the built-in {self.name!r} scores in [0, 1]; range applies to custom functions")

    @property
    def declared_range(self) -> tuple[float, float] | None:
        """The range rewards are checked against: the built-ins' [0, 1], a model term's normalised range, else
        ``range`` (None: unchecked)."""
        if self.name in BUILTIN_TERMS:
            return (0.0, 1.0)
        model = self.reward_model or self.judge
        return model.output_range if model is not None and model.output_range is not None else self.range

    @property
    def metric_key(self) -> str:
        return self.key or self.name.rsplit(":", 1)[-1]


@dataclasses.dataclass
class RewardConfig:
    """Reward = sum_k weight_k * term_k(sample, response), computed in a worker pool.

    num_workers: reward processes (0 runs everything in the calling process: timeout_s and the stop signals then
        interrupt a reward through Python signal handlers, rewards/in_process.py).
    timeout_s: per response; a response whose verifier takes longer scores 0 and is counted
        (a batched term gets timeout_s times its batch length; an async chunk gets timeout_s + 5).
    async_chunk_size: responses per task for async per-response functions (awaited concurrently).
    startup_timeout_s: how long workers may take to start and import the reward functions.
    import_dirs: folders put first on the import path for ``module:function`` terms (default: the config
        file's folder, so a reward module beside the config imports); a training run imports each custom
        term at start-up, and a failure is one line naming the term (trainer/config.py).
    max_print_bytes: what the reward functions may print per scored batch (workers' stdout and stderr, an
        in-process reward's ``print``), all together; the rest is cut, one log line says how much
        (``rewards/print_cut_bytes``; gspo_megatron/print_cap.py).
    stop_failure_fraction: a training batch in which a term with weight != 0 fails (error or timeout) on more
        than this fraction of its responses is a failing batch for that term.
    stop_after_failing_batches: this many failing batches of one term in a row stop the run (0: never); a batch
        in which such a term fails on every response stops it at once (trainer/finite.py). The stop names the
        term and writes each term's first traceback to the run folder (reward_failures.log).
    """

    terms: list[RewardTermConfig] = dataclasses.field(default_factory=lambda: [RewardTermConfig("math")])
    num_workers: int = 2
    timeout_s: float = 60.0
    async_chunk_size: int = 32
    startup_timeout_s: float = 120.0
    math: MathRewardConfig = dataclasses.field(default_factory=MathRewardConfig)
    code: CodeRewardConfig = dataclasses.field(default_factory=CodeRewardConfig)
    import_dirs: list[str] = dataclasses.field(default_factory=list)
    max_print_bytes: int = 65536
    stop_failure_fraction: float = 0.5
    stop_after_failing_batches: int = 3

    def validate(self, path: str) -> None:
        check(len(self.terms) > 0, f"{path}.terms", "needs at least one reward term")
        keys = [t.metric_key for t in self.terms]
        for i, k in enumerate(keys):
            check(keys.index(k) == i, f"{path}.terms[{i}].key",
                  f"metric key {k!r} is used twice; set a distinct 'key'")
        check(self.num_workers >= 0, f"{path}.num_workers", "must be >= 0")
        check(self.timeout_s > 0, f"{path}.timeout_s", "must be > 0")
        check(self.async_chunk_size >= 1, f"{path}.async_chunk_size", "must be >= 1")
        check(self.startup_timeout_s > 0, f"{path}.startup_timeout_s", "must be > 0")
        check(self.max_print_bytes >= 0, f"{path}.max_print_bytes", f"must be >= 0, got {self.max_print_bytes}")
        check(0 <= self.stop_failure_fraction < 1, f"{path}.stop_failure_fraction",
              f"must be in [0, 1) (every response failing stops the run anyway), got {self.stop_failure_fraction}")
        check(self.stop_after_failing_batches >= 0, f"{path}.stop_after_failing_batches",
              f"must be >= 0 (0: never), got {self.stop_after_failing_batches}")


__all__ = ["BUILTIN_TERMS", "JudgeConfig", "MODEL_TERMS", "RewardConfig", "RewardModelConfig", "RewardTermConfig",
           "template_fields"]
