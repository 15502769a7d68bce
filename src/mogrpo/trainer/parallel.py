"""The policy across processes, on PyTorch's own engines: DDP or FSDP2 (`fully_shard`).

`parallelize` applies the strategy once, apart from the model code and the loop (as
torchtitan's `parallelize` does); the GRPO update then only asks this module to run a
micro-batch (`micro_batch`, `backward`), clip (`clip_grad_norm`) and gather the weights for
generation (`gathered`). With one process nothing is wrapped and every call is the plain one.

Summed, not averaged. Every micro-batch's loss is divided by the *global* normaliser of the
optimizer step (`Dist.sum`), so the full-batch gradient is the SUM of the processes'
gradients, while both engines average by default. FSDP2 is told to divide by 1
(`set_gradient_divide_factor`); DDP, which has no such setting, gets the loss multiplied by the
world size before its average divides it again (exact for a power-of-two world size).

One synced backward per process. Only the last micro-batch of an optimizer step reduces
gradients (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`), and under FSDP2 every forward
all-gathers parameters: processes with fewer micro-batches (length buckets, dropped groups)
run zero-weighted ones (`pad`), so every process takes part in the same collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from mogrpo.config.processes import strategy_for
from mogrpo.config.sections import DistributedConfig
from mogrpo.errors import ModelError
from mogrpo.modeling.reference import Reference, make_reference
from mogrpo.rollout.layout import unwrap_causal_lm
from mogrpo.trainer.distributed import Dist

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ParallelPolicy:
    """How the policy trains across processes: what to forward, how to sync and clip."""

    policy: nn.Module
    """The model itself (under FSDP2 its parameters are the local shards, as DTensors)."""
    strategy: str = "none"
    dist: Dist = field(default_factory=Dist)
    module: nn.Module | None = None
    """What the training forward runs through: the DDP wrapper, else the policy itself."""
    sharded: list[nn.Module] = field(default_factory=list)
    """FSDP2: the policy's `fully_shard`-ed modules, root last."""
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.module is None:
            self.module = self.policy

    @property
    def is_fsdp(self) -> bool:
        return self.strategy == "fsdp"

    def pad(self, micro_batches: Sequence[T]) -> list[T | None]:
        """FSDP2: this process's micro-batches, then None (run a zero-weighted one) up to the
        largest count of any process, since every forward all-gathers. DDP's forwards do not
        communicate and each process syncs once, on its own last micro-batch: unpadded."""
        if not self.is_fsdp:
            return list(micro_batches)
        most = max(self.dist.gather(len(micro_batches)))
        return [*micro_batches, *[None] * (most - len(micro_batches))]

    def agree(self, flag: bool) -> bool:
        """FSDP2: True when `flag` holds in any process, so all run the same (collective)
        forwards; otherwise this process's own `flag`."""
        if not self.is_fsdp:
            return flag
        return any(self.dist.gather(bool(flag)))

    def sync_gradients(self, last: bool) -> None:
        """Before a micro-batch's forward: reduce its gradients over processes only if it is
        the optimizer step's `last` (the others accumulate locally, without communication).

        DDP: what its `no_sync()` context sets, here for a whole forward + backward; FSDP2:
        `set_requires_gradient_sync`. The last micro-batch leaves syncing switched on."""
        if self.strategy == "ddp":
            self.module.require_backward_grad_sync = last
        elif self.is_fsdp:
            self.sharded[-1].set_requires_gradient_sync(last)  # the root, and every layer

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a loss already divided by the global normaliser; the engine's
        reduction then leaves the sum over processes in every gradient."""
        if self.strategy == "ddp":
            loss = loss * self.dist.world_size  # DDP averages; the math needs the sum
        loss.backward()

    def idle_backward(self, forward: Callable[[], torch.Tensor]) -> None:
        """A zero-weighted backward through `forward()`'s output: this process has no rows
        left but takes part in the others' collectives, adding nothing to any gradient."""
        self.backward(forward().sum() * 0.0)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` by the global norm of every gradient; returns that norm (a plain
        tensor). FSDP2's gradients are DTensor shards: torch's clip reduces their norms."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return _full(norm)

    def global_norm(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of tensors given by their own norms (FSDP2: of their shards, whose local
        norms are combined over processes)."""
        if not self.is_fsdp:
            return torch.linalg.vector_norm(torch.stack(norms))
        local = sum(float(_local(n).double()) ** 2 for n in norms)
        return torch.tensor(self.dist.sum(local) ** 0.5)

    def reshard(self) -> None:
        """FSDP2: free every gathered module, so the sharded parameters are the registered
        ones again (a no-op where they already are)."""
        for module in self.sharded if self.is_fsdp else []:
            module.reshard()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Whole weights in every process for generation and quick-eval (FSDP2: all-gathered
        once, kept through every decode step, freed after); a no-op otherwise.

        The native engine calls the model's submodules directly, past FSDP2's hooks, and
        processes decode different numbers of tokens: gathering once up front makes both
        correct, at the cost of holding the whole model while generating."""
        if not self.is_fsdp:
            yield
            return
        for module in self.sharded:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        try:
            yield
        finally:
            for module in self.sharded:
                module.reshard()
                root = module is self.sharded[-1]
                module.set_reshard_after_forward(self.reshard_after_forward and not root,
                                                 recurse=False)

    def local_numel(self, tensors: list[torch.Tensor]) -> int:
        """Elements this process holds of `tensors` (a DTensor counts its local shard)."""
        return sum(_local(t).numel() for t in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def parallelize(policy: nn.Module, config: DistributedConfig, dist: Dist,
                device: torch.device, *, reference_needed: bool,
                reference_dtype: torch.dtype | None = None
                ) -> tuple[ParallelPolicy, Reference | None]:
    """Wrap `policy` for `config.strategy` and build the KL reference beside it (a frozen
    copy's weights in `reference_dtype`: see `make_reference`).

    Every process ends with process 0's weights: DDP broadcasts them when it wraps; FSDP2
    loads process 0's full state into the shards (`broadcast_from_rank0`). The reference is
    copied from those weights; under FSDP2 a frozen copy is sharded too (no optimizer)."""
    strategy = strategy_for(config, dist.world_size)
    if strategy == "none":
        return ParallelPolicy(policy), make_reference(policy, needed=reference_needed,
                                                      dtype=reference_dtype)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            policy, device_ids=[device] if device.type == "cuda" else None,
            broadcast_buffers=False)  # buffers (rotary tables) never change in training
        log.info("distributed: DDP over %d processes", dist.world_size)
        return (ParallelPolicy(policy, "ddp", dist, wrapped),
                make_reference(policy, needed=reference_needed, dtype=reference_dtype))
    # frozen copy: before sharding
    reference = make_reference(policy, needed=reference_needed, dtype=reference_dtype)
    sharded = shard(policy, config, dist)
    if reference is not None and reference.kind == "frozen_copy":
        shard(reference._module, config, dist)
    log.info("distributed: FSDP2 over %d processes (%d sharded modules, mixed precision %s%s)",
             dist.world_size, len(sharded), config.mixed_precision,
             ", shards offloaded to host memory" if config.cpu_offload else "")
    parallel = ParallelPolicy(policy, "fsdp", dist, sharded=sharded,
                              reshard_after_forward=config.reshard_after_forward)
    if reference is not None and reference.kind == "adapter_disabled":
        reference.settle = parallel.reshard  # peft's switch sets requires_grad on what it sees
    return parallel, reference


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the classes transformers never splits across devices
    (`_no_split_modules`, e.g. `LlamaDecoderLayer`)."""
    lm = unwrap_causal_lm(model)
    kinds = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ModelError(
            f"distributed.strategy: fsdp cannot find the decoder layers of "
            f"{type(lm).__name__} (no `_no_split_modules`); use distributed.strategy: ddp")
    return layers


def shard(model: nn.Module, config: DistributedConfig, dist: Dist,
          layers: list[nn.Module] | None = None) -> list[nn.Module]:
    """`fully_shard` each decoder layer, then the causal LM as the root; gradients summed,
    not averaged.

    The root is the Hugging Face causal LM, not a peft wrapper around it: `generate()` and the
    adapters' forward both enter through it, so FSDP2 sees one root whichever runs first.
    `layers` defaults to `decoder_layers(model)`. Returns the sharded modules, root last. The shards are then filled from process 0's full
    weights, so every process starts from the same model whatever it loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # references, not copies: fully_shard copies each process's part into its own storage
    root = unwrap_causal_lm(model)
    full = {k: v.detach() for k, v in root.state_dict().items()} if dist.is_main else {}
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if config.mixed_precision == "bf16" else MixedPrecisionPolicy()
    # cpu_offload: shards, gradients and optimizer state in host memory, the optimizer stepping
    # there; pinned, so copies to the GPU run asynchronously (without CUDA: tests, no pinning)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.cpu_offload \
        else OffloadPolicy()
    for layer in decoder_layers(model) if layers is None else layers:
        fully_shard(layer, mp_policy=precision, offload_policy=offload,
                    reshard_after_forward=config.reshard_after_forward)
    fully_shard(root, mp_policy=precision, offload_policy=offload, reshard_after_forward=False)
    sharded = [m for m in root.modules() if isinstance(m, FSDPModule)]
    sharded.remove(root)
    sharded.append(root)
    for module in sharded:
        # one reduction that sums: the loss is already divided by the global normaliser
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    set_model_state_dict(root, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))
    # FSDP2 settles each unit's gradient dtypes (reduce in float32, hand back float32) from the
    # parameters that require grad at its first forward. Under LoRA that forward can be the
    # reference's, with peft's adapters switched off and their requires_grad False: the
    # adapters' gradients would then come back in bfloat16. Settle them now, as trained.
    root._get_fsdp_state()._lazy_init()
    return sharded


def full_weights(parallel: ParallelPolicy) -> dict[str, torch.Tensor]:
    """Process 0: the trainable weights, whole, on the CPU. Every process must call it (it
    all-gathers); the others get an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    trainable = {n for n, p in parallel.policy.named_parameters() if p.requires_grad}
    weights = get_model_state_dict(parallel.policy, options=options)
    return {n: t.contiguous() for n, t in weights.items() if n in trainable}
