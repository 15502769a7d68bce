"""The judge's HTTP side: chat-completions requests through the official `openai` client.

Each provider gets one `AsyncOpenAI` client (its connection pool, timeout, headers); requests
run on the judge's own event loop (`loop.py`), at most `concurrency` at a time. The clients are
built with `max_retries=0`: retries, backoff and fallback are done here, one request at a time,
because every request must be seen to be counted — each is charged to the budget before it is
sent, timed, and sorted by how it ended; openai's internal retries would hide all of that.
Our policy, which openai's options cannot express, also differs from its built-in one:

- transient (retried with exponential backoff and equal jitter): timeouts, dropped
  connections, 5xx and 408, malformed bodies (openai does not retry those), and 429 after
  its Retry-After (or retry-after-ms) — but a 429 asking to wait longer than
  `MAX_RETRY_AFTER_S` moves on to the next provider at once (openai would back off instead);
- permanent, straight on to the next provider: other 4xx, 409 included (openai retries it);
  401/403/404 also take the provider out of rotation for the rest of the run: a wrong key or
  model name will not fix itself, and retrying it every step would be a retry storm.

Nothing here raises: `judge()` returns an `Outcome` that says what happened. A provider gets
only what its config names: no OPENAI_API_KEY, organisation or project from the environment.
"""

from __future__ import annotations

import asyncio
import email.utils
import importlib
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mogrpo.errors import ConfigError
from mogrpo.rewards.judge.loop import LoopThread
from mogrpo.version import __version__

if TYPE_CHECKING:
    from openai import AsyncOpenAI

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 30.0
"""A 429 asking to wait longer than this moves on to the next provider instead of stalling."""
INSTALL_HINT = "pip install 'mogrpo[judge]'"
_DISABLING = (401, 403, 404)
_WARN_PER_KIND = 3  # failures of one kind logged per provider; later ones only at debug


def require_openai(where: str) -> None:
    """Raise a ConfigError naming the fix when the `openai` package (the `judge` extra) is missing."""
    try:
        import openai  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"{where}: the judge reward needs the `openai` package, which is not installed; "
            f"install the judge extra: {INSTALL_HINT}") from err


@dataclass(frozen=True)
class Provider:
    """One OpenAI-compatible chat-completions endpoint; holds the key's variable name, not the key."""

    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    api_key_header: str = "Authorization"
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def __repr__(self) -> str:  # header values may be secret too: show their names only
        return (
            f"Provider({self.name!r}, {self.base_url!r}, model={self.model!r}, "
            f"api_key_env={self.api_key_env!r}, headers={sorted(self.headers)})"
        )


@dataclass
class Attempt:
    """One HTTP request: where it went, how long it took, and how it ended."""

    provider: str
    seconds: float
    kind: str
    """"ok", "timeout", "connection", "http_429", "http_5xx", "http_4xx", "bad_body"."""


@dataclass
class Outcome:
    """What judging one request came to: the reply text (None if no provider answered)."""

    content: str | None = None
    provider: str | None = None
    tokens: int | None = None
    attempts: list[Attempt] = field(default_factory=list)
    budget_exhausted: bool = False


class _Failure(Exception):
    def __init__(
        self, kind: str, detail: str, *, transient: bool, status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(detail)
        self.kind, self.transient, self.status, self.retry_after = kind, transient, status, retry_after


class Budget:
    """Per-run caps on requests sent and tokens reported; thread-safe, saved with checkpoints."""

    def __init__(self, max_calls: int | None = None, max_tokens: int | None = None) -> None:
        self.max_calls, self.max_tokens = max_calls, max_tokens
        self.calls = self.tokens = 0
        self._lock = threading.Lock()

    def reserve(self) -> bool:
        """Count one request about to be sent; False (and nothing counted) when the budget is spent.

        Tokens are known only after a reply, so concurrent requests can overshoot `max_tokens`
        by at most what the requests in flight report."""
        with self._lock:
            if (self.max_calls is not None and self.calls >= self.max_calls) or (
                self.max_tokens is not None and self.tokens >= self.max_tokens
            ):
                return False
            self.calls += 1
            return True

    def share(self, rank: int, processes: int) -> None:
        """Keep this process's part of the run's caps when `processes` processes each judge
        their own completions: an even split (the first ones take the remainder), so that
        together they send no more than the run's caps."""
        def part(cap: int | None) -> int | None:
            return None if cap is None else cap // processes + int(rank < cap % processes)

        self.max_calls, self.max_tokens = part(self.max_calls), part(self.max_tokens)

    def add_tokens(self, n: int) -> None:
        with self._lock:
            self.tokens += n

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls, self.tokens = int(state["calls"]), int(state["tokens"])


class JudgeClient:
    """Sends judge requests through the providers in order, with retries, a budget and at most
    `concurrency` requests in flight; `submit()` from any thread, `close()` when done."""

    def __init__(
        self, providers: list[Provider], *, timeout: float, retries: int, backoff: float,
        budget: Budget, label: str, concurrency: int = 8,
    ) -> None:
        self.providers, self.timeout, self.retries, self.backoff = providers, timeout, retries, backoff
        self.budget, self.label, self.concurrency = budget, label, concurrency
        self.disabled: dict[str, str] = {}
        self._warned: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set by close(): no new requests, backoff waits end
        self._runner: LoopThread | None = None
        # Loop-bound state, made on the loop by _ready() and dropped with the loop:
        self._clients: dict[str, AsyncOpenAI] = {}
        self._gate: asyncio.Semaphore | None = None
        self._woken: asyncio.Event | None = None

    def submit(self, body: dict[str, Any]) -> Future[Outcome]:
        """Start judging one request (`messages` and sampling fields) on the judge's loop."""
        if self._stop.is_set():
            done: Future[Outcome] = Future()
            done.set_result(Outcome())
            return done
        return self._loop().submit(self.judge(body))

    def _loop(self) -> LoopThread:
        with self._lock:
            if self._runner is None or not self._runner.alive:
                # First use, or a forked child: everything bound to the old loop is left alone.
                self._clients, self._gate, self._woken = {}, None, None
                self._runner = LoopThread(f"judge-{self.label}", owner=self, clients=self._clients)
            return self._runner

    def _ready(self) -> tuple[asyncio.Semaphore, asyncio.Event]:
        if self._gate is None or self._woken is None:
            self._gate, self._woken = asyncio.Semaphore(self.concurrency), asyncio.Event()
        return self._gate, self._woken

    async def judge(self, body: dict[str, Any]) -> Outcome:
        """Ask each provider in turn (skipping disabled ones) until one replies."""
        gate, woken = self._ready()
        async with gate:
            return await self._judge(body, woken)

    async def _judge(self, body: dict[str, Any], woken: asyncio.Event) -> Outcome:
        outcome = Outcome()
        for provider in self.providers:
            if provider.name in self.disabled:
                continue
            for attempt in range(self.retries + 1):
                if self._stop.is_set():
                    return outcome
                if not self.budget.reserve():
                    outcome.budget_exhausted = True
                    return outcome
                start = time.perf_counter()
                try:
                    content, tokens = await self._post(provider, body)
                except _Failure as failure:
                    outcome.attempts.append(
                        Attempt(provider.name, time.perf_counter() - start, failure.kind))
                    self._report(provider, failure)
                    wait = self._wait_before_retry(failure, attempt)
                    if wait is None:
                        break
                    try:  # close() sets `woken`: a backoff wait ends at once
                        await asyncio.wait_for(woken.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                    continue
                outcome.attempts.append(Attempt(provider.name, time.perf_counter() - start, "ok"))
                if tokens:
                    self.budget.add_tokens(tokens)
                outcome.content, outcome.provider, outcome.tokens = content, provider.name, tokens
                return outcome
        return outcome

    async def _post(self, provider: Provider, body: dict[str, Any]) -> tuple[str, int | None]:
        """One chat-completions request; returns (choices[0].message.content, total tokens)."""
        import openai

        client = self._clients.get(provider.name)
        if client is None:
            client = self._clients[provider.name] = _make_client(provider, self.timeout)
        key = _key(provider)
        # The body goes as it is (the provider's extra_body over ours), through the client's
        # own request path with its timeouts, connection pool and status errors, but not its
        # typed-parameter transform (a third of its CPU per request, and a field the installed
        # openai does not know still reaches the server); the reply comes back raw.
        try:
            raw = await client.post(
                "/chat/completions", cast_to=_raw_response(),
                body={**body, "model": provider.model, **provider.extra_body},
                options={"headers": _headers(provider, key)})
        except openai.APITimeoutError:
            raise _Failure("timeout", f"no reply within {self.timeout:g}s", transient=True) from None
        except openai.APIConnectionError as err:  # refused, reset, closed without a reply
            cause = err.__cause__ or err
            detail = f"connection: {type(cause).__name__} {_scrub(str(cause), key)}".strip()
            raise _Failure("connection", detail, transient=True) from None
        except openai.APIStatusError as err:
            raise _status_failure(err.response, key) from None
        # The body is parsed here, not by openai, so a malformed one is a counted `bad_body`.
        return _parse_body(raw.content, key)

    def _wait_before_retry(self, failure: _Failure, attempt: int) -> float | None:
        """Seconds to wait before retrying the same provider, or None to move on."""
        if not failure.transient or attempt >= self.retries:
            return None
        if failure.retry_after is not None:
            return failure.retry_after if failure.retry_after <= MAX_RETRY_AFTER_S else None
        # Exponential backoff with "equal jitter": half fixed, half random, so requests that
        # failed together do not retry together.
        delay = self.backoff * 2**attempt
        return delay / 2 + random.uniform(0, delay / 2)

    def _report(self, provider: Provider, failure: _Failure) -> None:
        with self._lock:
            self._warned[provider.name, failure.kind] += 1
            first = self._warned[provider.name, failure.kind] <= _WARN_PER_KIND
            disable = failure.status in _DISABLING and provider.name not in self.disabled
            if disable:
                self.disabled[provider.name] = failure.kind
        if disable:
            logger.error(
                "%s: provider %s answered HTTP %s (%s); it is skipped for the rest of the run. "
                "Check its base_url, model and api_key_env", self.label, provider.name,
                failure.status, failure)
        elif first:
            logger.warning("%s: provider %s: %s", self.label, provider.name, failure)
        else:
            logger.debug("%s: provider %s: %s", self.label, provider.name, failure)

    def close(self) -> None:
        """End backoff waits, cancel requests in flight, close connections, stop the loop."""
        self._stop.set()
        with self._lock:
            runner, self._runner = self._runner, None
        if runner is None or not runner.alive:
            return
        try:
            runner.submit(self._aclose()).result(timeout=10)
        except Exception:  # closing must not fail a run that is ending anyway
            logger.debug("%s: closing the judge's connections failed", self.label, exc_info=True)
        runner.stop()

    async def _aclose(self) -> None:
        if self._woken is not None:
            self._woken.set()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


def _key(provider: Provider) -> str:
    return os.environ.get(provider.api_key_env, "") if provider.api_key_env else ""


def _raw_response() -> type:
    import httpx

    return httpx.Response


def _make_client(provider: Provider, timeout: float) -> AsyncOpenAI:
    """The provider's client: its base URL, our timeout, no retries of its own (headers, the key
    among them, go with each request: `_headers`)."""
    import openai

    # `timeout` bounds the connect and every read, as one number does in httpx.
    return openai.AsyncOpenAI(api_key="unused", base_url=provider.base_url, timeout=timeout,
                              max_retries=0)


def _headers(provider: Provider, key: str) -> dict[str, Any]:
    """The request's headers; the key is read from its variable at each request, as before."""
    import openai

    # Recent openai versions export Omit; older 1.x ones (tested: 1.55.3) keep it in openai._types.
    omit = getattr(openai, "Omit", None) or importlib.import_module("openai._types").Omit
    # Omit() removes a header openai would add: its own bearer token (a placeholder here) and
    # organisation/project ids read from OPENAI_* variables, which are not this provider's.
    headers: dict[str, Any] = {
        "User-Agent": f"mogrpo/{__version__}", "Authorization": omit(),
        "OpenAI-Organization": omit(), "OpenAI-Project": omit(), **provider.headers}
    if key:
        bearer = provider.api_key_header.lower() == "authorization"
        headers[provider.api_key_header] = f"Bearer {key}" if bearer else key
    return headers


def _status_failure(response: Any, key: str) -> _Failure:
    """Sort an HTTP error status into our kinds (its body's first 200 characters, scrubbed)."""
    code = response.status_code
    try:
        text = response.text[:300]
    except Exception:  # a body that cannot be decoded says nothing we need
        text = ""
    detail = f"HTTP {code}: {_scrub(text, key).strip()[:200]}"
    if code == 429:
        headers = response.headers
        wait = _retry_after(headers.get("Retry-After"), headers.get("retry-after-ms"))
        return _Failure("http_429", detail, transient=True, status=429, retry_after=wait)
    if code >= 500 or code == 408:
        return _Failure("http_5xx", detail, transient=True, status=code)
    return _Failure("http_4xx", detail, transient=False, status=code)


def _parse_body(raw: bytes, key: str) -> tuple[str, int | None]:
    try:
        data = json.loads(raw)
        message = data["choices"][0]["message"]
        # null (a reasoning model cut off by max_tokens): a reply with no score in it, counted
        # and logged as unparseable, not a failure nothing explains
        content = message.get("content")
        content = "" if content is None else content
        if not isinstance(content, str):
            raise TypeError(f"message.content is a {type(content).__name__}")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        snippet = _scrub(raw[:120].decode("utf-8", "replace"), key)
        raise _Failure(
            "bad_body", f"malformed chat-completions body ({type(err).__name__}: {err}): {snippet!r}",
            transient=True) from None
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
    # an echoing server's reply would reach the unparseable-reply log and the cache file
    return _scrub(content, key), tokens if isinstance(tokens, int) else None


def _retry_after(value: str | None, millis: str | None = None) -> float | None:
    """Seconds from `retry-after-ms` (OpenAI's, preferred) or a Retry-After header (delta-seconds
    or an HTTP date); None if absent or invalid."""
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _scrub(text: str, key: str) -> str:
    """Servers sometimes echo the credentials they got; never let the key reach a log line."""
    return text.replace(key, "***") if key else text
