"""The sandbox of the code rewards: what generated code can reach, in each isolation mode."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from mogrpo import sandbox
from mogrpo.config import load_config
from mogrpo.errors import ConfigError, RewardError
from mogrpo.rewards.code import code_tests, run_tests
from mogrpo.sandbox import Isolation, SandboxLimits, resolve_isolation

NAMESPACES = Isolation("namespaces")
LIMITS = Isolation("limits", "forced by the test")
needs_namespaces = pytest.mark.skipif(
    sandbox.probe_isolation().mode != "namespaces",
    reason=f"this machine cannot isolate: {sandbox.probe_isolation().reason}")
BOTH = [pytest.param(NAMESPACES, marks=needs_namespaces, id="namespaces"),
        pytest.param(LIMITS, id="limits")]


def probe(statement: str, isolation: Isolation) -> bool:
    """Whether `statement` (Python, run by generated code) succeeded in the sandbox."""
    code = f"def attempt():\n{statement}\n"
    result = run_tests(code, "attempt()", SandboxLimits(), isolation)
    assert result.status == "ok", result
    return result.passed == 1


@pytest.fixture
def listener():
    """A TCP server on this machine: reachable means the network was not cut."""
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@needs_namespaces
def test_isolated_code_has_no_network_and_sees_none_of_the_users_files(listener, tmp_path):
    secret = tmp_path / "tests_of_the_row.py"
    secret.write_text("assert solve() == 42\n")
    # the home directory's entries, but for the one that holds this Python (bound read-only)
    interpreter = [str(Path(d).resolve()) for d in sandbox.interpreter_dirs()]
    private = [str(p) for p in sorted(Path.home().iterdir())[:50]
               if not any(d == str(p) or d.startswith(f"{p}/") for d in interpreter)]
    assert not probe(f"    __import__('socket').create_connection(('127.0.0.1', {listener}), 2)",
                     NAMESPACES)
    assert not probe(f"    open({str(secret)!r}).read()", NAMESPACES)
    assert probe(f"    assert not any(map(__import__('os').path.exists, {private!r}))",
                 NAMESPACES)
    assert probe(f"    assert not __import__('os').path.exists({str(Path.home() / '.ssh')!r})",
                 NAMESPACES)
    assert not probe(f"    __import__('os').listdir({os.getcwd()!r})", NAMESPACES)  # the run dir
    assert not probe(f"    open({str(tmp_path / 'planted.txt')!r}, 'w').write('x')", NAMESPACES)
    assert not (tmp_path / "planted.txt").exists()
    assert not probe("    open('/usr/planted.txt', 'w').write('x')", NAMESPACES)  # read-only
    assert probe("    assert __import__('os').getcwd() == '/sandbox'\n"
                 "    open('mine.txt', 'w').write('x')", NAMESPACES)  # its own dir is writable


def test_the_weaker_mode_is_what_it_says(listener, tmp_path):
    """`limits` keeps the limits and the clean environment, not the namespaces: the network and
    the user's files stay reachable, which is why it is announced and can be refused."""
    assert probe(f"    __import__('socket').create_connection(('127.0.0.1', {listener}), 2)",
                 LIMITS)
    assert probe("    assert not any(k.endswith('KEY') for k in __import__('os').environ)", LIMITS)
    assert probe("    assert open('/proc/self/status').read().count('NoNewPrivs:\\t1')", LIMITS)


@pytest.mark.parametrize("isolation", BOTH)
def test_sleeping_forever_is_cut_at_the_timeout(isolation):
    start = time.monotonic()
    result = run_tests("import time\ntime.sleep(10 ** 6)\n", "assert True",
                       SandboxLimits(timeout=1.0), isolation)
    assert (result.passed, result.status) == (0, "timeout")
    assert time.monotonic() - start < 4


def _processes_with(token: str) -> int:
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found += token in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            pass
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("isolation", BOTH)
def test_forking_without_end_scores_zero_and_leaves_nothing_behind(isolation):
    token = f"{os.getpid()}.{int(time.time() * 1000) % 10 ** 6}"  # sleep's argument, unique
    bomb = ("import os\n"
            "while True:\n"
            "    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{token}'])\n")
    result = run_tests(bomb, "assert True", SandboxLimits(timeout=1.0), isolation)
    assert result.passed == 0 and result.status in ("timeout", "error:BlockingIOError")
    deadline = time.monotonic() + 5
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(token) == 0


@pytest.mark.parametrize("isolation", BOTH)
def test_huge_output_is_bounded_by_the_file_size_limit(isolation):
    start = time.monotonic()
    spam = "while True:\n    print('x' * 4096)\n"
    result = run_tests(spam, "assert True", SandboxLimits(timeout=5.0, file_size_mb=1), isolation)
    assert (result.passed, result.status) == (0, "crashed")  # SIGXFSZ, long before the timeout
    assert time.monotonic() - start < 4


def test_without_prlimit_the_python_launcher_sets_the_same_limits(monkeypatch):
    real = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which",
                        lambda name: None if name in ("prlimit", "setpriv") else real(name))
    bomb = "x = bytearray(2 * 1024 ** 3)\ndef f():\n    return 1\n"
    assert run_tests(bomb, "assert f() == 1", SandboxLimits(memory_mb=256), LIMITS).status \
        == "error:MemoryError"
    assert probe("    assert open('/proc/self/status').read().count('NoNewPrivs:\\t1')", LIMITS)


def test_required_isolation_refuses_where_namespaces_are_refused(monkeypatch, caplog):
    refused = Isolation("limits", "the kernel refused the namespaces (bwrap: setting up uid "
                                  "map: Permission denied)")
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: refused)
    sandbox._warn_once.cache_clear()
    with pytest.raises(RewardError, match=r"isolation = required.*Permission denied"):
        resolve_isolation("required")
    with caplog.at_level(logging.WARNING, logger="mogrpo.sandbox"):
        assert resolve_isolation("auto") == refused
        assert resolve_isolation("auto") == refused
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "weaker `limits` mode" in said[0] and "Permission denied" in said[0]
    assert resolve_isolation("off").mode == "limits"
    with pytest.raises(RewardError, match="use one of auto, required, off"):
        code_tests([""], ["x = 1"], tests=["assert x == 1"], isolation="strict")


def test_required_isolation_is_a_config_error_before_anything_loads(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "probe_isolation",
                        lambda: Isolation("limits", "bubblewrap (bwrap) is not installed"))
    path = tmp_path / "run.yaml"
    path.write_text("tasks:\n  code:\n    data: d.jsonl\n    rewards: [code_tests]\n"
                    "sandbox: {isolation: required}\n")
    with pytest.raises(ConfigError, match=r"tasks\.code\.rewards\.0: sandbox\.isolation = "
                                          r"required.*bwrap\) is not installed"):
        load_config(path, ["model.name_or_path=any/model"], environ={})
    config, _ = load_config(path, ["model.name_or_path=any/model", "sandbox.isolation=auto"],
                            environ={})
    assert config.sandbox.isolation == "auto"


def test_the_runs_setting_reaches_the_code_rewards_unless_a_reward_sets_its_own():
    from mogrpo.config import RewardConfig, RunConfig
    from mogrpo.tasks.task import _reward

    config = RunConfig(sandbox={"isolation": "off"})
    for fn in ("code_tests", "verilog_tests"):
        assert _reward("t", 0, RewardConfig(fn=fn), config)[2] == {"isolation": "off"}
    own = RewardConfig(fn="code_tests", kwargs={"isolation": "required", "timeout": 2})
    assert _reward("t", 0, own, config)[2] == {"isolation": "required", "timeout": 2}
    assert _reward("t", 0, RewardConfig(fn="format"), config)[2] == {}
