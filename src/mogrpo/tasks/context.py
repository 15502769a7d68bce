"""What every phase of a run works on: the config, the tasks, the loaded policy and how to
sample from it (built by `mogrpo.trainer.run.build_context`), and the task's prompts rendered
for that policy's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mogrpo.config import RunConfig
from mogrpo.data.schema import Example
from mogrpo.modeling.chat import render_prompt
from mogrpo.modeling.precision import Precision
from mogrpo.rollout.generate import SamplingSettings
from mogrpo.tasks.task import Task


@dataclass
class TrainContext:
    """What every phase needs: the config, tasks, the loaded policy and how to sample."""

    config: RunConfig
    tasks: list[Task]
    policy: torch.nn.Module
    tokenizer: Any
    device: torch.device
    stop_token_ids: list[int]
    sampling: SamplingSettings
    rollout_engine: Any = None
    """The vLLM engine (`rollout.engine: vllm`): colocated, or the client of a vllm-server
    (`rollout.vllm.server_url`); else None: the policy generates."""
    precision: Precision = field(default_factory=lambda: Precision("fp32"))
    """How the policy's weights are kept and computed (`model.precision`, resolved): every
    forward of the policy and its reference runs under `precision.autocast()`."""

    @property
    def plain_max_bytes(self) -> int | None:
        """The weight copies the native engine may make to decode: unbounded for full
        fine-tuning on a CPU, where the trainer frees the gradients after every update and
        the copies (fused, packed linear weights) fit in their room; else the engine's cap
        (None: `PLAIN_MAX_BYTES`), for LoRA merges a whole copy the run otherwise never holds."""
        mc = self.config.model
        full = not self.config.lora.enabled and not (mc.load_in_4bit or mc.load_in_8bit)
        return 1 << 62 if full and self.device.type == "cpu" else None

    @property
    def engine(self) -> Any:
        """What `generate_rollout` gets as `engine`: the vLLM engine, or the configured name."""
        return self.rollout_engine if self.rollout_engine is not None \
            else self.config.rollout.engine


def render_prompts(ctx: TrainContext, picks: list[tuple[int, Example]]) -> tuple[list[str], bool]:
    """Prompt texts ready to tokenize, and whether the tokenizer should add special tokens; an
    agent task's list its tools (an environment's `reset` text is not added: it needs the
    episode's instance)."""
    texts, add_special = [], True
    for t, example in picks:
        text, add_special = render_prompt(
            ctx.tokenizer,
            example.prompt,
            system_prompt=ctx.tasks[t].config.system_prompt,
            use_chat_template=ctx.config.model.use_chat_template,
            tools=tools_of(ctx.tasks[t], example),
        )
        texts.append(text)
    return texts, add_special


def tools_of(task: Task, example: Example) -> list[dict[str, Any]] | None:
    """The schemas of the tools an agent task's prompt lists for `example` (its own, its
    environment's methods), as its episodes see them; None for a task without tools."""
    agent = task.agent
    if agent is None or not (agent.tools or agent.environments):
        return None
    return agent.schemas(agent.environment_of(example))
