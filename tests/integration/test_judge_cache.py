"""The judge's SQLite cache: repeated and resumed judging pays nothing twice (counted at the server)."""

from __future__ import annotations

import sqlite3

import pytest

from judge_server import FaultServer, judge_options, reply, status
from mogrpo.rewards.judge import JudgeReward
from mogrpo.rewards.judge.cache import CACHE_FILE

PROMPTS = ["Who was late?", "Who was late?", "Who left?", "Who left?"]
ANSWERS = ["Cannot be determined", "Anna", "Ben", "Not stated"]


@pytest.fixture
def server():
    with FaultServer(default=reply("8")) as s:
        yield s


def make_judge(server_urls: list[str], cache_dir, **overrides) -> JudgeReward:
    return JudgeReward.from_options(judge_options(*server_urls, **overrides), where="judge",
                                    cache_dir=cache_dir)


def test_second_identical_call_makes_no_request(server, tmp_path):
    judge = make_judge([server.url], tmp_path)
    first = judge(PROMPTS, ANSWERS)
    assert server.calls == 4
    second = judge(PROMPTS, ANSWERS)
    assert second == first == [pytest.approx(0.8)] * 4
    assert server.calls == 4
    stats = judge.last_stats()
    assert (stats["cache_hits"], stats["requests"]) == (4, 0)
    assert judge.format_stats(2).startswith("[Judge@2] 4 calls ")
    assert "cache 4/4 providers primary:0 failed 0" in judge.format_stats(2)


def test_a_resumed_run_reuses_the_cache_file(server, tmp_path):
    make_judge([server.url], tmp_path)(PROMPTS, ANSWERS)
    resumed = make_judge([server.url], tmp_path)  # a new process would build a new judge
    assert resumed(PROMPTS, ANSWERS) == [pytest.approx(0.8)] * 4
    assert server.calls == 4
    with sqlite3.connect(tmp_path / CACHE_FILE) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT COUNT(*) FROM judgements").fetchone()[0] == 4


def test_repeated_completions_in_one_call_are_asked_once(server):
    judge = make_judge([server.url], None)
    assert judge(["q"] * 4, ["A", "A", "B", "A"]) == [pytest.approx(0.8)] * 4
    assert server.calls == 2
    stats = judge.last_stats()
    assert (stats["duplicates"], stats["cache_hits"]) == (2, 0)
    assert "cache 2/4" in judge.format_stats(1)


def test_key_covers_template_and_settings(server, tmp_path):
    make_judge([server.url], tmp_path)(PROMPTS, ANSWERS)
    make_judge([server.url], tmp_path, template="Rate: {completion}")(PROMPTS, ANSWERS)
    assert server.calls == 4 + 4
    make_judge([server.url], tmp_path, temperature=0.7)(PROMPTS, ANSWERS)
    assert server.calls == 4 + 4 + 4


def test_a_backup_providers_reply_is_found_after_resume(tmp_path):
    with FaultServer(default=status(500)) as down, FaultServer(default=reply("6")) as up:
        judge = make_judge([down.url, up.url], tmp_path, retries=0)
        assert judge(PROMPTS, ANSWERS) == [pytest.approx(0.6)] * 4
        calls = (down.calls, up.calls)
        resumed = make_judge([down.url, up.url], tmp_path, retries=0)
        assert resumed(PROMPTS, ANSWERS) == [pytest.approx(0.6)] * 4
        assert (down.calls, up.calls) == calls == (4, 4)


def test_a_fixed_parser_rescores_cached_replies_for_free(tmp_path):
    with FaultServer(default=reply("Good.")) as server:
        judge = make_judge([server.url], tmp_path)
        assert judge(PROMPTS, ANSWERS) == [None] * 4  # the number parser finds no number
        fixed = make_judge([server.url], tmp_path,
                           parser={"kind": "labels", "map": {"good": 1.0, "bad": 0.0}})
        assert fixed(PROMPTS, ANSWERS) == [1.0] * 4
        assert server.calls == 4


def test_a_corrupt_cache_file_costs_requests_not_the_run(server, tmp_path, caplog):
    (tmp_path / CACHE_FILE).write_bytes(b"this is not a database" * 100)
    judge = make_judge([server.url], tmp_path)
    assert judge(PROMPTS, ANSWERS) == [pytest.approx(0.8)] * 4
    assert server.calls == 4 and "judge cache" in caplog.text
