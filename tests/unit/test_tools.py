"""Tools: schemas from signatures and docstrings, calls parsed in the Hermes / Qwen2.5 and
Llama 3.1 forms, and calls run with errors and timeouts given to the model as text."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from mogrpo.errors import ConfigError
from mogrpo.rollout.tools import ToolCall, parse_tool_calls, run_tool_calls, tool_schema
from multiproc import in_forked_child


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * 7".
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - a test's own input


async def lookup(key: str, default: int = 0) -> dict:
    """Look a key up.

    Args:
        key: The key.
        default: Returned when the key is missing.
    """
    await asyncio.sleep(0)
    return {"key": key, "value": default}


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "done"


def test_schema_comes_from_the_signature_and_docstring():
    schema = tool_schema(lookup)
    fn = schema["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Look a key up."
    assert fn["parameters"]["properties"]["key"] == {"type": "string", "description": "The key."}
    assert fn["parameters"]["required"] == ["key"]


def test_a_tool_without_docstring_is_a_config_error_naming_the_fix():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match=r"tasks.calc.tools.0: tool 'bare'.*docstring"):
        tool_schema(bare, "tasks.calc.tools.0")


def test_hermes_calls_are_parsed_one_per_block():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"2+3"}}\n</tool_call>\n<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}'
            '</tool_call><|im_end|>')
    calls = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("lookup", {"key": "a"})]


def test_llama3_json_calls_with_and_without_python_tag():
    assert parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1+1"}}',
                            "llama3") == [ToolCall("calculator", {"expression": "1+1"})]
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert parse_tool_calls(two) == [ToolCall("a", {}), ToolCall("b", {"x": 1})]


def test_an_answer_has_no_calls_and_broken_json_is_an_error_call():
    assert parse_tool_calls("The answer is 5.") == []
    [call] = parse_tool_calls("<tool_call>{\"name\": calculator}</tool_call>")
    assert call.error is not None and "not JSON" in call.error
    with pytest.raises(ConfigError, match="format 'xml'"):
        parse_tool_calls("x", "xml")  # type: ignore[arg-type]


def test_results_errors_and_timeouts_become_messages_for_the_model():
    tools = {"calculator": calculator, "lookup": lookup, "slow": slow}
    calls = [ToolCall("calculator", {"expression": "6*7"}), ToolCall("lookup", {"key": "k"}),
             ToolCall("calculator", {"expression": "1/0"}), ToolCall("nope", {}),
             ToolCall("calculator", {"expr": "1"}), ToolCall("slow", {"seconds": 5.0}),
             ToolCall("", {}, "the tool call is not JSON")]
    start = time.monotonic()
    results = run_tool_calls([(tools, c) for c in calls], timeout_s=0.5)
    assert time.monotonic() - start < 2.0  # the slow call did not hold the batch
    assert [r.content for r in results[:2]] == ["42", '{"key": "k", "value": 0}']
    assert results[2].content == "error: calculator raised ZeroDivisionError: division by zero"
    assert results[3].content == "error: there is no tool 'nope' (tools: calculator, lookup, slow)"
    assert results[4].error and "unexpected keyword argument 'expr'" in results[4].content
    assert results[5].timed_out and results[5].content == "error: slow timed out after 0.5 s"
    assert results[6].content == "error: the tool call is not JSON"
    assert [r.error for r in results] == [False, False, True, True, True, True, True]


def test_an_async_tool_called_with_bad_arguments_gives_the_model_an_error():
    # an async function binds its arguments when called, before any coroutine runs
    tools = {"lookup": lookup, "calculator": calculator}
    for parallel in (True, False):
        bad, good = run_tool_calls([(tools, ToolCall("lookup", {"name": "k"})),
                                    (tools, ToolCall("calculator", {"expression": "2*3"}))],
                                   timeout_s=1.0, parallel=parallel)
        assert bad.error and not bad.timed_out
        assert bad.content == ("error: lookup raised TypeError: lookup() got an unexpected "
                               "keyword argument 'name'")
        assert good.content == "6"


def test_a_timeout_the_tool_raises_itself_is_its_error_not_a_timeout_of_the_call():
    def fetch(url: str) -> str:
        raise TimeoutError(f"connect to {url} timed out")  # socket.timeout is TimeoutError

    async def afetch(url: str) -> str:
        raise TimeoutError("read timed out")

    tools = {"fetch": fetch, "afetch": afetch}
    results = run_tool_calls([(tools, ToolCall("fetch", {"url": "x"})),
                              (tools, ToolCall("afetch", {"url": "x"}))], timeout_s=10)
    assert [r.content for r in results] == [
        "error: fetch raised TimeoutError: connect to x timed out",
        "error: afetch raised TimeoutError: read timed out"]
    assert [(r.error, r.timed_out) for r in results] == [(True, False)] * 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_async_tools_run_in_a_forked_child():
    # the child inherits the parent's tool loop but not the thread that runs it
    call = [({"lookup": lookup}, ToolCall("lookup", {"key": "k"}))]
    assert run_tool_calls(call, timeout_s=5)[0].content == '{"key": "k", "value": 0}'
    answer = in_forked_child(lambda: run_tool_calls(call, timeout_s=2)[0].content)
    assert answer == '{"key": "k", "value": 0}'


def test_calls_of_a_batch_run_concurrently():
    tools = {"slow": slow}
    start = time.monotonic()
    results = run_tool_calls([(tools, ToolCall("slow", {"seconds": 0.3}))] * 8, timeout_s=5)
    assert [r.content for r in results] == ["done"] * 8
    assert time.monotonic() - start < 1.5


async def slow_async(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(seconds)
    return "awaited"


def test_serial_calls_run_one_at_a_time_each_with_its_own_timeout():
    """`tool_concurrency: serial`: sync tools one after another (a tool that is not thread-safe
    never runs beside itself), each within the timeout of its own start; async ones together."""
    active, most, lock = [0], [0], threading.Lock()

    def exclusive(seconds: float) -> str:
        """Count the calls running beside this one.

        Args:
            seconds: How long to run.
        """
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(seconds)
        with lock:
            active[0] -= 1
        return "alone"

    tools = {"exclusive": exclusive, "slow_async": slow_async}
    calls = [ToolCall("exclusive", {"seconds": 0.2})] * 4 + [ToolCall("slow_async",
                                                                      {"seconds": 0.3})] * 4
    start = time.monotonic()
    results = run_tool_calls([(tools, c) for c in calls], timeout_s=0.5, parallel=False)
    # 4 × 0.2 s of sync calls outlast one 0.5 s round, but each had 0.5 s of its own
    assert [r.content for r in results] == ["alone"] * 4 + ["awaited"] * 4
    assert most[0] == 1 and time.monotonic() - start >= 0.8
    most[0] = 0
    assert [r.content for r in run_tool_calls([(tools, c) for c in calls[:4]], 5)] \
        == ["alone"] * 4
    assert most[0] > 1  # parallel, the default: at once
    late, after = run_tool_calls([({"slow": slow}, ToolCall("slow", {"seconds": 5.0})),
                                  ({"slow": slow}, ToolCall("slow", {"seconds": 0.05}))],
                                 timeout_s=0.2, parallel=False)
    assert late.timed_out and late.content == "error: slow timed out after 0.2 s"
    assert after.content == "done"  # the next call still ran, with its own 0.2 s


def test_async_and_sync_calls_of_a_batch_run_together_each_with_its_timeout():
    tools = {"slow": slow, "slow_async": slow_async}
    calls = [ToolCall("slow_async", {"seconds": 0.3})] * 6 + [ToolCall("slow", {"seconds": 0.3})] * 2
    start = time.monotonic()
    results = run_tool_calls([(tools, c) for c in calls], timeout_s=5)
    assert [r.content for r in results] == ["awaited"] * 6 + ["done"] * 2
    assert time.monotonic() - start < 1.5  # 8 × 0.3 s one after another would be 2.4 s
    (late,) = run_tool_calls([(tools, ToolCall("slow_async", {"seconds": 5.0}))], timeout_s=0.2)
    assert late.timed_out and late.content == "error: slow_async timed out after 0.2 s"


def test_a_sync_tool_that_outlives_its_timeout_ends_quietly(monkeypatch):
    # its thread finishes after the batch gave up on it: nothing may raise in that thread
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    (result,) = run_tool_calls([({"slow": slow}, ToolCall("slow", {"seconds": 0.3}))], 0.05)
    assert result.timed_out
    for thread in [t for t in threading.enumerate() if t.name == "mogrpo-tool-slow"]:
        thread.join(5)
    assert raised == []


class Job:
    """An environment whose async tool starts a job that its async get_reward awaits."""

    def reset(self, **row) -> None:
        return None

    async def start(self, seconds: float) -> str:
        """Start the job.

        Args:
            seconds: How long it runs.
        """
        self.job = asyncio.get_running_loop().create_task(asyncio.sleep(seconds, result=1.0))
        return "started"

    async def get_reward(self) -> float:
        return await self.job


def test_async_get_rewards_await_what_async_tools_started_all_at_once():
    from mogrpo.tasks.agents import EnvironmentReward

    envs = [Job() for _ in range(6)]
    started = run_tool_calls([({"start": e.start}, ToolCall("start", {"seconds": 0.4}))
                              for e in envs], timeout_s=5)
    assert [r.content for r in started] == ["started"] * 6
    begin = time.monotonic()
    # the jobs live on the tools' loop; the rows of another environment are not scored
    scores = EnvironmentReward(Job)([None] * 7, [""] * 7, environments=[*envs, None])
    assert scores == [1.0] * 6 + [None]
    assert time.monotonic() - begin < 1.2  # together: one job's time, not six


class Sized:
    def __init__(self, size: int):
        self.size = size

    def reset(self, **row) -> None:
        return None


class NeedsBoard:
    def reset(self, **row) -> str:
        return row["board"]


def test_an_environment_that_cannot_be_made_or_reset_is_named_with_its_row():
    from mogrpo.config import TaskConfig
    from mogrpo.data.schema import Example
    from mogrpo.errors import RewardError
    from mogrpo.tasks.agents import Agent, start_episodes

    def task(env: str) -> TaskConfig:
        return TaskConfig.model_validate({"data": "rows.jsonl", "rewards": ["format"],
                                          "environment": f"{__file__}:{env}"})

    with pytest.raises(ConfigError) as err:  # before any model loads
        Agent.from_config("maze", task("Sized"))
    assert str(err.value).startswith(
        "tasks.maze.environment: Sized() raised TypeError: Sized.__init__() missing 1 required "
        "positional argument: 'size'; an environment class is made with no arguments")
    agent = Agent.from_config("maze", task("NeedsBoard"))
    with pytest.raises(RewardError) as err:  # mid-run: whose code, which row
        start_episodes(agent, [Example("Solve it.", {}, "mazes.jsonl:7")])
    assert str(err.value).startswith("task maze: NeedsBoard.reset() raised KeyError: 'board' "
                                     "on row mazes.jsonl:7 (at ")
    assert "test_tools.py:" in str(err.value)


def test_an_async_reward_function_awaits_what_an_async_tool_started():
    from mogrpo.rewards.base import score

    async def finished(completions, environments, **kwargs):  # a TRL-style reward of the task
        return [await env.job for env in environments]

    envs = [Job() for _ in range(3)]
    run_tool_calls([({"start": e.start}, ToolCall("start", {"seconds": 0.2})) for e in envs],
                   timeout_s=5)
    got = score([("finished", finished, {})], ["p"] * 3, ["a"] * 3, {"environments": envs})
    assert got[:, 0].tolist() == [1.0] * 3


class Counter:
    """An environment whose class shares its name with a reward of the task."""

    def reset(self, **row) -> None:
        return None

    def get_reward(self) -> float:
        return 1.0


def test_an_environment_reward_named_like_a_reward_of_the_task_is_refused(tmp_path):
    from mogrpo.config import load_config
    from mogrpo.tasks.task import load_tasks

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def Counter(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    config, _ = load_config(None, [], environ={}, base={
        "model": {"name_or_path": "unused"}, "output": {"dir": str(tmp_path / "run")},
        "tasks": {"t": {"data": "builtin:bias_probe?size=8", "rewards": [f"{rewards}:Counter"],
                        "environment": f"{__file__}:Counter"}}})
    with pytest.raises(ConfigError) as err:
        load_tasks(config)
    assert str(err.value) == (
        "tasks.t.environment (its class's get_reward): objective 'Counter' has the name of "
        "tasks.t.rewards.0; each objective needs its own (metrics, the completions log and a "
        "judge's budget are kept by name): set `name` on the reward, or rename a class")
