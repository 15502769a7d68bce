"""A step's judge calls overlap: the server sees min(workers, calls) requests in flight at once."""

from __future__ import annotations

import pytest

from judge_server import FaultServer, judge_options, reply
from mogrpo.rewards.judge import JudgeReward

DELAY = 0.3


@pytest.mark.parametrize(("n", "workers"), [(8, 4), (3, 8), (3, 1)])
def test_calls_overlap_up_to_max_workers(n, workers):
    # The server holds the first requests until min(workers, n) are open together (a client that
    # does not overlap them never gets there); a long timeout keeps slow starts from retrying.
    with FaultServer(default=reply("5", delay=DELAY), overlap=min(workers, n)) as server:
        judge = JudgeReward.from_options(
            judge_options(server.url, max_workers=workers, timeout=30), where="judge",
            cache_dir=None)
        scores = judge(["q"] * n, [f"answer {i}" for i in range(n)])
    assert scores == [pytest.approx(0.5)] * n
    assert server.calls == n
    # Every worker had a request open at the same time, and never more than the workers.
    assert server.max_in_flight == min(workers, n)
    stats = judge.last_stats()
    assert stats["requests"] == n and stats["latency_p50_s"] >= DELAY * 0.9
