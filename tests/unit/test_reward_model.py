"""`fn: reward_model`: a tiny sequence-classification model built here scores prompt +
completion through its own tokenizer and chat template, batched, as logit 0; options are
checked at config time; the memory planner counts it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from mogrpo.config import load_config
from mogrpo.data.schema import Example
from mogrpo.errors import ConfigError
from mogrpo.memory.estimate import estimate
from mogrpo.modeling.tiny import train_tokenizer
from mogrpo.rewards.base import score_examples
from mogrpo.rewards.reward_model import RewardModelReward, model_params
from mogrpo.tasks.task import load_tasks

CHAT = [{"role": "user", "content": "Is the sky blue?"}]
TEXTS = ["Yes, the sky is blue.", "No.", "The sky is blue on a clear day, because of "
         "Rayleigh scattering.", "Is the sky blue?"] * 5


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    tokenizer = train_tokenizer(TEXTS, vocab_size=300, max_length=256)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def reference_logit(path, text: str) -> float:
    """The model's logit 0 for one text alone: no padding, no batching."""
    from transformers import AutoTokenizer

    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return model(**ids).logits[0, 0].item()


def test_scores_are_logit_zero_of_the_chat_templated_text_batched(reward_model):
    rm = RewardModelReward.from_options({"model": str(reward_model), "batch_size": 2,
                                         "device": "cpu"}, where="tasks.t.rewards.0.kwargs")
    completions = ["Yes.", "No, it is not blue at all.", "Blue."]
    examples = [Example(list(CHAT), {}, f"d:{i}") for i in range(3)]
    got = score_examples([("rm", rm, {})], examples, completions,
                         torch.zeros(3, 1, dtype=torch.long), [1, 1, 1], [False] * 3)
    expected = [reference_logit(reward_model, rm.text(CHAT, [{"role": "assistant", "content": c}]))
                for c in completions]
    # the text is the RM tokenizer's own chat template over prompt + reply
    assert rm.text(CHAT, "Yes.") == ("<|user|>\nIs the sky blue?<|eot|>\n"
                                     "<|assistant|>\nYes.<|eot|>\n")
    assert got[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(got[:, 0].tolist())) == 3  # rows padded differently still score apart


def test_text_prompts_are_concatenated_and_normalised(reward_model):
    raw = RewardModelReward.from_options({"model": str(reward_model), "device": "cpu"}, where="w")
    logit = raw(["Q: sky? "], ["A: blue"])[0]
    assert logit == pytest.approx(reference_logit(reward_model, "Q: sky? A: blue"), abs=1e-5)
    sig = RewardModelReward.from_options({"model": str(reward_model), "normalize": "sigmoid",
                                          "device": "cpu"}, where="w")
    assert sig(["Q: sky? "], ["A: blue"])[0] == pytest.approx(1 / (1 + math.exp(-logit)))
    std = RewardModelReward.from_options({"model": str(reward_model), "normalize": "standardize",
                                          "mean": 0.5, "std": 2.0, "device": "cpu"}, where="w")
    assert std(["Q: sky? "], ["A: blue"])[0] == pytest.approx((logit - 0.5) / 2.0)


@pytest.mark.parametrize("options,match", [
    ({"model": "./no/such/rm"}, r"w.model = './no/such/rm': no config.json there"),
    ({"model": "x/y", "batch": 4}, r"w.batch: Extra inputs are not permitted"),
    ({"model": "x/y", "normalize": "zscore"}, r"w.normalize: Input should be 'none', 'sigmoid'"),
    ({}, r"w.model: Field required"),
])
def test_option_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        RewardModelReward.from_options(options, where="w")


def test_a_causal_lm_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="is a LlamaForCausalLM, not a sequence-classification"):
        RewardModelReward.from_options({"model": str(tmp_path)}, where="w")


def run_config(tmp_path, reward_model, **options):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Is the sky blue?"}) + "\n")
    config, _ = load_config(None, [], environ={}, base={
        "model": {"name_or_path": "some/model"}, "output": {"dir": str(tmp_path / "out")},
        "tasks": {"t": {"data": str(data), "rewards": [
            {"fn": "reward_model", "name": "helpful",
             "kwargs": {"model": str(reward_model), "batch_size": 8, **options}}]}},
    })
    return config


def test_config_loads_it_as_a_reward(tmp_path, reward_model):
    (task,) = load_tasks(run_config(tmp_path, reward_model, device="cpu"))
    assert task.reward_labels == ["helpful"]
    assert isinstance(task.reward_fns[0][1], RewardModelReward)


def test_memory_planner_counts_it(tmp_path, reward_model):
    from mogrpo.memory import reward_model_configs

    config = run_config(tmp_path, reward_model, dtype="bfloat16")
    policy = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 500}
    configs = reward_model_configs(config)
    with_rm = estimate(policy, config, reward_models=configs)
    without = estimate(policy, config)
    actual = sum(p.numel() for p in LlamaForSequenceClassification.from_pretrained(
        reward_model).parameters())
    assert model_params(configs["tasks.t.rewards.0"]) == actual
    assert with_rm["reward_model:tasks.t.rewards.0"] == actual * 2  # bf16
    assert with_rm.phase("always") - without.phase("always") == actual * 2
    assert any("not counted" in a for a in without.assumptions)
    on_cpu = estimate(policy, run_config(tmp_path, reward_model, device="cpu"))
    assert on_cpu.total == estimate(policy, run_config(tmp_path, reward_model, device="cpu"),
                                    reward_models=configs).total  # on the CPU: no GPU memory
