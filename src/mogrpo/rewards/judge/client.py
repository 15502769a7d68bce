"""The judge's HTTP side: one chat-completions request, retries with backoff, provider fallback.

Stdlib only (urllib honours HTTP(S)_PROXY / NO_PROXY like every other client on the machine).
Errors are sorted into transient ones, retried with exponential backoff and jitter (timeouts,
dropped connections, 5xx, malformed bodies, 429 after its Retry-After), and permanent ones
(other 4xx), which move straight on to the next provider. 401/403/404 also take the provider
out of rotation for the rest of the run: a wrong key or model name will not fix itself, and
retrying it every step would be a retry storm. Nothing here raises: `judge()` returns an
`Outcome` that says what happened.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mogrpo.version import __version__

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 30.0
"""A 429 asking to wait longer than this moves on to the next provider instead of stalling."""
_DISABLING = (401, 403, 404)
_WARN_PER_KIND = 3  # failures of one kind logged per provider; later ones only at debug


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

    def add_tokens(self, n: int) -> None:
        with self._lock:
            self.tokens += n

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls, self.tokens = int(state["calls"]), int(state["tokens"])


class JudgeClient:
    """Sends one judge request through the providers in order, with retries and a budget."""

    def __init__(
        self, providers: list[Provider], *, timeout: float, retries: int, backoff: float,
        budget: Budget, label: str,
    ) -> None:
        self.providers, self.timeout, self.retries, self.backoff = providers, timeout, retries, backoff
        self.budget, self.label = budget, label
        self.disabled: dict[str, str] = {}
        self._warned: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set by close(): backoff sleeps end at once

    def judge(self, body: dict[str, Any]) -> Outcome:
        """Ask each provider in turn (skipping disabled ones) until one replies."""
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
                    content, tokens = post_chat(provider, {**body, "model": provider.model,
                                                           **provider.extra_body}, self.timeout)
                except _Failure as failure:
                    outcome.attempts.append(
                        Attempt(provider.name, time.perf_counter() - start, failure.kind))
                    self._report(provider, failure)
                    wait = self._wait_before_retry(failure, attempt)
                    if wait is None:
                        break
                    self._stop.wait(wait)
                    continue
                outcome.attempts.append(Attempt(provider.name, time.perf_counter() - start, "ok"))
                if tokens:
                    self.budget.add_tokens(tokens)
                outcome.content, outcome.provider, outcome.tokens = content, provider.name, tokens
                return outcome
        return outcome

    def _wait_before_retry(self, failure: _Failure, attempt: int) -> float | None:
        """Seconds to wait before retrying the same provider, or None to move on."""
        if not failure.transient or attempt >= self.retries:
            return None
        if failure.retry_after is not None:
            return failure.retry_after if failure.retry_after <= MAX_RETRY_AFTER_S else None
        # Exponential backoff with "equal jitter": half fixed, half random, so workers that
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
        self._stop.set()


def post_chat(provider: Provider, body: dict[str, Any], timeout: float) -> tuple[str | None, int | None]:
    """POST one chat-completions request; returns (choices[0].message.content, total tokens)."""
    key = os.environ.get(provider.api_key_env, "") if provider.api_key_env else ""
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": f"mogrpo/{__version__}",
        **provider.headers,
    }
    if key:
        bearer = provider.api_key_header.lower() == "authorization"
        headers[provider.api_key_header] = f"Bearer {key}" if bearer else key
    request = urllib.request.Request(
        provider.url, data=json.dumps(body).encode("utf-8"), headers=headers, method="POST")
    try:
        # `timeout` bounds the connect and every read; a server that answers nothing in time
        # raises TimeoutError.
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        raise _http_failure(err, key) from None
    except urllib.error.URLError as err:
        kind = "timeout" if isinstance(err.reason, TimeoutError) else "connection"
        raise _Failure(kind, f"{kind}: {_scrub(str(err.reason), key)}", transient=True) from None
    except TimeoutError:
        raise _Failure("timeout", f"no reply within {timeout:g}s", transient=True) from None
    except (http.client.HTTPException, OSError) as err:  # dropped connection, reset, bad status
        detail = f"connection: {type(err).__name__} {_scrub(str(err), key)}".strip()
        raise _Failure("connection", detail, transient=True) from None
    return _parse_body(raw, key)


def _http_failure(err: urllib.error.HTTPError, key: str) -> _Failure:
    try:
        text = err.read(300).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        text = ""
    detail = f"HTTP {err.code}: {_scrub(text, key).strip()[:200]}"
    if err.code == 429:
        wait = _retry_after(err.headers.get("Retry-After") if err.headers else None)
        return _Failure("http_429", detail, transient=True, status=429, retry_after=wait)
    if err.code >= 500 or err.code == 408:
        return _Failure("http_5xx", detail, transient=True, status=err.code)
    return _Failure("http_4xx", detail, transient=False, status=err.code)


def _parse_body(raw: bytes, key: str) -> tuple[str | None, int | None]:
    try:
        data = json.loads(raw)
        message = data["choices"][0]["message"]
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise TypeError(f"message.content is a {type(content).__name__}")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        snippet = _scrub(raw[:120].decode("utf-8", "replace"), key)
        raise _Failure(
            "bad_body", f"malformed chat-completions body ({type(err).__name__}: {err}): {snippet!r}",
            transient=True) from None
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
    return content, tokens if isinstance(tokens, int) else None


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/invalid."""
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
