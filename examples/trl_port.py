"""A TRL GRPO script, ported to mogrpo. The TRL original:

    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import accuracy_reward, think_format_reward

    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
    args = GRPOConfig(
        output_dir="runs/deepmath", num_generations=8, max_completion_length=256,
        per_device_train_batch_size=8, gradient_accumulation_steps=4, learning_rate=1e-6,
        beta=0.0, loss_type="dapo", mask_truncated_completions=True, max_steps=500,
        log_completions=True, report_to="wandb",
    )
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct",
                          reward_funcs=[accuracy_reward, think_format_reward],
                          args=args, train_dataset=dataset)
    trainer.train()

The same run in mogrpo, with TRL's reward functions unchanged. The batch is the same: 8
completions per micro-batch × 4 accumulation steps = 32 completions = 4 prompts × 8. Run it
with `python examples/trl_port.py` (`pip install 'trl[math-verify]'` for the rewards).
"""

from __future__ import annotations

from typing import Any

from trl.rewards import accuracy_reward, think_format_reward

from mogrpo import Config, train

RUN = {
    "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"},
    "tasks": {"math": {
        "data": {"hub": "trl-lib/DeepMath-103K", "split": "train"},  # prompt (chat), solution
        "rewards": [accuracy_reward, think_format_reward],
        "beta": 0.0,  # TRL's default: no KL term, no reference model
    }},
    "rollout": {"num_generations": 8, "max_completion_length": 256},
    "algorithm": {"loss_type": "dapo", "mask_truncated_completions": True},
    "train": {"micro_batch_size": 8, "gradient_accumulation_steps": 4, "learning_rate": 1e-6,
              "max_steps": 500},
    "logging": {"log_completions": True, "trackers": ["wandb"]},
    "output": {"dir": "runs/deepmath"},
}


def make_config(**sections: Any) -> Config:
    """The run above, with `sections` merged over it (a smaller model, local data, ...)."""
    return Config(RUN, **sections)


if __name__ == "__main__":
    summary = train(make_config())
    print(summary["evals"])
