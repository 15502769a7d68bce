"""Curriculum stages: validation, when a stage ends, the weights it sets, and its state."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mogrpo.errors import ConfigError
from mogrpo.tasks.curriculum import Curriculum, CurriculumConfig

BASE = {"fairness": 1.0, "hallucination": 2.0}


def curriculum(*stages: dict) -> Curriculum:
    return Curriculum(CurriculumConfig(stages=list(stages)), BASE)


def test_no_stages_keeps_the_task_weights():
    c = curriculum()
    assert not c.active and c.weights() == [1.0, 2.0]
    assert c.observe(5, {"eval/fairness/score": 1.0}) is None


def test_a_stage_ends_after_its_steps():
    c = curriculum({"name": "warm", "task_weights": {"hallucination": 0}, "until": {"steps": 3}},
                   {"name": "all"})
    assert c.weights() == [1.0, 0.0]  # fairness keeps its base weight
    assert [c.observe(s, {}) for s in (1, 2)] == [None, None]
    line = c.observe(3, {})
    assert line == ("[Curriculum@3] stage warm -> all: 3 steps; task weights fairness 1, "
                    "hallucination 2")
    assert c.index == 1 and c.weights() == [1.0, 2.0]
    assert c.observe(100, {}) is None and c.changes == [line]  # the last stage runs to the end


def test_a_metric_stage_waits_for_its_window_and_minimum():
    c = curriculum(
        {"name": "easy", "task_weights": {"fairness": 3},
         "until": {"metric": "eval/fairness/score", "at_least": 0.7, "window": 2,
                   "min_steps": 6}},
        {"name": "hard", "task_weights": {"fairness": 1, "hallucination": 1},
         "until": {"metric": "loss", "at_most": 0.1}},
        {"name": "end"})
    assert c.weights() == [3.0, 2.0]
    assert c.observe(1, {"loss": 0.5}) is None  # no eval at this step: nothing counts
    assert c.observe(2, {"eval/fairness/score": 0.9}) is None  # window not full
    assert c.observe(4, {"eval/fairness/score": 0.8}) is None  # mean 0.85, but 4 < 6 steps
    assert c.observe(6, {"eval/fairness/score": 0.5}) is None  # mean 0.65 < 0.7
    line = c.observe(8, {"eval/fairness/score": 0.95})  # mean 0.725
    assert line == ("[Curriculum@8] stage easy -> hard: eval/fairness/score 0.725 (mean of 2) "
                    ">= 0.7; task weights fairness 1, hallucination 1")
    assert c.observe(9, {"loss": 0.2}) is None
    assert c.observe(10, {"loss": 0.05}).startswith("[Curriculum@10] stage hard -> end: loss "
                                                     "0.050 <= 0.1;")


def test_state_round_trips_mid_window():
    stages = ({"name": "a", "until": {"metric": "m", "at_least": 1.0, "window": 3}},
              {"name": "b"})
    c = curriculum(*stages)
    c.observe(1, {"m": 1.0})
    c.observe(2, {"m": 1.0})
    resumed = curriculum(*stages)
    resumed.load_state_dict(c.state_dict())
    assert resumed.observe(3, {"m": 1.0}) == c.observe(3, {"m": 1.0})
    assert resumed.index == 1


@pytest.mark.parametrize(("stages", "message"), [
    ([{"name": "a", "until": {"steps": 2}}], "the last stage 'a' runs to the end"),
    ([{"name": "a"}, {"name": "b"}], "stage 'a' needs `until`"),
    ([{"name": "a", "until": {"steps": 2}}, {"name": "a"}], "stage names must be unique"),
    ([{"name": "a", "until": {"metric": "loss"}}, {"name": "b"}], "needs exactly one of at_least"),
    ([{"name": "a", "until": {"steps": 2, "metric": "loss"}}, {"name": "b"}], "either `steps"),
    ([{"name": "a", "until": {"steps": 2, "at_least": 1}}, {"name": "b"}], "belong to `metric`"),
    ([{"name": "a", "task_weights": {"fairness": -1}}], "task weights must be >= 0"),
])
def test_invalid_stages(stages, message):
    with pytest.raises(ValidationError, match=message):
        CurriculumConfig(stages=stages)


def test_stage_tasks_are_checked_against_the_run():
    config = CurriculumConfig(stages=[{"name": "a", "task_weights": {"fairnes": 1}}])
    with pytest.raises(ConfigError, match="weights task 'fairnes', which is not a task; did you "
                                          "mean 'fairness'"):
        config.check_tasks(BASE)
    config = CurriculumConfig(stages=[{"name": "a", "task_weights": {"fairness": 0,
                                                                      "hallucination": 0}}])
    with pytest.raises(ConfigError, match="stage 'a' gives every task weight 0"):
        config.check_tasks(BASE)


def test_config_file_mistakes_name_the_stage_key(tmp_path):
    from mogrpo.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {name_or_path: m}\n"
        "tasks:\n"
        "  fairness: {data: builtin:bias_probe, rewards: [{fn: mc_correct}]}\n"
        "curriculum:\n"
        "  stages:\n"
        "    - {name: one, untill: {steps: 5}}\n"
        "    - {name: two}\n"
        "output: {dir: out}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unknown config key `curriculum.stages.0.untill` "
                                          r"\(from file .*run.yaml\); did you mean "
                                          r"`curriculum.stages.0.until`\?"):
        load_config(path)


THREE = ({"name": "warm", "until": {"steps": 1}}, {"name": "mid", "until": {"steps": 1}},
         {"name": "final"})


def in_final_stage() -> dict:
    c = curriculum(*THREE)
    c.observe(1, {})
    c.observe(2, {})
    assert c.index == 2
    return c.state_dict()


def test_resume_into_fewer_stages_is_a_clear_error_not_an_index_error():
    fewer = curriculum({"name": "warm", "until": {"steps": 1}}, {"name": "rest"})
    with pytest.raises(ConfigError) as err:
        fewer.load_state_dict(in_final_stage())
    assert str(err.value) == (
        "the checkpoint is in curriculum stage 3 ('final'), but the config's curriculum has 2 "
        "stage(s): warm, rest. To continue, name one of them 'final' (the run goes on in it), "
        "put the removed stages back, or start a new run")


def test_resume_finds_the_saved_stage_by_name_when_stages_change():
    renamed = curriculum({"name": "warm", "until": {"steps": 1}}, {"name": "final"})
    renamed.load_state_dict(in_final_stage())
    assert renamed.index == 1 and renamed.stage.name == "final"
    # a checkpoint written before stages were saved by name: its position must exist
    old = {k: v for k, v in in_final_stage().items() if k != "stage"}
    with pytest.raises(ConfigError, match=r"curriculum stage 3, but .* has 2 stage\(s\)"):
        curriculum({"name": "warm", "until": {"steps": 1}}, {"name": "rest"}).load_state_dict(old)
