"""The Python API: `Config` layers and checks like a YAML file, keeps reward callables, and
writes them to config.yaml as import paths."""

from __future__ import annotations

import pytest
import yaml

from mogrpo import Config
from mogrpo.config import RunConfig, to_yaml
from mogrpo.errors import ConfigError, RewardError
from mogrpo.rewards.base import resolve_reward
from mogrpo.rewards.builtin import format_reward

BASE = {"model": {"name_or_path": "some/model"},
        "tasks": {"t": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}}}


def polite(completions, **kwargs):
    return [1.0 if "please" in c else 0.0 for c in completions]


def test_config_is_a_run_config_with_sections_over_the_source(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**BASE, "train": {"max_steps": 7, "learning_rate": 1e-4}}))
    config = Config(path, train={"max_steps": 3})
    assert isinstance(config, RunConfig)
    assert (config.train.max_steps, config.train.learning_rate) == (3, 1e-4)  # merged key by key
    assert Config(config).train.max_steps == 3
    assert Config(BASE).tasks["t"].rewards[0].fn == "mc_correct"


def test_config_checks_like_a_file():
    with pytest.raises(ConfigError, match=r"unknown config key `trian`.*did you mean `train`"):
        Config(BASE, trian={"max_steps": 3})
    with pytest.raises(ConfigError, match="rollout.num_generations = 1"):
        Config(BASE, rollout={"num_generations": 1})


def test_reward_callables_are_kept_and_written_as_import_paths():
    local = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    config = Config(BASE, tasks={"t": {"data": "builtin:bias_probe",
                                       "rewards": [polite, {"fn": format_reward, "weight": 0.5},
                                                   {"fn": local, "name": "zero"}]}})
    rewards = config.tasks["t"].rewards
    assert rewards[0].fn is polite and [r.label for r in rewards] == ["polite", "format_reward",
                                                                       "zero"]
    written = yaml.safe_load(to_yaml(config))["tasks"]["t"]["rewards"]
    assert [r["fn"] for r in written] == [f"{__name__}:polite",
                                          "mogrpo.rewards.builtin:format_reward", "python:<lambda>"]
    assert resolve_reward(written[1]["fn"]) is format_reward  # a CLI resume finds it again
    with pytest.raises(RewardError, match="was a Python function passed to mogrpo.train"):
        resolve_reward(written[2]["fn"])


def test_top_level_names(monkeypatch):
    import mogrpo.api
    import mogrpo.trainer.grpo  # noqa: F401 - the loop's package has a name of its own

    calls = []
    monkeypatch.setattr(mogrpo.api, "train", lambda *a, **k: calls.append((a, k)) or "summary")
    from mogrpo import train

    assert train("run.yaml", resume="auto") == "summary"  # the root exports the API's function
    assert calls == [(("run.yaml",), {"resume": "auto"})]
    assert mogrpo.Config is Config
    assert callable(mogrpo.train) and mogrpo.trainer.grpo.__name__ == "mogrpo.trainer.grpo"
