"""Turn a prompt (plain text or chat messages) into the text the policy is asked to continue."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from mogrpo.config.model_limits import chat_template_file, missing_chat_template_file
from mogrpo.errors import ModelError

ROLES = ("system", "user", "assistant")


def resolve_chat_template(value: str) -> str:
    """`model.chat_template`'s Jinja text: `tiny_tools`, a `.jinja` file's text, or itself."""
    if value == "tiny_tools":
        from mogrpo.modeling.tiny import TOOL_CHAT_TEMPLATE

        return TOOL_CHAT_TEMPLATE
    missing = missing_chat_template_file(value)
    if missing:
        raise ModelError(missing)
    path = chat_template_file(value)
    return path.read_text(encoding="utf-8") if path is not None else value


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _check_messages(messages: list[Any]) -> list[dict[str, str]]:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ModelError(
                f"chat message {i} is {message!r}; each message must be a dict with 'role' and 'content'"
            )
        if message["role"] not in ROLES:
            raise ModelError(
                f"chat message {i} has role {message['role']!r}; use one of {list(ROLES)}"
            )
    return messages


def chat_messages(prompt: str | list[dict[str, str]], system_prompt: str | None = None
                  ) -> list[dict[str, str]]:
    """The messages a chat template renders for `prompt`: a text becomes one user message;
    `system_prompt` goes first unless the messages already start with a system message."""
    if isinstance(prompt, str):
        messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
    else:
        messages = list(_check_messages(prompt))
    if system_prompt and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict[str, str]],
    *,
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, bool]:
    """Render `prompt` to text; returns (text, add_special_tokens to use when tokenizing it).

    `use_chat_template=None` uses the tokenizer's template when it has one. A rendered template
    already holds its special tokens (BOS, role headers), so it is tokenized with
    `add_special_tokens=False` to avoid a doubled BOS. `system_prompt` is added as a system
    message unless the messages already start with one; without a template it is prepended to the
    text, separated by a blank line. `tools` (JSON schemas) go to the template, which renders
    them where the model family expects them (a tool-calling task needs a chat template).
    """
    template = has_chat_template(tokenizer)
    use = template if use_chat_template is None else use_chat_template
    if use and not template:
        raise ModelError(
            f"use_chat_template is on but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
            "chat template; set model.chat_template (a Jinja string or file) or set "
            "model.use_chat_template: false to send prompts as plain text"
        )

    if tools and not use:
        raise ModelError(
            "the task has tools but no chat template is in use: the template renders the tools "
            "and their results; set model.chat_template to a template that supports tool calls"
        )
    if isinstance(prompt, str) and not use:
        text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        return text, True
    if not use:
        raise ModelError(
            "the prompt is a list of chat messages but no chat template is in use "
            f"(tokenizer {getattr(tokenizer, 'name_or_path', '')!r}); set model.chat_template "
            "(or model.use_chat_template: true if the tokenizer has one) or give plain-text prompts"
        )
    messages = chat_messages(prompt, system_prompt)
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **extra)
    return str(text), False
