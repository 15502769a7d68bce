"""An on-disk SQLite cache of judge replies, shared by threads, processes and resumed runs.

Each entry is keyed by a hash of everything that determines the judge's reply (provider URL,
model, template hash, the exact request text, sampling settings) and holds the reply text,
re-parsed on every hit so that a fixed parser reuses old replies, and the score it had when
stored. Nothing secret goes in: API keys and headers are never part of a key or a value.
WAL mode lets several processes read while one writes; every write is its own transaction, so
a crash loses at most the reply being written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from mogrpo.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_FILE = "judge_cache.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS judgements (
    key TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    reply TEXT NOT NULL,
    score REAL,
    tokens INTEGER,
    created REAL NOT NULL
)
"""


def cache_key(
    *, base_url: str, model: str, template_sha256: str, request: str, settings: dict[str, Any]
) -> str:
    """sha256 over everything that decides a judge's reply (never the key or headers)."""
    payload = json.dumps(
        [base_url.rstrip("/"), model, template_sha256, request, settings],
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class JudgeCache:
    """Cached judge replies in one SQLite file; safe to use from several threads and processes.

    The file is opened at first use, so building a judge while validating a config creates
    nothing on disk; a location that can never be written is refused at construction."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        _check_writable(self.path)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._failures = 0

    def _connection(self) -> sqlite3.Connection:
        """The open connection (call with the lock held); raises sqlite3.Error or OSError."""
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One connection guarded by a lock: sqlite3 objects must not be used concurrently.
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s,
                                   check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable across process crashes in WAL mode (only power loss can drop the
            # last commits), and avoids an fsync per reply.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_SCHEMA)
            self._conn = conn
        return self._conn

    def get_many(self, keys: list[str]) -> dict[str, str]:
        """{key: reply} for the keys present; a read error counts as a miss."""
        found: dict[str, str] = {}
        unique = list(dict.fromkeys(keys))
        try:
            with self._lock:
                for start in range(0, len(unique), 500):  # SQLite caps bound parameters
                    chunk = unique[start : start + 500]
                    marks = ",".join("?" * len(chunk))
                    rows = self._connection().execute(
                        f"SELECT key, reply FROM judgements WHERE key IN ({marks})", chunk
                    ).fetchall()
                    found.update(dict(rows))
        except (sqlite3.Error, OSError) as err:
            self._failed("read", err)
        return found

    def put(
        self, key: str, *, provider: str, model: str, reply: str, score: float | None,
        tokens: int | None,
    ) -> None:
        """Store one reply in its own transaction; a write error is logged, never raised."""
        try:
            with self._lock:
                conn = self._connection()
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.execute(
                        "INSERT OR REPLACE INTO judgements VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (key, provider, model, reply, score, tokens, time.time()),
                    )
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as err:
            self._failed("written", err)

    def _failed(self, what: str, err: Exception) -> None:
        # Logged once as a warning: a broken file would otherwise repeat it for every reply.
        self._failures += 1
        level = logging.WARNING if self._failures == 1 else logging.DEBUG
        logger.log(level, "judge cache %s could not be %s (%s); judging goes on without it "
                   "(delete or move the file to start a new cache)", self.path, what, err)

    def __len__(self) -> int:
        with self._lock:
            return int(self._connection().execute("SELECT COUNT(*) FROM judgements").fetchone()[0])

    def close(self) -> None:
        """Close the connection (the file stays for the next run; a later use reopens it)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __repr__(self) -> str:
        return f"JudgeCache({str(self.path)!r})"


def _check_writable(path: Path) -> None:
    """Refuse a cache path whose nearest existing ancestor is not a writable directory."""
    if path.is_dir():
        raise ConfigError(f"the judge cache {path} is a directory; give a file path, e.g. "
                          f"{path / CACHE_FILE}")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot create the judge cache {path}: {ancestor} is not a writable directory; "
            "point the judge's `cache` option at a writable file, or set `cache: false`")
