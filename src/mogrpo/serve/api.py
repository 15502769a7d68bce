"""The OpenAI chat-completions schema for `mogrpo serve`: request checks, responses, HTTP handler.

Supported request fields: messages (system/user/assistant; string content or text parts),
temperature (0 = greedy), top_p, max_tokens / max_completion_tokens (capped at the server's
--max-new-tokens), stop (up to 4 strings, applied to the text after generation), n,
presence_penalty, frequency_penalty and seed (best effort: a batch shares one seed). `model` is
accepted whatever it says (the server has one model). stream, tools and logprobs are refused.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from mogrpo.errors import ConfigError
from mogrpo.rollout.generate import SamplingSettings

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
MAX_N = 16
_UNSUPPORTED = ("stream", "tools", "functions", "logprobs", "top_logprobs", "response_format")


class RequestError(Exception):
    """A request the server refuses: HTTP status and an OpenAI-style error message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


class Server(Protocol):
    model_name: str
    created: int

    def complete(self, request: dict[str, Any]) -> dict[str, Any]: ...


def parse_request(body: Any, *, max_new_tokens: int) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """(messages, {settings, n, seed, stop}) from a chat-completions body; RequestError 400 if bad."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, [], {"type": "text"}):
            raise RequestError(400, f"{name!r} is not supported by mogrpo serve", name)
    messages = _messages(body.get("messages"))
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise RequestError(400, f"max_tokens = {limit!r} must be an integer >= 1", "max_tokens")
    n = body.get("n", 1) if body.get("n") is not None else 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise RequestError(400, f"n = {n!r} must be an integer from 1 to {MAX_N}", "n")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(400, f"seed = {seed!r} must be an integer", "seed")
    try:
        settings = SamplingSettings(
            # The server's cap keeps one request from holding the worker for minutes.
            max_new_tokens=min(limit or max_new_tokens, max_new_tokens),
            temperature=temperature if temperature > 0 else 1.0,
            top_p=top_p if top_p > 0 else 1.0,
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            greedy=temperature == 0,
        )
    except ConfigError as err:
        raise RequestError(400, str(err)) from None
    return messages, {"settings": settings, "n": n, "seed": seed, "stop": _stops(body.get("stop"))}


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "developer"):
            raise RequestError(
                400, f"messages[{i}] needs a role of system, user or assistant", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise RequestError(400, f"messages[{i}]: only text content is supported", f"messages[{i}]")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content must be a string", f"messages[{i}]")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
    return out


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise RequestError(400, f"{name} = {value!r} must be a number in [{low:g}, {high:g}]", name)
    return float(value)


def _stops(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise RequestError(400, "stop must be a string or a list of at most 4 strings", "stop")
    return stops


def completion_response(model: str, choices: list[tuple[str, str, int]],
                        prompt_tokens: int) -> dict[str, Any]:
    """The chat.completion object for `choices` of (text, finish_reason, completion tokens)."""
    completion_tokens = sum(tokens for _, _, tokens in choices)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": text},
             "finish_reason": finish, "logprobs": None}
            for i, (text, finish, _) in enumerate(choices)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def make_handler(server: Server) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to `server`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as OpenAI clients expect
        timeout = 30  # an idle keep-alive connection frees its thread after this long

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s %s", self.address_string(), format % args)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path in ("/v1/models", "/models"):
                model = {"id": server.model_name, "object": "model", "created": server.created,
                         "owned_by": "mogrpo"}
                self._send(200, {"object": "list", "data": [model]})
            elif path in ("/health", "/v1/health"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, RequestError(404, f"no route GET {path}").body())

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            # Until the body is read the connection cannot carry another request.
            self.close_connection = True
            try:
                if path not in ("/v1/chat/completions", "/chat/completions"):
                    raise RequestError(404, f"no route POST {path}; use /v1/chat/completions")
                size = int(self.headers.get("Content-Length") or 0)
                if not 0 < size <= MAX_BODY_BYTES:
                    raise RequestError(413 if size else 400,
                                       f"the body must hold 1 to {MAX_BODY_BYTES} bytes")
                try:
                    raw = self.rfile.read(size)
                    self.close_connection = False
                    body = json.loads(raw)
                except ValueError:
                    raise RequestError(400, "the body is not valid JSON") from None
                self._send(200, server.complete(body))
            except RequestError as err:
                self._send(err.status, err.body())
            except Exception as err:  # a bug answers 500 and the server keeps serving
                logger.exception("serving %s failed", path)
                self._send(500, RequestError(500, f"{type(err).__name__}: {err}").body())

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client went away; nothing to tell it

    return Handler
