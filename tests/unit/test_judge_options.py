"""Judge options are validated at build time, with the config path, the bad value and the fix."""

from __future__ import annotations

import pytest

from mogrpo.errors import ConfigError, RewardError
from mogrpo.rewards.judge import JudgeReward

WHERE = "tasks.fairness.rewards.1.kwargs"


def options(**overrides):
    base = {
        "providers": [{"base_url": "http://127.0.0.1:9/v1", "model": "judge"}],
        "template": "Q: {prompt}\nA: {completion}\nScore 1-10:",
        "parser": {"kind": "number", "min": 1, "max": 10},
    }
    base.update(overrides)
    return base


def build(**overrides) -> JudgeReward:
    return JudgeReward.from_options(options(**overrides), where=WHERE, cache_dir=None)


def test_defaults():
    judge = build()
    assert judge.max_workers == 8 and judge.client.timeout == 10.0 and judge.client.retries == 1
    assert judge.temperature == 0.0 and judge.fields == ["prompt", "completion"]
    assert judge.providers[0].name == "127.0.0.1" and judge.cache is None
    assert repr(judge) == (f"JudgeReward({WHERE}, providers=[127.0.0.1:judge], parser=number, "
                           "cache=None)")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"template": "Rate {answer}"},
     rf"{WHERE}\.template never shows the judge the completion; include {{completion}}"),
    ({"template": "Rate {completon}"}, r"\({completon} looks like a typo\)"),
    ({"template": 'Reply as {"score": N}: {completion}'},
     r"placeholder {\"score\"} that is not a name; write literal braces as {{ and }}"),
    ({"template": "Rate {} {completion}"}, r"positional placeholder {}; name it"),
    ({"timeout": 0}, rf"{WHERE}\.timeout = 0 must be a number > 0"),
    ({"retries": -1}, rf"{WHERE}\.retries = -1 must be an integer >= 0"),
    ({"max_workers": 0}, rf"{WHERE}\.max_workers = 0 must be an integer >= 1"),
    ({"timout": 5}, rf"{WHERE}\.timout is not a judge option; did you mean 'timeout'\?"),
    ({"providers": []}, rf"{WHERE}\.providers must be a non-empty list"),
    ({"providers": [{"base_url": "api.openai.com", "model": "m"}]},
     rf"{WHERE}\.providers\.0\.base_url = 'api.openai.com': give the API's base URL"),
    ({"providers": [{"base_url": "http://a/v1", "model": "m"}] * 2},
     rf"{WHERE}\.providers\.1\.name = 'a' is used twice"),
    ({"parser": {"kind": "score"}}, rf"{WHERE}\.parser = .*kind one of \['number', 'json', 'labels'\]"),
    ({"parser": {"kind": "number", "min": 5, "max": 1}}, r"min \(5\) and max \(1\) must be numbers, min < max"),
    ({"parser": {"kind": "labels", "map": {"good": 2}}}, r"scores numbers in \[0, 1\]"),
    ({"parser": {"kind": "number", "pattern": "(a)(b)"}}, r"has 2 groups; use one group"),
    ({"budget": {"max_call": 5}}, rf"{WHERE}\.budget\.max_call is not a judge option; did you mean 'max_calls'"),
    ({"fallback": "mc_corect"}, rf"{WHERE}\.fallback: unknown reward 'mc_corect'; did you mean 'mc_correct'"),
    ({"fallback": "judge"}, r"a judge cannot fall back on a judge"),
    ({"cache": 3}, rf"{WHERE}\.cache = 3: give true"),
])
def test_bad_options_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(**overrides)


def test_missing_required_option():
    with pytest.raises(ConfigError, match=rf"{WHERE}\.parser is missing"):
        JudgeReward.from_options({"providers": [], "template": "x"}, where=WHERE, cache_dir=None)


def test_unknown_column_placeholder_is_a_reward_error_at_the_first_call():
    judge = build(template="{completion} vs {reference}")
    with pytest.raises(RewardError) as err:
        judge(["q"], ["a"], correct_answer=["A"], completion_lengths=[3])
    assert str(err.value) == (
        f"{WHERE}.template uses {{reference}} but this task's rows have no column 'reference'; "
        "available placeholders: prompt, completion, completion_lengths, correct_answer. Fix the "
        "template or add the column to the task's data")


def test_template_renders_columns_and_chat_prompts():
    judge = build(template="{prompt} | {completion} | {reference} | {meta[k]}")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]
    assert judge._render(chat, "Anna", {"reference": ["Ben"], "meta": [{"k": 1}]}, 0) == (
        "system: Be brief.\nuser: Who? | Anna | Ben | 1")
    assert judge._render([{"role": "user", "content": "Who?"}], "x",
                         {"reference": [None], "meta": [{"k": 2}]}, 0) == "Who? | x |  | 2"


def test_system_prompt_and_omitted_sampling_fields_shape_the_request():
    judge = build(system="You are a strict grader.", temperature=None, max_tokens=None)
    assert judge._body("R") == {"messages": [
        {"role": "system", "content": "You are a strict grader."}, {"role": "user", "content": "R"}]}
    assert build()._body("R") == {"messages": [{"role": "user", "content": "R"}],
                                  "temperature": 0.0, "max_tokens": 64}


def test_cache_option(tmp_path):
    run = tmp_path / "run"
    judge = JudgeReward.from_options(options(), where=WHERE, cache_dir=run)
    assert judge.cache.path == run / "judge_cache.sqlite"
    assert not run.exists()  # validating a config creates nothing: the file opens at first use
    assert JudgeReward.from_options(options(cache=False), where=WHERE, cache_dir=tmp_path).cache is None
    shared = tmp_path / "shared" / "judge.sqlite"
    assert build(cache=str(shared)).cache.path == shared


def test_empty_call_returns_empty_and_counts_nothing():
    judge = build()
    assert judge([], []) == []
    assert judge.format_stats(3) == (
        "[Judge@3] 0 calls 0.0s p50 0.0s p95 0.0s cache 0/0 providers 127.0.0.1:0 failed 0")
