"""4-bit NF4 and 8-bit bases loaded on the CPU by `load_policy` with the bitsandbytes installed
here (skipped without one of 0.46.1 or newer: CI installs none): the linear weights stored
quantised, LoRA adapters trained on top."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from mogrpo.config.hardware import BNB_CPU_MIN, bitsandbytes_version
from mogrpo.modeling.load import LoraSettings, load_policy

bnb = pytest.importorskip("bitsandbytes")
if Version(bitsandbytes_version() or "0") < Version(BNB_CPU_MIN):
    pytest.skip(f"bitsandbytes {bitsandbytes_version()} has no CPU kernels",
                allow_module_level=True)

LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


def _quantised(bits: int) -> dict[str, bool]:
    return {f"load_in_{bits}bit": True}


@pytest.mark.parametrize("bits", [4, 8])
def test_lora_trains_on_a_quantised_base_on_the_cpu(tiny_model_dir, bits):
    model, _ = load_policy(str(tiny_model_dir), lora=LORA, **_quantised(bits))
    base = model.get_base_model()
    q_proj = base.model.layers[0].self_attn.q_proj.base_layer
    n = q_proj.in_features * q_proj.out_features
    if bits == 4:  # two 4-bit codes a byte
        assert type(q_proj) is bnb.nn.Linear4bit
        assert (q_proj.weight.dtype, q_proj.weight.numel()) == (torch.uint8, n // 2)
    else:
        assert type(q_proj) is bnb.nn.Linear8bitLt
        assert (q_proj.weight.dtype, q_proj.weight.numel()) == (torch.int8, n)
    assert q_proj.weight.device.type == "cpu"
    # transformers leaves the head (tied to the embedding here) unquantised
    assert type(base.lm_head) is torch.nn.Linear and base.lm_head.weight.dtype == torch.float32

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)  # the base is frozen
    # B starts at 0, so A's gradient is 0 at first; B's is not, in every adapted layer
    lora_b = [p for name, p in trained.items() if "lora_B" in name]
    assert len(lora_b) == 7 * base.config.num_hidden_layers
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    torch.optim.AdamW(trained.values(), lr=1e-2).step()
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss < loss  # one step down its own gradient
