"""`mogrpo predict`: a multiple-choice file in, a submission CSV (id, answer) and details out.

The model here answers "B" to anything (by construction), so every figure is known."""

from __future__ import annotations

import csv
import json

import pytest

from judge_server import build_constant_model
from mogrpo.cli import main

HEADER = ["id", "question", "option_A", "option_B", "option_C", "option_D", "correct_answer"]
ROWS = [  # Chinese questions, as in the Kaggle-style run of USERS.md; two without an answer
    ["c-101", "以下哪个城市是中国的首都？", "上海", "北京", "广州", "深圳", "B"],
    ["c-102", "水的化学式是什么？", "CO2", "O2", "H2O", "NaCl", "C"],
    ["c-103", "一年有几个季节？", "两个", "四个", "六个", "十二个", ""],
    ["c-104", "太阳从哪个方向升起？", "西", "东", "南", "北", "B"],
    ["c-105", "哪个是哺乳动物？", "鲨鱼", "鲸鱼", "金鱼", "章鱼", ""],
]


@pytest.fixture(scope="module")
def b_model(tmp_path_factory):
    corpus = [" ".join(row[1:6]) + " Answer: B" for row in ROWS] + ["A B C D"]
    return build_constant_model(tmp_path_factory.mktemp("b") / "model", "B", corpus)


def write_tsv(path, header, rows):
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(header)
        writer.writerows(rows)
    return path


def read_csv(path):
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.reader(f))


def test_submission_and_details_for_a_chinese_tsv(b_model, tmp_path, capsys):
    data = write_tsv(tmp_path / "test.tsv", HEADER, ROWS)
    out = tmp_path / "out" / "submission.csv"
    assert main(["predict", str(b_model), str(data), "--out", str(out)]) == 0

    assert read_csv(out) == [["id", "answer"]] + [[row[0], "B"] for row in ROWS]
    details = [json.loads(line) for line in
               (tmp_path / "out" / "submission.details.jsonl").read_text("utf-8").splitlines()]
    assert [d["id"] for d in details] == [row[0] for row in ROWS]
    assert {d["completion"] for d in details} == {"B"}
    assert {d["rule"] for d in details} == {"final_letter"}
    assert [d["correct"] for d in details] == [True, False, None, True, None]
    assert "北京" in details[0]["prompt"]  # the prompt as the model saw it

    printed = capsys.readouterr().out
    assert "5 rows: a letter found in 5 (100.0%)" in printed
    assert "accuracy 0.667 (2 of 3 rows with a correct_answer)" in printed


def test_rows_without_ids_or_answers_are_numbered(b_model, tmp_path, capsys):
    rows = [row[1:6] for row in ROWS[:3]]
    data = write_tsv(tmp_path / "test.tsv", HEADER[1:6], rows)
    out = tmp_path / "sub.csv"
    assert main(["predict", str(b_model), str(data), "--out", str(out),
                 "--answer-column", "label"]) == 0
    # data rows start at line 2 of the file (line 1 is the header), and the message says so
    assert read_csv(out) == [["id", "label"], ["2", "B"], ["3", "B"], ["4", "B"]]
    captured = capsys.readouterr()
    assert "accuracy" not in captured.out
    assert ("each row's id is its line number in the file, as in error messages (the first data "
            "row of a CSV/TSV is line 2)") in captured.err
    assert "from 1" not in captured.err


def test_the_run_config_builds_the_training_prompt(b_model, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {{name_or_path: {b_model}, use_chat_template: false}}\n"
        "tasks:\n"
        "  exam:\n"
        "    data: test.tsv\n"
        "    prompt_template: \"题目：{question}\\n{options}\\n答案：\"\n"
        "    rewards: [{fn: mc_correct}]\n"
        "rollout: {max_completion_length: 8}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n", encoding="utf-8")
    data = write_tsv(tmp_path / "test.tsv", HEADER, ROWS[:1])
    out = tmp_path / "sub.csv"
    assert main(["predict", str(b_model), str(data), "--out", str(out),
                 "--config", str(config)]) == 0
    (detail,) = [json.loads(line) for line in
                 (tmp_path / "sub.details.jsonl").read_text("utf-8").splitlines()]
    assert detail["prompt"] == "题目：以下哪个城市是中国的首都？\nA. 上海\nB. 北京\nC. 广州\nD. 深圳\n答案："


def test_a_run_directory_builds_the_prompts_from_its_own_config(b_model, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "model").symlink_to(b_model)
    (run / "config.yaml").write_text(
        f"model: {{name_or_path: {b_model}, use_chat_template: false}}\n"
        "tasks:\n"
        "  exam:\n"
        "    data: test.tsv\n"
        "    system_prompt: 只回答字母。\n"
        "    prompt_template: \"题目：{question}\\n{options}\\n答案：\"\n"
        "    rewards: [{fn: mc_correct}]\n"
        f"output: {{dir: {run}}}\n", encoding="utf-8")
    data = write_tsv(tmp_path / "test.tsv", HEADER, ROWS[:1])
    out = tmp_path / "sub.csv"
    assert main(["predict", str(run), str(data), "--out", str(out)]) == 0
    (detail,) = [json.loads(line) for line in
                 (tmp_path / "sub.details.jsonl").read_text("utf-8").splitlines()]
    assert detail["prompt"] == ("只回答字母。\n\n题目：以下哪个城市是中国的首都？\n"
                                "A. 上海\nB. 北京\nC. 广州\nD. 深圳\n答案：")
    assert f"building the prompts as run {run} did (its config.yaml)" in capsys.readouterr().err


def test_the_run_config_decodes_as_its_greedy_eval(b_model, tmp_path, monkeypatch):
    # the run's penalties and stop ids shape its greedy eval (quick_eval keeps them), so the
    # answers of `predict --config` are those the eval scored
    from dataclasses import replace

    from mogrpo.config import load_config
    from mogrpo.rollout import generate
    from mogrpo.rollout.sampling import SamplingSettings

    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {{name_or_path: {b_model}}}\n"
        "tasks: {exam: {data: test.tsv, rewards: [{fn: mc_correct}]}}\n"
        "rollout: {max_completion_length: 8, presence_penalty: 0.5, frequency_penalty: 0.25,"
        " repetition_penalty: 1.1, stop_token_ids: [1, 2]}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n", encoding="utf-8")
    seen = []
    real = generate.generate_rollout
    monkeypatch.setattr(generate, "generate_rollout", lambda model, tok, texts, settings, **kw:
                        seen.append(settings) or real(model, tok, texts, settings, **kw))
    data = write_tsv(tmp_path / "test.tsv", HEADER, ROWS[:1])
    assert main(["predict", str(b_model), str(data), "--out", str(tmp_path / "sub.csv"),
                 "--config", str(config)]) == 0
    rollout = load_config(config, [])[0].rollout
    assert seen == [replace(SamplingSettings.from_rollout(rollout), greedy=True)]


@pytest.mark.parametrize(("rows", "args", "message"), [
    ([ROWS[0], ROWS[0]], [], "column 'id' repeats the id 'c-101'"),
    (ROWS[:2], ["--id-column", "qid"], "no value in the id column 'qid'"),
    (ROWS[:2], ["--fallback", "BB"], "--fallback 'BB' must be one option letter"),
    (ROWS[:2], ["--task", "exam"], "--task and --set read a run's config: pass it with --config"),
    ([["c-1", "问题", "甲", "乙", "丙", "丁", "E"]], [],
     "column 'correct_answer' = 'E': not one of the options A–D"),
    ([ROWS[0], ROWS[1][:5]], [],  # a short row is reported as such, not read as "no answer"
     "row 3: 5 fields but the header has 7 (a short row: no value for 'option_D', "
     "'correct_answer')"),
    ([["c-1", "问题", "甲", "乙", "丙", "丁", "b"]], ["--strict"],
     "row 2, column 'correct_answer' = 'b': read as 'B'"),
])
def test_user_mistakes_are_one_line_errors(b_model, tmp_path, capsys, rows, args, message):
    data = write_tsv(tmp_path / "test.tsv", HEADER, rows)
    assert main(["predict", str(b_model), str(data), "--out", str(tmp_path / "s.csv"),
                 *args]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "s.csv").exists()


def test_a_prompt_file_is_not_multiple_choice(b_model, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello"}\n', encoding="utf-8")
    assert main(["predict", str(b_model), str(data)]) == 2
    assert "needs multiple-choice rows (question, option_A, option_B, …)" in capsys.readouterr().err


def test_on_a_cpu_batches_reuse_freed_memory_as_training_steps_do(b_model, tmp_path,
                                                                   monkeypatch):
    from mogrpo import kernels

    calls = []
    monkeypatch.setattr(kernels, "apply_host_memory", lambda *a: calls.append(a))
    data = write_tsv(tmp_path / "test.tsv", HEADER, ROWS[:2])
    assert main(["predict", str(b_model), str(data), "--out", str(tmp_path / "s.csv")]) == 0
    assert calls == [("auto", "cpu")]  # train.host_memory's default, for this device


def test_batches_decode_on_one_build_of_the_weights(b_model, tmp_path, monkeypatch):
    """Batch after batch decodes with the same weights: they are fused and packed once
    (`held_projections`) for the whole file, and let go at the end."""
    from mogrpo.rollout import projections

    built = []
    build = projections._build_projections
    monkeypatch.setattr(projections, "_build_projections", lambda *a: built.append(1) or build(*a))
    data = write_tsv(tmp_path / "test.tsv", HEADER, ROWS)
    out = tmp_path / "s.csv"
    assert main(["predict", str(b_model), str(data), "--out", str(out), "--batch-size", "2"]) == 0
    assert read_csv(out) == [["id", "answer"]] + [[row[0], "B"] for row in ROWS]  # 3 batches
    assert len(built) == 1 and not projections._HELD
