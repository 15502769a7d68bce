"""`judge`: a reward scored by another model over any OpenAI-compatible chat-completions API.

Built once per task from the reward's `kwargs` (`JudgeReward.from_options`), then called like any
reward: `judge(prompts, completions, **columns) -> list[float | None]`. One call judges a step's
completions concurrently, reuses cached replies and repeated completions, retries and fails
over between providers, and never raises for a transport problem: a completion it could not
score gets None (or the fallback reward's value) and is counted in the stats.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import threading
import time
from concurrent.futures import CancelledError, Future, as_completed
from pathlib import Path
from typing import Any

from mogrpo.errors import ConfigError, RewardError
from mogrpo.rewards.base import TRAINER_ARGUMENTS, call_reward
from mogrpo.rewards.builtin import completion_text
from mogrpo.rewards.judge.cache import JudgeCache, cache_key
from mogrpo.rewards.judge.client import Budget, JudgeClient, Outcome, Provider
from mogrpo.rewards.judge.options import parse_options
from mogrpo.rewards.judge.parse import ScoreParser
from mogrpo.rewards.judge.stats import JudgeStats
from mogrpo.templates import placeholders

logger = logging.getLogger(__name__)

_BUILTIN_FIELDS = ("prompt", "completion")


class JudgeReward:
    """An LLM-judge reward obeying the reward contract; see `from_options` for its settings."""

    def __init__(
        self, *, providers: list[Provider], template: str, parser: ScoreParser,
        system: str | None = None, temperature: float | None = 0.0, max_tokens: int | None = 64,
        max_workers: int = 8, timeout: float = 10.0, retries: int = 1, backoff: float = 0.5,
        budget: Budget | None = None, fallback: tuple[str, Any, dict[str, Any]] | None = None,
        cache: JudgeCache | None = None, log_unparseable: int = 5, where: str = "judge",
    ) -> None:
        self.providers, self.template, self.parser, self.system = providers, template, parser, system
        self.temperature, self.max_tokens, self.max_workers = temperature, max_tokens, max_workers
        self.fallback, self.cache, self.where = fallback, cache, where
        self.log_unparseable = log_unparseable
        self.fields = _template_fields(template, where)
        self.budget = budget or Budget()
        self.client = JudgeClient(providers, timeout=timeout, retries=retries, backoff=backoff,
                                  budget=self.budget, label=where, concurrency=max_workers)
        self._template_sha = hashlib.sha256(template.encode("utf-8")).hexdigest()
        self._settings = {"system": system, "temperature": temperature, "max_tokens": max_tokens}
        self._names = [p.name for p in providers]
        self._last = JudgeStats.empty(self._names)
        self._pending = JudgeStats.empty(self._names)
        self._unparseable_logged = 0
        self._budget_warned = False
        # after a resume: the cache rows the stopped run wrote after its checkpoint (rowids in
        # (after, upto]), and the keys of those already charged again (`_charge_replays`)
        self._replays: tuple[int, int] | None = None
        self._replayed: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_options(
        cls, options: dict[str, Any], *, where: str, cache_dir: Path | None
    ) -> JudgeReward:
        """Validate a judge reward's options (its config `kwargs`) and build it.

        `where` is the options' config path, used in every error message (e.g.
        `tasks.fairness.rewards.0.kwargs`); `cache_dir` holds the default cache file
        (`judge_cache.sqlite`), None for no default cache.
        """
        return cls(**parse_options(options, where=where, cache_dir=cache_dir), where=where)

    # -- the reward contract -------------------------------------------------------------------

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        """One score in [0, 1] per completion; None (or the fallback's value) where unscorable."""
        start = time.perf_counter()
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(f"{self.where}: got {len(prompts)} prompts for {n} completions")
        self._check_columns(columns)
        requests = [self._render(prompts[i], completions[i], columns, i) for i in range(n)]
        stats = JudgeStats.empty(self._names, calls=n)
        replies = self._cached(requests)
        replayed = self._charge_replays(replies, stats) if self._replays else set()
        stats.cache_hits = sum(1 for r in requests if r in replies and r not in replayed)
        todo = [r for r in dict.fromkeys(requests) if r not in replies]
        # Repeated completions (common: K samples of a short answer) are asked once.
        stats.duplicates = n - stats.cache_hits - len(todo) - len(replayed)
        if todo:
            self._ask(todo, replies, stats)
        parsed = {r: self.parser.parse(reply) for r, (reply, _) in replies.items()}
        scores: list[float | None] = [parsed.get(r) for r in requests]
        stats.failed = sum(1 for s in scores if s is None)
        stats.unparseable = sum(1 for r in requests if r in replies and parsed[r] is None)
        self._log_unparseable([replies[r] for r in dict.fromkeys(requests)
                               if r in replies and parsed[r] is None])
        if self.fallback is not None and stats.failed:
            scores = self._apply_fallback(scores, prompts, completions, columns, stats)
        stats.wall_s = time.perf_counter() - start
        with self._lock:
            self._last = stats
            self._pending = self._pending.merge(stats)
        return scores

    def _render(self, prompt: Any, completion: str, columns: dict[str, Any], i: int) -> str:
        # Column values stay as they are (a dict column can be indexed: {meta[source]}).
        values = {name: _blank_none(columns[name][i]) for name in self.fields if name in columns}
        values["prompt"], values["completion"] = _prompt_text(prompt), completion_text(completion)
        try:
            return self.template.format_map(values)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as err:
            raise RewardError(
                f"{self.where}.template cannot be filled for row {i} ({type(err).__name__}: "
                f"{err}); check its placeholders against the row's columns") from err

    def _check_columns(self, columns: dict[str, Any]) -> None:
        missing = [f for f in self.fields if f not in _BUILTIN_FIELDS and f not in columns]
        if missing:
            available = ", ".join([*_BUILTIN_FIELDS,
                                   *sorted(c for c in columns if c not in TRAINER_ARGUMENTS)])
            raise RewardError(
                f"{self.where}.template uses {{{missing[0]}}} but this task's rows have no column "
                f"{missing[0]!r}; available placeholders: {available}. Fix the template or add the "
                "column to the task's data"
            )

    def _messages(self, request: str) -> list[dict[str, str]]:
        messages = [{"role": "user", "content": request}]
        return [{"role": "system", "content": self.system}, *messages] if self.system else messages

    def _body(self, request: str) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": self._messages(request)}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    def _key(self, provider: Provider, request: str) -> str:
        return cache_key(base_url=provider.base_url, model=provider.model,
                         template_sha256=self._template_sha, request=request,
                         settings={**self._settings, "extra_body": provider.extra_body})

    # -- cache, requests, fallback -------------------------------------------------------------

    def _cached(self, requests: list[str]) -> dict[str, tuple[str, str]]:
        """{request: (reply, provider)} for requests any provider has answered before."""
        if self.cache is None or not requests:
            return {}
        unique = list(dict.fromkeys(requests))
        keys = {(p.name, r): self._key(p, r) for r in unique for p in self.providers}
        found = self.cache.get_many(list(keys.values()))
        replies: dict[str, tuple[str, str]] = {}
        for request in unique:
            for provider in self.providers:  # fallback order: the first provider's reply wins
                key = keys[provider.name, request]
                if key in found:
                    replies[request] = (found[key], provider.name)
                    break
        return replies

    def _charge_replays(self, replies: dict[str, tuple[str, str]],
                        stats: JudgeStats) -> set[str]:
        """After a resume, the cached replies the stopped run got after its checkpoint are
        counted as the requests they were: charged to the budget (which the checkpoint holds
        without them) and to this call's request counts, once each, as the uninterrupted run
        counted them. Not free cache hits: the budget caps what is paid, and they were paid
        for. A reply the budget can no longer afford is dropped from `replies` (the request
        then meets the spent budget as the uninterrupted run's did). Returns the requests
        charged.

        What the cache cannot tell stays uncounted: the stopped run's retries and failed
        requests after its checkpoint (one request is charged per reply), and it charges rows
        another writer of a shared cache file added in that window as if this run had."""
        if self.cache is None or self._replays is None:
            return set()
        providers = {p.name: p for p in self.providers}
        keys = {r: self._key(providers[name], r) for r, (_, name) in replies.items()}
        fresh = [k for k in keys.values() if k not in self._replayed]
        written = self.cache.written_between(fresh, *self._replays) if fresh else {}
        charged: set[str] = set()
        for request, key in keys.items():
            if key not in written or key in self._replayed:
                continue
            self._replayed.add(key)
            if not self.budget.reserve():
                del replies[request]
                continue
            tokens = written[key]
            if tokens:
                self.budget.add_tokens(tokens)
            provider = replies[request][1]
            stats.requests += 1
            stats.provider_requests[provider] += 1
            stats.provider_answers[provider] += 1
            stats.tokens += tokens
            charged.add(request)
        return charged

    def _ask(self, todo: list[str], replies: dict[str, tuple[str, str]],
             stats: JudgeStats) -> None:
        # All requests go to the judge's loop at once; it keeps `max_workers` in flight.
        futures = {self.client.submit(self._body(r)): r for r in todo}
        for future in as_completed(futures):
            request = futures[future]
            outcome = self._outcome(future)
            stats.add_outcome(outcome)
            if outcome.content is None:
                continue
            replies[request] = (outcome.content, outcome.provider or "")
            if self.cache is not None:
                provider = next(p for p in self.providers if p.name == outcome.provider)
                # Written as each reply lands, so a crash mid-step loses nothing paid for.
                self.cache.put(self._key(provider, request), provider=provider.name,
                               model=provider.model, reply=outcome.content,
                               score=self.parser.parse(outcome.content), tokens=outcome.tokens)
        if stats.budget_skipped and not self._budget_warned:
            self._budget_warned = True
            logger.warning(
                "%s: the judge budget is spent (%s); completions not yet judged get %s from now on",
                self.where, self.budget.state_dict(),
                "the fallback reward" if self.fallback else "None")

    def _outcome(self, future: Future[Outcome]) -> Outcome:
        try:
            return future.result()
        except CancelledError:  # close() ended the request
            return Outcome()
        except Exception:  # a bug here must cost one score, not the run
            logger.exception("%s: judging one completion failed unexpectedly", self.where)
            return Outcome()

    def _apply_fallback(self, scores: list[float | None], prompts: list[Any],
                        completions: list[Any], columns: dict[str, Any],
                        stats: JudgeStats) -> list[float | None]:
        name, fn, kwargs = self.fallback  # type: ignore[misc]
        rows = [i for i, s in enumerate(scores) if s is None]
        n = len(scores)
        # per-completion columns are cut to the failed rows; trainer_state and the like are not
        sub_columns = {k: [v[i] for i in rows] if isinstance(v, list) and len(v) == n else v
                       for k, v in columns.items()}
        values = call_reward(fn, {"prompts": [prompts[i] for i in rows],
                                  "completions": [completions[i] for i in rows],
                                  **sub_columns, **kwargs})
        if not isinstance(values, list | tuple) or len(values) != len(rows):
            raise RewardError(
                f"{self.where}.fallback {name!r} returned {values!r:.80} for {len(rows)} "
                "completions; it must return one score (or None) per completion")
        out = list(scores)
        for i, value in zip(rows, values, strict=True):
            out[i] = value
        stats.fallback += len(rows)
        return out

    def _log_unparseable(self, replies: list[tuple[str, str]]) -> None:
        """Log the run's first `log_unparseable` unparseable replies verbatim (cut to 200 chars),
        so the template or parser can be fixed."""
        for text, provider in replies:
            if self._unparseable_logged >= self.log_unparseable:
                return
            self._unparseable_logged += 1
            logger.warning(
                "%s: unparseable judge reply %d/%d from %s (parser %s): %r", self.where,
                self._unparseable_logged, self.log_unparseable, provider, self.parser.kind,
                text[:200])

    # -- stats and state -----------------------------------------------------------------------

    def last_stats(self) -> dict[str, Any]:
        """The stats of the most recent call (one step's judging) as a plain dict."""
        with self._lock:
            return self._last.as_dict()

    def take_stats(self) -> JudgeStats:
        """Stats of every call since the previous `take_stats()` (a step with refills calls the
        reward more than once), and start a new tally."""
        with self._lock:
            taken, self._pending = self._pending, JudgeStats.empty(self._names)
        return taken

    def format_stats(self, step: int, stats: JudgeStats | None = None) -> str:
        """`[Judge@5] 8 calls 3.2s p50 0.4s p95 1.1s cache 2/8 providers openai:6 failed 0`."""
        with self._lock:
            stats = stats if stats is not None else self._last
        return stats.format(step)

    def metrics(self, prefix: str, stats: JudgeStats | None = None) -> dict[str, float]:
        """Namespaced metrics, e.g. prefix `task/fairness/judge` → `task/fairness/judge/failed`."""
        with self._lock:
            stats = stats if stats is not None else self._last
        out = stats.metrics(prefix)
        out[f"{prefix}/budget/calls"] = float(self.budget.calls)
        out[f"{prefix}/budget/tokens"] = float(self.budget.tokens)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The run's budget usage, so a resumed run keeps counting from where it stopped, and
        the cache's newest row, so it can tell the replies got after the checkpoint."""
        return {"budget": self.budget.state_dict(),
                "cache_mark": self.cache.mark() if self.cache is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budget.load_state_dict(state["budget"])
        # no mark (no cache then, an unreadable one, or an older checkpoint): nothing is known
        # to have been paid after the checkpoint, and nothing is charged
        after = state.get("cache_mark")
        upto = self.cache.mark() if self.cache is not None and after is not None else None
        self._replays = (int(after), upto) if upto is not None and upto > int(after) else None
        self._replayed.clear()

    def close(self) -> None:
        """Stop pending requests and backoff waits, close connections and the cache file."""
        self.client.close()
        if self.cache is not None:
            self.cache.close()

    def __repr__(self) -> str:
        providers = ", ".join(f"{p.name}:{p.model}" for p in self.providers)
        cache = self.cache.path if self.cache is not None else None
        return f"JudgeReward({self.where}, providers=[{providers}], parser={self.parser.kind}, cache={cache})"


def _template_fields(template: str, where: str) -> list[str]:
    """Placeholder names in a str.format template; checks prompt/completion now, the rest later."""
    try:
        fields = placeholders(template)
    except ValueError as err:
        raise ConfigError(
            f"{where}.template is not a valid format string ({err}); write literal braces as "
            "{{ and }} (e.g. a JSON example: {{\"score\": 3}})") from err
    names: list[str] = []
    for name, base in fields:
        if not base or base.isdigit():
            raise ConfigError(
                f"{where}.template has a positional placeholder {{{name}}}; name it, e.g. "
                "{prompt}, {completion} or a column such as {reference}")
        if not base.isidentifier():
            raise ConfigError(
                f"{where}.template has a placeholder {{{name}}} that is not a name; write literal "
                "braces as {{ and }} (e.g. a JSON example: {{\"score\": 3}})")
        if base not in names:
            names.append(base)
    if "completion" not in names:
        close = difflib.get_close_matches("completion", names, n=1, cutoff=0.6)
        hint = f" ({{{close[0]}}} looks like a typo)" if close else ""
        raise ConfigError(
            f"{where}.template never shows the judge the completion{hint}; include {{completion}} "
            f"(placeholders found: {names or 'none'}; also available: {{prompt}} and any column of "
            "the task's rows)")
    return names


def _prompt_text(prompt: Any) -> str:
    """A chat prompt (list of messages) as `role: content` lines; a string as it is."""
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], dict):
            return str(prompt[0].get("content", ""))
        return "\n".join(
            f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
            for m in prompt)
    return str(_blank_none(prompt))


def _blank_none(value: Any) -> Any:
    return "" if value is None else value
