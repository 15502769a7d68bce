"""load_policy / trainable_parameters / save_model on the tiny model."""

from __future__ import annotations

import copy
import json
import shutil

import huggingface_hub.constants
import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mogrpo.errors import ConfigError, ModelError
from mogrpo.modeling.load import LoraSettings, load_policy, save_model, trainable_parameters

HIDDEN, INTER, LAYERS = 64, 256, 2


def checkpointing_on(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def lora_count(r: int) -> int:
    # q, k, v, o: 64 -> 64; gate, up: 64 -> 256; down: 256 -> 64; each adds r * (in + out).
    per_layer = 4 * r * (HIDDEN + HIDDEN) + 2 * r * (HIDDEN + INTER) + r * (INTER + HIDDEN)
    return LAYERS * per_layer


def base_count(vocab: int) -> int:
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN  # attention, MLP, 2 norms
    return vocab * HIDDEN + LAYERS * per_layer + HIDDEN  # tied embeddings counted once, final norm


def test_full_model_loads_float32_left_padded(tiny_model_dir):
    model, tok = load_policy(str(tiny_model_dir))
    assert model.dtype == torch.float32  # "auto" on CPU
    assert tok.padding_side == "left" and tok.pad_token == "<|pad|>"
    assert trainable_parameters(model) == (base_count(len(tok)),) * 2
    assert not checkpointing_on(model)


def test_explicit_dtype(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir), dtype="bfloat16")
    assert model.dtype == torch.bfloat16


def test_lora_trainable_counts(tiny_model_dir):
    model, tok = load_policy(str(tiny_model_dir), lora=LoraSettings(r=8))
    assert isinstance(model, PeftModel)
    trainable, total = trainable_parameters(model)
    assert trainable == lora_count(8) == 23552
    assert total == base_count(len(tok)) + lora_count(8)
    assert model.get_nb_trainable_parameters() == (trainable, total)


def test_lora_target_subset_and_rank(tiny_model_dir):
    model, _ = load_policy(
        str(tiny_model_dir), lora=LoraSettings(r=4, target_modules=["q_proj", "v_proj"])
    )
    assert trainable_parameters(model)[0] == LAYERS * 2 * 4 * (HIDDEN + HIDDEN)


def test_gradient_checkpointing_with_lora_trains(tiny_model_dir):
    model, tok = load_policy(
        str(tiny_model_dir), gradient_checkpointing=True, lora=LoraSettings(r=4)
    )
    assert checkpointing_on(model)
    model.train()
    batch = tok(["the cat sat on the mat"], return_tensors="pt")
    out = model(**batch, labels=batch["input_ids"], use_cache=False)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    # B starts at 0, so A's gradient is 0 too; B's must flow through the checkpointed blocks.
    b_grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None for g in grads)
    assert all(g is not None and g.abs().sum() > 0 for g in b_grads)


def test_missing_local_path_is_named(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelError, match=r"no_such_model.*does not exist.*local directory"):
        load_policy(str(missing))
    with pytest.raises(ModelError, match="does not exist"):
        load_policy("./models/llama//x")


def test_directory_without_a_model(tmp_path):
    with pytest.raises(ModelError, match=r"from directory .*save_pretrained \(config.json"):
        load_policy(str(tmp_path))


def test_a_config_json_field_of_the_wrong_type_is_named(tmp_path):
    """A hand-edited config.json ("2048" for an int) was a traceback from huggingface_hub's
    strict dataclass, in `mogrpo train` and `mogrpo memory` alike."""
    from mogrpo.memory.model_config import load_model_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "vocab_size": 300, "max_position_embeddings": "2048"}))
    message = (f"model '{tmp_path}': its config.json does not fit its model type (Validation "
               "error for field 'max_position_embeddings': TypeError: Field "
               "'max_position_embeddings' expected int, got str (value: '2048')); fix that field "
               "in config.json (or save the config again with save_pretrained)")
    with pytest.raises(ModelError) as err:
        load_policy(str(tmp_path))
    assert str(err.value) == message
    with pytest.raises(ModelError) as err:
        load_model_config(str(tmp_path))
    assert str(err.value) == message


def test_unreachable_hub_id_explains_fix(monkeypatch):
    # Offline mode makes the hub fail at once instead of retrying the network for ~30 s.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ModelError, match=r"'meta-llama/Meta-Llama-3-8B'.*could not fetch.*local directory"
    ):
        load_policy("meta-llama/Meta-Llama-3-8B")


def test_flash_attention_without_gpu(tiny_model_dir):
    with pytest.raises(ModelError, match="flash_attention_2.*'sdpa'"):
        load_policy(str(tiny_model_dir), attn_implementation="flash_attention_2")


def test_eager_attention_is_accepted(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir), attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_bad_dtype(tiny_model_dir):
    with pytest.raises(ConfigError, match="'fp8'.*bfloat16"):
        load_policy(str(tiny_model_dir), dtype="fp8")


def test_not_a_causal_lm(tmp_path):
    AutoConfig.for_model(
        "t5", d_model=8, num_layers=1, num_heads=1, d_kv=8, d_ff=8
    ).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="'t5'.*not a causal language model"):
        load_policy(str(tmp_path))


def test_pad_token_falls_back_to_eos(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg_path = tmp_path / "m" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token")
    cfg_path.write_text(json.dumps(cfg))
    _, tok = load_policy(str(tmp_path / "m"))
    assert tok.pad_token == "<|end_of_text|>" and tok.pad_token_id == tok.eos_token_id


def test_separate_tokenizer_path(tiny_model_dir):
    _, tok = load_policy(str(tiny_model_dir), tokenizer_name_or_path=str(tiny_model_dir))
    assert tok.eos_token == "<|end_of_text|>"


def _logits(model, tok):
    batch = tok(["the cat sat", "答案 因为"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


# peft 0.21 probes transformers 5's deprecated `is_gradient_checkpointing` alias.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_save_lora_round_trips(tiny_model_dir, tmp_path):
    model, tok = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(
                    std=0.5
                )  # a trained adapter: the merged model must differ from the base
    model.eval()
    expected = _logits(model, tok)
    paths = save_model(model, tok, tmp_path)
    assert set(paths) == {"adapter", "merged"}

    merged = AutoModelForCausalLM.from_pretrained(paths["merged"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.allclose(_logits(merged, tok), expected, atol=1e-5)
    assert not torch.allclose(_logits(base, tok), expected, atol=1e-3)
    adapter = PeftModel.from_pretrained(base, paths["adapter"])
    assert torch.allclose(_logits(adapter, tok), expected, atol=1e-5)
    # The training model keeps its adapters (the merge happened on a copy).
    assert isinstance(model, PeftModel) and any("lora_B" in n for n, _ in model.named_parameters())
    assert torch.equal(_logits(model, tok), expected)
    assert AutoTokenizer.from_pretrained(paths["merged"]).chat_template == tok.chat_template


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_save_in_place_merges_without_a_copy(tiny_model_dir, tmp_path, monkeypatch):
    model, tok = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.05)
    model.eval()
    expected = _logits(model, tok)

    deepcopy = copy.deepcopy

    def no_model_copy(obj, *args):  # peft deep-copies configs while saving: those may pass
        assert not isinstance(obj, torch.nn.Module), "in_place must not copy the model"
        return deepcopy(obj, *args)

    monkeypatch.setattr(copy, "deepcopy", no_model_copy)
    paths = save_model(model, tok, tmp_path, in_place=True)
    merged = AutoModelForCausalLM.from_pretrained(paths["merged"])
    assert torch.allclose(_logits(merged, tok), expected, atol=1e-5)
    assert (paths["adapter"] / "adapter_config.json").exists()


def test_save_lora_adapter_only(tiny_model_dir, tmp_path):
    model, tok = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4))
    paths = save_model(model, tok, tmp_path, merged=False)
    assert set(paths) == {"adapter"} and (paths["adapter"] / "adapter_config.json").exists()
    assert not (tmp_path / "merged").exists()


def test_save_full_model_round_trips(tiny_model_dir, tmp_path):
    model, tok = load_policy(str(tiny_model_dir))
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    expected = _logits(model, tok)
    paths = save_model(model, tok, tmp_path)
    assert set(paths) == {"model"}
    reloaded = AutoModelForCausalLM.from_pretrained(paths["model"])
    assert torch.allclose(_logits(reloaded, tok), expected, atol=1e-5)


def test_on_a_gpu_the_weights_load_straight_onto_it(tiny_model_dir, monkeypatch):
    """Loaded on the CPU and then moved, a model's weights sit whole in host memory first (on an
    H200 mogrpo's peak host RSS at 0.21 B fp32 was ~700 MiB above TRL's, which loads with a
    device map): given a CUDA device, `from_pretrained` gets a device map of that GPU alone."""
    import mogrpo.modeling.load as load

    seen: list[dict] = []
    real = load.AutoModelForCausalLM.from_pretrained

    def spy(name, **kwargs):
        seen.append(kwargs)
        return real(name, **{k: v for k, v in kwargs.items() if k != "device_map"})

    monkeypatch.setattr(load.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    load_policy(str(tiny_model_dir), device=torch.device("cuda", 1))
    load_policy(str(tiny_model_dir), device=torch.device("cuda"))
    load_policy(str(tiny_model_dir), device=torch.device("cpu"))
    load_policy(str(tiny_model_dir))
    assert [k.get("device_map") for k in seen] == [{"": 1}, {"": 3}, None, None]
