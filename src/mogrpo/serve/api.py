"""The OpenAI request and response formats of `mogrpo serve`: request models, errors, responses
and stream chunks.

Supported request fields: `messages` (system/developer/user/assistant; string content or text
parts) or `prompt` (a string or a list of strings), temperature (0 = greedy), top_p, max_tokens /
max_completion_tokens (capped at the server's --max-new-tokens), stop (up to 4 strings, applied
to the text), n, presence_penalty, frequency_penalty, seed (best effort: a batch shares one
seed), stream and stream_options.include_usage. Other fields OpenAI clients send (user,
metadata, ...) are ignored; tools, logprobs, echo, suffix, best_of > 1 and non-text response
formats are refused with 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mogrpo.errors import ConfigError
from mogrpo.rollout.generate import SamplingSettings

MAX_BODY_BYTES = 4 << 20
MAX_N = 16
MAX_PROMPTS = 64
# refused unless absent or neutral (None, False, empty, a text response format, best_of 1)
_UNSUPPORTED = ("tools", "functions", "tool_choice", "logprobs", "top_logprobs",
                "response_format", "echo", "suffix", "best_of", "logit_bias")


def _neutral(name: str, value: Any) -> bool:
    if value is None or value is False or value in ([], {}, "", "none", {"type": "text"}):
        return True
    return name == "best_of" and type(value) is int and value == 1


class RequestError(Exception):
    """A request the server refuses: HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = {404: "not_found_error", 413: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param,
                          "code": self.code}}


class _Request(BaseModel):
    """Fields both endpoints share. Strict: 1.5 is not an int, "1" not a number, true not 1."""

    # extra="allow": OpenAI clients send fields the server has no use for (user, metadata)
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name in _UNSUPPORTED:
                if not _neutral(name, body.get(name)):
                    raise RequestError(400, f"{name!r} is not supported by mogrpo serve", name,
                                       "unsupported_parameter")
        return body

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop strings")
        return stop

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_new_tokens: int) -> SamplingSettings:
        """The sampling settings asked for; max_tokens is capped at the server's limit, which
        keeps one request from holding the worker for minutes."""
        temperature = 1.0 if self.temperature is None else self.temperature
        limit = self.max_completion_tokens or self.max_tokens or max_new_tokens
        try:
            return SamplingSettings(
                max_new_tokens=min(limit, max_new_tokens),
                temperature=temperature if temperature > 0 else 1.0,
                top_p=self.top_p if self.top_p else 1.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                greedy=temperature == 0)
        except ConfigError as err:
            raise RequestError(400, str(err)) from None


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]

    def plain(self) -> dict[str, str]:
        """{role, content} with the text parts joined; a developer message is a system one."""
        content = self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_Request):
    """A POST /v1/chat/completions body."""

    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Request):
    """A POST /v1/completions body (prompts as text; token-id prompts are refused)."""

    prompt: str | list[str] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        return prompt

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def parse(model: type[_Request], body: Any) -> Any:
    """`body` validated as `model`; RequestError 400 naming the first bad field if it is not."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = _param(first["loc"])
        got = f" (got {first['input']!r:.60})" if first["type"] != "missing" else ""
        raise RequestError(400, f"{param or 'body'}: {first['msg']}{got}", param) from None


def _param(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].role` from pydantic's ('messages', 0, 'role'), without the union branch
    names pydantic adds (`str`, `list[...]`)."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif item in ("str", "bool", "int", "float") or "[" in str(item) or item == "_TextPart":
            continue
        else:
            parts.append(str(item))
    return ".".join(parts) or None


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, model: str, choices: list[tuple[str, str, int]],
             prompt_tokens: int) -> dict[str, Any]:
    """The chat.completion or text_completion object for `choices` of (text, finish_reason,
    completion tokens)."""
    if kind == "chat":
        listed = [{"index": i, "message": {"role": "assistant", "content": text},
                   "finish_reason": finish, "logprobs": None}
                  for i, (text, finish, _) in enumerate(choices)]
    else:
        listed = [{"index": i, "text": text, "finish_reason": finish, "logprobs": None}
                  for i, (text, finish, _) in enumerate(choices)]
    return {"id": new_id(kind), "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": listed,
            "usage": usage(prompt_tokens, sum(tokens for _, _, tokens in choices))}


def chunk(kind: str, ident: str, created: int, model: str, index: int, *,
          text: str | None = None, role: bool = False, finish: str | None = None
          ) -> dict[str, Any]:
    """One stream chunk: chat.completion.chunk (a delta with the role, or content) or
    text_completion (text), for choice `index`, with its finish_reason when it is the last."""
    if kind == "chat":
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta}
        kind_name = "chat.completion.chunk"
    else:
        choice, kind_name = {"index": index, "text": text or ""}, "text_completion"
    choice.update(finish_reason=finish, logprobs=None)
    return {"id": ident, "object": kind_name, "created": created, "model": model,
            "choices": [choice]}
