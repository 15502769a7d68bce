"""Each fault a judge endpoint can throw is retried, failed over, or scored None/fallback, and
counted — against real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import pytest

from judge_server import (
    FaultServer,
    drop,
    echo_auth,
    judge_options,
    malformed,
    reply,
    status,
)
from mogrpo.rewards.judge import JudgeReward
from mogrpo.rewards.judge.stats import ERROR_KINDS

WHERE = "tasks.fairness.rewards.0.kwargs"


def make_judge(*urls: str, **overrides) -> JudgeReward:
    return JudgeReward.from_options(judge_options(*urls, **overrides), where=WHERE, cache_dir=None)


@pytest.fixture
def primary():
    with FaultServer() as server:
        yield server


@pytest.fixture
def backup():
    with FaultServer(default=reply("3")) as server:
        yield server


@pytest.mark.parametrize(("fault", "kind"), [
    (status(500), "http_5xx"), (status(503), "http_5xx"), (malformed(), "bad_body"),
    (drop(), "connection"),
])
def test_transient_faults_are_retried_then_scored(primary, fault, kind):
    primary.script.extend([fault])
    judge = make_judge(primary.url)
    assert judge(["q"], ["a"]) == [pytest.approx(0.7)]
    stats = judge.last_stats()
    assert primary.calls == 2
    assert (stats["requests"], stats["retries"], stats["failed"]) == (2, 1, 0)
    assert stats["errors"][kind] == 1 and sum(stats["errors"].values()) == 1
    assert stats["answers"] == {"primary": 1}


def test_a_client_error_is_not_retried(primary, backup):
    primary.script.extend([status(400)])
    judge = make_judge(primary.url, backup.url, retries=3)
    assert judge(["q"], ["a"]) == [pytest.approx(0.3)]
    assert (primary.calls, backup.calls) == (1, 1)
    assert judge.last_stats()["errors"]["http_4xx"] == 1


def test_429_waits_for_retry_after(primary):
    primary.script.extend([status(429, retry_after="1")])
    judge = make_judge(primary.url, backoff=0.0)  # any wait comes from Retry-After alone
    start = time.perf_counter()
    assert judge(["q"], ["a"]) == [pytest.approx(0.7)]
    assert time.perf_counter() - start >= 0.95
    assert primary.calls == 2 and judge.last_stats()["errors"]["http_429"] == 1


def test_429_with_a_long_retry_after_fails_over_at_once(primary, backup):
    primary.script.extend([status(429, retry_after="3600")])
    judge = make_judge(primary.url, backup.url)
    start = time.perf_counter()
    assert judge(["q"], ["a"]) == [pytest.approx(0.3)]
    assert time.perf_counter() - start < 60  # not the hour Retry-After asked for
    stats = judge.last_stats()
    assert (primary.calls, backup.calls) == (1, 1)
    assert stats["failovers"] == 1 and stats["providers"] == {"primary": 1, "backup": 1}


def test_dropped_connection_fails_over_when_retries_are_spent(primary, backup):
    primary.script.extend([drop()])
    judge = make_judge(primary.url, backup.url, retries=0)
    assert judge(["q"], ["a"]) == [pytest.approx(0.3)]
    stats = judge.last_stats()
    assert stats["errors"]["connection"] == 1 and stats["answers"] == {"primary": 0, "backup": 1}
    assert judge.format_stats(4).endswith("cache 0/1 providers primary:1 backup:1 failed 0")


def test_timeout_gives_none_and_is_counted(primary):
    primary.script.extend([reply("9", delay=5.0)])
    judge = make_judge(primary.url, timeout=0.3, retries=0)
    start = time.perf_counter()
    assert judge(["q"], ["a"]) == [None]
    assert time.perf_counter() - start < 4.5  # gave up before the server's 5 s reply
    stats = judge.last_stats()
    assert stats["errors"]["timeout"] == 1 and stats["failed"] == 1 and stats["unparseable"] == 0


def test_unparseable_reply_is_none_not_retried_and_logged_verbatim(primary, caplog):
    long_reply = "I think this answer is quite good overall. " * 10
    primary.by_content = {"bad": deque([reply(long_reply)])}
    judge = make_judge(primary.url)
    with caplog.at_level(logging.WARNING, logger="mogrpo.rewards.judge"):
        scores = judge(["q", "q"], ["bad answer", "good answer"])
    assert scores == [None, pytest.approx(0.7)]
    assert primary.calls == 2  # one request per completion: a readable reply is not asked again
    stats = judge.last_stats()
    assert (stats["failed"], stats["unparseable"], stats["retries"]) == (1, 1, 0)
    logged = [r.getMessage() for r in caplog.records if "unparseable" in r.getMessage()]
    assert len(logged) == 1 and repr(long_reply[:200]) in logged[0]
    assert repr(long_reply[:201]) not in logged[0]


def test_a_reply_with_null_content_is_unparseable_and_logged(primary, caplog):
    # a reasoning model that spent max_tokens thinking answers content: null
    primary.default = reply(None)
    judge = make_judge(primary.url)
    with caplog.at_level(logging.WARNING, logger="mogrpo.rewards.judge"):
        assert judge(["q"], ["a"]) == [None]
    stats = judge.last_stats()
    assert (stats["failed"], stats["unparseable"], primary.calls) == (1, 1, 1)
    assert "unparseable judge reply 1/5 from primary (parser number): ''" in caplog.text


def test_only_the_first_n_unparseable_replies_are_logged(primary, caplog):
    primary.default = reply("no idea")
    judge = make_judge(primary.url, log_unparseable=2)
    with caplog.at_level(logging.WARNING, logger="mogrpo.rewards.judge"):
        assert judge(["q"] * 4, ["a", "b", "c", "d"]) == [None] * 4
    assert sum("unparseable" in r.getMessage() for r in caplog.records) == 2


def test_fallback_scores_what_the_judge_could_not(primary):
    primary.by_content = {"down": deque([status(503), status(503)])}
    judge = make_judge(primary.url, fallback={"fn": "length_penalty",
                                              "kwargs": {"target_length": 1, "max_length": 2}})
    scores = judge(["q", "q"], ["up", "down"], completion_lengths=[1, 1])
    assert scores[0] == pytest.approx(0.7)
    assert scores[1] is not None and not math.isnan(scores[1])
    stats = judge.last_stats()
    assert (stats["failed"], stats["fallback"], stats["errors"]["http_5xx"]) == (1, 1, 2)
    metrics = judge.metrics("task/fairness/judge")
    assert metrics["task/fairness/judge/fallback"] == 1.0
    assert metrics["task/fairness/judge/errors/http_5xx"] == 2.0
    assert metrics["task/fairness/judge/failed_frac"] == 0.5


def test_rejected_key_disables_the_provider_for_the_run(primary, backup, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789abcdef")
    primary.default = echo_auth()
    options = judge_options(primary.url, backup.url)
    options["providers"][0]["api_key_env"] = "JUDGE_TEST_KEY"
    judge = JudgeReward.from_options(options, where=WHERE, cache_dir=None)
    with caplog.at_level(logging.DEBUG, logger="mogrpo"):
        assert judge(["q"], ["a"]) == [pytest.approx(0.3)]
        assert judge(["q"], ["b"]) == [pytest.approx(0.3)]
    assert (primary.calls, backup.calls) == (1, 2)  # not asked again after the 401
    assert "skipped for the rest of the run" in caplog.text
    assert "sk-test-0123456789abcdef" not in caplog.text and "Bearer ***" in caplog.text


def test_budget_caps_requests_and_is_restored_on_resume(primary):
    judge = make_judge(primary.url, budget={"max_calls": 3})
    scores = judge(["q"] * 5, ["a", "b", "c", "d", "e"])
    assert sum(s is not None for s in scores) == 3 and primary.calls == 3
    assert judge.last_stats()["budget_skipped"] == 2
    resumed = make_judge(primary.url, budget={"max_calls": 3})
    resumed.load_state_dict(judge.state_dict())
    assert resumed(["q"], ["f"]) == [None] and primary.calls == 3


def test_metrics_have_every_key_every_step(primary, backup):
    judge = make_judge(primary.url, backup.url)
    judge(["q"], ["a"])
    keys = set(judge.metrics("j"))
    assert {f"j/errors/{kind}" for kind in ERROR_KINDS} <= keys
    assert {"j/provider/primary/requests", "j/provider/backup/requests", "j/calls", "j/failed",
            "j/cache_hits", "j/latency_p50_s", "j/latency_p95_s", "j/wall_s"} <= keys
    judge([], [])
    assert set(judge.metrics("j")) == keys


def test_a_resume_counts_the_replies_got_after_the_checkpoint_as_paid(primary, tmp_path):
    """The stopped run's replies after its checkpoint stay in the cache (paid for, and not
    asked again), but the checkpoint's budget does not hold them: a resumed run charges them
    once, so its budget, its counts and the completions it can still afford equal the
    uninterrupted run's (they were once free cache hits: 4 more calls than the cap paid)."""
    def judge(cache: str) -> JudgeReward:
        return JudgeReward.from_options(judge_options(primary.url, budget={"max_calls": 5}),
                                        where=WHERE, cache_dir=tmp_path / cache)

    counted = ("calls", "cache_hits", "duplicates", "requests", "failed", "budget_skipped",
               "tokens", "providers", "answers")
    steps = [(["q"] * 3, ["a", "b", "a"]), (["q"] * 2, ["c", "d"]), (["q"] * 2, ["e", "f"])]

    whole, seen = judge("whole"), []
    for prompts, completions in steps:
        scores = whole(prompts, completions)
        seen.append((scores, {k: whole.last_stats()[k] for k in counted},
                     whole.budget.state_dict()))

    stopped = judge("cut")
    stopped(*steps[0])
    checkpoint = stopped.state_dict()
    stopped(*steps[1])  # then killed: step 2's replies are in the cache, not in the checkpoint
    stopped.close()
    sent = primary.calls
    resumed = judge("cut")
    resumed.load_state_dict(checkpoint)
    again = []
    for prompts, completions in steps[1:]:
        scores = resumed(prompts, completions)
        again.append((scores, {k: resumed.last_stats()[k] for k in counted},
                      resumed.budget.state_dict()))
    assert again == seen[1:]
    assert seen[2][1]["budget_skipped"] == 1  # the cap bites in step 3, in both runs
    assert primary.calls == sent + 1  # step 2 was not asked again; step 3's one affordable was
