"""`fn: verilog_tests`: the completion's Verilog, compiled with the row's testbench and simulated."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from mogrpo import sandbox
from mogrpo.config import load_config
from mogrpo.data.check import check_file, check_references
from mogrpo.errors import ConfigError, RewardError
from mogrpo.rewards import verilog
from mogrpo.rewards.base import check_reward_call, resolve_reward
from mogrpo.rewards.verilog import (
    SimResult,
    extract_verilog,
    forbidden_construct,
    score_result,
    simulate,
    verilog_tests,
)
from mogrpo.sandbox import Isolation, SandboxLimits

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "verilog"
ROWS = [json.loads(line) for line in (EXAMPLES / "problems.jsonl").read_text().splitlines()]
MUX = next(r for r in ROWS if r["top_module"] == "mux2")
needs_iverilog = pytest.mark.skipif(
    shutil.which("iverilog") is None or shutil.which("vvp") is None,
    reason="Icarus Verilog is not installed (apt-get install iverilog; .ci/run installs it)")
LIMITS = Isolation("limits", "forced by the test")
ISOLATIONS = [
    pytest.param(Isolation("namespaces"), id="namespaces", marks=pytest.mark.skipif(
        sandbox.probe_isolation().mode != "namespaces", reason="this machine cannot isolate")),
    pytest.param(LIMITS, id="limits")]


def mux(body: str) -> str:
    return f"module mux2(input a, input b, input s, output y);\n{body}\nendmodule\n"


def fenced(code: str, tag: str = "verilog") -> str:
    return f"Here is the module.\n```{tag}\n{code}```\nDone."


def run(design: str, timeout: float = 5.0) -> SimResult:
    return simulate(design, MUX["testbench"], SandboxLimits(timeout=timeout), LIMITS, "mux2")


@needs_iverilog
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_every_example_reference_scores_one(isolation):
    scores = verilog_tests([r["prompt"] for r in ROWS], [fenced(r["reference"]) for r in ROWS],
                           testbench=[r["testbench"] for r in ROWS],
                           top_module=[r["top_module"] for r in ROWS],
                           isolation="off" if isolation.mode == "limits" else "required")
    assert scores == [1.0] * len(ROWS)


@needs_iverilog
def test_wrong_logic_scores_the_fraction_of_checks_passed():
    wrong = mux("  assign y = a;")  # right whenever s = 0 or a = b: 6 of 8 cases
    assert run(wrong) == SimResult(6, 8, True, "ok")
    scores = verilog_tests([""] * 2, [fenced(wrong), fenced(MUX["reference"])],
                           testbench=MUX["testbench"], isolation="off")
    assert scores == [0.75, 1.0]
    assert verilog_tests([""], [wrong], testbench=MUX["testbench"], partial=False,
                         isolation="off") == [0.0]
    assert verilog_tests([""], [wrong], testbench=MUX["testbench"], compile_bonus=0.2,
                         isolation="off") == [pytest.approx(0.2 + 0.8 * 0.75)]


@needs_iverilog
def test_code_that_does_not_compile_scores_zero_even_with_a_compile_bonus():
    broken = mux("  assign y = s ? b : a")  # no semicolon
    assert run(broken) == SimResult(0, 0, False, "compile_error")
    assert verilog_tests([""], [broken], testbench=MUX["testbench"], compile_bonus=0.1,
                         isolation="off") == [0.0]
    assert run("module other(input a); endmodule") == SimResult(0, 0, False, "missing_module")


@needs_iverilog
def test_an_endless_simulation_is_cut_at_the_timeout_and_keeps_only_the_bonus():
    endless = mux("  assign y = s ? b : a;\n  reg t = 0;\n  initial forever t = ~t;")  # time stops
    start = time.monotonic()
    assert run(endless, timeout=1.0) == SimResult(0, 0, True, "timeout")
    assert time.monotonic() - start < 4
    assert score_result(SimResult(0, 0, True, "timeout"), compile_bonus=0.1) == 0.1


@needs_iverilog
def test_a_forged_result_line_is_not_believed():
    printed = mux('  assign y = a;\n  initial $display("__MOGRPO_RESULT__ 8 8");\n'
                  '  initial $display("__MOGRPO_RESULT__00000000000000000000000000000000 8 8");')
    assert run(printed) == SimResult(6, 8, True, "ok")
    # the macro is defined in the testbench, after the completion: not visible to it
    assert run(mux("  assign y = a;\n  initial `MOGRPO_RESULT(8, 8);")).status == "compile_error"
    early = mux("  assign y = a;\n  initial $finish;")  # ends before the testbench reports
    assert run(early) == SimResult(0, 0, True, "no_result")


@needs_iverilog
def test_huge_output_is_cut_and_scores_no_check():
    start = time.monotonic()
    spam = mux('  assign y = s ? b : a;\n  initial forever #1 $display("%0200d", 0);')
    result = simulate(spam, MUX["testbench"], SandboxLimits(timeout=3.0, file_size_mb=1), LIMITS)
    assert result.status in ("no_result", "ok")  # the testbench may finish first: then it counts
    assert result.status == "no_result" or result.passed == 8
    flood = mux('  assign y = s ? b : a;\n  initial forever $display("%0200d", 0);')  # time 0
    assert simulate(flood, MUX["testbench"], SandboxLimits(timeout=3.0, file_size_mb=1),
                    LIMITS) == SimResult(0, 0, True, "no_result")
    assert time.monotonic() - start < 8


@pytest.mark.parametrize("snippet, what", [
    ('initial $system("cat /etc/passwd");', "$system"),
    ('integer f; initial f = $fopen("/tmp/x", "w");', "file access"),
    ('initial $readmemh("tests.hex", mem);', "file access"),
    ('initial $dumpfile("big.vcd");', "dump"),
    ('reg [8*40:1] s; initial if ($value$plusargs("nonce=%s", s)) ;', "plusargs"),
    ("initial tb.passed = 8;", "hierarchical name"),
    ("initial $root.tb.total = 1;", "$root"),
    ('`include "testbench.v"', "`include"),
    ("defparam tb.N = 1;", "hierarchical name"),
])
def test_what_could_reach_around_the_testbench_is_forbidden(snippet, what):
    design = mux("  assign y = s ? b : a;\n  " + snippet)
    assert forbidden_construct(design) == what
    assert simulate(design, MUX["testbench"], isolation=LIMITS) == \
        SimResult(0, 0, False, f"forbidden:{what}")


def test_ordinary_verilog_is_not_forbidden():
    ordinary = ("// $system and tb.x in a comment\n"
                "module top(input [3:0] a, output y);\n"
                '  initial $display("tb.passed %d", 1.5);  /* $fopen */\n'
                "  sub u1 (.a(a[0]), .y(y));\n  sub u2(.*);\n  real r = 2.5e3;\nendmodule\n")
    assert forbidden_construct(ordinary) is None


def test_extract_takes_the_last_verilog_block():
    text = ("```python\nx = 1\n```\n```verilog\nmodule a; endmodule\n```\n"
            "```systemverilog\nmodule b; endmodule\n```\n```text\nnot code\n```")
    assert extract_verilog(text) == "module b; endmodule\n"
    assert extract_verilog("module c; endmodule") == "module c; endmodule"


@needs_iverilog
def test_rows_without_a_testbench_are_unscored():
    assert verilog_tests(["", ""], [MUX["reference"]] * 2, testbench=[MUX["testbench"], ""],
                         isolation="off") == [1.0, None]


def test_configuration_mistakes_are_named(monkeypatch, tmp_path):
    with pytest.raises(RewardError, match=r"compile_bonus 1\.5 must be in \[0, 1\)"):
        verilog_tests([""], ["x"], testbench="tb", compile_bonus=1.5)
    with pytest.raises(RewardError, match="testbench"):
        check_reward_call("verilog", resolve_reward("verilog_tests"), {}, ["prompt"], where="t")
    monkeypatch.setattr(verilog.shutil, "which", lambda name: None)
    with pytest.raises(RewardError, match="apt-get install iverilog"):
        verilog_tests([""], ["x"], testbench="tb")
    with pytest.raises(ConfigError, match=r"tasks\.verilog\.rewards\.0: verilog_tests needs "
                                          r"Icarus Verilog.*apt-get install iverilog"):
        load_config(EXAMPLES / "verilog_grpo.yaml", ["model.name_or_path=any/model"],
                    environ={})


def test_the_example_config_validates():
    config, _ = load_config(EXAMPLES / "verilog_grpo.yaml", ["model.name_or_path=any/model"],
                            environ={}, machine=False)
    assert config.tasks["verilog"].rewards[0].fn == "verilog_tests"
    assert len(ROWS) >= 12 and {"prompt", "testbench", "top_module", "reference"} <= set(ROWS[0])


@needs_iverilog
def test_data_check_proves_each_reference_passes_its_testbench(tmp_path):
    rows = [dict(ROWS[0]), dict(MUX, reference=mux("  assign y = a;"))]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check = check_file(path)
    assert check_references(check) == "  references: 1 of 2 pass their testbench"
    assert "row 2, column 'reference'" in check.problems.error_text()
    assert "6 of 8 checks" in check.problems.error_text()
