"""The KL reference policy: the base weights the policy is kept close to.

Under LoRA the reference is the policy itself with its adapters switched off, so no second copy
of the weights is held; for full fine-tuning it is a frozen deep copy taken at the start.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP / FSDP-style wrappers keep the real model in `.module`; the reference needs no syncing.
    while isinstance(model, nn.parallel.DistributedDataParallel) or (
        type(model).__name__ == "FullyShardedDataParallel" and hasattr(model, "module")
    ):
        model = model.module
    return model


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class Reference:
    """Something to run a reference forward on: `with ref.model() as m: logits = m(**batch).logits`."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        if kind not in ("adapter_disabled", "frozen_copy"):
            raise ValueError(f"unknown reference kind {kind!r}")
        self._module = module
        self.kind = kind
        self._modules: list[nn.Module] | None = None  # found at the first reference pass
        self._switches: list[nn.Module] = []  # its adapter layers (peft's `_disable_adapters`)
        self.settle: Callable[[], None] | None = None
        """Called before the adapters are switched off and on again (FSDP2: reshard, so the
        switch sets `requires_grad` on the sharded parameters, not on gathered copies)."""

    @contextmanager
    def model(self) -> Iterator[nn.Module]:
        """Yield the reference module in eval mode under `torch.no_grad()`."""
        if self.kind == "frozen_copy":
            with torch.no_grad():
                yield self._module
            return
        # The policy may be in train mode: dropout must not make the reference stochastic, and the
        # per-module flags are restored so the caller's training state is untouched.
        if self._modules is None:  # the module tree is fixed once the run has built it
            self._modules = list(self._module.modules())
            self._switches = [m for m in self._modules if hasattr(m, "_disable_adapters")]
        flags = [m.training for m in self._modules]
        for m in self._modules:
            m.training = False
        try:
            if self.settle is not None:
                self.settle()
            with torch.no_grad(), self._adapters_off():
                yield self._module
                if self.settle is not None:
                    self.settle()
        finally:
            for module, training in zip(self._modules, flags, strict=True):
                module.training = training

    @contextmanager
    def _adapters_off(self) -> Iterator[None]:
        """Every adapter layer's switch off for the block. peft's `disable_adapter()` does the
        same and also recomputes the model's adapter status and `requires_grad` flags: ~2 ms a
        call on a 0.7 M-parameter model, for each micro-batch. Where a layer's switch does not
        read back as off (another peft), peft's own context runs instead."""
        layers = self._switches
        before = [layer._disable_adapters for layer in layers]
        for layer in layers:
            layer._disable_adapters = True
        try:
            if all(layer.disable_adapters is True for layer in layers):
                yield
            else:
                with self._module.disable_adapter():
                    yield
        finally:
            for layer, flag in zip(layers, before, strict=True):
                layer._disable_adapters = flag


def make_reference(policy: nn.Module, *, needed: bool,
                   dtype: torch.dtype | None = None) -> Reference | None:
    """Build the KL reference for `policy`, or None when no task uses a KL term (every beta is 0).

    A full fine-tuning reference is a frozen copy with its parameters in `dtype` (None: the
    policy's): under mixed precision the compute dtype, half the memory of float32 master
    weights and what autocast computes with anyway. Buffers (rotary frequencies) are copied as
    they are, as a model loaded in that dtype keeps them."""
    if not needed:
        return None
    policy = _unwrap(policy)
    if _is_peft(policy):
        logger.info("KL reference: the policy with its LoRA adapters disabled")
        return Reference(policy, "adapter_disabled")
    # each parameter copied straight into `dtype` (deepcopy takes them from the memo, ties
    # kept): no float32 copy of the whole model on the way
    memo = {id(p): nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), requires_grad=False)
            for p in policy.parameters() if p.is_floating_point()}
    frozen = copy.deepcopy(policy, memo)
    frozen.eval()
    frozen.requires_grad_(False)
    logger.info(
        "KL reference: a frozen copy of the policy (%d parameters, %s)",
        sum(p.numel() for p in frozen.parameters()),
        str(next(frozen.parameters()).dtype).removeprefix("torch."),
    )
    return Reference(frozen, "frozen_copy")
