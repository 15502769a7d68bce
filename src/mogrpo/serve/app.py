"""The HTTP side of `mogrpo serve`: a Starlette app with the OpenAI routes.

POST /v1/chat/completions and /v1/completions (plain JSON, or server-sent events with
`stream: true`), GET /v1/models and GET /health. Errors are OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (a prompt longer than
the context: code `context_length_exceeded`), 404 for an unknown route or model, 413 for a body
over 4 MiB, 500 when generation fails, 503 while shutting down, 504 past the request timeout.
The same routes answer without the /v1 prefix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mogrpo.errors import MogrpoError
from mogrpo.modeling.chat import has_chat_template, render_prompt
from mogrpo.serve import api
from mogrpo.serve.api import RequestError
from mogrpo.serve.batcher import Batcher, Job, Reply

logger = logging.getLogger(__name__)

_DRAIN_BYTES = 64 << 20  # a body too big is read and dropped up to this size, then cut off

REQUEST_TIMEOUT_S = 600.0
"""A request still unanswered after this long gets HTTP 504 (the worker is stuck or swamped)."""


@dataclass
class ServeOptions:
    """What the app answers with: the model's id, the cap on max_tokens, and whether a request
    naming another model gets 404 (`strict_model`: the id was given with --name)."""

    model_name: str
    max_new_tokens: int
    strict_model: bool = False
    created: int = 0


def build_app(batcher: Batcher, options: ServeOptions) -> Starlette:
    """The ASGI app answering with `batcher`'s model."""

    async def models(request: Request) -> Response:
        model = {"id": options.model_name, "object": "model", "created": options.created,
                 "owned_by": "mogrpo"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(request: Request) -> Response:
        alive = batcher.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)

    async def chat(request: Request) -> Response:
        return await _complete(request, "chat", batcher, options)

    async def completions(request: Request) -> Response:
        return await _complete(request, "text", batcher, options)

    routes = []
    for prefix in ("/v1", ""):
        routes += [Route(f"{prefix}/models", models, methods=["GET"]),
                   Route(f"{prefix}/health", health, methods=["GET"]),
                   Route(f"{prefix}/chat/completions", chat, methods=["POST"]),
                   Route(f"{prefix}/completions", completions, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={
        RequestError: _request_error, 404: _not_found, 405: _not_found, Exception: _server_error})
    return app


async def _request_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, RequestError)
    return JSONResponse(err.body(), status_code=err.status)


async def _not_found(request: Request, err: Exception) -> Response:
    return await _request_error(request, RequestError(
        404, f"no route {request.method} {request.url.path}; use POST /v1/chat/completions, "
        "POST /v1/completions or GET /v1/models"))


async def _server_error(request: Request, err: Exception) -> Response:  # a bug: 500, keep serving
    logger.error("serving %s failed", request.url.path, exc_info=err)
    return await _request_error(request, RequestError(500, f"{type(err).__name__}: {err}"))


async def _read_json(request: Request) -> Any:
    """The JSON body; 413 past MAX_BODY_BYTES, holding none of the excess in memory."""
    size = request.headers.get("content-length")
    declared = int(size) if size is not None and size.isdigit() else 0
    body, seen = bytearray(), 0
    if declared <= _DRAIN_BYTES:
        # read to the end even when it is too big: a client still sending its body when the
        # connection closes sees a reset instead of the 413
        async for part in request.stream():
            seen += len(part)
            if seen <= api.MAX_BODY_BYTES:
                body += part
            elif seen > _DRAIN_BYTES:
                break
    if max(seen, declared) > api.MAX_BODY_BYTES:
        raise RequestError(413, f"the body is over {api.MAX_BODY_BYTES} bytes", None,
                           "request_too_large")
    try:
        return json.loads(body)
    except ValueError:
        raise RequestError(400, "the body is not valid JSON") from None


async def _complete(request: Request, kind: str, batcher: Batcher,
                    options: ServeOptions) -> Response:
    """Validate, queue one job per prompt, answer as JSON or as a stream."""
    body = api.parse(api.ChatRequest if kind == "chat" else api.CompletionRequest,
                     await _read_json(request))
    if options.strict_model and body.model not in (None, options.model_name):
        raise RequestError(404, f"the model {body.model!r} does not exist; this server has "
                           f"{options.model_name!r}", "model", "model_not_found")
    settings = body.sampling(options.max_new_tokens)
    reply = Reply(asyncio.get_running_loop())
    jobs = []
    for i, (text, add_special) in enumerate(_prompts(body, kind, batcher.tokenizer)):
        job = Job(text=text, add_special_tokens=add_special, settings=settings, reply=reply,
                  n=body.n or 1, seed=body.seed, stop=body.stops(), stream=bool(body.stream),
                  first=i * (body.n or 1))
        # tokenized here, beside the worker's decoding: a tokenizer's encode and decode only
        # read it (so prompts too long are refused before anything is queued)
        job.prompt_tokens = batcher.admit(text, add_special, settings,
                                          "messages" if kind == "chat" else "prompt")
        jobs.append(job)
    try:
        for job in jobs:
            batcher.submit(job)
    except RequestError:
        reply.cancelled = True  # the prompts already queued are dropped
        raise
    prompt_tokens = sum(job.prompt_tokens for job in jobs)
    choices = len(jobs) * (body.n or 1)
    if body.stream:
        events = _stream(kind, options.model_name, reply, choices, prompt_tokens,
                         body.include_usage())
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    answers: list[tuple[str, str, int]] = [("", "", 0)] * choices
    async for events in _events(reply, choices):
        for _, index, text, finish, tokens in events:
            answers[index] = (text, finish, tokens)
    return JSONResponse(api.response(kind, options.model_name, answers, prompt_tokens))


def _prompts(body: Any, kind: str, tokenizer: Any) -> list[tuple[str, bool]]:
    """(text, add_special_tokens) of each prompt: the chat rendered with the model's template
    (or, for a base model without one, system and user text joined as plain text); a
    completion prompt as it is, with the tokenizer's special tokens (BOS) added."""
    if kind == "text":
        return [(prompt, True) for prompt in body.prompts()]
    messages = [m.plain() for m in body.messages]
    prompt: str | list[dict[str, str]] = messages
    if not has_chat_template(tokenizer) and all(m["role"] != "assistant" for m in messages):
        prompt = "\n\n".join(m["content"] for m in messages)
    try:
        return [render_prompt(tokenizer, prompt)]
    except MogrpoError as err:
        raise RequestError(400, str(err), "messages") from None


async def _events(reply: Reply, choices: int) -> AsyncIterator[list[tuple]]:
    """The worker's events for a request until all its choices are done, in lists: each
    what had arrived when the request's turn came (one when the server keeps up, several when
    it lags). RequestError on an error event or past the timeout (504)."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    done = 0
    while done < choices:
        try:
            events = [await asyncio.wait_for(reply.events.get(), deadline - time.monotonic())]
        except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
            raise RequestError(504, f"no completion within {REQUEST_TIMEOUT_S:g}s; the server "
                               "is overloaded") from None
        while not reply.events.empty():
            events.append(reply.events.get_nowait())
        for event in events:
            if event[0] == "error":
                raise event[1]
        done += sum(event[0] == "done" for event in events)
        yield events


async def _stream(kind: str, model: str, reply: Reply, choices: int, prompt_tokens: int,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: (chat) a role delta per choice, content deltas as the worker decodes
    them, one chunk with each choice's finish_reason, then (if asked) a usage chunk, then
    `data: [DONE]`. An error after the stream started is sent as a data line with an `error`
    object, which the openai client raises."""
    ident, created = api.new_id(kind), int(time.time())

    def line(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    completion_tokens = 0
    try:
        if kind == "chat":
            for index in range(choices):
                yield line(api.chunk(kind, ident, created, model, index, role=True, text=""))
        async for events in _events(reply, choices):
            # the deltas that arrived together go out as one chunk per choice, in one write:
            # a server that lags behind the decode sends fewer, longer chunks
            lines, pending = [], {}
            for event in events:
                if event[0] == "delta":
                    pending[event[1]] = pending.get(event[1], "") + event[2]
                    continue
                _, index, rest, finish, tokens = event
                completion_tokens += tokens
                rest = pending.pop(index, "") + rest
                if rest:
                    lines.append(line(api.chunk(kind, ident, created, model, index, text=rest)))
                lines.append(line(api.chunk(kind, ident, created, model, index, finish=finish)))
            lines += [line(api.chunk(kind, ident, created, model, index, text=text))
                      for index, text in pending.items()]
            yield "".join(lines)
        if include_usage:
            yield line({"id": ident, "object": "chat.completion.chunk" if kind == "chat"
                        else "text_completion", "created": created, "model": model,
                        "choices": [], "usage": api.usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    except RequestError as err:
        yield line(err.body())
    finally:  # the client left (or the stream ended): its jobs not started yet are skipped
        reply.cancelled = True
