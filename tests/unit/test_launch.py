"""`mogrpo train CONFIG --nproc N`: the torchrun command it runs, what it refuses before
launching anything, and the exit status it passes back (no process is started here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from mogrpo.cli import main
from mogrpo.cli.app import build_parser
from mogrpo.cli.launch import torchrun_command
from mogrpo.errors import ConfigError

CONFIG = {
    "model": {"name_or_path": "some/model"},
    "tasks": {"fair": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}},
    # 8 completions per step = 2 prompts × K 4: splits over 1 or 2 processes, not 3
    "rollout": {"num_generations": 4},
    "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 2},
}


class FakeTorchrun:
    """Stands in for subprocess.Popen: records the command, exits with `status`."""

    commands: list[list[str]] = []
    status = 0

    def __init__(self, command: list[str]):
        FakeTorchrun.commands.append(command)

    def wait(self, timeout: float | None = None) -> int:
        return FakeTorchrun.status


@pytest.fixture
def torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    FakeTorchrun.commands, FakeTorchrun.status = [], 0
    monkeypatch.setattr("mogrpo.cli.launch.subprocess.Popen", FakeTorchrun)
    return FakeTorchrun


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return path


def test_the_command_is_rewritten_for_torchrun_without_nproc():
    argv = ["train", "run.yaml", "--set", "train.max_steps=5", "--nproc", "4", "--resume",
            "auto", "--allow-config-change", "--strict", "--set", "rollout.temperature=0.9"]
    args = build_parser().parse_args(argv)
    command = torchrun_command(args, 4)
    assert command == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "-m", "mogrpo.cli", "train", "run.yaml", "--set", "train.max_steps=5", "--set",
        "rollout.temperature=0.9", "--resume", "auto", "--allow-config-change", "--strict"]
    # each process parses back exactly what was asked, less --nproc
    again = vars(build_parser().parse_args(command[command.index("train"):]))
    assert again == {**vars(args), "nproc": None}


def test_every_train_option_is_passed_through():
    # an option added to `mogrpo train` must be added to train_arguments (and here)
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    dests = {a.dest for a in train._actions} - {"help"}
    assert dests == {"config", "overrides", "resume", "allow_config_change", "strict", "nproc"}
    plain = torchrun_command(build_parser().parse_args(["train", "r.yaml", "--nproc", "2"]), 2)
    assert plain[-2:] == ["train", "r.yaml"]


def test_two_processes_launch_torchrun_and_return_its_status(torchrun, config):
    torchrun.status = 7
    assert main(["train", str(config), "--nproc", "2"]) == 7
    (command,) = torchrun.commands
    assert command[command.index("--nproc-per-node") + 1] == "2"
    assert command[-2:] == ["train", str(config)]
    torchrun.status = -9  # torchrun killed by SIGKILL: the shell's 128 + 9
    assert main(["train", str(config), "--nproc", "2"]) == 137


@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc", "0"], "--nproc 0: the number of processes must be at least 1"),
    (["--nproc", "3"], "2 prompts per step do not split over 3 processes"),
    (["--nproc", "2", "--set", "distributed.strategy=none"],
     "distributed.strategy: none trains in one process, but 2 processes were asked for"),
    (["--nproc", "2", "--set", "rollout.temprature=0.9"],
     "did you mean `rollout.temperature`?"),
], ids=["zero", "not-a-divisor", "strategy-none", "config-typo"])
def test_errors_come_before_anything_launches(torchrun, config, argv, message, capsys):
    assert main(["train", str(config), *argv]) == 2
    assert message in capsys.readouterr().err
    assert torchrun.commands == []


def test_nproc_inside_a_launched_process_is_refused(torchrun, config, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", str(config), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "--nproc 2 given inside a process that torchrun (or another launcher) already " \
        "started (WORLD_SIZE=2); drop --nproc" in err
    assert torchrun.commands == []


def test_one_process_trains_here(torchrun, config, monkeypatch):
    import mogrpo.trainer.run

    seen = []
    monkeypatch.setattr(mogrpo.trainer.run, "run_training",
                        lambda cfg, **kw: seen.append((cfg.train.micro_batch_size, kw)))
    assert main(["train", str(config), "--nproc", "1"]) == 0
    assert seen == [(4, {"resume": None, "allow_config_change": False})]
    assert torchrun.commands == []


def test_every_setting_several_processes_cannot_run_is_listed_at_once():
    from mogrpo.config import RunConfig
    from mogrpo.config.processes import check_processes

    config = RunConfig.model_validate({
        "model": {"name_or_path": "m", "load_in_4bit": True},
        "tasks": {"t": {"data": "d.jsonl", "rewards": [{"fn": "format"}]}},
        "lora": {"enabled": True}, "distributed": {"strategy": "fsdp"}})
    with pytest.raises(ConfigError) as err:
        check_processes(config, 3)
    text = str(err.value)
    assert text.startswith("invalid config for 3 processes:")
    for part in ("cannot shard quantised weights (model.load_in_4bit)",
                 "2 prompts per step do not split over 3 processes"):
        assert part in text
    assert check_processes(config, 1) == "none"  # one process: nothing to refuse
