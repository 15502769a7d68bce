"""A TRL agent script with an environment, ported to mogrpo. The TRL original (the shape its
GRPO documentation gives `environment_factory`):

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content":
        "Increment the counter until it reaches 10."}]}] * 64)
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward_func,
                          train_dataset=dataset, environment_factory=IncrementEnv,
                          args=GRPOConfig(max_completion_length=256,
                                          max_tool_calling_iterations=5))
    trainer.train()

The environment class and the reward function below move over unchanged: one instance per
rollout, `reset(**row)`, public methods as tools, and `environments` given to the reward.
Run it with `python examples/trl_agent_port.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mogrpo import Config, train

DATA = Path(__file__).with_name("trl_agent_port.jsonl")  # the dataset above, 64 rows


class IncrementEnv:
    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        return None

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def reward_func(environments, **kwargs) -> list[float]:
    return [1.0 if env.counter == 10 else 0.0 for env in environments]


RUN = {
    "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"},
    "tasks": {"counter": {
        "data": str(DATA),
        "rewards": [reward_func],
        "environment": IncrementEnv,
        "max_tool_calling_iterations": 5,
        "beta": 0.0,  # TRL's default: no KL term, no reference model
    }},
    "rollout": {"max_completion_length": 256},
    "output": {"dir": "runs/trl_agent_port"},
}


def make_config(**sections: Any) -> Config:
    """The run above, with `sections` merged over it (a smaller model, fewer steps, ...)."""
    return Config(RUN, **sections)


if __name__ == "__main__":
    summary = train(make_config())
    print(summary["evals"])
