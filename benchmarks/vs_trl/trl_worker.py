"""One TRL GRPOTrainer run of the benchmark, in its own process (started by run.py).

    python benchmarks/vs_trl/trl_worker.py --model DIR --prompts ORDER.jsonl --steps N \
        --mode full|lora --out RESULT.json [--device cpu|cuda] [--precision fp32|bf16-mixed]
        [--phases] [--ops] [--torch-profile FILE [--warmup N]]

Writes per-step wall and CPU times (on_step_begin → on_step_end), generation times (TRL's `_generate`:
tokenize, `model.generate`, decode — what mogrpo's `time/rollout_s` covers) and completion
token counts. Rewards come from the shared reward log (see arith_rewards.py). `--phases` also
writes each step's wall time per phase (generation, rewards, the reference pass, the
policy's forward and loss, backward, clipping, the optimizer), to set beside
`benchmarks/profile_step.py`'s figures for mogrpo; `--ops` the ATen operations each step
dispatches outside `_generate` (`op_count.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import arith_rewards
from op_count import OpCounter
from torch_profile import StepProfiler
from workload import Settings


class StepTimer:
    """Times each optimizer step and the generation inside it."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []
        self.generation_s: list[float] = []
        self.completion_tokens: list[int] = []
        self.phases: list[dict[str, float]] = []  # per step, with --phases
        self.counter: OpCounter | None = None  # with --ops
        self.profiler: StepProfiler | None = None  # with --torch-profile, after `warmup` steps
        self.warmup = 0
        self.ops: list[dict[str, Any]] = []
        self._spent: dict[str, float] = {}
        self._start = self._cpu_start = 0.0

    @staticmethod
    def synchronize() -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def wrap_generate(self, trainer: Any) -> None:
        """Replace the trainer's `_generate` by a timed call of the original."""
        original = trainer._generate

        def timed(prompts: list[Any]) -> Any:
            start = time.perf_counter()
            with (self.counter.pause() if self.counter else contextlib.nullcontext()), \
                    (self.profiler.paused() if self.profiler else contextlib.nullcontext()):
                out = original(prompts)
            self.generation_s.append(time.perf_counter() - start)
            self._spent["generation"] = self.generation_s[-1]
            self.completion_tokens.append(sum(len(ids) for ids in out[1]))  # completion_ids
            return out

        trainer._generate = timed

    def wrap_phases(self, trainer: Any) -> None:
        """Time the parts of TRL's step (wall): its methods on this trainer, and PyTorch's
        backward, clipping and AdamW step, which every trainer calls."""
        import torch

        def timed(owner: Any, attr: str, label: Any) -> None:
            original = getattr(owner, attr)

            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    name = label() if callable(label) else label
                    self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - start

            setattr(owner, attr, run)

        # the reference pass runs without gradients, the policy's inside _compute_loss
        timed(trainer, "_get_per_token_logps_and_entropies",
              lambda: "policy forward" if torch.is_grad_enabled() else "reference forward")
        timed(trainer, "_calculate_rewards", "reward")
        timed(trainer, "_compute_loss", "policy forward + loss")
        timed(torch.Tensor, "backward", "backward")
        timed(torch.nn.utils, "clip_grad_norm_", "grad clip")
        timed(torch.optim.AdamW, "step", "optimizer")

    def callback(self) -> Any:
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                timer._spent = {}
                if timer.counter is not None:
                    timer.counter.__enter__()
                if timer.profiler is not None and len(timer.step_s) >= timer.warmup:
                    timer.profiler.begin()
                timer._start, timer._cpu_start = time.perf_counter(), time.process_time()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                timer.synchronize()  # a GPU's queued work belongs to this step
                timer.step_s.append(time.perf_counter() - timer._start)
                timer.cpu_s.append(time.process_time() - timer._cpu_start)
                timer.phases.append(dict(timer._spent))
                if timer.profiler is not None:
                    timer.profiler.end()
                if timer.counter is not None:
                    timer.counter.__exit__(None, None, None)
                    timer.ops.append(timer.counter.take())

        return _Callback()


def grpo_config(settings: Settings, steps: int, output_dir: str, device: str = "cpu",
                precision: str = "fp32") -> Any:
    """TRL's config matching mogrpo's run: float32 weights on `device` (under bf16 autocast
    with `precision` bf16-mixed), token-mean (DAPO) loss, k3 KL without the importance weight
    (mogrpo's default), no eval, no saving, no trackers."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=1,
        generation_batch_size=settings.batch_size,  # one generation per optimizer step
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        top_p=1.0,
        top_k=0,
        beta=settings.beta,
        use_bias_correction_kl=False,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        reward_weights=list(arith_rewards.WEIGHTS.values()),
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=precision == "bf16-mixed",
        fp16=False,
        use_cpu=device == "cpu",
        gradient_checkpointing=False,
        use_vllm=False,
        shuffle_dataset=False,  # the dataset is already in mogrpo's draw order
        seed=settings.seed,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=steps,
        disable_tqdm=True,
        log_level="warning",
        dataloader_num_workers=0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL in draw order")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--mode", choices=["full", "lora"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed"], default="fp32")
    parser.add_argument("--phases", action="store_true", help="time each phase of a step")
    parser.add_argument("--torch-profile", type=Path, default=None,
                        help="write torch.profiler's summary of the steps after --warmup "
                        "(generation left out)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ops", action="store_true",
                        help="count each step's operations outside the generation")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    hf_logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    settings = Settings()
    torch.manual_seed(settings.seed)
    rows = [json.loads(line) for line in args.prompts.read_text(encoding="utf-8").splitlines()]
    peft_config = LoraConfig(
        r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
        target_modules="all-linear", task_type="CAUSAL_LM",
    ) if args.mode == "lora" else None
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        config = grpo_config(settings, args.steps, tmp, args.device, args.precision)
        config.model_init_kwargs = {"dtype": torch.float32}
        trainer = GRPOTrainer(
            model=args.model,
            reward_funcs=[getattr(arith_rewards, name) for name in arith_rewards.WEIGHTS],
            args=config,
            train_dataset=Dataset.from_list(rows),
            peft_config=peft_config,
            callbacks=[timer.callback()],
        )
        timer.wrap_generate(trainer)
        if args.phases:
            timer.wrap_phases(trainer)
        if args.ops:
            timer.counter = OpCounter()
        if args.torch_profile:
            timer.profiler = StepProfiler(args.torch_profile, args.device == "cuda")
            timer.warmup = args.warmup
        trainer.train()
        if timer.profiler is not None:
            timer.profiler.write(f"TRL {args.mode} {args.precision} on {args.device}")
    args.out.write_text(json.dumps({
        "step_s": timer.step_s,
        "cpu_s": timer.cpu_s,
        "generation_s": timer.generation_s,
        "completion_tokens": timer.completion_tokens,
        **({"phases": timer.phases} if args.phases else {}),
        **({"ops": timer.ops} if args.ops else {}),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }), encoding="utf-8")


if __name__ == "__main__":
    main()
