"""The judge's openai-based client: called from any thread or a forked child, closed cleanly,
sends a provider only what its config names, and asks for the `judge` extra when it is missing."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import sys
import threading
import time

import pytest

from judge_server import FaultServer, judge_options, status
from mogrpo.errors import ConfigError
from mogrpo.rewards.judge import JudgeReward
from mogrpo.rewards.judge.client import _retry_after

WHERE = "tasks.t.rewards.0.kwargs"


def make_judge(*urls: str, **overrides) -> JudgeReward:
    return JudgeReward.from_options(judge_options(*urls, **overrides), where=WHERE, cache_dir=None)


def test_called_from_a_coroutine_whose_loop_is_running():
    # A notebook or an async server calling the synchronous reward: asyncio.run() would refuse.
    async def caller(judge: JudgeReward) -> list[float | None]:
        return judge(["q", "q"], ["a", "b"])

    with FaultServer() as server:
        judge = make_judge(server.url)
        assert asyncio.run(caller(judge)) == [pytest.approx(0.7)] * 2
        assert judge(["q"], ["c"]) == [pytest.approx(0.7)]  # and again from plain code
        judge.close()


def _judge_in_child(judge: JudgeReward, out: multiprocessing.Queue) -> None:
    out.put(judge(["q"], ["from the child"]))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_judges_on_its_own_loop():
    with FaultServer() as server:
        judge = make_judge(server.url)
        assert judge(["q"], ["parent"]) == [pytest.approx(0.7)]  # the parent's loop is running
        context = multiprocessing.get_context("fork")
        out = context.Queue()
        child = context.Process(target=_judge_in_child, args=(judge, out))
        child.start()
        scores = out.get(timeout=60)
        child.join(timeout=30)
        assert scores == [pytest.approx(0.7)] and child.exitcode == 0
        assert judge(["q"], ["parent again"]) == [pytest.approx(0.7)]
        judge.close()


def test_close_ends_a_backoff_wait_and_later_calls_send_nothing():
    with FaultServer(default=status(429, retry_after="20")) as server:
        judge = make_judge(server.url, retries=1)
        scores: list = []
        caller = threading.Thread(target=lambda: scores.extend(judge(["q"], ["a"])))
        start = time.perf_counter()
        caller.start()
        while server.calls == 0 and time.perf_counter() - start < 10:
            time.sleep(0.01)
        judge.close()  # the judge is now waiting out Retry-After: 20
        caller.join(timeout=15)
        assert not caller.is_alive() and time.perf_counter() - start < 10
        assert scores == [None] and server.calls == 1
        assert judge(["q"], ["b"]) == [None] and server.calls == 1


def test_a_provider_gets_no_key_or_ids_it_was_not_configured_with(monkeypatch):
    # openai's client would send these from the environment to any base_url.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-this-provider")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-not-for-this-provider")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-not-for-this-provider")
    monkeypatch.setenv("JUDGE_AZURE_KEY", "azure-key-123")
    with FaultServer() as plain, FaultServer() as azure:
        options = judge_options(plain.url, azure.url)
        options["providers"][1].update(api_key_env="JUDGE_AZURE_KEY", api_key_header="api-key")
        judge = JudgeReward.from_options(options, where=WHERE, cache_dir=None)
        plain.default = status(500)  # so the second provider is asked too
        assert judge(["q"], ["a"]) == [pytest.approx(0.7)]
        judge.close()
        first, second = plain.requests[0]["headers"], azure.requests[0]["headers"]
    for headers in (first, second):
        assert headers.get("Authorization") is None
        assert headers.get("OpenAI-Organization") is None and headers.get("OpenAI-Project") is None
        assert headers.get("User-Agent").startswith("mogrpo/")
    assert second.get("api-key") == "azure-key-123" and first.get("api-key") is None


def test_missing_openai_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` raises ImportError
    with pytest.raises(ConfigError) as err:
        make_judge("http://127.0.0.1:9/v1")
    assert str(err.value).startswith(f"{WHERE}: the judge reward needs the `openai` package")
    assert "pip install 'mogrpo[judge]'" in str(err.value)


def test_retry_after_ms_is_preferred_and_dates_and_junk_are_handled():
    assert _retry_after("7", "1500") == 1.5
    assert _retry_after("7", None) == 7.0
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: no wait
    assert _retry_after("soon", "later") is None and _retry_after(None) is None



def test_a_judge_dropped_without_close_closes_its_connections_and_thread(caplog):
    # Kept-alive connections belong to the judge's loop: they must be closed there, before it
    # stops, not later by the garbage collector on some other loop ("Event loop is closed").
    with FaultServer(keep_alive=True) as server, caplog.at_level(logging.ERROR, logger="asyncio"):
        for step in range(3):
            judge = make_judge(server.url)
            assert judge(["q"] * 2, [f"{step} a", f"{step} b"]) == [pytest.approx(0.7)] * 2
            del judge
            gc.collect()
        deadline = time.perf_counter() + 10
        while any(t.name.startswith("judge-") for t in threading.enumerate()) \
                and time.perf_counter() < deadline:
            time.sleep(0.05)
        gc.collect()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("judge-")]
    assert not caplog.records, caplog.text
