"""An API key set in the environment reaches the provider and nothing else: not the cache file,
the logs, the stats, the metrics or a repr."""

from __future__ import annotations

import json
import logging

import pytest

from judge_server import FaultServer, echo_auth, judge_options, reply, status
from mogrpo.errors import ConfigError
from mogrpo.rewards.judge import JudgeReward

KEY = "sk-mogrpo-leak-check-5f1c2a9e7b3d"


def test_key_is_sent_but_never_stored_or_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MOGRPO_TEST_JUDGE_KEY", KEY)
    with FaultServer(script=[status(500)], default=echo_auth()) as first, \
            FaultServer(default=reply("9")) as second:
        options = judge_options(first.url, second.url)
        for provider in options["providers"]:
            provider["api_key_env"] = "MOGRPO_TEST_JUDGE_KEY"
        with caplog.at_level(logging.DEBUG):
            judge = JudgeReward.from_options(options, where="tasks.t.rewards.0.kwargs",
                                             cache_dir=tmp_path / "cache")
            assert judge(["q", "q"], ["a", "b"]) == [pytest.approx(0.9)] * 2
            judge(["q"], ["a"])  # from the cache
            lines = [judge.format_stats(1), repr(judge), repr(judge.providers),
                     json.dumps(judge.last_stats()), json.dumps(judge.metrics("judge")),
                     json.dumps(judge.state_dict())]
            judge.close()
        seen = [r["headers"].get("Authorization") for r in first.requests + second.requests]
    assert seen and set(seen) == {f"Bearer {KEY}"}  # the provider did get the key
    assert "Incorrect API key" in caplog.text  # the echoing 401 was logged, scrubbed
    assert KEY not in caplog.text
    assert not any(KEY in line for line in lines)
    files = list((tmp_path / "cache").iterdir())
    assert files and not any(KEY.encode() in f.read_bytes() for f in files)


def test_a_reply_echoing_the_key_is_scrubbed_before_the_log_and_the_cache(tmp_path,
                                                                          monkeypatch, caplog):
    monkeypatch.setenv("MOGRPO_TEST_JUDGE_KEY", KEY)
    with FaultServer(default=echo_auth(200)) as server:
        options = judge_options(server.url)
        options["providers"][0]["api_key_env"] = "MOGRPO_TEST_JUDGE_KEY"
        with caplog.at_level(logging.DEBUG):
            judge = JudgeReward.from_options(options, where="judge", cache_dir=tmp_path / "c")
            assert judge(["q"], ["a"]) == [None]  # "you sent Bearer ***": no score in it
            judge.close()
    assert "unparseable judge reply 1/5 from primary" in caplog.text
    assert "you sent Bearer ***" in caplog.text and KEY not in caplog.text
    files = list((tmp_path / "c").iterdir())
    assert files and not any(KEY.encode() in f.read_bytes() for f in files)


def test_a_key_pasted_as_the_variable_name_is_refused_without_echo():
    options = judge_options("http://127.0.0.1:9/v1")
    options["providers"][0]["api_key_env"] = KEY
    with pytest.raises(ConfigError) as err:
        JudgeReward.from_options(options, where="tasks.t.rewards.0.kwargs", cache_dir=None)
    assert "NAME of an environment variable" in str(err.value) and KEY not in str(err.value)


def test_an_unset_key_variable_fails_before_the_run(monkeypatch):
    monkeypatch.delenv("MOGRPO_TEST_UNSET_KEY", raising=False)
    options = judge_options("https://api.example.com/v1")
    options["providers"][0]["api_key_env"] = "MOGRPO_TEST_UNSET_KEY"
    with pytest.raises(ConfigError, match=r"tasks\.t\.rewards\.0\.kwargs\.providers\.0\.api_key_env"
                       r": environment variable MOGRPO_TEST_UNSET_KEY is not set"):
        JudgeReward.from_options(options, where="tasks.t.rewards.0.kwargs", cache_dir=None)


def test_a_key_in_headers_is_refused():
    options = judge_options("https://api.example.com/v1")
    options["providers"][0]["headers"] = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(ConfigError, match="keys must not be written in configs") as err:
        JudgeReward.from_options(options, where="judge", cache_dir=None)
    assert KEY not in str(err.value)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("base_url", f"https://user:{KEY}@api.example.com/v1", "base_url holds a user name or password"),
    ("base_url", f"https://api.example.com/v1?api-key={KEY}", "base_url has a 'api-key' query"),
    ("extra_body", {"api_key": KEY, "max_tokens": 8}, "extra_body.api_key: keys must not be"),
])
def test_a_key_in_the_url_or_the_body_is_refused_without_echo(field, value, message):
    """They reached config.yaml and every checkpoint's copy of the config."""
    options = judge_options("https://api.example.com/v1")
    options["providers"][0][field] = value
    with pytest.raises(ConfigError) as err:
        JudgeReward.from_options(options, where="judge", cache_dir=None)
    assert message in str(err.value) and "api_key_env" in str(err.value)
    assert KEY not in str(err.value)
