"""What a run asks of this machine: a CUDA GPU where `device: cuda` says so, bfloat16 where the
precision asks for it, flash-attention's package (bitsandbytes for quantised weights, with CUDA
for 8-bit optimizers: `mogrpo.config.hardware`), Icarus Verilog for `verilog_tests`, and the
namespaces `sandbox.isolation: required` asks of the code rewards.

Checked by `validate` (`machine=True`) before any data or model loads, and again by the
loaders for callers of the Python functions. torch is imported only when a check needs it (a
config that asks for none of these costs no torch import).
"""

from __future__ import annotations

import importlib.util
import shutil

from mogrpo.config.precision import resolve_precision
from mogrpo.config.sections import RunConfig

NO_CUDA = "device = cuda but no CUDA GPU is visible; set device: auto or cpu"
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def accelerator_problems(attn_implementation: str | None, device: str = "auto") -> list[str]:
    """A flash-attention kernel without CUDA or its package; `device` the run's (`cpu` rules
    CUDA out without asking torch). (4-bit and 8-bit weights: `mogrpo.config.hardware`.)"""
    problems = []
    package = FLASH_PACKAGES.get(attn_implementation or "")
    if package and (device == "cpu" or importlib.util.find_spec(package) is None
                    or not cuda_visible()):
        problems.append(
            f"model.attn_implementation = {attn_implementation!r} needs a CUDA GPU and the "
            f"`{package}` package; install it or use attn_implementation 'sdpa' (the default) "
            "or 'eager'")
    return problems


def no_bf16(precision: str, gpu: str) -> str:
    """The error for a bfloat16 precision on a GPU without bfloat16."""
    return (f"model.precision = {precision}: this GPU ({gpu}) has no bfloat16; use fp16-mixed "
            "(float32 weights, float16 compute with loss scaling) or fp32")


def machine_errors(config: RunConfig) -> list[str]:
    """Everything `config` asks of this machine that it does not have."""
    mc = config.model
    if config.device == "cuda" and not cuda_visible():
        return [NO_CUDA]
    # 4-bit and 8-bit weights: `mogrpo.config.hardware.small_gpu_errors` (one message each)
    errors = accelerator_problems(mc.attn_implementation, config.device)
    errors.extend(sandbox_errors(config))
    # only an explicit bfloat16 can fail: `auto` falls back to fp16-mixed on such a GPU
    precision = resolve_precision(mc.precision, mc.dtype, "cuda", bf16_supported=False)
    if config.device != "cpu" and "bf16" in precision and cuda_visible():
        import torch

        if not torch.cuda.is_bf16_supported():
            errors.append(no_bf16(precision, torch.cuda.get_device_name()))
    return errors


SANDBOXED_REWARDS = ("code_tests", "verilog_tests")
INSTALL_IVERILOG = ("install Icarus Verilog (Debian/Ubuntu: apt-get install iverilog; Fedora: "
                    "dnf install iverilog; macOS: brew install icarus-verilog)")


def iverilog_missing() -> str | None:
    """Why `verilog_tests` cannot run on this machine (no `iverilog` or `vvp`), or None."""
    missing = [tool for tool in ("iverilog", "vvp") if shutil.which(tool) is None]
    if not missing:
        return None
    return (f"verilog_tests needs Icarus Verilog, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH: {INSTALL_IVERILOG}")




def sandbox_errors(config: RunConfig) -> list[str]:
    """The code rewards' needs: `iverilog` for `verilog_tests`, namespaces where isolation is
    `required` (the rewards module is imported only when a task uses one of them)."""
    used = [(f"tasks.{name}.rewards.{i}", r) for name, task in config.tasks.items()
            for i, r in enumerate(task.rewards)
            if isinstance(r.fn, str) and r.fn.strip() in SANDBOXED_REWARDS]
    if not used:
        return []
    from mogrpo.errors import RewardError
    from mogrpo.sandbox import resolve_isolation

    errors = []
    if any(r.fn.strip() == "verilog_tests" for _, r in used):
        missing = iverilog_missing()
        if missing:
            errors.append(f"{next(w for w, r in used if r.fn.strip() == 'verilog_tests')}: "
                          f"{missing}")
    for where, reward in used:
        setting = reward.kwargs.get("isolation", config.sandbox.isolation)
        try:
            resolve_isolation(setting)
        except RewardError as err:
            errors.append(f"{where}: {err}")
            break  # one machine, one reason
    return errors
