"""Every metric name, defined once for whoever writes or reads it: the trainer, the health
checks, the report and console lines, the trackers and the tests.

Names are namespaced: `policy/...`, `rollout/...`, `time/...`; per task `task/<task>/<suffix>`
(`PerTask`); per objective of a task `task/<task>/reward/<label>/<stat>` (`PerObjective`);
greedy evals `eval/<task>/<stat>`. A reader that looked up a name nobody writes would be
silently switched off, so tests/unit/test_metric_names.py runs a GRPO step and checks that
every name declared here is written, and that readers spell no metric name of their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TASK_PREFIX = "task/"


class Metric(str):
    """One metric's name (it is the string itself, so it keys a metrics dict directly),
    written at every step unless `when` names the setting that turns it on."""

    when: str

    def __new__(cls, name: str, when: str = "") -> Metric:
        metric = super().__new__(cls, name)
        metric.when = when
        return metric


@dataclass(frozen=True)
class PerTask:
    """A metric kept for each task: `task/<task>/<suffix>`."""

    suffix: str
    when: str = ""

    def of(self, task: str) -> str:
        return f"{TASK_PREFIX}{task}/{self.suffix}"

    def matches(self, key: str) -> bool:
        # `task/<task>/<suffix>` with a task name free of "/" (not an objective's deeper key)
        return (key.startswith(TASK_PREFIX) and key.endswith("/" + self.suffix)
                and key.count("/") == self.suffix.count("/") + 2)

    def keys(self, metrics: Iterable[str]) -> list[str]:
        """This metric's key of every task present in `metrics`, sorted."""
        return sorted(k for k in metrics if self.matches(k))


@dataclass(frozen=True)
class PerObjective:
    """A statistic of one objective (reward function) of a task:
    `task/<task>/reward/<label>/<stat>`."""

    stat: str

    def of(self, task: str, label: str) -> str:
        return f"{TASK_PREFIX}{task}/reward/{label}/{self.stat}"

    def matches(self, key: str) -> bool:
        parts = key.split("/")
        return len(parts) == 5 and parts[0] + "/" == TASK_PREFIX and parts[2] == "reward" \
            and parts[4] == self.stat

    @staticmethod
    def objective(key: str) -> str:
        """`task/fairness/reward/judge/mean` → `fairness/reward/judge`."""
        return key[len(TASK_PREFIX):key.rindex("/")]


@dataclass(frozen=True)
class PerTool:
    """A statistic of one tool of an agent task: `task/<task>/tool/<tool>/<stat>`."""

    stat: str
    when: str = "tasks.NAME.tools or tasks.NAME.environment"

    def of(self, task: str, tool: str) -> str:
        return f"{TASK_PREFIX}{task}/tool/{tool}/{self.stat}"

    def matches(self, key: str) -> bool:
        parts = key.split("/")
        return len(parts) == 5 and parts[0] + "/" == TASK_PREFIX and parts[2] == "tool" \
            and parts[4] == self.stat


def task_of(key: str) -> str:
    """The task a per-task key belongs to (`task/fairness/kl` → `fairness`)."""
    return key.split("/")[1] if key.startswith(TASK_PREFIX) else "all tasks"


def judge_prefix(task: str, label: str) -> str:
    """Where the judge `label` of `task` puts its metrics (`task/<task>/judge/<label>/...`)."""
    return f"{TASK_PREFIX}{task}/judge/{label}"


def reward_logged(task: str, key: str) -> str:
    """What a reward function of `task` logs with `log_metric(name, value)`:
    `task/<task>/reward/<label>/<name>` (`key` is `<label>/<name>`)."""
    return f"{TASK_PREFIX}{task}/reward/{key}"


def eval_metric(task: str, stat: str) -> str:
    """A greedy eval's figure: `eval/<task>/<stat>` (score, truncated_frac, ...)."""
    return f"eval/{task}/{stat}"


# --------------------------------------------------------------------------- the step

STEP = Metric("step")
LR = Metric("lr")
LOSS = Metric("loss")
KL = Metric("kl")
"""The mean sequence KL to the reference over the step's completions (all tasks)."""

GRAD_NORM = Metric("policy/grad_norm")
UPDATE_NORM = Metric("policy/update_norm")
CLIP_FRAC = Metric("policy/clip_frac")
ENTROPY = Metric("policy/entropy")
SKIPPED_UPDATES = Metric("policy/skipped_updates")
"""Cumulative count of updates skipped for a non-finite gradient."""
LOSS_SCALE = Metric("policy/loss_scale", when="model.precision: fp16-mixed")
"""The fp16 loss scale after the step: halved when the gradients overflowed (that update is
skipped, and not counted in skipped_updates), doubled after 2000 clean steps."""
SAMPLER_IS_WEIGHT = Metric("policy/sampler_is_weight", when="rollout.engine: vllm")
"""Mean truncated importance weight π_old / π_sampler over the step's tokens."""
SAMPLER_IS_CAPPED_FRAC = Metric("policy/sampler_is_capped_frac", when="rollout.engine: vllm")
"""Fraction of the step's tokens whose importance weight hit `rollout.vllm.importance_cap`."""

COMPLETION_LENGTH = Metric("rollout/completion_length")
TRUNCATED_FRAC = Metric("rollout/truncated_frac")
PROMPT_TRUNCATED = Metric("rollout/prompt_truncated")
NONFINITE_LOGITS = Metric("rollout/nonfinite_logits")
IDENTICAL_GROUP_FRAC = Metric("rollout/identical_group_frac")
GROUPS = Metric("rollout/groups")
DYNAMIC_SAMPLING = "rollout/dynamic_sampling"
"""The prefix of dynamic sampling's counts (`.../dropped`, `.../refilled`, ...)."""
DROPPED = Metric(f"{DYNAMIC_SAMPLING}/dropped", when="algorithm.dynamic_sampling")
DYNAMIC_SAMPLING_COUNTS = tuple(f"{DYNAMIC_SAMPLING}/{count}"
                                for count in ("dropped", "refilled", "surplus", "missing"))
"""Dynamic sampling's group counts: each process counts its own groups (summed over them)."""

TIME_ROLLOUT = Metric("time/rollout_s")
TIME_REWARD = Metric("time/reward_s")
TIME_UPDATE = Metric("time/update_s")
TIME_STEP = Metric("time/step_s")
TIME_WEIGHT_SYNC = Metric("time/weight_sync_s", when="rollout.engine: vllm")
"""Seconds spent pushing the updated weights into the vLLM engine."""
TOKENS_PER_S = Metric("throughput/completion_tokens_per_s")
PEAK_GIB = Metric("memory/peak_gib")
CURRICULUM_STAGE = Metric("curriculum/stage", when="curriculum.stages")

# --------------------------------------------------------------------------- per task

TASK_KL = PerTask("kl")
TASK_BETA = PerTask("beta")
TASK_REWARD = PerTask("reward/mean")
"""The weighted mean of the task's objectives; NaN when a weighted objective scored nothing."""
TASK_ZERO_VAR_FRAC = PerTask("zero_var_frac")
"""Fraction of the task's groups whose advantages are all zero (no signal)."""
TASK_COMPLETION_LENGTH = PerTask("completion_length")

OBJECTIVE_MEAN = PerObjective("mean")
OBJECTIVE_STD = PerObjective("std")
OBJECTIVE_MISSING_FRAC = PerObjective("missing_frac")
OBJECTIVE_ZERO_VAR_FRAC = PerObjective("zero_var_frac")
OBJECTIVE_WEIGHT = PerObjective("weight")

_AGENT = "tasks.NAME.tools or tasks.NAME.environment"
TASK_TURNS = PerTask("agent/turns", when=_AGENT)
"""Model turns per episode of an agent task (1 = answered without a tool)."""
TASK_TOKENS_GENERATED = PerTask("agent/tokens_generated", when=_AGENT)
"""Tokens the policy sampled per episode (those that train)."""
TASK_TOKENS_INSERTED = PerTask("agent/tokens_inserted", when=_AGENT)
"""Tokens inserted per episode between turns: tool results and template text (masked)."""
TOOL_CALLS = PerTool("calls")
"""Calls of the tool per episode."""
TOOL_ERRORS = PerTool("error_frac")
"""Share of the tool's calls that failed (raised, bad arguments, unknown tool, unreadable)."""
TOOL_TIMEOUTS = PerTool("timeout_frac")
"""Share of the tool's calls that ran past `tasks.NAME.tool_timeout_s`."""

STEP_METRICS = tuple(v for v in dict(globals()).values() if isinstance(v, Metric))
PER_TASK = tuple(v for v in dict(globals()).values() if isinstance(v, PerTask))
PER_OBJECTIVE = tuple(v for v in dict(globals()).values() if isinstance(v, PerObjective))
PER_TOOL = tuple(v for v in dict(globals()).values() if isinstance(v, PerTool))
