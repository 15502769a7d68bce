"""`mogrpo data check`: every problem listed, a summary of what is usable, honest exit codes;
and `mogrpo train` reads data with the same rules (every file's problems at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mogrpo.cli import main
from mogrpo.config import load_config
from mogrpo.errors import DataError
from mogrpo.tasks.task import load_tasks

HEADER = "question\toption_A\toption_B\toption_C\toption_D\tcorrect_answer"
GOOD = ["哪项正确？\t甲\t乙\t丙\t丁\tB", "哪项合适？\t甲\t乙\t丙\t丁\tA", "哪个中立？\t甲\t乙\t丙\t丁\tB",
        "哪种说法？\t甲\t乙\t丙\t丁\tD"]
BAD = ["空选项？\t甲\t乙\t\t丁\tD", "不是选项？\t甲\t乙\t丙\t丁\tE", "短行？\t甲\t乙",
       "长行？\t甲\t乙\t丙\t丁\tA\t多余", "不是字母？\t甲\t乙\t丙\t丁\t答案B"]


def write(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    return path


def test_a_file_with_five_bad_rows_lists_them_all_and_exits_3(tmp_path, capsys):
    data = write(tmp_path / "zh.tsv", GOOD[:2] + BAD)
    assert main(["data", "check", str(data)]) == 3
    out = capsys.readouterr().out
    assert out.startswith(f"{data}: 7 rows, 2 usable, 5 with problems, 0 dropped (empty fields); "
                          "format multiple_choice\n")
    assert f"5 problems in {data} (each listed; fix them all, then run again):" in out
    for row in (4, 5, 6, 7, 8):
        assert f"    {data} row {row}" in out
    assert "a short row: no value for 'option_C', 'option_D', 'correct_answer'" in out
    assert out.endswith("problems found\n")


def test_a_clean_file_is_summarised_with_token_lengths(tmp_path, capsys, tiny_model_dir):
    from mogrpo.data.schema import load_examples
    from mogrpo.modeling.load import load_tokenizer

    data = write(tmp_path / "zh.tsv", GOOD)
    assert main(["data", "check", str(data), "--tokenizer", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{data}: 4 rows, 4 usable, 0 with problems, 0 dropped (empty fields); " \
                     "format multiple_choice"
    assert out[2] == "  answers: A 1 (25%), B 2 (50%), D 1 (25%)"
    tokenizer = load_tokenizer(str(tiny_model_dir))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                           add_generation_prompt=True, tokenize=False)
             for ex in load_examples(data)]
    lengths = sorted(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    assert out[3] == (f"  prompt length (tokens of {tiny_model_dir} (chat template applied)): "
                      f"min {lengths[0]}, median {(lengths[1] + lengths[2]) / 2:g}, mean "
                      f"{sum(lengths) / 4:.1f}, p95 {lengths[3]}, max {lengths[3]}")
    assert out[-1] == "ok: no problem found"


def test_repaired_values_warn_and_strict_makes_them_problems(tmp_path, capsys):
    data = write(tmp_path / "zh.tsv", [*GOOD, "小写？\t甲\t乙\t丙\t丁\tc"])
    assert main(["data", "check", str(data)]) == 0
    out = capsys.readouterr().out
    assert "warning: " in out and "1 value(s) normalised — lower-case answer letter" in out
    assert main(["data", "check", str(data), "--strict"]) == 3
    assert "row 6, column 'correct_answer' = 'c': read as 'C'" in capsys.readouterr().out


def test_a_config_checks_every_task_file_with_its_settings(tmp_path, capsys):
    good = write(tmp_path / "good.tsv", GOOD)
    bad = write(tmp_path / "bad.tsv", [*GOOD, BAD[0]])
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": "some/model"},
        "tasks": {"a": {"data": str(good), "rewards": ["mc_correct"]},
                  "b": {"data": str(bad), "rewards": ["mc_correct"], "drop_incomplete": True}}}))
    assert main(["data", "check", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"{good} (task a): 4 rows, 4 usable" in out
    assert f"{bad} (task b): 5 rows, 4 usable, 0 with problems, 1 dropped (empty fields)" in out
    assert main(["data", "check", str(config), "--set", "tasks.b.drop_incomplete=false"]) == 3


@pytest.mark.parametrize("argv", [["data", "check", "nope.tsv"], ["data"],
                                  ["data", "check", "x.tsv", "--bogus"]])
def test_usage_errors_exit_2(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.tsv").write_text(HEADER + "\n" + GOOD[0] + "\n", encoding="utf-8")
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2


def test_set_on_a_data_file_is_refused_not_ignored(tmp_path, capsys):
    data = tmp_path / "x.tsv"
    data.write_text(HEADER + "\n" + GOOD[0] + "\n", encoding="utf-8")
    assert main(["data", "check", str(data), "--set", "tasks.t.strict=true"]) == 2
    assert capsys.readouterr().err == (
        "error: --set overrides a run config's values; a data file has none: give the config "
        "(mogrpo data check run.yaml --set ...) or use the data-file options (--strict, "
        "--format, ...)\n")


def test_an_unreadable_file_is_a_found_problem(tmp_path, capsys):
    path = tmp_path / "gbk.tsv"
    path.write_bytes((HEADER + "\n" + GOOD[0] + "\n").encode("gbk"))
    assert main(["data", "check", str(path)]) == 3
    assert "the file is not valid UTF-8" in capsys.readouterr().out


def test_train_reports_every_task_file_at_once(tmp_path):
    a = write(tmp_path / "a.tsv", [*GOOD, BAD[1]])
    b = write(tmp_path / "b.tsv", [*GOOD, BAD[2], BAD[3]])
    config, _ = load_config(None, [], environ={}, base={
        "model": {"name_or_path": "some/model"},
        "tasks": {"a": {"data": str(a), "rewards": ["mc_correct"]},
                  "b": {"data": str(b), "rewards": ["mc_correct"]}}})
    with pytest.raises(DataError) as err:
        load_tasks(config)
    message = str(err.value)
    assert message.startswith(f"{a} row 6, column 'correct_answer' = 'E': not one of the options")
    assert f"2 problems in {b}" in message
    assert f"{b} row 6: 3 fields but the header has 6 (a short row" in message
    assert f"{b} row 7: 7 fields but the header has 6" in message


def test_train_strict_refuses_repaired_values(tmp_path):
    a = write(tmp_path / "a.tsv", [*GOOD, "小写？\t甲\t乙\t丙\t丁\t b"])
    base = {"model": {"name_or_path": "some/model"},
            "tasks": {"a": {"data": str(a), "rewards": ["mc_correct"]}}}
    config, _ = load_config(None, [], environ={}, base=base)
    assert [t.train[-1].columns["correct_answer"] for t in load_tasks(config)] == ["B"]
    config, _ = load_config(None, ["tasks.a.strict=true"], environ={}, base=base)
    with pytest.raises(DataError, match=r"row 6, column 'correct_answer' = ' b': read as 'B' "
                                        r"\(leading or trailing whitespace stripped; lower-case"):
        load_tasks(config)


def test_a_config_counts_prompts_longer_than_the_prompt_budget(tmp_path, capsys, tiny_model_dir):
    data = write(tmp_path / "zh.tsv", GOOD)
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(tiny_model_dir)},
        "rollout": {"max_seq_length": 64, "max_prompt_length": 16, "max_completion_length": 48},
        "tasks": {"a": {"data": str(data), "rewards": ["mc_correct"]}}}))
    assert main(["data", "check", str(config), "--tokenizer", str(tiny_model_dir)]) == 0
    assert "  4 prompt(s) longer than rollout.max_prompt_length 16: they are cut from the left" \
        in capsys.readouterr().out
