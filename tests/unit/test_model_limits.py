"""What the model decides is checked before its weights load: positions against the rollout
lengths (budgets lowered, given lengths refused) and the tokenizer against the embeddings.
Models here are config.json files (and tokenizer files) without weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config

import mogrpo
from mogrpo.config import load_config
from mogrpo.config.model_limits import position_limit, tokenizer_tokens
from mogrpo.errors import ConfigError
from mogrpo.trainer.startup import startup_summary

TASKS = {"t": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}}


def model_dir(path: Path, config=None, **fields) -> Path:
    """A model directory holding only config.json (a small Llama unless `config` is given)."""
    config = config or LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   vocab_size=300, **fields)
    config.save_pretrained(path)
    return path


def load(model: Path | str, *overrides: str, machine: bool = False, **sections):
    base = {"model": {"name_or_path": str(model)}, "tasks": TASKS, **sections}
    return load_config(None, list(overrides), environ={}, base=base, machine=machine)


def error_of(model: Path | str, *overrides: str, **sections) -> str:
    with pytest.raises(ConfigError) as err:
        load(model, *overrides, **sections)
    return str(err.value)


@pytest.fixture
def small(tmp_path) -> Path:
    model = model_dir(tmp_path / "m128", max_position_embeddings=128)
    (model / "tokenizer_config.json").write_text("{}")  # a run needs tokenizer files
    return model


# ------------------------------------------------------------------------------- positions


def test_an_unset_prompt_budget_is_what_the_positions_leave_and_the_summary_says_so(small):
    config, origin = load(small, rollout={"max_completion_length": 16})
    ro = config.rollout
    # 496 (512 − 16) without the model's limit
    assert (ro.prompt_length, ro.completion_length, ro.max_seq_length) == (112, 16, 128)
    note = (f"512 → 128, the positions of model {small} (max_position_embeddings = 128); "
            "rollout.max_prompt_length is not set: 112 prompt + 16 completion tokens")
    assert config.limit_notes == {"rollout.max_seq_length": note}
    assert origin["rollout.max_seq_length"] == "model limit (512 → 128; was default)"
    lines = startup_summary(config, torch.nn.Linear(2, 2), torch.device("cpu"), [], None,
                            Path("runs/x")).splitlines()
    assert lines[-4].endswith("up to 112 prompt + 16 completion tokens")
    assert lines[-3] == f"  limits   rollout.max_seq_length {note}"
    # the Python API keeps the note (it is no field, so a dump leaves it out)
    api = mogrpo.Config({"model": {"name_or_path": str(small)}, "tasks": TASKS},
                        rollout={"max_completion_length": 16})
    assert api.limit_notes == config.limit_notes and api.rollout.prompt_length == 112


def test_a_budget_within_the_positions_is_left_alone(tmp_path, small):
    config, _ = load(model_dir(tmp_path / "m1k", max_position_embeddings=1024),
                     rollout={"max_completion_length": 16})
    assert (config.rollout.prompt_length, config.limit_notes) == (496, {})
    config, _ = load(small, rollout={"max_seq_length": 100, "max_completion_length": 16})
    assert (config.rollout.prompt_length, config.limit_notes) == (84, {})


@pytest.mark.parametrize(("rollout", "lengths", "how"), [
    ({}, (64, 64), "rollout.max_prompt_length and rollout.max_completion_length are not set"),
    ({"max_prompt_length": 100}, (100, 28), "rollout.max_completion_length is not set"),
    ({"length_allocation": "prompt_heavy"}, (96, 32), "rollout.length_allocation = prompt_heavy"),
])
def test_every_length_left_to_derive_comes_from_the_positions(small, rollout, lengths, how):
    config, _ = load(small, rollout=rollout)
    assert (config.rollout.prompt_length, config.rollout.completion_length) == lengths
    assert config.limit_notes["rollout.max_seq_length"].endswith(
        f"; {how}: {lengths[0]} prompt + {lengths[1]} completion tokens")


def test_given_lengths_the_model_cannot_hold_are_errors_with_the_fix(small):
    where = f"the 128 positions of model {small} (max_position_embeddings = 128)"
    assert error_of(small, rollout={"max_prompt_length": 496, "max_completion_length": 16}) == (
        f"invalid config:\n  rollout.max_prompt_length (496) + rollout.max_completion_length "
        f"(16) = 512 exceeds {where}; set rollout.max_prompt_length ≤ 112 or use a model with "
        "more positions")
    assert error_of(small, rollout={"max_prompt_length": 100, "max_completion_length": 200}) == (
        f"invalid config:\n  rollout.max_prompt_length (100) + rollout.max_completion_length "
        f"(200) = 300 exceeds {where}; set rollout.max_completion_length < 128 and "
        "rollout.max_prompt_length ≤ 128 minus it or use a model with more positions")
    assert error_of(small, rollout={"max_completion_length": 128}) == (
        f"invalid config:\n  rollout.max_completion_length = 128 leaves no room for a prompt in "
        f"{where}; set it below 128 (the prompt gets the rest) or use a model with more "
        "positions")
    assert error_of(small, rollout={"max_prompt_length": 200}) == (
        f"invalid config:\n  rollout.max_prompt_length = 200 leaves no room for a completion in "
        f"{where}; set it below 128 (the completion gets the rest) or use a model with more "
        "positions")


def test_the_sft_budget_is_lowered_to_the_positions_when_the_warm_up_runs(small):
    config, _ = load(small, sft={"enabled": True, "max_length": 256})
    assert config.sft.max_length == 128
    assert config.limit_notes["sft.max_length"] == (
        f"256 → 128, the positions of model {small} (max_position_embeddings = 128): longer "
        "warm-up examples are cut")
    assert load(small)[0].sft.max_length == 256  # no warm-up: nothing to lower


def test_a_gpt2_names_its_positions_n_positions(tmp_path):
    gpt2 = model_dir(tmp_path / "gpt2", GPT2Config(n_positions=64, n_layer=1, n_embd=32,
                                                    n_head=4))
    assert "exceeds the 64 positions of model " + str(gpt2) + " (n_positions = 64)" in error_of(
        gpt2, rollout={"max_prompt_length": 60, "max_completion_length": 16})


@pytest.mark.parametrize(("config", "limit"), [
    ({"max_position_embeddings": 128}, (128, "max_position_embeddings = 128")),
    ({"n_positions": 1024, "n_ctx": 1024}, (1024, "n_positions = 1024")),
    ({"seq_length": 8192}, (8192, "seq_length = 8192")),  # ChatGLM
    ({"max_position_embeddings": 4096, "max_sequence_length": 2048},
     (2048, "max_sequence_length = 2048")),  # the smaller binds
    # Qwen2.5's long-context recipe: yarn × 4 over the 32k it was trained on
    ({"max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     (131072, "max_position_embeddings = 32768, RoPE yarn scaling to 131072")),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear", "factor": 2}},
     (8192, "max_position_embeddings = 4096, RoPE linear scaling to 8192")),
    # Llama 3.1 states its extended length; 8 × 8192 is less
    ({"max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}},
     (131072, "max_position_embeddings = 131072")),
    ({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 1e4}},
     (2048, "max_position_embeddings = 2048")),
    # Gemma 3: a text_config, RoPE per layer type; the least extended binds
    ({"text_config": {"max_position_embeddings": 131072, "vocab_size": 262208,
                      "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8},
                                          "sliding_attention": {"rope_type": "default"}}}},
     (131072, "max_position_embeddings = 131072")),
    # Gemma 3 as its config.json on the hub has it: one scaling, the global layers'
    ({"text_config": {"max_position_embeddings": 131072, "rope_local_base_freq": 10000.0,
                      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}},
     (131072, "max_position_embeddings = 131072")),
    ({"model_type": "falcon"}, (None, "no position limit in its config")),
])
def test_position_limits_of_the_families(config, limit):
    assert position_limit(config) == limit


def test_the_rollout_reads_a_loaded_config_as_validation_reads_config_json(tmp_path):
    yarn = Qwen2Config(max_position_embeddings=32768, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    saved = json.loads((model_dir(tmp_path / "q", yarn) / "config.json").read_text())
    assert position_limit(yarn.to_dict()) == position_limit(saved) == (
        131072, "max_position_embeddings = 32768, RoPE yarn scaling to 131072")
    assert position_limit(GPT2Config(n_positions=64).to_dict()) == (64, "n_positions = 64")
    # Gemma 3: validation read 8 × 131072 positions, the loaded model 131072
    gemma = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "linear",
             "factor": 8.0}, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}
    loaded = Gemma3TextConfig(**gemma, num_hidden_layers=6).to_dict()
    assert position_limit(loaded) == position_limit(gemma) == (
        131072, "max_position_embeddings = 131072")


def test_a_hub_model_is_checked_from_the_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    model_dir(snapshot, max_position_embeddings=128)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert "exceeds the 128 positions of model org/tiny" in error_of(
        "org/tiny", rollout={"max_prompt_length": 496, "max_completion_length": 16})
    # not in the cache: nothing is fetched, the rollout checks it once the model is loaded
    config, _ = load("org/other", rollout={"max_prompt_length": 496, "max_completion_length": 16})
    assert config.rollout.prompt_length == 496


def test_a_directory_without_config_json_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    assert error_of(tmp_path / "empty") == (
        f"invalid config:\n  model.name_or_path = '{tmp_path / 'empty'}' is a directory without "
        "config.json; pass the directory save_pretrained wrote (config.json, weights, tokenizer "
        "files)")


# ------------------------------------------------------------------------------ vocabulary


def test_a_run_needs_the_tokenizer_files_the_planner_does_not(tmp_path):
    """A model saved without its tokenizer failed with transformers' traceback about
    sentencepiece; `mogrpo memory` and `config show` need only config.json."""
    model = model_dir(tmp_path / "m", max_position_embeddings=512)
    with pytest.raises(ConfigError) as err:
        load(model, machine=True)
    assert str(err.value) == (
        f"invalid config:\n  model.name_or_path = '{model}' has no tokenizer files "
        "(tokenizer.json, tokenizer_config.json); save the tokenizer there too "
        "(tokenizer.save_pretrained), or set model.tokenizer to the directory or hub id that has "
        "it")
    assert load(model)[0].model.name_or_path == str(model)  # machine=False: the planner's view
    with pytest.raises(ConfigError, match=r"model.tokenizer = '.*' has no tokenizer files"):
        load(save_tokenizer(model, 280), f"model.tokenizer={tmp_path}", machine=True)
    assert load(model, machine=True)[0].model.tokenizer is None  # its tokenizer saved now




def save_tokenizer(path: Path, tokens: int) -> Path:
    from mogrpo.modeling.tiny import train_tokenizer

    texts = [f"word{i} other{i * 7} thing{i * 13}" for i in range(200)]
    tokenizer = train_tokenizer(texts, tokens, 128)
    tokenizer.save_pretrained(path)
    assert tokenizer_tokens(str(path)) == len(tokenizer) == tokens
    return path


def test_a_tokenizer_with_more_tokens_than_embeddings_is_an_error(tmp_path):
    model = save_tokenizer(model_dir(tmp_path / "m", max_position_embeddings=512), 400)
    assert error_of(model) == (
        f"invalid config:\n  the tokenizer of model.name_or_path = '{model}' has 400 tokens (ids "
        f"up to 399), but model {model} embeds only vocab_size = 300 of them; use the tokenizer "
        "saved with the model, or save the model with its embeddings resized to 400 "
        "(model.resize_token_embeddings)")
    other = save_tokenizer(tmp_path / "tok", 280)  # fewer tokens than embeddings: fine
    assert load(model, f"model.tokenizer={other}")[0].model.tokenizer == str(other)
    big = save_tokenizer(tmp_path / "big", 320)
    assert error_of(model, f"model.tokenizer={big}").startswith(
        f"invalid config:\n  model.tokenizer = '{big}' has 320 tokens (ids up to 319), but")


def test_stop_ids_beyond_the_vocabulary_are_an_error(tmp_path):
    """They replace the model's EOS: every completion ran to max_completion_length, silently."""
    model = model_dir(tmp_path / "m", max_position_embeddings=512)  # vocab_size 300
    assert error_of(model, "rollout.stop_token_ids=[2, 128001, 128009]") == (
        f"invalid config:\n  rollout.stop_token_ids = [2, 128001, 128009]: 128001, 128009 are "
        f"beyond the vocabulary of model {model} (vocab_size = 300: ids 0 to 299), so no "
        "completion would stop on them; give this model's end-of-turn ids, or remove "
        "rollout.stop_token_ids to stop on its EOS tokens")
    assert load(model, "rollout.stop_token_ids=[2, 299]")[0].rollout.stop_token_ids == [2, 299]


# --------------------------------------------------------------------------- chat template


def test_what_needs_a_chat_template_is_checked_before_the_weights(tmp_path):
    """A tokenizer without one, with use_chat_template, chat rows or tools, and a missing
    .jinja file, failed only once the weights had loaded (and the reference been copied)."""
    model = save_tokenizer(model_dir(tmp_path / "m", max_position_embeddings=512), 280)
    assert load(model, "model.use_chat_template=true")[0].model.use_chat_template
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert "chat_template" not in config  # the template was only in the .jinja file
    none = (f"the tokenizer of model.name_or_path = '{model}' has no chat template; set "
            "model.chat_template (Jinja text, a .jinja file, or tiny_tools), or use a tokenizer "
            "that has one")
    assert error_of(model, "model.use_chat_template=true") == (
        f"invalid config:\n  model.use_chat_template = true, but {none}")
    assert error_of(model, "tasks.t.format=chat") == (
        f"invalid config:\n  tasks.t.format = chat, but {none}")
    assert load(model, "tasks.t.format=chat", "model.chat_template=tiny_tools")[0]
    assert load(model)[0].model.use_chat_template is None  # plain text: nothing needs one
    assert error_of(model, "model.chat_template=templates/chat.jinja") == (
        "invalid config:\n  model.chat_template: file templates/chat.jinja not found (resolved "
        f"to {Path('templates/chat.jinja').resolve()}); give a .jinja file, the template's text "
        "or tiny_tools")
    assert error_of(model, "tasks.t.format=chat", "model.use_chat_template=false") == (
        "invalid config:\n  tasks.t.format = chat, but model.use_chat_template = false; remove "
        "model.use_chat_template (or set it true)")


# ------------------------------------------------------------------ saved quantised

BNB_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_quant_type": "nf4"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128}


def test_a_checkpoint_saved_quantised_needs_lora_and_the_flag_of_its_format(tmp_path):
    """transformers loads such weights as saved, whatever load_in_4bit/8bit ask: full
    fine-tuning trained only the embeddings and norms (37 % of a tiny Llama) and failed at the
    final save; load_in_8bit over a 4-bit checkpoint silently loaded 4-bit."""
    bnb = model_dir(tmp_path / "bnb", max_position_embeddings=512, quantization_config=BNB_4BIT)
    saved = (f"model {bnb} is saved quantised (bitsandbytes 4-bit: `quantization_config` in its "
             "config.json), and loads as saved")
    assert error_of(bnb) == (
        f"invalid config:\n  {saved}; its quantised weights cannot be trained, so full "
        "fine-tuning would train only the rest (embeddings, norms): set lora.enabled: true, or "
        "train the unquantised checkpoint")
    assert error_of(bnb, "lora.enabled=true", "model.load_in_8bit=true") == (
        f"invalid config:\n  model.load_in_8bit = true, but {saved}; set model.load_in_4bit: "
        "true instead")
    assert error_of(bnb, "lora.enabled=true").startswith(
        f"invalid config:\n  {saved}; set model.load_in_4bit: true, so that the run treats it")
    config, _ = load(bnb, "lora.enabled=true", "model.load_in_4bit=true")
    assert config.model.load_in_4bit
    gptq = model_dir(tmp_path / "gptq", max_position_embeddings=512, quantization_config=GPTQ)
    assert "(gptq: `quantization_config` in its config.json), and loads as saved; its quantised " \
        "weights cannot be trained" in error_of(gptq)
    assert error_of(gptq, "lora.enabled=true", "model.load_in_4bit=true").endswith(
        "(gptq: `quantization_config` in its config.json), and loads as saved; remove "
        "model.load_in_4bit")
    assert load(gptq, "lora.enabled=true")[0].lora.enabled


# ----------------------------------------------------------------------- before the weights


def test_no_weights_load_when_the_model_refuses_the_config(tmp_path, monkeypatch):
    import mogrpo.modeling.load
    from mogrpo.modeling.tiny import build_tiny_model

    loaded = []

    def from_pretrained(*args, **kwargs):
        loaded.append(args)
        raise RuntimeError("weights loaded")

    monkeypatch.setattr(mogrpo.modeling.load.AutoModelForCausalLM, "from_pretrained",
                        from_pretrained)
    model = build_tiny_model(tmp_path / "m", ["a b c d"] * 20, hidden_size=16, num_heads=2,
                             num_layers=1, vocab_size=300, max_position_embeddings=128)
    run = {"model": {"name_or_path": str(model)}, "tasks": TASKS,
           "output": {"dir": str(tmp_path / "run")}, "logging": {"progress_bar": False},
           "rollout": {"max_prompt_length": 496, "max_completion_length": 16}}
    with pytest.raises(ConfigError, match="set rollout.max_prompt_length ≤ 112"):
        mogrpo.train(run)
    assert loaded == [] and not (tmp_path / "run").exists()
    run["rollout"] = {"max_completion_length": 16}  # the same run, valid: it gets to the load
    with pytest.raises(RuntimeError, match="weights loaded"):
        mogrpo.train(run)
    assert len(loaded) == 1


PROBE = """
import json, sys
from mogrpo.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers")
                                                if m in sys.modules)}))
"""


def test_the_cli_refuses_before_importing_torch(small, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(small)}, "tasks": TASKS,
        "rollout": {"max_prompt_length": 496, "max_completion_length": 16}}), encoding="utf-8")
    src = str(Path(mogrpo.__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", PROBE, "train", str(config)], cwd=tmp_path,
                          text=True, capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": src})
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"code": 2, "heavy": []}
    assert "set rollout.max_prompt_length ≤ 112 or use a model with more positions" in \
        done.stderr
