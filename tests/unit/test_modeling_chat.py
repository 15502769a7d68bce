"""render_prompt: chat template when there is one, plain text otherwise, clear errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mogrpo.errors import ModelError
from mogrpo.modeling.chat import render_prompt


@pytest.fixture
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def plain_tok(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    return tokenizer


def test_plain_text_auto_uses_template(tok):
    text, add_special = render_prompt(tok, "Who is it?", system_prompt="Be fair.")
    assert text == "<|system|>\nBe fair.<|eot|>\n<|user|>\nWho is it?<|eot|>\n<|assistant|>\n"
    assert add_special is False


def test_plain_text_without_system(tok):
    assert render_prompt(tok, "Hi") == ("<|user|>\nHi<|eot|>\n<|assistant|>\n", False)


def test_messages_keep_their_own_system_message(tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text, _ = render_prompt(tok, messages, system_prompt="ignored")
    assert text == "<|system|>\nS<|eot|>\n<|user|>\nU<|eot|>\n<|assistant|>\n"


def test_template_switched_off_gives_plain_text(tok):
    assert render_prompt(tok, "Hi", use_chat_template=False) == ("Hi", True)
    assert render_prompt(tok, "Hi", system_prompt="S", use_chat_template=False) == ("S\n\nHi", True)


def test_no_template_auto_is_plain(plain_tok):
    assert render_prompt(plain_tok, "Hi") == ("Hi", True)


def test_messages_without_template_explain_fix(plain_tok):
    with pytest.raises(ModelError, match="model.chat_template"):
        render_prompt(plain_tok, [{"role": "user", "content": "Hi"}])


def test_forcing_missing_template_explains_fix(plain_tok):
    with pytest.raises(ModelError, match="has no chat template.*use_chat_template: false"):
        render_prompt(plain_tok, "Hi", use_chat_template=True)


def test_malformed_message_names_its_index(tok):
    with pytest.raises(ModelError, match="chat message 1 has role 'bot'"):
        render_prompt(tok, [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}])
    with pytest.raises(ModelError, match="chat message 0"):
        render_prompt(tok, [{"text": "a"}])
