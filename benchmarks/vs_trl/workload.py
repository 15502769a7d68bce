"""What both tools run: the settings, the model sizes, the prompts and their order.

Everything here is built from scratch and offline: two-digit additions, one byte-level BPE
tokenizer trained on them, and three Qwen2 models of different sizes saved as ordinary
Hugging Face folders, so TRL and mogrpo load the very same files.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from arith_rewards import WEIGHTS

HERE = Path(__file__).resolve().parent
REWARDS_FILE = HERE / "arith_rewards.py"
TASK = "add"


@dataclass(frozen=True)
class Settings:
    """The GRPO settings shared by both tools (one optimizer step = one generation batch)."""

    prompts_per_step: int = 4
    num_generations: int = 4
    max_completion_length: int = 32
    temperature: float = 1.0
    beta: float = 0.04
    learning_rate: float = 1e-4
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    seed: int = 0

    @property
    def batch_size(self) -> int:
        """Completions per step (prompts x K), one micro-batch."""
        return self.prompts_per_step * self.num_generations


@dataclass(frozen=True)
class ModelSize:
    """A Qwen2 shape; `params` is filled in once built."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


# ~0.7 M, ~8 M and ~32 M parameters with the shared 512-token vocabulary (embeddings tied);
# "xl", ~0.2 B, is for GPUs (`--device cuda`): on two CPU cores one run takes many minutes.
SIZES = {
    "small": ModelSize(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=640),
    "medium": ModelSize(hidden_size=256, num_layers=8, num_heads=4, intermediate_size=960),
    "large": ModelSize(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1920),
    "xl": ModelSize(hidden_size=1024, num_layers=16, num_heads=16, intermediate_size=2816),
}
CPU_SIZES = ["small", "medium", "large"]
VOCAB_SIZE = 512
PRECISION_DTYPES = {"fp32": "float32", "bf16-mixed": "bfloat16"}
"""The precisions both tools are compared in, and their compute dtypes: TRL keeps float32
weights either way and autocasts to bfloat16 with `bf16=True`, as mogrpo's bf16-mixed does."""
POOL_SIZE = 512


def prompt_rows(seed: int, n: int = POOL_SIZE) -> list[dict[str, Any]]:
    """`n` two-digit additions, `{"prompt": "What is 23 + 45?\\nAnswer:", "answer": 68}`."""
    rng = random.Random(f"vs_trl/{seed}")
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}?\nAnswer:", "answer": a + b})
    return rows


def tokenizer_texts(rows: list[dict[str, Any]]) -> list[str]:
    """The tokenizer's training text: every prompt followed by its answer."""
    return [f"{r['prompt']} {r['answer']}" for r in rows]


def build_models(work: Path, sizes: list[str], seed: int,
                 arch: str = "qwen2") -> dict[str, dict[str, Any]]:
    """Build each size from scratch into `work/models/SIZE`, of the family `arch` (a
    `build_tiny_model` arch: qwen2, qwen3, gemma or llama); one tokenizer for all of them.

    Returns per size: the folder, the parameter count and the tokenizer's hash (the same for
    every size, checked here).
    """
    from mogrpo.modeling.tiny import build_tiny_model

    texts = tokenizer_texts(prompt_rows(seed))
    built: dict[str, dict[str, Any]] = {}
    for name in sizes:
        shape = SIZES[name]
        path = build_tiny_model(
            work / "models" / name, texts, arch=arch, seed=seed, vocab_size=VOCAB_SIZE,
            hidden_size=shape.hidden_size, num_layers=shape.num_layers,
            num_heads=shape.num_heads, intermediate_size=shape.intermediate_size,
            max_position_embeddings=256,
        )
        built[name] = {"path": str(path), "arch": arch, "params": count_params(path),
                       "tokenizer_sha1": _sha1(path / "tokenizer.json"), **asdict(shape)}
    hashes = {b["tokenizer_sha1"] for b in built.values()}
    if len(hashes) > 1:
        raise RuntimeError(f"the model sizes got different tokenizers ({hashes}); they must share one")
    return built


def loaded_models(sizes: list[str], seed: int = 0,
                  arch: str = "qwen2") -> Iterator[tuple[str, Any, Any]]:
    """(size, model in eval mode, tokenizer) for each size (of the family `arch`), built in a
    temporary directory that is removed after the last (for the benchmarks that time one
    process's engines)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        built = build_models(Path(tmp), sizes, seed, arch)
        for size in sizes:
            path = built[size]["path"]
            yield (size, AutoModelForCausalLM.from_pretrained(path).eval(),
                   AutoTokenizer.from_pretrained(path))


def count_params(model_dir: Path) -> int:
    """Parameters stored in a saved model folder (tied embeddings counted once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def write_prompts(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSONL (mogrpo's task data)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def mogrpo_order(rows: list[dict[str, Any]], steps: int, settings: Settings) -> list[dict[str, Any]]:
    """The prompts mogrpo draws in `steps` steps, in order, using mogrpo's own task mixer.

    TRL is given exactly this list with shuffling off, so both see the same prompts in the
    same order.
    """
    from mogrpo.tasks.task import TaskMixer

    task = SimpleNamespace(name=TASK, train=rows, stream=None, config=SimpleNamespace(weight=1.0))
    mixer = TaskMixer([task], settings.seed)  # type: ignore[list-item]
    order = []
    for _ in range(steps):
        order.extend(row for _, row in mixer.next_batch(settings.prompts_per_step))
    return order


def mogrpo_config(model: str, data: Path, out_dir: Path, steps: int, lora: bool,
                  settings: Settings, engine: str | None = None,
                  device: str = "cpu", precision: str = "fp32") -> dict[str, Any]:
    """mogrpo's config for one run: the shared settings, no eval, no SFT, no checkpoints;
    `precision` fp32 (float32 throughout) or bf16-mixed (float32 weights, bf16 autocast)."""
    model_section: dict[str, Any] = {"name_or_path": model, "dtype": "float32",
                                     "use_chat_template": False}
    if precision != "fp32":
        model_section.update(precision=precision, dtype=PRECISION_DTYPES[precision])
    config: dict[str, Any] = {
        "seed": settings.seed,
        "device": device,
        "model": model_section,
        "lora": {"enabled": lora, "r": settings.lora_r, "alpha": settings.lora_alpha,
                 "dropout": settings.lora_dropout, "target_modules": "all-linear"},
        "tasks": {TASK: {
            "data": str(data),
            "eval_size": 0,
            "rewards": [{"fn": f"{REWARDS_FILE}:{name}", "weight": weight}
                        for name, weight in WEIGHTS.items()],
            "beta": settings.beta,
        }},
        "rollout": {
            "num_generations": settings.num_generations,
            "max_seq_length": 32 + settings.max_completion_length,
            "max_prompt_length": 32,
            "max_completion_length": settings.max_completion_length,
            "temperature": settings.temperature,
        },
        "algorithm": {"loss_aggregation": "token_mean", "kl_estimator": "k3",
                      "num_iterations": 1},
        "train": {"max_steps": steps, "micro_batch_size": settings.batch_size,
                  "gradient_accumulation_steps": 1, "learning_rate": settings.learning_rate,
                  "lr_scheduler": "constant", "warmup_steps": 0},
        "sft": {"enabled": False},
        "eval": {"at_start": False, "every_steps": 0},
        "logging": {"log_every": steps, "progress_bar": False, "level": "warning"},
        "output": {"dir": str(out_dir), "overwrite": True, "save_every": 0,
                   "save_merged": False},
    }
    if engine is not None:
        config["rollout"]["engine"] = engine
    return config


def write_mogrpo_config(path: Path, config: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


