"""Config: source priority, validation messages, unknown keys, length allocation."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from mogrpo.config import (
    RunConfig,
    derive_lengths,
    describe,
    field_reference,
    load_config,
    parse_set,
)
from mogrpo.errors import ConfigError

BASE = """
model: {name_or_path: some/model}
tasks:
  fairness:
    data: builtin:bias_probe
    rewards: [mc_correct]
    beta: 0.1
rollout: {num_generations: 4, max_seq_length: 256, max_prompt_length: 128, max_completion_length: 96}
train: {micro_batch_size: 8, gradient_accumulation_steps: 2}
"""


@pytest.fixture
def cfg_file(tmp_path: Path):
    def write(text: str = BASE, **sections) -> Path:
        data = yaml.safe_load(text)
        for key, value in sections.items():
            data.setdefault(key, {}).update(value)
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return write


def load(path, overrides=(), env=None):
    return load_config(path, list(overrides), environ=env or {})


def test_priority_cli_over_env_over_file_over_default(cfg_file):
    path = cfg_file(rollout={"temperature": 0.5})
    env = {"MOGRPO_ROLLOUT__TEMPERATURE": "0.7", "MOGRPO_ROLLOUT__TOP_P": "0.9"}
    config, origin = load(path, ["rollout.temperature=0.8"], env)
    assert config.rollout.temperature == 0.8
    assert origin["rollout.temperature"] == "--set rollout.temperature"
    assert config.rollout.top_p == 0.9  # env beats file/default when no --set
    assert origin["rollout.top_p"] == "env MOGRPO_ROLLOUT__TOP_P"
    config, origin = load(path, [], env)
    assert config.rollout.temperature == 0.7
    config, origin = load(path)
    assert config.rollout.temperature == 0.5
    assert origin["rollout.temperature"].startswith("file ")
    assert config.rollout.top_k == 0 and "rollout.top_k" not in origin  # default


def test_env_addresses_tasks_and_ignores_unrelated_variables(cfg_file):
    env = {"MOGRPO_TASKS__FAIRNESS__BETA": "0.05", "MOGRPO_JUDGE_KEY": "secret", "MOGRPO_SEED": "7"}
    config, _ = load(cfg_file(), [], env)
    assert config.tasks["fairness"].beta == 0.05
    assert config.seed == 7


def test_config_show_lists_every_value_with_its_source(cfg_file):
    config, origin = load(cfg_file(), ["train.max_steps=10"])
    rows = {key: (value, source) for key, value, source in describe(config, origin)}
    assert rows["train.max_steps"] == (10, "--set train.max_steps")
    assert rows["tasks.fairness.beta"][0] == 0.1
    assert rows["tasks.fairness.beta"][1].startswith("file ")
    assert rows["tasks.fairness.rewards.0.fn"][0] == "mc_correct"
    assert rows["algorithm.kl_estimator"] == ("k3", "default")
    assert rows["prompts per step"][0] == 4  # 8 × 2 / 4


def test_set_and_env_address_an_item_of_a_list_as_config_show_names_it(cfg_file):
    """`--set tasks.fairness.rewards.0.weight=0.5`, the key `config show` prints, was refused
    as "unknown config key `tasks.fairness.rewards.0`; known keys here: fn, weight, …"."""
    env = {"MOGRPO_TASKS__FAIRNESS__REWARDS__0__KWARGS__LETTERS": "AB"}
    config, origin = load(cfg_file(), ["tasks.fairness.rewards.0.weight=0.5"], env)
    reward = config.tasks["fairness"].rewards[0]
    assert (reward.fn, reward.weight, reward.kwargs) == ("mc_correct", 0.5, {"letters": "AB"})
    rows = {key: source for key, _, source in describe(config, origin)}
    assert rows["tasks.fairness.rewards.0.weight"] == "--set tasks.fairness.rewards.0.weight"
    assert rows["tasks.fairness.rewards.0.fn"].startswith("file ")
    config, _ = load(cfg_file(), ["tasks.fairness.rewards.0=format"])
    assert config.tasks["fairness"].rewards[0].fn == "format"
    with pytest.raises(ConfigError) as err:
        load(cfg_file(), ["tasks.fairness.rewards.1.weight=0.5"])
    assert str(err.value) == (
        "`tasks.fairness.rewards.1` (from --set tasks.fairness.rewards.1.weight): "
        "tasks.fairness.rewards has 1 item(s), 0 to 0; to add one, set the whole list: "
        "tasks.fairness.rewards=[...]")


def test_a_task_only_set_or_env_names_is_a_misspelt_task(cfg_file):
    """`--set tasks.fairnes.beta=0.05` made a new task and was refused as "tasks.fairnes.data:
    Field required", with neither the source nor the task meant."""
    with pytest.raises(ConfigError) as err:
        load(cfg_file(), ["tasks.fairnes.beta=0.05"])
    assert str(err.value) == ("`tasks.fairnes` (from --set tasks.fairnes.beta) is not a task of "
                              "this config (its tasks: fairness); did you mean `tasks.fairness`?")
    with pytest.raises(ConfigError, match=r"a new task needs `tasks.math.data` and "):
        load(cfg_file(), [], {"MOGRPO_TASKS__MATH__BETA": "0.05"})
    config, _ = load(cfg_file(), ["tasks.qa.data=builtin:grounded_qa", "tasks.qa.rewards=[mc_correct]"])
    assert list(config.tasks) == ["fairness", "qa"]


def test_unknown_key_gets_did_you_mean(cfg_file):
    path = cfg_file(rollout={"temprature": 0.9})
    with pytest.raises(ConfigError, match=r"unknown config key `rollout.temprature`.*did you mean `rollout.temperature`"):
        load(path)


def test_unknown_key_in_task_and_reward_and_cli(cfg_file):
    text = BASE.replace("beta: 0.1", "betta: 0.1")
    with pytest.raises(ConfigError, match=r"tasks.fairness.betta.*did you mean `tasks.fairness.beta`"):
        load(cfg_file(text))
    with pytest.raises(ConfigError, match=r"`trian`.*from --set trian.max_steps.*did you mean `train`"):
        load(cfg_file(), ["trian.max_steps=3"])
    text = BASE.replace("rewards: [mc_correct]", "rewards: [{fn: mc_correct, wieght: 2}]")
    with pytest.raises(ConfigError, match=r"rewards.0.wieght.*did you mean `tasks.fairness.rewards.0.weight`"):
        load(cfg_file(text))


def test_k_must_be_at_least_two(cfg_file):
    with pytest.raises(ConfigError, match=r"rollout.num_generations = 1: GRPO needs at least 2"):
        load(cfg_file(), ["rollout.num_generations=1", "train.micro_batch_size=1"])


def test_batch_must_hold_whole_groups(cfg_file):
    with pytest.raises(ConfigError, match=r"= 6 completions per step is not a multiple of rollout.num_generations = 4"):
        load(cfg_file(), ["train.micro_batch_size=3"])


def test_lengths_must_fit_the_sequence(cfg_file):
    with pytest.raises(ConfigError, match=r"max_prompt_length \(1536\) \+ rollout.max_completion_length \(2600\) = 4136 exceeds rollout.max_seq_length \(4096\)"):
        load(cfg_file(), ["rollout.max_seq_length=4096", "rollout.max_prompt_length=1536",
                          "rollout.max_completion_length=2600"])


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [("balanced", (2048, 2048)), ("prompt_heavy", (3072, 1024)), ("completion_heavy", (1024, 3072))],
)
def test_length_allocation_strategies(cfg_file, strategy, expected):
    text = BASE.replace(", max_prompt_length: 128, max_completion_length: 96", "")
    config, _ = load(cfg_file(text), [f"rollout.length_allocation={strategy}", "rollout.max_seq_length=4096"])
    assert derive_lengths(config.rollout) == expected
    assert config.rollout.completion_length == expected[1]


def test_explicit_allocation_fills_the_remainder(cfg_file):
    text = BASE.replace(", max_completion_length: 96", "")
    config, _ = load(cfg_file(text))
    assert derive_lengths(config.rollout) == (128, 128)


def test_strategy_with_explicit_lengths_is_refused(cfg_file):
    with pytest.raises(ConfigError, match=r"length_allocation = balanced derives both lengths.*set length_allocation: explicit"):
        load(cfg_file(), ["rollout.length_allocation=balanced"])


def test_a_negative_stop_id_is_refused(cfg_file):
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids.1 = -1 .*greater than or "
                                          r"equal to 0"):
        load(cfg_file(), ["rollout.stop_token_ids=[2, -1]"])


def test_type_errors_name_field_value_and_source(cfg_file):
    with pytest.raises(ConfigError, match=r"rollout.temperature = 'hot' \(from --set rollout.temperature\)"):
        load(cfg_file(), ["rollout.temperature=hot"])
    with pytest.raises(ConfigError, match=r"algorithm.kl_estimator = 'k4'.*'k1', 'k2' or 'k3'"):
        load(cfg_file(), ["algorithm.kl_estimator=k4"])


def test_missing_model_tasks_and_rewards():
    with pytest.raises(ConfigError) as err:
        load_config(None, [], environ={}, base={"tasks": {"t": {"data": "x.jsonl"}}})
    message = str(err.value)
    assert "model.name_or_path is not set" in message
    assert "tasks.t.rewards is empty" in message
    with pytest.raises(ConfigError, match="no tasks"):
        load_config(None, ["model.name_or_path=m"], environ={})


def test_bad_set_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected `section.key=value`"):
        parse_set("rollout.temperature")
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)


def test_kl_importance_weight_needs_several_passes(cfg_file):
    with pytest.raises(ConfigError, match="kl_importance_weight = detached has no effect"):
        load(cfg_file(), ["algorithm.kl_importance_weight=true"])
    config, _ = load(cfg_file(), ["algorithm.kl_importance_weight=true", "algorithm.num_iterations=2"])
    assert config.algorithm.num_iterations == 2
    assert config.algorithm.kl_importance_weight == "detached"  # what true meant before
    config, _ = load(cfg_file(), ["algorithm.kl_importance_weight=differentiable"])
    assert config.algorithm.kl_importance_weight == "differentiable"  # acts at μ = 1 too


def test_loss_type_options_and_old_configs(cfg_file):
    config, _ = load(cfg_file())
    algo = config.algorithm
    assert (algo.loss_type, algo.loss_aggregation, algo.kl_importance_weight) == ("grpo", None, "off")
    config, _ = load(cfg_file(), ["algorithm.loss_aggregation=token_mean"])  # an older config
    assert config.algorithm.loss_aggregation == "token_mean"
    config, _ = load(cfg_file(), ["algorithm.loss_type=luspo",
                                  "algorithm.importance_sampling_level=sequence"])
    assert config.algorithm.importance_sampling_level == "sequence"
    with pytest.raises(ConfigError, match=r"algorithm.loss_type = 'ppo'.*'grpo', 'bnpo'"):
        load(cfg_file(), ["algorithm.loss_type=ppo"])
    with pytest.raises(ConfigError, match=r"algorithm.delta = 0.9.*greater than 1"):
        load(cfg_file(), ["algorithm.delta=0.9"])


def test_every_field_is_documented():
    reference = field_reference()
    rows = [line for line in reference.splitlines()[2:]]
    assert len(rows) > 60
    for row in rows:
        meaning = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert meaning.strip(), f"undocumented field: {row}"


def test_shipped_configs_validate():
    root = Path(__file__).resolve().parents[2]
    shipped = sorted((root / "examples").glob("*.yaml"))
    assert shipped, "examples/*.yaml missing"
    for path in shipped:
        config, _ = load_config(path, ["model.name_or_path=any/model"], environ={})
        assert isinstance(config, RunConfig)


def test_yaml_comments_and_shorthand(cfg_file, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(BASE) + "# comment\n")
    config, _ = load(path)
    assert config.tasks["fairness"].rewards[0].fn == "mc_correct"
    assert config.tasks["fairness"].rewards[0].label == "mc_correct"


def test_kl_controller_options_are_validated_before_any_model_loads(cfg_file):
    with pytest.raises(ConfigError, match=r"tasks\.fairness\.kl\.low is required for kind 'band'"):
        load(cfg_file(), ["tasks.fairness.kl.kind=band", "tasks.fairness.kl.high=0.06"])
    with pytest.raises(ConfigError, match=r"tasks\.fairness\.kl\.target=0\.05 does not apply to kind 'band'"):
        load(cfg_file(), ["tasks.fairness.kl={kind: band, low: 0.02, high: 0.06, target: 0.05}"])
    with pytest.raises(ConfigError, match=r"tasks\.fairness\.kl\.kindd.*did you mean `tasks\.fairness\.kl\.kind`"):
        load(cfg_file(), ["tasks.fairness.kl.kindd=band"])
    config, _ = load(cfg_file(), ["tasks.fairness.kl={kind: band, low: 0.02, high: 0.06}"])
    assert config.tasks["fairness"].kl.options() == {"low": 0.02, "high": 0.06}


def test_reward_weight_schedules_are_validated(cfg_file):
    text = BASE.replace("rewards: [mc_correct]",
                        "rewards: [{fn: mc_correct, weight: {kind: linear, start: 0, end: 1}}]")
    with pytest.raises(ConfigError, match=r"tasks\.fairness\.rewards\.0\.weight"):
        load(cfg_file(text))
    text = BASE.replace(
        "rewards: [mc_correct]",
        "rewards: [{fn: mc_correct, weight: {kind: linear, start: 0, end: 1, end_step: 10}}]")
    config, _ = load(cfg_file(text))
    assert config.tasks["fairness"].rewards[0].weight["end_step"] == 10
