"""The judge cache file: WAL mode, one transaction per reply, shared by many connections at once."""

from __future__ import annotations

import sqlite3
import threading

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


def test_entries_survive_reopening_and_many_writers(tmp_path):
    path = tmp_path / "c.sqlite"
    caches = [JudgeCache(path) for _ in range(4)]  # separate connections, as separate processes

    def write(c: JudgeCache, start: int) -> None:
        for i in range(start, start + 25):
            c.put(key(i), provider="p", model="m", reply=f"reply {i}", score=0.5, tokens=3)

    threads = [threading.Thread(target=write, args=(c, 25 * n)) for n, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for c in caches:
        c.close()
    reopened = JudgeCache(path)
    assert len(reopened) == 100
    assert reopened.get_many([key(7), key(99), key(1000)]) == {key(7): "reply 7", key(99): "reply 99"}
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_unwritable_cache_location_is_a_config_error(tmp_path):
    import pytest

    from mogrpo.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create the judge cache .*file is not a writable directory.*set `cache: false`"):
        JudgeCache(blocker / "sub" / "c.sqlite")
