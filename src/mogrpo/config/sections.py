"""The run configuration's typed sections: one pydantic model per config section, each field
documented by the docstring right under it (`mogrpo config fields` prints them all).

Loading, layering and validation live in `mogrpo.config.load`; `mogrpo.config` exports both.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_serializer, field_validator, model_validator

from mogrpo.algo.choices import (
    AdvantageCombine,
    AdvantageScaling,
    ImportanceSamplingLevel,
    KLEstimator,
    KLImportanceWeight,
    LossAggregation,
    LossType,
    OptimizerName,
)
from mogrpo.config.base import Section
from mogrpo.config.curriculum import CurriculumConfig
from mogrpo.config.health import HealthConfig
from mogrpo.config.kl import KLControlConfig
from mogrpo.config.memory import MemoryConfig
from mogrpo.config.precision import Precision
from mogrpo.config.rollout import RolloutConfig


class ModelConfig(Section):
    name_or_path: str | None = None
    """Hugging Face causal LM: a local directory or a hub id (required)."""
    tokenizer: str | None = None
    """Tokenizer path or hub id when it differs from the model's."""
    precision: Precision = "auto"
    """How weights are kept and computed: `fp32`; `bf16-mixed` (float32 weights and AdamW
    states, forward and backward under bfloat16 autocast: the default on GPUs); `fp16-mixed`
    (the same in float16, with a dynamic loss scale); `bf16` (bfloat16 weights and AdamW
    states: updates below ~0.4 % of a weight are lost, so small learning rates do nothing);
    `auto` = fp32 on a CPU, else bf16-mixed (fp16-mixed without bfloat16), or what `dtype`
    names. A frozen LoRA or 4-bit base loads in the compute dtype; adapters stay float32."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The compute dtype: set, it must agree with `precision`, and with `precision: auto` it
    picks it (`bfloat16` → bf16-mixed, `float16` → fp16-mixed, `float32` → fp32)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30 % slower steps."""
    attn_implementation: str | None = None
    """Attention kernel passed to transformers (`eager`, `sdpa`, `flash_attention_2`)."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository to run (only for models you trust)."""
    load_in_4bit: bool = False
    """Load the linear weights in 4-bit NF4 (QLoRA; needs lora.enabled and `pip install
    'mogrpo[gpu]'`: bitsandbytes, on a CUDA GPU or, from bitsandbytes 0.46.1, on the CPU).
    Under a mixed precision the 1-D weights (norms, biases) are cast to float32, as QLoRA
    trained: HF's RMSNorm returns its weight's dtype, so the residual stream then sums in
    float32 (the norms take their statistics in float32 whatever the weight's dtype). The
    embedding and head keep the compute dtype, unlike peft's preparation: a
    float32 copy of their 16-bit values adds 2 B a parameter (2.1 GB on Llama-3-8B) and no
    information, and autocast computes the head in the compute dtype anyway."""
    load_in_8bit: bool = False
    """Load the linear weights in 8-bit (LLM.int8(), Dettmers et al. 2022): twice 4-bit's
    memory, closer to the 16-bit base; as `load_in_4bit` otherwise, and exclusive with it."""
    embeddings_in_4bit: bool = False
    """With `load_in_4bit`: store the input embedding and the output head in NF4 too (one
    4-bit table where they are tied), dequantised as they are used: the base then takes ~0.52
    B a parameter instead of 0.67-0.93 (docs/memory.md, "Small GPUs"). Off by default, as in
    QLoRA and transformers: the head's logits then carry NF4's rounding (the policy's and the
    reference's alike), and while the head runs its weight is dequantised whole in the compute
    dtype (V × H × 2 B under bf16: 1.05 GB on Llama-3.1-8B, which the planner counts)."""
    use_chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; null = when the tokenizer has one."""
    chat_template: str | None = None
    """A chat template in place of the tokenizer's (saved with the trained model): the Jinja
    text, a path to a `.jinja` file, or `tiny_tools` (mogrpo's tiny models with tool calls in
    the Hermes form). Agent tasks need one that renders tools and their results."""
    disable_dropout: bool = True
    """Set the model's own dropout to 0 at load (SFT warm-up included), so rollout, old,
    reference and update passes score identically; LoRA's `lora.dropout` stays as set."""


class LoraConfig(Section):
    enabled: bool = False
    """Train LoRA adapters instead of all weights; the reference is then the adapter-free base."""
    r: int = Field(8, ge=1)
    """LoRA rank."""
    alpha: int = Field(16, ge=1)
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the LoRA branch."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, e.g. [q_proj, k_proj, v_proj, o_proj], or `all-linear`."""


def reward_label(spec: str) -> str:
    """"mc_correct" → "mc_correct"; "pkg.mod:fn" and "dir/file.py:fn" → "fn"."""
    return spec.strip().rpartition(":")[2]


def callable_spec(fn: Callable[..., Any]) -> str:
    """How a reward passed as a Python callable is written in config.yaml: `module:function`
    when that import path gives back this very object, else `python:NAME` (resumable only
    from Python, passing the function again)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module and qualname and module != "__main__" and module in sys.modules:
        found: Any = sys.modules[module]
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is fn:
            return f"{module}:{qualname}"
    return f"python:{getattr(fn, '__name__', type(fn).__name__)}"


class RewardConfig(Section):
    fn: str | Callable[..., Any]
    """A built-in reward (`mc_correct`, `format`, `length_penalty`, `code_tests`, `verilog_tests`),
    `judge` (an LLM judge over an OpenAI-compatible API, options under `kwargs`), `reward_model`
    (a sequence-classification model, options under `kwargs`), or `package.module:function` / `path/file.py:function`; from
    Python, the function itself."""
    weight: float | dict[str, Any] = 1.0
    """Weight of this objective in the advantage: a number, or a schedule
    `{kind: linear, start: 0.0, end: 1.0, start_step: 0, end_step: 100}`."""
    name: str | None = None
    """Name used in metrics; defaults to the function's name. A task's objectives need distinct names."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed to the function on every call."""

    @property
    def label(self) -> str:
        """The objective's name in metrics: `name`, else the function's (`reward_label`)."""
        if self.name:
            return self.name
        if callable(self.fn):
            return getattr(self.fn, "__name__", type(self.fn).__name__)
        return reward_label(self.fn)

    @field_serializer("fn", when_used="json")
    def _spec(self, fn: str | Callable[..., Any]) -> str:
        return fn if isinstance(fn, str) else callable_spec(fn)


class DataSource(Section):
    hub: str | None = None
    """A Hugging Face Hub dataset as `datasets.load_dataset` names it, e.g. `openai/gsm8k`."""
    path: str | None = None
    """A local dataset: a `save_to_disk` folder, a Parquet or Arrow file, or JSONL/CSV/TSV."""
    config: str | None = None
    """The dataset's configuration (subset), e.g. `main`."""
    split: str = "train"
    """The split to read."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to pin the data to."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Renames, {dataset column: name mogrpo and the rewards see}, e.g. {problem: prompt}."""
    streaming: bool = False
    """Read rows as training draws them instead of loading the split (data larger than
    memory): shuffled through a buffer per pass, resumed exactly; the first rows are checked
    before the model loads, the rest as they arrive."""
    shuffle_buffer: int = Field(10_000, ge=1)
    """Streaming: rows in the shuffle buffer."""

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        if (self.hub is None) == (self.path is None):
            raise ValueError("give exactly one of `hub` (a Hub dataset) and `path` (a local one)")
        return self


class TaskConfig(Section):
    data: str | DataSource
    """Prompt data: a JSONL/CSV/TSV/Parquet/Arrow file, a `save_to_disk` folder, `builtin:NAME`
    for a built-in synthetic task, or {hub: NAME, split: …, columns: {…}} (see `data.*`)."""
    eval_data: str | DataSource | None = None
    """Held-out prompts for the greedy evaluation; default: `eval_size` rows split off `data`."""
    eval_size: int = Field(0, ge=0)
    """Rows split off `data` for evaluation when `eval_data` is not given (0 = no eval)."""
    format: Literal["auto", "prompt", "chat", "multiple_choice"] = "auto"
    """Row schema; `auto` detects multiple-choice, chat `messages` or `prompt` rows."""
    prompt_template: str | None = None
    """Multiple-choice prompt template with `{question}`, `{options}` and any column."""
    system_prompt: str | None = None
    """System message prepended when the chat template is used."""
    drop_incomplete: bool = False
    """Skip rows with empty required fields (counted and logged) instead of failing."""
    strict: bool = False
    """Refuse values mogrpo would repair (answer `b` or `Ｂ` read as `B`, stripped whitespace):
    errors instead of counted warnings."""
    rewards: list[RewardConfig] = Field(default_factory=list)
    """Reward functions of this task; each is one objective."""
    weight: float = Field(1.0, gt=0)
    """This task's share of the prompts (relative to the other tasks); exact over any run of
    steps whose prompts add up to a multiple of the summed weights."""
    beta: float = Field(0.04, ge=0)
    """KL coefficient toward the reference model for this task (0 = no KL term); the
    starting value when `kl.kind` adapts it."""
    kl: KLControlConfig = Field(default_factory=KLControlConfig)
    """How β adapts to this task's measured KL."""
    sft_target: str | None = None
    """SFT warm-up target template over the row's columns; default: the first non-empty
    text column of `completion`, `response`, `answer`, else `Answer: {correct_answer}`. A
    `completion` of chat messages (an agent task's worked episode: tool calls, tool results)
    trains on its assistant turns only."""
    tools: list[str | Callable[..., Any]] = Field(default_factory=list)
    """Functions the policy may call between its turns (TRL's `tools`), each
    `package.module:function` or `path/file.py:function`; from Python, the function. Each needs
    type hints and a docstring: its schema for the chat template comes from them (docs/agents.md)."""
    environment: str | type | dict[str, str | type] | None = None
    """A class in TRL's `environment_factory` shape (`package.module:Class`, `path/file.py:Class`;
    from Python, the class): one instance per rollout, `reset(**row)` may return text added to
    the prompt, its public methods are tools, `get_reward()` an extra objective named after the
    class. A mapping {value: class} picks one by the row's `environment` column."""
    max_tool_calling_iterations: int | None = Field(None, ge=0)
    """Rounds of tool calls an episode may make; None: until a turn makes no call or the episode
    fills `rollout.max_completion_length` (which counts tool results too)."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Longest wait for one round of tool calls (`serial`: for each sync call); a call still
    running then gives the model an error message."""
    tool_concurrency: Literal["parallel", "serial"] = "parallel"
    """How a round's calls run: `parallel`, all at once across the batch (async tools on one
    event loop, each sync call on a thread of its own: sync tools must then be thread-safe);
    `serial`, the sync calls one after another (as TRL calls them), for tools that share state
    or use libraries that are not thread-safe (CPython's `ast.parse`, for one: docs/agents.md).
    Async calls run together either way."""
    tool_call_format: Literal["auto", "hermes", "llama3"] = "auto"
    """How calls are written: `hermes` (Qwen2.5 and others: a JSON {name, arguments} between
    `<tool_call>` tags), `llama3` (Llama 3.1: a JSON {name, parameters}, `<|python_tag|>`
    optional), `auto`: Hermes where a turn has `<tool_call>`, else Llama 3.1's form."""
    rollout_func: str | Callable[..., Any] | None = None
    """The task's rollouts written by you, as TRL's `rollout_func(prompts, trainer)` (spec or,
    from Python, the function): a dict with `prompt_ids`, `completion_ids`, `logprobs` and
    optionally `env_mask` (0: tokens it inserted, kept out of the loss). Not with `tools`."""

    @property
    def has_tools(self) -> bool:
        """Whether episodes of this task run tools (several turns)."""
        return bool(self.tools) or self.environment is not None

    def objective_labels(self) -> list[str]:
        """The task's objectives: its rewards' labels, then each environment class's name (its
        `get_reward()`, if it has one, is an objective named after it)."""
        env = self.environment
        specs = list(env.values()) if isinstance(env, dict) else [] if env is None else [env]
        classes = [s.rsplit(":", 1)[-1].strip() if isinstance(s, str) else s.__name__
                   for s in specs]
        return [r.label for r in self.rewards] + list(dict.fromkeys(classes))

    @model_validator(mode="after")
    def _one_rollout(self) -> TaskConfig:
        if self.rollout_func is not None and self.has_tools:
            raise ValueError("rollout_func samples the whole rollout itself: run its tools "
                             "inside it, or drop rollout_func and give tools/environment")
        return self

    @field_serializer("tools", when_used="json")
    def _tool_specs(self, tools: list[str | Callable[..., Any]]) -> list[str]:
        return [t if isinstance(t, str) else callable_spec(t) for t in tools]

    @field_serializer("rollout_func", when_used="json")
    def _rollout_func_spec(self, fn: Any) -> Any:
        return fn if fn is None or isinstance(fn, str) else callable_spec(fn)

    @field_serializer("environment", when_used="json")
    def _environment_spec(self, env: Any) -> Any:
        if isinstance(env, dict):
            return {k: v if isinstance(v, str) else callable_spec(v) for k, v in env.items()}
        return env if env is None or isinstance(env, str) else callable_spec(env)

    @field_validator("tools", "environment", "rollout_func", mode="after")
    @classmethod
    def _named(cls, value: Any, info: Any) -> Any:
        specs = value if isinstance(value, list) else \
            list(value.values()) if isinstance(value, dict) else [value]
        for spec in specs:
            if isinstance(spec, str) and ":" not in spec.strip().rstrip(":"):
                raise ValueError(
                    f"{info.field_name} entry {spec!r} names no object; give "
                    "package.module:name or path/to/file.py:name")
        return value

    @field_validator("rewards", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # `rewards: [mc_correct, format]` is shorthand for `[{fn: mc_correct}, {fn: format}]`,
        # and from Python `rewards: [accuracy_reward]` for `[{fn: accuracy_reward}]`.
        if isinstance(value, list):
            return [{"fn": v} if isinstance(v, str) or callable(v) else v for v in value]
        return value


class AlgorithmConfig(Section):
    advantage_combine: AdvantageCombine = "sum_then_normalize"
    """Combine objectives before group normalisation, or normalise each first (MO-GRPO)."""
    advantage_scaling: AdvantageScaling = "group"
    """Divide centred rewards by the group std (GRPO), the batch std, or nothing (Dr. GRPO)."""
    epsilon_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip range of the importance ratio (1 - ε_low)."""
    epsilon_high: float = Field(0.2, ge=0)
    """Upper clip range (1 + ε_high); DAPO's clip-higher uses 0.28."""
    num_iterations: int = Field(1, ge=1)
    """μ: optimisation passes over each rollout batch."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator from Schulman (2020); k3 is unbiased and always ≥ 0."""
    kl_importance_weight: KLImportanceWeight = "off"
    """Multiply the KL estimate by the importance ratio π/π_old (the samples came from π_old):
    `differentiable` is TRL's `use_bias_correction_kl` (DeepSeek-V3.2, arXiv 2512.02556), whose
    gradient is exactly that of KL(π‖π_ref), also at μ = 1; `detached` (`true`) reweights the
    value only (arXiv 2505.17508), so the gradient is plain k3's — the same for every μ."""
    loss_type: LossType = "grpo"
    """Policy loss, as TRL names them: `grpo` (DeepSeekMath, arXiv 2402.03300), `bnpo`
    (TRL's per-micro-batch token mean), `dr_grpo` (arXiv 2503.20783), `dapo` (arXiv
    2503.14476), `cispo` (MiniMax-M1, arXiv 2506.13585), `sapo` (arXiv 2511.20347), `luspo`
    (arXiv 2602.05261; use with sequence-level weights), `vespo` (arXiv 2602.10693)."""
    loss_aggregation: LossAggregation | None = None
    """How token losses are summed up; null = the loss type's own: `seq_mean` (grpo, sapo),
    `token_mean` (dapo, cispo, vespo), `fixed_length` (dr_grpo), `seq_sum` (luspo),
    `micro_token_mean` (bnpo; the only one that depends on the micro-batch split)."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """Importance ratio per token, or one per sequence from its mean log-ratio (GSPO, arXiv
    2507.18071)."""
    delta: float | None = Field(None, gt=1)
    """Two-sided clipping: also cap the unclipped ratio at δ (> 1 + ε_high) for negative
    advantages (INTELLECT-2, arXiv 2505.07291); null = off."""
    cispo_max_ratio: float = Field(5.0, gt=0)
    """cispo: ε_max, the cap on the detached importance weight (TRL's `epsilon_high` for cispo;
    ScaleRL, arXiv 2510.13786, uses 5.0)."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """sapo: gate temperature for tokens with positive advantage (arXiv 2511.20347)."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """sapo: gate temperature for tokens with non-positive advantage."""
    vespo_k_pos: float = Field(2.0, ge=0)
    """vespo: power k of φ(w) = e^λ w^k e^(−λw) for A ≥ 0 (arXiv 2602.10693)."""
    vespo_lambda_pos: float = Field(3.0, gt=0)
    """vespo: decay λ of φ(w) for A ≥ 0."""
    vespo_k_neg: float = Field(3.0, ge=0)
    """vespo: power k of φ(w) for A < 0."""
    vespo_lambda_neg: float = Field(2.0, gt=0)
    """vespo: decay λ of φ(w) for A < 0."""
    mask_truncated_completions: bool = False
    """Leave completions that hit the length limit out of the loss (DAPO's overlong filtering,
    arXiv 2503.14476); they still count in rewards and metrics."""
    dynamic_sampling: bool = False
    """Drop groups whose combined rewards are all equal — they carry no signal (DAPO)."""
    max_refill_rounds: int = Field(0, ge=0)
    """With dynamic sampling, extra rollout rounds per step to refill the dropped groups."""

    @field_validator("kl_importance_weight", mode="before")
    @classmethod
    def _kl_weight_bool(cls, value: Any) -> Any:
        # configs written before the differentiable form: true meant the detached weight
        return {True: "detached", False: "off"}.get(value, value) if isinstance(value, bool) else value


class TrainConfig(Section):
    max_steps: int = Field(100, ge=1)
    """Optimizer steps of GRPO."""
    micro_batch_size: int = Field(8, ge=1)
    """Completions per forward/backward pass (what memory depends on)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step; gradients are summed, never overwritten."""
    learning_rate: float = Field(1e-5, gt=0)
    """Peak learning rate (of whichever `optimizer`)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (of whichever `optimizer`)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (the 8-bit AdamWs too; Adafactor keeps no first moment)."""
    optimizer: OptimizerName = "adamw"
    """`adamw` (torch's, fused: m and v in the trained weights' dtype, 8 B a float32 parameter);
    `adamw_8bit` (bitsandbytes' block-wise 8-bit m and v, Dettmers et al. 2022: ~2 B a
    parameter; `pip install 'mogrpo[gpu]'`, on a CPU bitsandbytes >= 0.50); `paged_adamw_8bit`
    (the same in CUDA managed memory, which pages to host memory when the GPU runs short instead
    of failing; on a CPU the same as adamw_8bit); `adafactor`
    (transformers', Shazeer & Stern 2018: a matrix keeps one value per row and per column, no
    first moment; at train.learning_rate, no relative step). Also the SFT warm-up's."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    prompt_sharing: Literal["auto", "on", "off"] = "auto"
    """The update's and the reference's forwards: `on` runs each distinct prompt of a
    micro-batch once and the K completions on its keys and values (two passes, fewer tokens);
    `off` runs every row whole (one pass, as TRL does); `auto` shares where the device gains:
    on a CPU always, elsewhere when it saves at least half of the pass's tokens (long prompts,
    many completions each). Equal log-probs to float rounding either way. Only for the
    families that allow it, and never under gradient checkpointing, DDP or FSDP2."""
    host_memory: Literal["auto", "keep", "release"] = "auto"
    """What the C library's malloc does with the memory a step frees: "keep" holds it for the
    next step (glibc on Linux: no fresh pages faulted in every step, ~8 % of a small model's
    CPU step; small freed blocks merged at once rather than in walks over its fastbins),
    "release" leaves its defaults, "auto" keeps on CPU runs. Never changes the math; MALLOC_*
    and glibc.malloc tunables in the environment win."""


class SFTConfig(Section):
    enabled: bool = False
    """Run a supervised warm-up on the tasks' targets before GRPO."""
    steps: int = Field(100, ge=1)
    """Optimizer steps of the warm-up."""
    batch_size: int = Field(8, ge=1)
    """Examples per warm-up step."""
    max_length: int = Field(256, ge=2)
    """Token limit of prompt + target in the warm-up (at most the model's positions)."""
    learning_rate: float = Field(1e-4, gt=0)
    """Warm-up learning rate (constant after a short linear warm-up)."""
    max_examples: int | None = Field(None, ge=1)
    """Use at most this many examples per task for the warm-up."""


EVAL_BATCH = 32
"""Held-out prompts the quick eval decodes at once (fewer where `rollout.generation_batch_size`
is smaller); the memory planner counts them."""


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Greedy evaluation every N GRPO steps (0 = only before and after GRPO)."""
    max_samples: int = Field(64, ge=1)
    """Held-out prompts evaluated per task."""
    at_start: bool = True
    """Evaluate before GRPO starts (the baseline the run is compared with)."""
    reward: str | None = None
    """Reward label scored as the task's eval score (an environment's class name for its
    `get_reward()`); default: the task's first reward."""
    print_samples: int = Field(0, ge=0)
    """Print this many greedy completions per task at each eval."""


class LoggingConfig(Section):
    log_every: int = Field(1, ge=1)
    """Print a metrics line every N steps (the JSONL file gets every step)."""
    progress_bar: bool = True
    """Show a progress bar (off automatically when output is not a terminal)."""
    level: Literal["debug", "info", "warning"] = "info"
    """Console log level."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Also send metrics to these trackers (`pip install 'mogrpo[trackers]'`); the JSONL file
    is always written. W&B honours WANDB_MODE (e.g. offline) and WANDB_API_KEY."""
    project: str = "mogrpo"
    """W&B project / MLflow experiment name."""
    run_name: str | None = None
    """Tracker run name; default: the name of output.dir."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; default: a local file store, RUN_DIR/mlruns."""
    log_completions: bool = False
    """Log every completion of a step — prompt, completion, each reward, advantage and the
    reward functions' `log_extra` columns — to RUN_DIR/completions.jsonl and the trackers
    (TensorBoard text, W&B table, MLflow artifact), as TRL's `log_completions` does."""
    log_completions_every: int = Field(1, ge=1)
    """Steps between two completions tables (TRL logs one every `logging_steps`)."""


class OutputConfig(Section):
    dir: str = "runs/mogrpo"
    """Run directory: metrics.jsonl, config.yaml and the final model go here."""
    overwrite: bool = False
    """Allow writing into a run directory that already holds a run (it is replaced)."""
    save_every: int = Field(0, ge=0)
    """Save a checkpoint every N GRPO steps (0 = only at the end); resume with --resume."""
    keep_last: int = Field(3, ge=0)
    """Checkpoints kept besides the best per task and the Pareto set (0 = keep all)."""
    save_merged: bool = True
    """For LoRA runs, also save a merged full model next to the adapter (loads with plain
    transformers); full fine-tuning always saves the full model."""


DistributedStrategy = Literal["auto", "none", "ddp", "fsdp"]


class DistributedConfig(Section):
    strategy: DistributedStrategy = "auto"
    """How several processes (torchrun, or `mogrpo train --nproc N`) train one model: `ddp`
    (PyTorch DistributedDataParallel: every process holds the whole model), `fsdp` (FSDP2
    `fully_shard`: parameters, gradients and optimizer state split across processes), `none`
    (one process only); `auto` = `ddp` when there is more than one process."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """`fsdp` only: `bf16` gathers and computes with bfloat16 parameters and reduces gradients
    in float32 (the shards and the optimizer stay as `model.precision` keeps them, LoRA
    adapters included); `none` gathers them in that dtype (under bf16-mixed, autocast then
    computes in bfloat16)."""
    reshard_after_forward: bool = True
    """`fsdp` only: free the gathered parameters after each layer's forward (less memory, one
    more all-gather in backward); false keeps them until the backward (faster, more memory)."""
    cpu_offload: bool = False
    """`fsdp` only (CUDA): keep the parameter shards, their gradients and AdamW's state in host
    memory (FSDP2's CPUOffloadPolicy): layers are copied to the GPU as they run, the optimizer
    steps on the CPU. Slower steps; PyTorch offers no such offload without FSDP2."""


class SandboxConfig(Section):
    isolation: Literal["auto", "required", "off"] = "auto"
    """How the code rewards (`code_tests`, `verilog_tests`) contain generated code: `auto`
    isolates it with bubblewrap namespaces (no network, none of the user's files) where the
    machine allows and otherwise runs the weaker `limits` mode (CPU, memory, file-size limits
    and a timeout), saying so once; `required` refuses to run without isolation; `off` always
    uses `limits`. A reward's own `kwargs.isolation` wins over this."""


class RunConfig(Section):
    seed: int = 0
    """Seed for Python, NumPy and torch."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; `auto` picks CUDA when available."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters."""
    tasks: dict[str, TaskConfig] = Field(default_factory=dict)
    """Tasks by name; each has its own data, rewards, batch share and β."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Sampling and lengths."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """GRPO math."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Supervised warm-up."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Greedy quick-eval."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Console output."""
    output: OutputConfig = Field(default_factory=OutputConfig)
    """Run directory and saved models."""
    health: HealthConfig = Field(default_factory=HealthConfig)
    """Training health checks: threshold, patience and action of each."""
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    """Stages that change the tasks' shares of the prompts as the run progresses."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Several processes: data parallel (DDP) or sharded (FSDP2)."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """How generated code is contained by the code rewards (see docs/rewards_code.md)."""
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    """What an out-of-memory error costs: a smaller batch (`adapt`) or the run (`fail`)."""

    _limit_notes: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def limit_notes(self) -> dict[str, str]:
        """Budgets `validate` lowered to the model's limits, by key: from what to what, and why
        (`config.model_limits`; the startup summary prints them)."""
        return self._limit_notes

    @property
    def prompts_per_step(self) -> int:
        """Prompts sampled per optimizer step (validated to be a whole number)."""
        completions = self.train.micro_batch_size * self.train.gradient_accumulation_steps
        return completions // self.rollout.num_generations
