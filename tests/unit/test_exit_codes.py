"""Every command's exit status: 0 ok, 1 internal error, 2 usage/config/data error, 3 a check
found a problem, 130 interrupted (docs/commands.md, "Exit status")."""

from __future__ import annotations

import pytest
import torch
import yaml

from mogrpo.checkpoint import save_checkpoint
from mogrpo.cli import config as config_command
from mogrpo.cli import main
from mogrpo.config import load_config, to_yaml

BASE = {"model": {"name_or_path": "some/model"},
        "tasks": {"fair": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}}}


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE), encoding="utf-8")
    return path


@pytest.fixture
def run_dir(tmp_path, config_path):
    """A run directory with two intact checkpoints of a small model."""
    config, _ = load_config(config_path, [], environ={})
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(run, step, model=model, optimizer=optimizer, state={"sft_done": False},
                        config_yaml=to_yaml(config))
    return run


def corrupt(checkpoint):
    weights = checkpoint / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))


def test_doctor_exits_0_on_an_intact_checkpoint_and_3_on_a_corrupt_one(run_dir, capsys):
    checkpoint = run_dir / "checkpoints" / "step-0000002"
    assert main(["doctor", str(checkpoint)]) == 0
    assert "problem:" not in capsys.readouterr().out
    corrupt(checkpoint)
    assert main(["doctor", str(checkpoint)]) == 3
    out = capsys.readouterr().out
    assert "status   corrupt  (step 2)" in out
    assert out.rstrip().endswith(f"problem: checkpoint {checkpoint} is corrupt")


def test_doctor_exits_3_when_the_resume_would_be_refused(run_dir, config_path, capsys):
    checkpoint = run_dir / "checkpoints" / "step-0000002"
    assert main(["doctor", str(checkpoint), "--config", str(config_path)]) == 0
    assert main(["doctor", str(checkpoint), "--config", str(config_path),
                 "--set", "rollout.temperature=0.5"]) == 3
    assert "problem: a resume with the given config would be refused" in capsys.readouterr().out


def test_doctor_usage_errors_exit_2(run_dir, tmp_path, config_path):
    assert main(["doctor", str(tmp_path / "nope")]) == 2
    assert main(["doctor", str(run_dir / "checkpoints" / "step-0000002"), "--config",
                 str(config_path), "--set", "rollout.temprature=0.5"]) == 2
    # --set changes the config given with --config; without one it would be silently ignored
    assert main(["doctor", str(run_dir / "checkpoints" / "step-0000002"),
                 "--set", "rollout.temperature=0.5"]) == 2


def test_doctor_on_a_run_directory_says_it_is_not_a_checkpoint_and_exits_2(run_dir, tmp_path,
                                                                          capsys):
    # docs/commands.md: `doctor CHECKPOINT` exits 2 on "not a checkpoint directory"; a run
    # directory (or an empty one) is not an interrupted save
    assert main(["doctor", str(run_dir)]) == 2
    assert capsys.readouterr().err == (
        f"error: {run_dir} is a run directory, not a checkpoint: list its checkpoints with "
        f"`mogrpo checkpoints {run_dir}` and pass one (RUN/checkpoints/step-N)\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["doctor", str(empty)]) == 2
    assert capsys.readouterr().err == (
        f"error: {empty} is not a checkpoint directory (RUN/checkpoints/step-N)\n")
    step = run_dir / "checkpoints" / "step-0000002"
    (step / "manifest.json").unlink()  # a step directory without its manifest: incomplete
    assert main(["doctor", str(step)]) == 3


def test_checkpoints_exits_3_when_one_is_damaged(run_dir, tmp_path, capsys):
    assert main(["checkpoints", str(run_dir)]) == 0
    corrupt(run_dir / "checkpoints" / "step-0000001")
    assert main(["checkpoints", str(run_dir)]) == 3
    assert "step-0000001  step      1  corrupt" in capsys.readouterr().out
    capsys.readouterr()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["checkpoints", str(empty)]) == 2  # no checkpoints: not a run directory
    assert capsys.readouterr().err == (
        f"error: no checkpoints in {empty / 'checkpoints'}; this is not a run's output.dir\n")
    (empty / "metrics.jsonl").write_text("")
    assert main(["checkpoints", str(empty)]) == 2
    assert "the run stopped before its first one (written every output.save_every steps and " \
        "at the end)" in capsys.readouterr().err
    assert main(["checkpoints", str(tmp_path / "missing")]) == 2
    assert "missing is not a directory; give a run's output.dir" in capsys.readouterr().err


def test_train_data_and_config_errors_exit_2(tmp_path, capsys):
    data = tmp_path / "d.tsv"
    data.write_text("question\toption_A\toption_B\tcorrect_answer\nq\ta\tb\tZ\n", "utf-8")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**BASE, "tasks": {"t": {"data": str(data),
                                                              "rewards": ["mc_correct"]}},
                                      "output": {"dir": str(tmp_path / "out")}}), "utf-8")
    assert main(["train", str(config)]) == 2
    assert "column 'correct_answer' = 'Z'" in capsys.readouterr().err
    assert main(["train", str(config), "--set", "train.max_stpes=3"]) == 2


def test_report_outside_a_run_directory_exits_2(tmp_path):
    assert main(["report", str(tmp_path)]) == 2


def test_an_unexpected_exception_is_an_internal_error_exit_1(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(config_command, "cmd_fields", broken)
    assert main(["config", "fields"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err  # the traceback, for the bug report
    assert "internal error: this is a bug in mogrpo" in err


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(config_command, "cmd_fields", interrupted)
    assert main(["config", "fields"]) == 130


def test_argparse_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train"])  # the config argument is missing
    assert exit_.value.code == 2


def test_serve_usage_error_exits_2_and_doctor_env_exits_0(capsys):
    assert main(["serve", "some/model", "--port", "70000"]) == 2
    assert "need 0 <= port <= 65535" in capsys.readouterr().err
    assert main(["doctor", "env", "--json"]) == 0  # informational: warnings do not change it
