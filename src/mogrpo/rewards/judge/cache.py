"""An on-disk SQLite cache of judge replies, shared by threads, processes and resumed runs.

Each entry is keyed by a hash of everything that determines the judge's reply (provider URL,
model, template hash, the exact request text, sampling settings) and holds the reply text,
re-parsed on every hit so that a fixed parser reuses old replies, and the score it had when
stored. Nothing secret goes in: API keys and headers are never part of a key or a value.
WAL mode lets several processes read while one writes; every write is its own transaction, so
a crash loses at most the reply being written.

Waiting for other writers: SQLite's busy timeout covers most statements, but not all. Switching
a new file to WAL upgrades a read lock to a write lock, and SQLite answers "database is locked"
at once, without its busy handler, when another connection holds the write lock (for instance
another process setting the same new file up). So first-use setup and every statement here go
through `_retry_locked`, which retries a "locked"/"busy" error with backoff until the busy
timeout has passed since the operation began; only then is a reply dropped, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mogrpo.errors import ConfigError

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
            try:
                mode = self._retry_locked(conn, _set_up)
            except BaseException:
                conn.close()
                raise
            if mode != "wal":  # e.g. a file system without shared memory: still correct, slower
                logger.debug("judge cache %s stays in %s journal mode", self.path, mode)
            self._conn = conn
        return self._conn

    def _retry_locked(
        self, conn: sqlite3.Connection, action: Callable[..., T], *args: Any
    ) -> T:
        """`action(conn, *args)`, retried with backoff on "locked"/"busy" for `busy_timeout_s`.

        Each retry lowers the connection's own busy timeout to the time left, so the whole
        operation, busy-handler waits included, ends within about `busy_timeout_s` (the first
        use of a connection may wait that long twice: once to set the file up, once to write)."""
        deadline = time.monotonic() + self.busy_timeout_s
        delay, retried = 0.002, False
        try:
            while True:
                try:
                    return action(conn, *args)
                except sqlite3.OperationalError as err:
                    left = deadline - time.monotonic()
                    if not _is_locked(err) or left <= 0:
                        raise
                time.sleep(min(delay * random.uniform(0.5, 1.5), left))  # jitter: no lockstep
                delay = min(delay * 2, 0.1)
                retried = True
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                conn.execute(f"PRAGMA busy_timeout = {left_ms}")
        finally:
            if retried:
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")

    def get_many(self, keys: list[str]) -> dict[str, str]:
        """{key: reply} for the keys present; a read error counts as a miss."""
        found: dict[str, str] = {}
        unique = list(dict.fromkeys(keys))
        try:
            with self._lock:
                conn = self._connection()
                for start in range(0, len(unique), 500):  # SQLite caps bound parameters
                    chunk = unique[start : start + 500]
                    marks = ",".join("?" * len(chunk))
                    rows = self._retry_locked(
                        conn, _fetch, f"SELECT key, reply FROM judgements WHERE key IN ({marks})",
                        tuple(chunk))
                    found.update(dict(rows))
        except (sqlite3.Error, OSError) as err:
            self._failed("read", err)
        return found

    def mark(self) -> int | None:
        """The newest row's id: the rows written later have larger ones (0: no row yet; None:
        the file could not be read)."""
        try:
            with self._lock:
                conn = self._connection()
                return int(self._retry_locked(
                    conn, _fetch, "SELECT COALESCE(MAX(rowid), 0) FROM judgements")[0][0])
        except (sqlite3.Error, OSError) as err:
            self._failed("read", err)
            return None

    def written_between(self, keys: list[str], after: int, upto: int) -> dict[str, int]:
        """{key: tokens} of the keys whose row was written after the row `after` and no later
        than the row `upto` (tokens 0 where the reply reported none)."""
        found: dict[str, int] = {}
        unique = list(dict.fromkeys(keys))
        try:
            with self._lock:
                conn = self._connection()
                for start in range(0, len(unique), 500):
                    chunk = unique[start : start + 500]
                    marks = ",".join("?" * len(chunk))
                    rows = self._retry_locked(
                        conn, _fetch, "SELECT key, COALESCE(tokens, 0) FROM judgements WHERE "
                        f"rowid > ? AND rowid <= ? AND key IN ({marks})", (after, upto, *chunk))
                    found.update({key: int(tokens) for key, tokens in rows})
        except (sqlite3.Error, OSError) as err:
            self._failed("read", err)
        return found

    def put(
        self, key: str, *, provider: str, model: str, reply: str, score: float | None,
        tokens: int | None,
    ) -> None:
        """Store one reply in its own transaction; a write error is logged, never raised."""
        try:
            row = (key, provider, model, reply, score, tokens, time.time())
            with self._lock:
                conn = self._connection()
                self._retry_locked(conn, _transaction,
                                   "INSERT OR REPLACE INTO judgements VALUES (?, ?, ?, ?, ?, ?, ?)",
                                   row)
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
            conn = self._connection()
            return int(self._retry_locked(conn, _fetch, "SELECT COUNT(*) FROM judgements")[0][0])

    def close(self) -> None:
        """Close the connection (the file stays for the next run; a later use reopens it)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __repr__(self) -> str:
        return f"JudgeCache({str(self.path)!r})"


def _set_up(conn: sqlite3.Connection) -> str:
    """Put the file in WAL mode and create the table (each step harmless to repeat); returns
    the journal mode the file ends up in."""
    # Reading the mode takes only a read lock; the switch (a lock upgrade that SQLite does not
    # wait for) is needed once per file, by whichever connection comes first.
    mode = _journal_mode(conn)
    if mode != "wal":
        mode = _journal_mode(conn, "WAL")
    # NORMAL is durable across process crashes in WAL mode (only power loss can drop the
    # last commits), and avoids an fsync per reply.
    conn.execute("PRAGMA synchronous=NORMAL")
    _transaction(conn, _SCHEMA)
    return mode


def _journal_mode(conn: sqlite3.Connection, new: str | None = None) -> str:
    """The file's journal mode, after switching it to `new` when given."""
    sql = "PRAGMA journal_mode" if new is None else f"PRAGMA journal_mode={new}"
    return str(conn.execute(sql).fetchone()[0]).lower()


def _fetch(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """All rows of one query."""
    return conn.execute(sql, params).fetchall()


def _transaction(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Run one statement in its own write transaction, taken up front (BEGIN IMMEDIATE) so it
    never needs a lock upgrade; on any error the transaction is rolled back, so a retry (or the
    next reply) starts clean even when COMMIT itself failed."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(sql, params)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _is_locked(err: sqlite3.OperationalError) -> bool:
    """True for SQLITE_BUSY / SQLITE_LOCKED (any extended code), the errors worth waiting out."""
    code = getattr(err, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(err) or "busy" in str(err)


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
