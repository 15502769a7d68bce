"""What `mogrpo serve` streams: the decode loop's per-step tokens and the text deltas built
from them (UTF-8 split over byte tokens, stripped whitespace, stop strings)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mogrpo.modeling.tiny import build_tiny_model
from mogrpo.rollout.generate import SamplingSettings, generate_rollout
from mogrpo.serve.stream import TextStream, apply_stop

CORPUS = ["the quick brown fox jumps over the lazy dog", "naïve café über straße"] * 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS, vocab_size=300,
                            hidden_size=32, num_layers=1, num_heads=2)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def stream_of(tokenizer, ids, stops=()):
    """(the deltas pushed token by token, the finished text's rest, the finished text)."""
    stream = TextStream(tokenizer, list(stops))
    deltas = [stream.push(token) for token in ids]
    final, _ = apply_stop(tokenizer.decode(ids, skip_special_tokens=True).strip(), list(stops), "")
    return deltas, stream.finish(final), final


def test_characters_split_over_byte_tokens_are_sent_whole(tiny):
    _, tokenizer = tiny
    text = "  naïve 🙂 日本語 fox  "  # the emoji and the kanji are not in the corpus: byte tokens
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # some characters really are several tokens
    deltas, rest, final = stream_of(tokenizer, ids)
    assert final == "naïve 🙂 日本語 fox"
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) + rest == final
    assert sum(bool(d) for d in deltas) >= 5  # sent as it grows, not at the end
    assert not deltas[0] and rest == ""  # the leading space is stripped; the trailing one too


def test_a_stop_string_is_never_sent_even_in_part(tiny):
    _, tokenizer = tiny
    ids = tokenizer("the quick brown fox jumps", add_special_tokens=False)["input_ids"]
    deltas, rest, final = stream_of(tokenizer, ids, stops=["brown fo"])
    assert final == "the quick " and "".join(deltas) + rest == final
    assert all("b" not in d for d in deltas)


def test_on_step_sees_every_token_of_the_rollout(tiny):
    model, tokenizer = tiny
    seen: dict[int, list[int]] = {}

    def on_step(rows, tokens):
        for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
            seen.setdefault(row, []).append(token)

    torch.manual_seed(0)
    rollout = generate_rollout(model, tokenizer, ["the fox", "naïve café über"],
                               SamplingSettings(max_new_tokens=6), num_generations=2,
                               max_prompt_length=16, engine="native", on_step=on_step)
    assert sorted(seen) == [0, 1, 2, 3]
    for row, tokens in seen.items():
        length = int(rollout.lengths[row])
        assert tokens == rollout.completion_ids[row, :length].tolist()
