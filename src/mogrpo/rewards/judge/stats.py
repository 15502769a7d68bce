"""What one judge call (one step's judging) cost and how it went: counts, latencies, a log line.

Counts are per completion unless named `requests` (HTTP requests sent, retries included):
`calls` completions judged, of which `cache_hits` came from the on-disk cache, `duplicates`
repeated a completion asked about in the same call, and `failed` got no judge score
(`unparseable` of them because the reply held none, `budget_skipped` requests were never sent);
`fallback` got the fallback reward's value instead of None.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mogrpo.rewards.judge.client import Outcome

ERROR_KINDS = ("timeout", "connection", "http_429", "http_5xx", "http_4xx", "bad_body")


@dataclass
class JudgeStats:
    """Counts and latencies of one or more judge calls; `merge` adds two tallies."""

    providers: list[str]
    calls: int = 0
    cache_hits: int = 0
    duplicates: int = 0
    requests: int = 0
    retries: int = 0
    failovers: int = 0
    failed: int = 0
    unparseable: int = 0
    fallback: int = 0
    budget_skipped: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    provider_requests: Counter[str] = field(default_factory=Counter)
    provider_answers: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    @classmethod
    def empty(cls, providers: list[str], calls: int = 0) -> JudgeStats:
        return cls(providers=list(providers), calls=calls)

    def add_outcome(self, outcome: Outcome) -> None:
        """Count the HTTP requests one completion needed."""
        previous: str | None = None
        for attempt in outcome.attempts:
            self.requests += 1
            self.provider_requests[attempt.provider] += 1
            self.latencies.append(attempt.seconds)
            if attempt.kind != "ok":
                self.errors[attempt.kind] += 1
            if previous is not None:
                if attempt.provider == previous:
                    self.retries += 1
                else:
                    self.failovers += 1
            previous = attempt.provider
        if outcome.provider is not None:
            self.provider_answers[outcome.provider] += 1
        self.tokens += outcome.tokens or 0
        self.budget_skipped += int(outcome.budget_exhausted)

    def merge(self, other: JudgeStats) -> JudgeStats:
        """The tally of both (wall times add up: the calls ran one after the other)."""
        out = JudgeStats.empty(self.providers)
        for name in ("calls", "cache_hits", "duplicates", "requests", "retries", "failovers",
                     "failed", "unparseable", "fallback", "budget_skipped", "tokens", "wall_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.provider_requests = self.provider_requests + other.provider_requests
        out.provider_answers = self.provider_answers + other.provider_answers
        out.errors = self.errors + other.errors
        out.latencies = self.latencies + other.latencies
        return out

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of request latencies in seconds (0.0 without requests)."""
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]

    def format(self, step: int) -> str:
        """`[Judge@5] 8 calls 3.2s p50 0.4s p95 1.1s cache 2/8 providers openai:6 local:2 failed 0`.

        `cache` counts completions that needed no request of their own (cache hits and repeats);
        `providers` counts the requests sent to each provider, retries included."""
        providers = " ".join(f"{name}:{self.provider_requests[name]}" for name in self.providers)
        return (
            f"[Judge@{step}] {self.calls} calls {self.wall_s:.1f}s p50 {self.percentile(50):.1f}s "
            f"p95 {self.percentile(95):.1f}s cache {self.cache_hits + self.duplicates}/{self.calls} "
            f"providers {providers} failed {self.failed}"
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain counts plus p50/p95 latency; per-provider and per-error counts as dicts."""
        return {
            "calls": self.calls, "cache_hits": self.cache_hits, "duplicates": self.duplicates,
            "requests": self.requests, "retries": self.retries, "failovers": self.failovers,
            "failed": self.failed, "unparseable": self.unparseable, "fallback": self.fallback,
            "budget_skipped": self.budget_skipped, "tokens": self.tokens, "wall_s": self.wall_s,
            "latency_p50_s": self.percentile(50), "latency_p95_s": self.percentile(95),
            "providers": {name: self.provider_requests[name] for name in self.providers},
            "answers": {name: self.provider_answers[name] for name in self.providers},
            "errors": {kind: self.errors[kind] for kind in ERROR_KINDS},
        }

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat float metrics under `prefix`; every key present every step (stable columns)."""
        data = self.as_dict()
        out = {f"{prefix}/{k}": float(v) for k, v in data.items() if not isinstance(v, dict)}
        out[f"{prefix}/failed_frac"] = self.failed / self.calls if self.calls else 0.0
        out[f"{prefix}/cache_frac"] = (
            (self.cache_hits + self.duplicates) / self.calls if self.calls else 0.0)
        for name in self.providers:
            out[f"{prefix}/provider/{name}/requests"] = float(self.provider_requests[name])
            out[f"{prefix}/provider/{name}/answers"] = float(self.provider_answers[name])
        for kind in ERROR_KINDS:
            out[f"{prefix}/errors/{kind}"] = float(self.errors[kind])
        return out
