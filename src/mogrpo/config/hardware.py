"""What the small-GPU settings ask of the machine, checked when the config is validated, before
any model loads: bitsandbytes and a CUDA GPU for the 8-bit optimizers, bitsandbytes for the
4-/8-bit weights (on a CPU too, from 0.46.1), a GPU for FSDP2's CPU offload, and which of them
can go together.

Torch is imported only to ask for a GPU, and only when a setting needs one; a config that
names none of them validates without it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING

from packaging.version import Version

if TYPE_CHECKING:
    from mogrpo.config.sections import ModelConfig, RunConfig

BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")
"""The optimizers bitsandbytes provides (on CUDA GPUs; on a CPU from `BNB_CPU_OPTIM_MIN`)."""
GPU_EXTRA = "pip install 'mogrpo[gpu]'"
BNB_CPU_MIN = "0.46.1"
"""The oldest bitsandbytes that quantises and runs 4-bit (NF4) and 8-bit weights on a CPU: its
kernels moved behind torch custom ops with CPU implementations in 0.46 (0.45's wheel has no
`bitsandbytes.backends`), and 0.46.1 is the oldest transformers 5.24 accepts at all
(`BITSANDBYTES_MIN_VERSION`). Checked: NF4 and LLM.int8() loading, LoRA forward and backward
on CPU with 0.46.1 and 0.50.2 (torch 2.13, transformers 5.24)."""
BNB_CPU_OPTIM_MIN = "0.50.0"
"""The oldest bitsandbytes whose 8-bit optimizers step CPU tensors: 0.46.1 to 0.49.2 raise
"All input tensors need to be on the same GPU" at the first step (checked with 0.46.1, 0.48.2,
0.49.2, 0.50.0 and 0.50.2, torch 2.13). On a CPU the paged optimizer has nothing to page and
runs as the plain one."""


def quantized_field(model: ModelConfig) -> str | None:
    """`model.load_in_4bit` or `model.load_in_8bit`, whichever is set (None: neither)."""
    if model.load_in_4bit:
        return "model.load_in_4bit"
    return "model.load_in_8bit" if model.load_in_8bit else None


def bitsandbytes_version() -> str | None:
    """The installed bitsandbytes' version (None: not installed), from its package metadata:
    importing it would load its native library."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def quantized_weights_problem(field: str, device: str, machine: bool) -> str | None:
    """Why `field` (`model.load_in_4bit` or `load_in_8bit`) cannot load on this machine for a run
    on `device`, as a whole message (None: it can; `machine` False: always None, the config is
    meant for another machine). On a CUDA GPU any bitsandbytes transformers accepts will do;
    without one (`device: cpu`, or none visible) it must be `BNB_CPU_MIN` or newer."""
    if not machine:
        return None
    installed = bitsandbytes_version()
    if installed is None:
        return (f"{field} = true needs bitsandbytes (`{GPU_EXTRA}`), but bitsandbytes is not "
                f"installed; install it, or on this machine set {field}: false")
    on_cpu = device == "cpu" or not _cuda()
    if on_cpu and Version(installed) < Version(BNB_CPU_MIN):
        return (f"{field} = true on a CPU needs bitsandbytes >= {BNB_CPU_MIN} (older ones have "
                f"CUDA kernels only), but {installed} is installed; upgrade it (`pip install -U "
                f"'bitsandbytes>={BNB_CPU_MIN}'`), or set {field}: false")
    return None


def bitsandbytes_problem(device: str, machine: bool) -> str | None:
    """Why bitsandbytes' 8-bit optimizers cannot run for a run on `device` (None: they can).
    `machine`: look at this machine (the package installed, its version where no CUDA GPU
    is visible or `device` is cpu); without it (a config meant for another machine) None."""
    if not machine:
        return None
    installed = bitsandbytes_version()
    if installed is None:
        return "bitsandbytes is not installed"
    if (device == "cpu" or not _cuda()) and Version(installed) < Version(BNB_CPU_OPTIM_MIN):
        return (f"on a CPU it needs bitsandbytes >= {BNB_CPU_OPTIM_MIN} (older ones step CUDA "
                f"tensors only) and {installed} is installed; upgrade it (`pip install -U "
                f"'bitsandbytes>={BNB_CPU_OPTIM_MIN}'`)")
    return None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def quantization_errors(model: ModelConfig, lora: bool) -> list[str]:
    """What cannot be loaded or trained of `model.load_in_4bit` / `load_in_8bit` (`lora`:
    `lora.enabled`), whatever the machine."""
    errors = []
    quantized = quantized_field(model)
    if model.load_in_4bit and model.load_in_8bit:
        errors.append("model.load_in_4bit and model.load_in_8bit are both set: the weights load "
                      "in one format; keep one of them")
    if model.embeddings_in_4bit and not model.load_in_4bit:
        errors.append("model.embeddings_in_4bit stores the embedding and head in NF4 beside a "
                      "4-bit base; set model.load_in_4bit: true as well, or "
                      "embeddings_in_4bit: false")
    if quantized and not lora:
        errors.append(f"{quantized} trains nothing without LoRA (quantised weights are frozen); "
                      "set lora.enabled: true")
    return errors


def saved_quantization_errors(model: ModelConfig, lora: bool, name: str,
                              saved: dict | None) -> list[str]:
    """What cannot go with a checkpoint saved quantised (`saved`: its config.json's
    `quantization_config`; `lora`: `lora.enabled`). transformers loads such weights as saved,
    whatever `model.load_in_4bit` / `load_in_8bit` ask, and they cannot be trained: full
    fine-tuning would train only the rest (embeddings, norms). A bitsandbytes checkpoint needs
    the flag of its format, so that the run treats it as the quantised base it is (QLoRA's
    preparation, the memory plan, the vLLM and FSDP2 checks)."""
    if saved is None:
        return []
    method = saved.get("quant_method")
    bits = 4 if saved.get("load_in_4bit") or saved.get("_load_in_4bit") else \
        8 if saved.get("load_in_8bit") or saved.get("_load_in_8bit") else None
    flag = f"model.load_in_{bits}bit" if method == "bitsandbytes" and bits else None
    what = f"bitsandbytes {bits}-bit" if flag else method or "an unknown method"
    where = (f"model {name} is saved quantised ({what}: `quantization_config` in its "
             "config.json), and loads as saved")
    asked = quantized_field(model)
    errors = []
    if not lora and not asked:  # (a flag without LoRA: `quantization_errors` says it)
        errors.append(f"{where}; its quantised weights cannot be trained, so full fine-tuning "
                      "would train only the rest (embeddings, norms): set lora.enabled: true, "
                      "or train the unquantised checkpoint")
    if asked and flag is None:
        errors.append(f"{asked} quantises with bitsandbytes, but {where}; remove {asked}")
    elif asked and asked != flag:
        errors.append(f"{asked} = true, but {where}; set {flag}: true instead")
    elif flag and not asked and lora:
        errors.append(f"{where}; set {flag}: true, so that the run treats it as the quantised "
                      "base it is (QLoRA's preparation, the memory plan, the vLLM and FSDP2 "
                      "checks)")
    return errors


def small_gpu_errors(config: RunConfig, machine: bool = True) -> list[str]:
    """Every problem of `train.optimizer`, `model.load_in_4bit` / `load_in_8bit` and
    `distributed.cpu_offload` in `config` (with `machine`: on this machine)."""
    mc, optimizer = config.model, config.train.optimizer
    quantized = quantized_field(mc)
    errors = quantization_errors(mc, config.lora.enabled)
    weights = quantized_weights_problem(quantized, config.device, machine) if quantized else None
    errors.extend([weights] if weights else [])
    problem = (bitsandbytes_problem(config.device, machine) if optimizer in BNB_OPTIMIZERS
               else None)
    if problem:
        errors.append(f"train.optimizer = {optimizer} needs bitsandbytes (`{GPU_EXTRA}`), but "
                      f"{problem}; or on this machine use train.optimizer: adamw, or adafactor "
                      "(its state is also small)")
    dc = config.distributed
    if dc.cpu_offload and dc.strategy != "fsdp":
        errors.append(f"distributed.cpu_offload moves FSDP2's shards to host memory, but "
                      f"distributed.strategy is {dc.strategy}; set it to fsdp (several "
                      "processes), or cpu_offload: false")
    elif dc.cpu_offload and (config.device == "cpu" or machine and not _cuda()):
        errors.append("distributed.cpu_offload frees GPU memory, but this run has no CUDA GPU "
                      "(device cpu, or none visible); set distributed.cpu_offload: false")
    return errors


def process_errors(config: RunConfig, strategy: str) -> list[str]:
    """What the small-GPU settings cannot do under `strategy` (the one the processes use)."""
    quantized = quantized_field(config.model)
    errors = []
    if strategy == "fsdp" and quantized:
        errors.append(f"distributed.strategy: fsdp cannot shard quantised weights ({quantized}); "
                      "use distributed.strategy: ddp")
    if strategy == "fsdp" and config.train.optimizer != "adamw":
        # bitsandbytes: issues #89 and #1633 (FSDP2: illegal memory access); transformers'
        # Adafactor adds plain tensors to DTensor shards and fails
        errors.append(f"train.optimizer = {config.train.optimizer} cannot step FSDP2's sharded "
                      "parameters (DTensors): only adamw can; use adamw or "
                      "distributed.strategy: ddp")
    if strategy == "none" and config.distributed.cpu_offload:
        errors.append("distributed.cpu_offload offloads FSDP2's shards, and one process shards "
                      "nothing; run several (--nproc N, distributed.strategy: fsdp) or set "
                      "distributed.cpu_offload: false")
    return errors
