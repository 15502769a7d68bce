"""Tools an agent calls between its turns: their schemas, the calls parsed from a turn's text,
and the calls run (sync or async, each with a timeout, all of a turn's batch at once, or the sync
ones one at a time for tools that are not thread-safe).

A tool is a plain typed Python function with a docstring, as TRL and transformers take them:
its JSON schema comes from transformers' `get_json_schema` (the name, the first docstring line,
each `Args:` entry, the type hints), which `apply_chat_template(tools=...)` renders into the
prompt. A tool that raises, times out or is called badly gives the model an error message as
its result; the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from mogrpo.errors import ConfigError
from mogrpo.user_loop import user_loop

ToolFormat = Literal["auto", "hermes", "llama3"]
TOOL_FORMATS: tuple[str, ...] = ("auto", "hermes", "llama3")

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def tool_schema(fn: Callable[..., Any], where: str = "tools") -> dict[str, Any]:
    """The JSON schema of `fn` that chat templates render (transformers' `get_json_schema`);
    a function without a docstring or a type hint is a ConfigError naming the fix."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(
            f"{where}: tool {name!r} has no usable schema ({err}); give it type hints on every "
            "argument and a docstring whose first line says what it does and whose `Args:` "
            "section describes each argument (transformers' get_json_schema reads them)"
        ) from err


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its arguments, or why it could not be
    read (`error`)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def _call_from(obj: Any, args_key: str) -> ToolCall:
    """A ToolCall from a decoded JSON object {name, <args_key>: {...} | "json"}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, f"a tool call must be a JSON object with a \"name\"; got {obj!r}")
    arguments = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return ToolCall(obj["name"], {}, f"the arguments are not JSON: {err}")
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, f"the arguments must be a JSON object; got {arguments!r}")
    return ToolCall(obj["name"], arguments)


def _parse_hermes(text: str) -> list[ToolCall]:
    """Qwen2.5 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            calls.append(_call_from(json.loads(body), "arguments"))
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({err}): {body[:200]!r}"))
    return calls


def _json_objects(text: str) -> list[Any]:
    """The JSON values written one after another in `text` (separated by `;` or spaces)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in " \t\r\n;":
            i += 1
            continue
        value, i = decoder.raw_decode(text, i)
        values.append(value)
    return values


def _parse_llama3(text: str) -> list[ToolCall]:
    """Llama 3.1's JSON tool calling: the turn is `{"name": ..., "parameters": {...}}` (several
    separated by `;`), after `<|python_tag|>` or not. A turn that does not start with `{` (after
    the tag) is an answer, not a call."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return []
    try:
        return [_call_from(obj, "parameters") for obj in _json_objects(body)]
    except json.JSONDecodeError as err:
        return [ToolCall("", {}, f"the tool call is not JSON ({err}): {body[:200]!r}")]


def parse_tool_calls(text: str, format: ToolFormat = "auto") -> list[ToolCall]:
    """The tool calls in one model turn's text (its special tokens kept); [] for an answer.
    `auto`: Hermes `<tool_call>` blocks where the turn has one, else Llama 3.1's JSON form."""
    if format not in TOOL_FORMATS:
        raise ConfigError(f"tool call format {format!r} is not one of {list(TOOL_FORMATS)}")
    if format == "hermes" or (format == "auto" and "<tool_call>" in text):
        return _parse_hermes(text)
    return _parse_llama3(text)


@dataclass
class ToolResult:
    """What a call gave the model: its text, and whether it failed or timed out."""

    name: str
    content: str
    error: bool = False
    timed_out: bool = False


def _content(value: Any) -> str:
    """A tool's return value as the text of a tool message (dicts and lists as JSON)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) \
            else str(value)
    except (TypeError, ValueError):
        return str(value)


def _start(fn: Callable[..., Any], arguments: dict[str, Any]) -> Future:
    """Start one call: async tools on the shared loop, sync ones on a daemon thread of their
    own (a tool that never returns leaves its thread behind, not the run waiting)."""
    future: Future = Future()
    if inspect.iscoroutinefunction(fn):
        try:  # arguments are bound at the call: a bad one raises here, not in the coroutine
            coroutine = fn(**arguments)
        except Exception as err:  # noqa: BLE001 - the model reads what went wrong
            future.set_exception(err)
            return future
        return asyncio.run_coroutine_threadsafe(coroutine, user_loop())
    future.set_running_or_notify_cancel()  # running: a timeout cannot cancel it, only leave it

    def run() -> None:
        try:
            future.set_result(fn(**arguments))
        except BaseException as err:  # noqa: BLE001 - every failure goes to the model
            future.set_exception(err)

    threading.Thread(target=run, name=f"mogrpo-tool-{getattr(fn, '__name__', 'tool')}",
                     daemon=True).start()
    return future


def run_tool_calls(calls: Sequence[tuple[dict[str, Callable[..., Any]], ToolCall]],
                   timeout_s: float, parallel: bool = True) -> list[ToolResult]:
    """Run every (tools of its row, call), the results in the calls' order. An unknown tool,
    bad arguments, an exception or a timeout gives an `error: ...` text instead of a result.

    `parallel`: every call at once, each within `timeout_s` seconds from the start of the batch.
    Else the sync calls one after another, in order, each within `timeout_s` seconds of its own
    start (for tools that are not thread-safe: TRL calls sync tools one at a time); async
    calls still run together on the event loop, within `timeout_s` from the start."""
    started: list[Future | ToolResult | None] = []
    for tools, call in calls:
        if call.error is not None:
            started.append(ToolResult(call.name or "unknown", f"error: {call.error}", error=True))
        elif call.name not in tools:
            known = ", ".join(sorted(tools)) or "none"
            started.append(ToolResult(call.name, f"error: there is no tool {call.name!r} "
                                                 f"(tools: {known})", error=True))
        elif parallel or inspect.iscoroutinefunction(tools[call.name]):
            started.append(_start(tools[call.name], call.arguments))
        else:
            started.append(None)  # a sync call of a serial batch: started in its turn
    deadline = time.monotonic() + timeout_s
    results = []
    for (tools, call), item in zip(calls, started, strict=True):
        if isinstance(item, ToolResult):
            results.append(item)
        elif item is None:
            results.append(_result(call, _start(tools[call.name], call.arguments), timeout_s,
                                   timeout_s))
        else:
            results.append(_result(call, item, max(deadline - time.monotonic(), 0.0), timeout_s))
    return results


def _result(call: ToolCall, future: Future, wait: float, timeout_s: float) -> ToolResult:
    """What a started call gave within `wait` seconds (`timeout_s`: the limit its message
    names)."""
    try:
        return ToolResult(call.name, _content(future.result(timeout=wait)))
    except Exception as err:  # noqa: BLE001 - the model reads what went wrong
        # a TimeoutError the tool raised itself (a socket timeout) is its error, not ours
        raised = future.done() and not future.cancelled() and future.exception() is err
        if isinstance(err, TimeoutError) and not raised:
            future.cancel()
            return ToolResult(call.name, f"error: {call.name} timed out after {timeout_s:g} s",
                              error=True, timed_out=True)
        return ToolResult(call.name, f"error: {call.name} raised {type(err).__name__}: {err}",
                          error=True)
