"""The judge cache file: WAL mode, one transaction per reply, shared by many connections at once."""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3
import threading
import time

import pytest

from mogrpo.rewards.judge.cache import JudgeCache, cache_key


def key(i: int, **changes) -> str:
    fields = {"base_url": "http://h/v1", "model": "m", "template_sha256": "t", "request": f"r{i}",
              "settings": {"temperature": 0.0}}
    fields.update(changes)
    return cache_key(**fields)


def test_key_depends_on_every_part_but_not_a_trailing_slash():
    assert key(0) == key(0, base_url="http://h/v1/")
    variants = [key(1), key(0, model="n"), key(0, template_sha256="u"),
                key(0, settings={"temperature": 0.5}), key(0, base_url="http://other/v1")]
    assert len({key(0), *variants}) == 6


def _write_together(path, start: int, connections: int, per: int, barrier) -> None:
    """`connections` caches on one file, in threads released by `barrier` (shared with the other
    processes), each putting `per` replies: every first use of the new file races the others."""
    caches = [JudgeCache(path) for _ in range(connections)]

    def write(c: JudgeCache, first: int) -> None:
        barrier.wait(timeout=60)
        for i in range(first, first + per):
            c.put(key(i), provider="p", model="m", reply=f"reply {i}", score=0.5, tokens=3)

    threads = [threading.Thread(target=write, args=(c, start + per * n))
               for n, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for c in caches:
        c.close()


def _many_writers(path, processes: int, connections: int, per: int) -> None:
    """`processes` forked processes (this one among them) × `connections` caches each."""
    ctx = multiprocessing.get_context("fork")  # the children only use sqlite3, never torch
    barrier = ctx.Barrier(processes * connections)
    share = connections * per
    children = [ctx.Process(target=_write_together, args=(path, share * n, connections, per, barrier))
                for n in range(1, processes)]
    for child in children:
        child.start()
    _write_together(path, 0, connections, per, barrier)
    for child in children:
        child.join(timeout=120)
        assert child.exitcode == 0


def test_entries_survive_reopening_and_many_writers(tmp_path, caplog):
    path = tmp_path / "c.sqlite"
    _many_writers(path, processes=3, connections=4, per=10)
    reopened = JudgeCache(path)
    assert len(reopened) == 120
    assert reopened.get_many([key(7), key(119), key(1000)]) == {key(7): "reply 7", key(119): "reply 119"}
    assert "could not be" not in caplog.text
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_first_use_waits_while_another_process_sets_the_new_file_up(tmp_path, caplog):
    # Switching a new file to WAL is a lock upgrade, which SQLite refuses at once ("database is
    # locked", no busy wait) while another connection holds the write lock: the reply was lost.
    path = tmp_path / "c.sqlite"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, other.execute, args=("COMMIT",)).start()
    cache = JudgeCache(path, busy_timeout_s=30)
    cache.put(key(1), provider="p", model="m", reply="reply 1", score=1.0, tokens=2)
    assert cache.get_many([key(1)]) == {key(1): "reply 1"}
    assert "could not be" not in caplog.text
    cache.close()
    other.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("new_file", [True, False], ids=["new-file", "wal-file"])
def test_a_write_waits_at_most_the_busy_timeout_then_warns(tmp_path, caplog, new_file):
    path = tmp_path / "c.sqlite"
    if not new_file:
        JudgeCache(path).put(key(0), provider="p", model="m", reply="r", score=None, tokens=None)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # held for the whole test: the write can never happen
    cache = JudgeCache(path, busy_timeout_s=0.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mogrpo.rewards.judge_cache"):
        cache.put(key(1), provider="p", model="m", reply="reply 1", score=1.0, tokens=2)
    waited = time.monotonic() - started
    assert 0.45 <= waited < 10  # it waited for the lock, and gave up (generous: a loaded machine)
    assert "could not be written (database is locked); judging goes on without it" in caplog.text
    other.execute("ROLLBACK")
    other.close()
    assert key(1) not in cache.get_many([key(1)])
    cache.close()


@pytest.mark.slow
def test_no_entry_is_lost_by_many_processes_and_threads_opening_new_files(tmp_path, caplog):
    # Before the WAL switch waited, about 1 trial in 40 lost entries (up to 10 of 80).
    for trial in range(100):
        path = tmp_path / f"c{trial}.sqlite"
        _many_writers(path, processes=8, connections=2, per=5)
        assert len(JudgeCache(path)) == 80, f"trial {trial} lost entries"
    assert "could not be" not in caplog.text


def test_unwritable_cache_location_is_a_config_error(tmp_path):
    from mogrpo.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create the judge cache .*file is not a writable directory.*set `cache: false`"):
        JudgeCache(blocker / "sub" / "c.sqlite")
