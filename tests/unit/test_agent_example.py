"""examples/agent_calculator.py: its data is what its generator writes, its rewards score an
episode's text as documented, and its config is the one the benchmark runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"


def _example():
    sys.path.insert(0, str(EXAMPLES))
    sys.path.insert(0, str(EXAMPLES / "agent_calculator"))
    try:
        import agent_calculator
        import tools
    finally:
        sys.path[:2] = []
    return agent_calculator, tools


def test_the_shipped_rows_are_the_generator_s():
    example, _ = _example()
    shipped = [json.loads(line) for line in example.DATA.read_text().splitlines()]
    assert shipped == example.sums()
    assert len(shipped) == 512 and len({r["prompt"][0]["content"] for r in shipped}) == 512
    by_memory = sum(len(r["completion"]) == 1 for r in shipped) / len(shipped)
    assert abs(by_memory - example.FROM_MEMORY) < 0.05


def test_the_rewards_read_the_episode_s_text():
    _, tools = _example()
    assert tools.calculator("(3 + 4) * 5") == "35"
    called = ('<tool_call>{"name": "calculator", "arguments": {"expression": "(3 + 4) * 5"}}'
              "</tool_call>\n<tool_response>35</tool_response>\n35")
    misread = called.replace("\n35", "\n36")
    guessed = "The answer is 35."
    wrong_call = called.replace("<tool_response>35", "<tool_response>34")
    episodes = [[{"role": "assistant", "content": t}]
                for t in (called, misread, guessed, wrong_call)]
    answers = ["35"] * 4
    assert tools.correct(None, episodes, answers) == [1.0, 0.0, 1.0, 1.0]
    assert tools.calculator_call(None, episodes, answers) == [1.0, 1.0, 0.0, 0.0]


def test_the_tokenizer_corpus_is_the_rendered_episodes():
    example, _ = _example()
    rows = example.sums()[:40]
    called = next(r for r in rows if len(r["completion"]) == 3)
    text = example.tokenizer_corpus([called])[0]
    assert text.startswith("<|system|>\nTools: calculator(expression).")
    assert f"<tool_response>{called['answer']}</tool_response>" in text


class _Cyclic:
    """Garbage only the collector frees, whose finalizer runs Python code: the collector may run
    it in a tool's thread in the middle of a parse, which then yields the GIL."""

    def __del__(self) -> None:
        sum(range(50))


def test_the_calculator_answers_every_call_of_a_batch_run_at_once():
    """mogrpo runs a turn's calls on threads at once; CPython's ast.parse is not thread-safe
    (python/cpython#106905), so without the example's lock about one batch in 20 of these had a
    call fail with "SystemError: AST constructor recursion depth mismatch" (a thread switch
    every microsecond and a collection every 50 allocations make it happen within seconds)."""
    import gc

    from mogrpo.rollout.tools import ToolCall, run_tool_calls

    _, tools = _example()
    calls = [({"calculator": tools.calculator},
              ToolCall("calculator", {"expression": f"(({i % 9} + 5) * {i % 7 + 2}) - 3 / 4"}))
             for i in range(64)]
    want = [tools.calculator(call.arguments["expression"]) for _, call in calls]
    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50)
    try:
        for _ in range(200):
            for _ in range(200):
                cycle = _Cyclic()
                cycle.me = cycle
            assert [r.content for r in run_tool_calls(calls, 5.0)] == want
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
