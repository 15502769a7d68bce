"""Validate a judge reward's options (its config `kwargs`) before any model loads.

Every error names the option by its config path (`tasks.fairness.rewards.0.kwargs.timeout`),
the bad value and the fix. API keys are never options: a provider names the environment
variable that holds its key (`api_key_env: OPENAI_API_KEY`), read at call time. A value that
looks like a key in that field is refused without being echoed.

```yaml
- fn: judge
  name: judge
  kwargs:
    providers:
      - {name: openai, base_url: https://api.openai.com/v1, model: gpt-4o-mini,
         api_key_env: OPENAI_API_KEY}
      - {name: local, base_url: http://127.0.0.1:8000/v1, model: judge}
    template: "Question: {prompt}\\nAnswer: {completion}\\nReference: {reference}\\nScore 1-10:"
    parser: {kind: number, min: 1, max: 10}
    timeout: 8
    retries: 1
    budget: {max_calls: 20000}
    fallback: null            # or a reward spec, e.g. mc_correct
```
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import math
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

from mogrpo.config.sections import reward_label
from mogrpo.errors import ConfigError, MogrpoError
from mogrpo.rewards.base import resolve_reward
from mogrpo.rewards.judge.cache import CACHE_FILE, JudgeCache
from mogrpo.rewards.judge.client import Budget, Provider, require_openai
from mogrpo.rewards.judge.parse import ScoreParser

logger = logging.getLogger(__name__)

OPTIONS = (
    "providers", "template", "system", "parser", "temperature", "max_tokens", "max_workers",
    "timeout", "retries", "backoff", "budget", "fallback", "cache", "log_unparseable",
)
PROVIDER_OPTIONS = (
    "name", "base_url", "model", "api_key_env", "api_key_header", "headers", "extra_body",
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_HEADERS = {"authorization", "proxy-authorization", "api-key", "x-api-key"}
# Names a key goes by in a URL's query or a request body (Azure's `api-key`, Google's `key`, a
# signed URL's `sig`): written in a config, it would be saved with the run and its checkpoints.
_SECRET_FIELDS = {"key", "api_key", "apikey", "api-key", "token", "access_token", "auth",
                  "secret", "password", "sig", "signature"}
_NO_KEYS = ("keys must not be written in configs (the config is saved with the run and its "
            "checkpoints); put the key in an environment variable, name it in api_key_env, and "
            "set api_key_header if the provider expects a header other than Authorization")


def parse_options(options: Any, *, where: str, cache_dir: Path | None) -> dict[str, Any]:
    """The keyword arguments of `JudgeReward(...)` built from validated `options`."""
    if not isinstance(options, dict):
        raise ConfigError(f"{where} = {options!r:.80}: a judge reward's kwargs must be a mapping")
    _reject_unknown(options, OPTIONS, where)
    require_openai(where)
    for required in ("providers", "template", "parser"):
        if required not in options:
            raise ConfigError(
                f"{where}.{required} is missing; a judge needs providers, a template and a parser "
                "(see the judge section of the README)")
    template = options["template"]
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"{where}.template must be a non-empty string with {{completion}} in it")
    system = options.get("system")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{where}.system = {system!r:.60} must be a string (a system prompt)")
    return {
        "providers": _providers(options["providers"], f"{where}.providers"),
        "template": template,
        "system": system,
        "parser": ScoreParser.from_options(options["parser"], f"{where}.parser"),
        "temperature": _number(options, "temperature", 0.0, where, low=0.0, optional=True),
        "max_tokens": _integer(options, "max_tokens", 64, where, optional=True),
        "max_workers": _integer(options, "max_workers", 8, where),
        "timeout": _number(options, "timeout", 10.0, where, low=0.0, strict=True),
        "retries": _integer(options, "retries", 1, where, low=0),
        "backoff": _number(options, "backoff", 0.5, where, low=0.0),
        "budget": _budget(options.get("budget"), f"{where}.budget"),
        "fallback": _fallback(options.get("fallback"), f"{where}.fallback"),
        "cache": _cache(options.get("cache", True), cache_dir, f"{where}.cache"),
        "log_unparseable": _integer(options, "log_unparseable", 5, where, low=0),
    }


def _reject_unknown(options: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}.{key} is not a judge option; {hint}options: {', '.join(known)}")


def _providers(value: Any, where: str) -> list[Provider]:
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"{where} must be a non-empty list, in fallback order, of "
            "{base_url, model, api_key_env, headers}")
    providers: list[Provider] = []
    for i, spec in enumerate(value):
        provider = _provider(spec, f"{where}.{i}")
        if provider.name in [p.name for p in providers]:
            raise ConfigError(
                f"{where}.{i}.name = {provider.name!r} is used twice; give each provider a "
                "distinct `name` (it labels the provider in stats and metrics)")
        providers.append(provider)
    return providers


def _provider(spec: Any, where: str) -> Provider:
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a mapping with base_url and model")
    _reject_unknown(spec, PROVIDER_OPTIONS, where)
    base_url, model = spec.get("base_url"), spec.get("model")
    parsed = urlparse(base_url) if isinstance(base_url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(
            f"{where}.base_url = {base_url!r}: give the API's base URL, e.g. "
            "https://api.openai.com/v1 or http://127.0.0.1:8000/v1 (from `mogrpo serve`)")
    # never echo the URL from here on: it may hold the key
    if parsed.username or parsed.password:
        raise ConfigError(f"{where}.base_url holds a user name or password (user:pass@host): "
                          + _NO_KEYS)
    secret = sorted(k for k, _ in parse_qsl(parsed.query, keep_blank_values=True)
                    if k.lower() in _SECRET_FIELDS)
    if secret:
        raise ConfigError(f"{where}.base_url has a {secret[0]!r} query parameter: " + _NO_KEYS)
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}.model = {model!r}: give the judge model's name at this provider")
    key_env = spec.get("api_key_env")
    if key_env is not None:
        if not isinstance(key_env, str) or not _ENV_NAME.match(key_env):
            # Never echo the value: it may be the key itself, pasted in the wrong place.
            raise ConfigError(
                f"{where}.api_key_env must be the NAME of an environment variable (like "
                "OPENAI_API_KEY) that holds the key, not the key itself; export the key and "
                "put the variable's name here")
        if not os.environ.get(key_env):
            raise ConfigError(
                f"{where}.api_key_env: environment variable {key_env} is not set (or empty); "
                f"export {key_env}=... before the run, or drop api_key_env for a server without keys")
        if parsed.scheme == "http" and not _is_loopback(parsed.hostname):
            logger.warning("%s: the API key in %s would be sent unencrypted to %s; use https",
                           where, key_env, parsed.hostname)
    headers = spec.get("headers") or {}
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ConfigError(f"{where}.headers must map header names to string values")
    secret = sorted(k for k in headers if k.lower() in _SECRET_HEADERS)
    if secret:
        raise ConfigError(f"{where}.headers.{secret[0]}: " + _NO_KEYS)
    key_header = spec.get("api_key_header", "Authorization")
    extra = spec.get("extra_body") or {}
    if not isinstance(key_header, str) or not key_header or not isinstance(extra, dict):
        raise ConfigError(
            f"{where}: api_key_header must be a header name and extra_body a mapping of "
            "additional request fields (e.g. {max_completion_tokens: 64})")
    secret = sorted(k for k in extra if isinstance(k, str) and k.lower() in _SECRET_FIELDS)
    if secret:
        raise ConfigError(f"{where}.extra_body.{secret[0]}: " + _NO_KEYS)
    name = spec.get("name") or parsed.hostname
    if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name):
        raise ConfigError(f"{where}.name = {name!r}: use letters, digits, '.', '-' or '_'")
    return Provider(name=name, base_url=base_url, model=model, api_key_env=key_env,
                    api_key_header=key_header, headers=dict(headers), extra_body=dict(extra))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _number(options: dict[str, Any], name: str, default: float, where: str, *, low: float,
            strict: bool = False, optional: bool = False) -> float | None:
    value = options.get(name, default)
    if value is None and optional:
        return None  # None: leave the field out of the request (some models refuse it)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ConfigError(f"{where}.{name} = {value!r} must be a number {bound}")
    return float(value)


def _integer(options: dict[str, Any], name: str, default: int | None, where: str, *, low: int = 1,
             optional: bool = False) -> int | None:
    value = options.get(name, default)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{where}.{name} = {value!r} must be an integer >= {low}")
    return value


def _budget(value: Any, where: str) -> Budget:
    if value is None:
        return Budget()
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where} = {value!r}: give {{max_calls: N, max_tokens: N}} (either may be left out)")
    _reject_unknown(value, ("max_calls", "max_tokens"), where)
    return Budget(max_calls=_integer(value, "max_calls", None, where, optional=True),
                  max_tokens=_integer(value, "max_tokens", None, where, optional=True))


def _fallback(value: Any, where: str) -> tuple[str, Any, dict[str, Any]] | None:
    """None, a reward spec string, or {fn: spec, kwargs: {...}}."""
    if value is None:
        return None
    spec, kwargs = (value, {}) if isinstance(value, str) else (
        (value.get("fn"), value.get("kwargs") or {}) if isinstance(value, dict) else (None, {}))
    if not isinstance(spec, str) or not isinstance(kwargs, dict):
        raise ConfigError(
            f"{where} = {value!r:.80}: give a reward spec (a built-in name, package.module:function "
            "or file.py:function), {fn: SPEC, kwargs: {...}}, or null for None")
    if spec.strip() == "judge":
        raise ConfigError(f"{where}: a judge cannot fall back on a judge; give a rule reward")
    try:
        fn = resolve_reward(spec)
    except MogrpoError as err:
        raise ConfigError(f"{where}: {err}") from err
    return reward_label(spec), fn, dict(kwargs)


def _cache(value: Any, cache_dir: Path | None, where: str) -> JudgeCache | None:
    """True → `cache_dir/judge_cache.sqlite` (none without a cache_dir); False → off; a path."""
    if value is False or (value is True and cache_dir is None):
        return None
    if value is True:
        return JudgeCache(Path(cache_dir) / CACHE_FILE)  # type: ignore[arg-type]
    if isinstance(value, str) and value.strip():
        return JudgeCache(Path(value).expanduser())
    raise ConfigError(f"{where} = {value!r}: give true (the run's cache), false, or a file path")
