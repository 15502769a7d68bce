"""`mogrpo data check FILE`: validate a data file (or every task file of a run config) and
summarise it, with the same reader and rules as `mogrpo train` and `mogrpo predict`.

The summary is what a user checks before a long run: how many rows are usable, the answer
letters' distribution (a skew shows at once), and prompt lengths in tokens of the tokenizer the
run will use. Rows with a `testbench` and a `reference` (Verilog) have the reference simulated
against the testbench: it must pass every check. Exit status 0 when every row is usable, 3
when a problem was found.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mogrpo.data.problems import Problem, ProblemLog
from mogrpo.data.readers import read_records
from mogrpo.data.schema import Example, collect_examples, detect_format
from mogrpo.errors import ConfigError, DataError, ExitCode


@dataclass
class FileCheck:
    """One data file, checked: its usable examples and everything wrong with it."""

    source: str
    task: str | None
    problems: ProblemLog
    format: str = "?"
    rows: int = 0
    """Data rows in the file (usable, dropped and bad)."""
    examples: list[Example] = field(default_factory=list)
    dropped: int = 0
    columns: list[str] = field(default_factory=list)

    @property
    def bad_rows(self) -> int:
        return len({(p.row, p.source) for p in self.problems.errors}
                   | {(row, p.source) for p in self.problems.errors for row in p.also})


def check_file(path: str | Path, *, task: str | None = None, format: str = "auto",
               prompt_template: str | None = None, drop_incomplete: bool = False,
               require_answer: bool = True, strict: bool = False) -> FileCheck:
    """Read and parse one file, collecting every problem instead of stopping at the first."""
    problems = ProblemLog(strict=strict)
    result = FileCheck(str(path), task, problems)
    try:
        records = read_records(path, problems)
    except DataError as err:  # the file cannot be read at all: that is its one problem
        problems.error(Problem(str(path), None, None, str(err), "fix the file", kind="file"))
        return result
    readers_bad = len(problems.errors)
    result.format = detect_format(records) if format == "auto" and records else format
    result.columns = list(dict.fromkeys(k for r in records for k in r.data))
    examples, dropped = collect_examples(
        records, problems, format=format, prompt_template=prompt_template,
        drop_incomplete=drop_incomplete, require_answer=require_answer)
    result.examples, result.dropped = examples, len(dropped)
    result.rows = len(records) + readers_bad
    return result


def _tasks_of(config: Any, config_path: Path, strict: bool) -> list[FileCheck]:
    """Every task's data and eval_data files of a run config, checked with its settings."""
    from mogrpo.data.synthetic import BUILTIN_PREFIX

    checks = []
    for name, tc in config.tasks.items():
        for spec in (tc.data, tc.eval_data):
            if spec is None or spec.startswith(BUILTIN_PREFIX):
                continue
            checks.append(check_file(spec, task=name, format=tc.format,
                                     prompt_template=tc.prompt_template,
                                     drop_incomplete=tc.drop_incomplete,
                                     strict=strict or tc.strict))
    if not checks:
        raise ConfigError(f"{config_path}: no task reads a data file (only builtin: tasks); "
                          "nothing to check")
    return checks


def _stats(values: list[int]) -> str:
    if not values:
        return "–"
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return (f"min {ordered[0]}, median {statistics.median(ordered):g}, "
            f"mean {statistics.fmean(ordered):.1f}, p95 {p95}, max {ordered[-1]}")


def _prompt_lengths(examples: list[Example], tokenizer: Any | None) -> tuple[list[int], str]:
    if tokenizer is None:
        return [len(_text(ex.prompt)) for ex in examples], "characters"
    from mogrpo.modeling.chat import has_chat_template, render_prompt

    use = has_chat_template(tokenizer) or None
    lengths = []
    for ex in examples:
        if isinstance(ex.prompt, list) and not use:
            text, special = _text(ex.prompt), True
        else:
            text, special = render_prompt(tokenizer, ex.prompt, use_chat_template=use)
        lengths.append(len(tokenizer(text, add_special_tokens=special)["input_ids"]))
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return lengths, f"tokens of {name}" + (" (chat template applied)" if use else "")


def _text(prompt: str | list[dict[str, str]]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def summarize(check: FileCheck, tokenizer: Any | None = None,
              max_prompt_length: int | None = None) -> list[str]:
    """The lines printed for one file: rows, format, answers, lengths."""
    task = f" (task {check.task})" if check.task else ""
    lines = [f"{check.source}{task}: {check.rows} rows, {len(check.examples)} usable, "
             f"{check.bad_rows} with problems, {check.dropped} dropped (empty fields); "
             f"format {check.format}"]
    if check.columns:
        lines.append(f"  columns: {', '.join(check.columns)}")
    if not check.examples:
        return lines
    answers = Counter(ex.columns.get("correct_answer") for ex in check.examples
                      if "options" in ex.columns)
    if answers:
        n = sum(answers.values())
        shown = ", ".join(f"{letter} {count} ({count / n:.0%})" for letter, count in
                          sorted(answers.items(), key=lambda kv: (kv[0] is None, kv[0] or "")))
        lines.append(f"  answers: {shown}".replace("None ", "none "))
    lengths, unit = _prompt_lengths(check.examples, tokenizer)
    lines.append(f"  prompt length ({unit}): {_stats(lengths)}")
    if max_prompt_length is not None and tokenizer is not None:
        over = sum(length > max_prompt_length for length in lengths)
        if over:
            lines.append(f"  {over} prompt(s) longer than rollout.max_prompt_length "
                         f"{max_prompt_length}: they are cut from the left")
    return lines


def check_references(check: FileCheck) -> str | None:
    """Simulate each row's Verilog `reference` against its `testbench`; a reference that does
    not pass every check is an error of that row. The summary line, or None without such rows."""
    rows = [ex for ex in check.examples
            if isinstance(ex.columns.get("testbench"), str) and ex.columns.get("reference")]
    if not rows:
        return None
    from concurrent.futures import ThreadPoolExecutor

    from mogrpo.rewards.verilog import iverilog_missing, simulate

    missing = iverilog_missing()
    if missing:
        return f"  references: not simulated: {missing}"

    def run(ex: Example) -> Any:
        top = ex.columns.get("top_module")
        return simulate(str(ex.columns["reference"]), ex.columns["testbench"],
                        top_module=top if isinstance(top, str) else None)

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        results = list(pool.map(run, rows))
    for ex, result in zip(rows, results, strict=True):
        if result.status != "ok" or result.total == 0 or result.passed < result.total:
            source, _, row = ex.source.rpartition(":")
            check.problems.error(Problem(
                source, int(row) if row.isdigit() else None, "reference",
                f"the reference does not pass the row's testbench ({result.status}, "
                f"{result.passed} of {result.total} checks)",
                "fix the testbench or the reference (the testbench must report with "
                "`MOGRPO_RESULT(passed, total))"))
    good = sum(r.status == "ok" and 0 < r.total == r.passed for r in results)
    return f"  references: {good} of {len(rows)} pass their testbench"


def cmd_data(args: argparse.Namespace) -> int:
    """The `mogrpo data check` command; returns the exit status."""
    path: Path = args.file
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a data file or a run config")
    limit = None
    if path.suffix.lower() in (".yaml", ".yml"):
        from mogrpo.config import load_config

        config = load_config(path, args.overrides, machine=False)[0]
        checks = _tasks_of(config, path, args.strict)
        limit = config.rollout.prompt_length
    else:
        if args.overrides:
            raise ConfigError(
                "--set overrides a run config's values; a data file has none: give the config "
                "(mogrpo data check run.yaml --set ...) or use the data-file options (--strict, "
                "--format, ...)")
        checks = [check_file(path, format=args.format, prompt_template=args.template,
                             drop_incomplete=args.drop_incomplete,
                             require_answer=not args.no_answer, strict=args.strict)]
    tokenizer = None
    if args.tokenizer is not None:
        from mogrpo.modeling.load import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    found = False
    for check in checks:
        references = check_references(check)  # first: its failures are the rows' problems
        print("\n".join(summarize(check, tokenizer, limit)))
        if references:
            print(references)
        for line in check.problems.warning_lines():
            print(f"  warning: {line}")
        if check.problems.errors:
            found = True
            print("  " + check.problems.error_text(args.limit).replace("\n", "\n  "))
    print("problems found" if found else "ok: no problem found")
    return ExitCode.FOUND_PROBLEM if found else ExitCode.OK
