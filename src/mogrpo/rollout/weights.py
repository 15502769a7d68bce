"""The policy's weights under the names of its Hugging Face checkpoint, LoRA merged in.

An inference engine that loads checkpoints (vLLM's `model.load_weights`) takes exactly the
`(name, tensor)` pairs a `save_pretrained` directory holds: `model.layers.0.self_attn.q_proj.weight`,
not peft's `base_model.model.….q_proj.base_layer.weight`, DDP's `module.…` or torch.compile's
`_orig_mod.…`. `checkpoint_weights` walks the unwrapped causal LM and yields those pairs one at
a time, so a push never holds a second copy of the model.

LoRA layers are yielded merged, `W + scale · B @ A`, computed out of place: the policy's own
weights are never touched. (Merging in place and unmerging afterwards, as peft's
`merge_adapter()` / `unmerge_adapter()` do, rounds the base weights twice in bf16 and lets them
drift from the frozen reference step after step.)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from mogrpo.errors import ModelError
from mogrpo.rollout.layout import unwrap_causal_lm


def _lora_layer_type() -> type | None:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is a dependency, but the walk works without it
        return None
    return LoraLayer


def merged_lora_weight(layer: nn.Module) -> Tensor:
    """The weight a LoRA layer computes with: base + every active, not yet merged adapter."""
    base = layer.get_base_layer().weight
    if layer.disable_adapters:
        return base.detach()
    weight = base.detach()
    for adapter in layer.active_adapters:
        if adapter in layer.merged_adapters or adapter not in layer.scaling:
            continue  # merged: already inside the base weight; absent: not on this layer
        if layer.use_dora.get(adapter, False):
            raise ModelError(
                "DoRA adapters cannot be merged for the vLLM engine; use plain LoRA "
                "or rollout.engine: native"
            )
        if getattr(layer, "lora_bias", {}).get(adapter, False):
            raise ModelError("LoRA bias terms are not supported by the vLLM weight push")
        # [out, in]: the same transposition and scaling peft itself uses when merging
        weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


@torch.no_grad()  # each resumption of the generator runs without autograd
def checkpoint_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, detached tensor) for every parameter, LoRA merged, tied weights once."""
    lm = unwrap_causal_lm(model)
    lora_type = _lora_layer_type()
    seen: set[int] = set()  # parameters yielded (tied ones come once)
    inside: set[int] = set()  # sub-modules of LoRA layers already yielded merged
    for name, module in lm.named_modules():
        if id(module) in inside:
            continue
        if lora_type is not None and isinstance(module, lora_type):
            inside.update(id(m) for m in module.modules())
            base = module.get_base_layer()
            seen.update(id(p) for p in base.parameters(recurse=False))
            yield f"{name}.weight", merged_lora_weight(module)
            if getattr(base, "bias", None) is not None:
                yield f"{name}.bias", base.bias.detach()
            continue
        if hasattr(module, "modules_to_save"):
            raise ModelError(
                f"{name}: peft `modules_to_save` is not supported by the vLLM weight push; "
                "train it as a LoRA target instead"
            )
        for pname, param in module.named_parameters(recurse=False):
            if type(param).__name__ == "DTensor":  # an FSDP2 shard, not the weight
                raise RuntimeError(f"{name}.{pname} is sharded (FSDP2): gather the weights "
                                   "first (ParallelPolicy.gathered) to read them whole")
            if id(param) in seen:  # tied (lm_head = embed_tokens): the checkpoint's first name
                continue
            seen.add(id(param))
            yield (f"{name}.{pname}" if name else pname), param.detach()


@torch.no_grad()
def checkpoint_state(model: nn.Module) -> dict[str, Tensor]:
    """`checkpoint_weights` collected into a dict (tests and small models only: it copies)."""
    return {name: tensor.clone() for name, tensor in checkpoint_weights(model)}
