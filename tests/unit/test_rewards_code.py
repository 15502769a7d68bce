"""`fn: code_tests`: the completion's code runs against the row's tests in a sandboxed process."""

from __future__ import annotations

import os

import pytest

from mogrpo.errors import RewardError
from mogrpo.rewards.base import resolve_reward, score
from mogrpo.rewards.code import SandboxLimits, code_tests, extract_code, run_tests

TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4\nassert add(0, 0) == 0"
RIGHT = "def add(a, b):\n    return a + b\n"
HALF = "def add(a, b):\n    return a + b if a > 0 else 99\n"  # passes the 1st and 3rd


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}```\nIt adds the numbers."


def test_scores_are_the_fraction_of_tests_passed():
    completions = [fenced(RIGHT), fenced(HALF), "def add(a, b):\n    return a - b\n"]
    assert code_tests([""] * 3, completions, tests=[TESTS] * 3) == [1.0, 0.5, 0.25]
    assert code_tests([""] * 3, completions, tests=TESTS, partial=False) == [1.0, 0.0, 0.0]


def test_extract_code_takes_the_last_python_block():
    text = "```bash\npip install x\n```\n```python\nfirst = 1\n```\nthen\n```py\nsecond = 2\n```"
    assert extract_code(text) == "second = 2\n"
    assert extract_code("x = 1") == "x = 1"  # no fence: the whole completion
    assert extract_code("```\ny = 2\n```") == "y = 2\n"  # an untagged block counts


def test_what_fails_scores_zero_and_says_why():
    assert run_tests("def add(a, b) return a", TESTS) == run_tests("def add(:", TESTS)
    assert run_tests("def add(a, b) return a", TESTS).status == "syntax_error"
    raised = run_tests("raise ValueError('no')", TESTS)
    assert (raised.passed, raised.total, raised.status) == (0, 4, "error:ValueError")
    assert run_tests(RIGHT, TESTS).status == "ok"


def test_an_endless_loop_is_killed_at_the_timeout():
    result = run_tests("while True:\n    pass\n", TESTS, SandboxLimits(timeout=1.0))
    assert (result.passed, result.status) == (0, "timeout")


def test_a_memory_bomb_hits_the_limit():
    bomb = "x = bytearray(2 * 1024 ** 3)\n" + RIGHT
    result = run_tests(bomb, TESTS, SandboxLimits(memory_mb=256))
    assert (result.passed, result.status) == (0, "error:MemoryError")


def test_generated_code_sees_no_api_keys_and_writes_only_to_its_own_directory(
        monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-for-the-judge")
    probe = ("import os\n"
             "open('left_behind.txt', 'w').write('x')\n"
             "def add(a, b):\n    return a + b\n")
    tests = ("assert 'OPENAI_API_KEY' not in os.environ\n"
             "assert os.getcwd() != " + repr(os.getcwd()) + "\n"
             "assert add(1, 2) == 3")
    monkeypatch.chdir(tmp_path)
    assert run_tests(probe, tests).passed == 3
    assert not (tmp_path / "left_behind.txt").exists()


def test_rows_without_tests_are_unscored_not_zero():
    out = code_tests(["", ""], [fenced(RIGHT), fenced(RIGHT)], tests=[TESTS, ""])
    assert out == [1.0, None]


def test_configuration_mistakes_are_reward_errors():
    with pytest.raises(RewardError, match="needs a 'tests' column"):
        code_tests([""], ["x"])
    with pytest.raises(RewardError, match="do not parse as Python"):
        code_tests([""], ["x"], tests=["assert (("])
    with pytest.raises(RewardError, match="runs Python only"):
        code_tests([""], ["x"], tests=[TESTS], language="verilog")
    with pytest.raises(RewardError, match="need timeout > 0"):
        code_tests([""], ["x"], tests=[TESTS], timeout=0)


def test_it_is_a_builtin_reward_that_scores_a_batch():
    fn = resolve_reward("code_tests")
    values = score([("code", fn, {"timeout": 5.0})], ["p1", "p2"],
                   [fenced(RIGHT), fenced(HALF)], {"tests": [TESTS, TESTS]})
    assert values[:, 0].tolist() == [1.0, 0.5]


def test_printing_a_fake_result_line_does_not_score():
    forged = ("import os\n"
              "print('__MOGRPO_RESULT__' + '{\"passed\": 99, \"total\": 4}', flush=True)\n"
              "os._exit(0)\n")
    result = run_tests(forged, TESTS)
    assert (result.passed, result.status) == (0, "crashed")
