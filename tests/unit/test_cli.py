"""The `mogrpo` command line without a model: help, `config show`, `config fields`, errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from mogrpo import __version__
from mogrpo.cli import main
from mogrpo.config import field_reference

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"
CONFIG = {
    "model": {"name_or_path": "some/model"},
    "tasks": {"fair": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}},
}


@pytest.fixture
def config_file(tmp_path: Path):
    def write(**sections) -> Path:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump({**CONFIG, **sections}), encoding="utf-8")
        return path

    return write


def run_help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--help"], ["train", "demo", "config", "--set rollout.temperature=0.9",
                      "MOGRPO_SECTION__KEY", "--set > environment"]),
        (["train", "--help"], ["config", "YAML config file", "--set SECTION.KEY=VALUE"]),
        (["demo", "--help"], ["--seed SEED", "--out OUT", "--set SECTION.KEY=VALUE",
                              "default runs/demo"]),
        (["config", "--help"], ["show", "fields"]),
        (["config", "show", "--help"], ["config", "--set SECTION.KEY=VALUE", "with its source"]),
        (["config", "fields", "--help"], ["type, default and one-line meaning"]),
    ],
)
def test_help_lists_the_documented_options(argv, expected, capsys):
    out = run_help(argv, capsys)
    assert out.startswith("usage: mogrpo")
    for text in expected:
        assert text in out, f"{text!r} missing from `mogrpo {' '.join(argv)}`:\n{out}"


def test_version(capsys):
    assert run_help(["--version"], capsys).strip() == f"mogrpo {__version__}"


def test_no_command_prints_the_top_level_help(capsys, monkeypatch):
    # `main([])` must not fall back to the process's own arguments.
    monkeypatch.setattr(sys, "argv", ["mogrpo", "demo"])
    assert main([]) == 2  # nothing was done: a usage error
    out = capsys.readouterr().out
    assert out.startswith("usage: mogrpo [-h] [--version] COMMAND")
    assert "--seed" not in out


def test_config_without_subcommand_prints_its_help(capsys):
    assert main(["config"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: mogrpo config [-h] SUBCOMMAND")
    assert "show" in out and "fields" in out


def test_config_show_reports_each_value_and_its_source(config_file, capsys):
    path = config_file(rollout={"temperature": 0.5})
    assert main(["config", "show", str(path), "--set", "train.max_steps=7"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert captured.err == ""

    def line(key: str) -> list[str]:
        found = [ln for ln in lines if ln.split()[0] == key]
        assert len(found) == 1, f"{key} not printed once:\n{captured.out}"
        return re.split(r"\s{2,}", found[0].strip())

    assert line("train.max_steps") == ["train.max_steps", "7", "--set train.max_steps"]
    assert line("rollout.temperature") == ["rollout.temperature", "0.5", f"file {path}"]
    assert line("tasks.fair.data") == ["tasks.fair.data", "builtin:bias_probe", f"file {path}"]
    assert line("train.learning_rate") == ["train.learning_rate", "1e-05", "default"]


def test_config_show_invalid_config_is_one_error_and_exit_2(config_file, capsys):
    path = config_file(rollout={"num_generations": 1})
    assert main(["config", "show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: invalid config:\n  rollout.num_generations = 1: ")
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "train.max_stpes=7"],
         "error: unknown config key `train.max_stpes` (from --set train.max_stpes); "
         "did you mean `train.max_steps`?"),
        (["--set", "train.max_steps"], "error: --set 'train.max_steps': expected `section.key=value`"),
    ],
)
def test_config_show_bad_override_is_reported(argv, message, config_file, capsys):
    assert main(["config", "show", str(config_file()), *argv]) == 2
    assert capsys.readouterr().err.startswith(message)


def test_config_show_missing_file(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["config", "show", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"error: config file {missing} does not exist; pass the path of a YAML config\n"
    )


def test_config_fields_prints_the_markdown_table(capsys):
    assert main(["config", "fields"]) == 0
    out = capsys.readouterr().out
    assert out == field_reference() + "\n"
    assert out.startswith("| key | type | default | meaning |\n|---|---|---|---|\n")
    assert "| `train.max_steps` | int | 100 | Optimizer steps of GRPO. |" in out
    assert "| `tasks.NAME.rewards[].fn` | str \\| function | required |" in out


def test_docs_config_md_holds_the_current_field_reference():
    text = DOCS.read_text(encoding="utf-8")
    table = text[text.find("| key | type | default | meaning |"):]
    assert table.rstrip("\n") == field_reference(), (
        "docs/config.md is out of date: regenerate its table with `mogrpo config fields` "
        "(replace everything from `| key | type | default | meaning |` to the end)"
    )
