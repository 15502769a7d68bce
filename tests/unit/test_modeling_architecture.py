"""LoRA targets checked against the model's own module names, before any weight loads."""

from __future__ import annotations

import warnings

import pytest

from architectures import FAMILIES, LAYERS, build_family, family_config
from mogrpo.errors import ConfigError
from mogrpo.modeling import ModuleTree, lora_targets
from mogrpo.modeling import load as load_module
from mogrpo.modeling.load import LoraSettings, load_policy


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tiny_texts):
    return build_family(tmp_path_factory.mktemp("gpt2") / "m", "gpt2", tiny_texts)


def test_wrong_targets_fail_before_the_weights_load(gpt2_dir, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the LoRA targets were checked")

    monkeypatch.setattr(load_module.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ConfigError, match=r"^lora.target_modules = \['q_proj', 'v_proj'\]: no "
                       r"module of this gpt2 model is named q_proj, v_proj; its linear layers "
                       r"are c_attn, c_fc, c_proj \(or use all-linear, the default\)$"):
        load_policy(str(gpt2_dir), lora=LoraSettings(target_modules=["q_proj", "v_proj"]))


def test_conv1d_models_get_fan_in_fan_out_without_a_warning(gpt2_dir, tiny_model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft's "fan_in_fan_out is set to False" would raise
        gpt2, _ = load_policy(str(gpt2_dir), lora=LoraSettings(r=4, target_modules=["c_attn"]))
    assert gpt2.peft_config["default"].fan_in_fan_out is True
    # a model of nn.Linear layers keeps the flag off
    llama, _ = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4))
    assert llama.peft_config["default"].fan_in_fan_out is False


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_linear_is_what_peft_wraps(family):
    """The planner's LoRA accounting and peft agree on the modules, family by family."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family))
    ours = {m.name for m in lora_targets(ModuleTree.from_model(model), "all-linear")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's Conv1D notice: not what this test is about
        wrapped = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    theirs = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules()
              if isinstance(m, LoraLayer)}
    assert ours == theirs and len(ours) >= 4 * LAYERS
