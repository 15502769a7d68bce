"""Hugging Face datasets as task data: saved folders, Parquet, Arrow and `load_dataset` sources,
column mapping, row-numbered errors, and streaming with exact resume."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mogrpo.config import load_config
from mogrpo.errors import ConfigError, DataError
from mogrpo.tasks.task import TaskMixer, load_tasks

datasets = pytest.importorskip("datasets")

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def rows(n: int) -> dict[str, list]:
    return {"problem": [f"What is {i} + {i}?" for i in range(n)],
            "answer": [str(2 * i) for i in range(n)]}


def tasks(tmp_path: Path, data, **task) -> list:
    (tmp_path / "out").mkdir(exist_ok=True)
    config, _ = load_config(None, [], environ={}, base={
        "model": {"name_or_path": "some/model"}, "output": {"dir": str(tmp_path / "out")},
        "tasks": {"math": {"data": data, "rewards": ["format"], **task}},
    })
    return load_tasks(config)


def test_saved_folder_chat_prompts_and_a_trl_style_solution_column(tmp_path):
    ds = datasets.Dataset.from_dict({"prompt": [CHAT, CHAT], "solution": ["4", "four"]})
    ds.save_to_disk(str(tmp_path / "saved"))
    (task,) = tasks(tmp_path, str(tmp_path / "saved"))
    assert [ex.prompt for ex in task.train] == [CHAT, CHAT]  # chat format detected
    assert [ex.columns["solution"] for ex in task.train] == ["4", "four"]
    assert task.train[1].source == f"{tmp_path / 'saved'} (train):2"


def test_parquet_with_column_mapping(tmp_path):
    datasets.Dataset.from_dict(rows(5)).to_parquet(str(tmp_path / "d.parquet"))
    (task,) = tasks(tmp_path, {"path": str(tmp_path / "d.parquet"),
                               "columns": {"problem": "prompt", "answer": "solution"}})
    assert task.train[3].prompt == "What is 3 + 3?"
    assert task.train[3].columns == {"solution": "6"}


def test_arrow_file_and_dataset_dict_splits(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a", "b"]}),
                               "test": datasets.Dataset.from_dict({"prompt": ["c"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    (task,) = tasks(tmp_path, {"path": str(tmp_path / "dd"), "split": "train"},
                    eval_data={"path": str(tmp_path / "dd"), "split": "test"})
    assert [ex.prompt for ex in task.train] == ["a", "b"] and task.eval[0].prompt == "c"
    arrow = next((tmp_path / "dd" / "train").glob("*.arrow"))
    (task,) = tasks(tmp_path, str(arrow))
    assert [ex.prompt for ex in task.train] == ["a", "b"]
    with pytest.raises(DataError, match=r"no split 'validation'; it has train, test"):
        tasks(tmp_path, {"path": str(tmp_path / "dd"), "split": "validation"})


def test_hub_form_goes_through_load_dataset(tmp_path):
    # `load_dataset(NAME)` reads a hub repo; a local folder of data files takes the same path.
    repo = tmp_path / "repo"
    repo.mkdir()
    datasets.Dataset.from_dict({"prompt": ["x", "y", "z"]}).to_parquet(str(repo / "train.parquet"))
    (task,) = tasks(tmp_path, {"hub": str(repo), "split": "train"})
    assert [ex.prompt for ex in task.train] == ["x", "y", "z"]
    assert task.train[0].source == f"hub:{repo} (train):1"
    with pytest.raises(DataError, match=r"cannot load hub:.*no_such_dataset_xyz.*check the "
                                        r"dataset name"):
        tasks(tmp_path, {"hub": str(tmp_path / "no_such_dataset_xyz")})


def test_bad_rows_are_reported_with_their_row_number(tmp_path):
    datasets.Dataset.from_dict({"prompt": ["ok", "fine", "  ", "ok"]}).to_parquet(
        str(tmp_path / "d.parquet"))
    with pytest.raises(DataError, match=r"d\.parquet \(train\) row 3, column 'prompt' = '  ': empty"):
        tasks(tmp_path, str(tmp_path / "d.parquet"))
    (task,) = tasks(tmp_path, str(tmp_path / "d.parquet"), drop_incomplete=True)
    assert len(task.train) == 3


def test_column_mapping_errors(tmp_path):
    datasets.Dataset.from_dict(rows(2)).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(DataError, match=r"`columns` renames 'question', but the dataset has "
                                        r"columns problem, answer"):
        tasks(tmp_path, {"path": str(tmp_path / "d.parquet"), "columns": {"question": "prompt"}})


def test_data_section_errors(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of `hub`"):
        tasks(tmp_path, {"hub": "a/b", "path": "x.parquet"})
    with pytest.raises(ConfigError, match=r"unknown config key `tasks.math.data.splt` .*; did you "
                                          r"mean `tasks.math.data.split`"):
        tasks(tmp_path, {"hub": "a/b", "splt": "test"})


# --- streaming -------------------------------------------------------------------------------


def streamed(tmp_path, n=30, **source):
    datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(n)]}).to_parquet(
        str(tmp_path / "big.parquet"))
    data = {"path": str(tmp_path / "big.parquet"), "streaming": True, "shuffle_buffer": 8,
            **source}
    return tasks(tmp_path, data, eval_size=4)


def test_streaming_holds_out_eval_rows_and_covers_each_pass(tmp_path):
    (task,) = streamed(tmp_path)
    assert [ex.prompt for ex in task.eval] == ["p0", "p1", "p2", "p3"]
    mixer = TaskMixer([task], seed=0)
    first = [ex.prompt for _, ex in mixer.next_batch(26)]
    second = [ex.prompt for _, ex in mixer.next_batch(26)]
    assert Counter(first) == Counter(f"p{i}" for i in range(4, 30))  # each row once per pass
    assert Counter(second) == Counter(first) and second != first  # reshuffled per pass
    assert first != sorted(first, key=lambda p: int(p[1:]))  # shuffled at all
    assert mixer.epoch_of(0) == 1.0


def test_streaming_resume_draws_the_same_prompts(tmp_path):
    (task,) = streamed(tmp_path)
    mixer = TaskMixer([task], seed=0)
    mixer.next_batch(20)
    state = mixer.state_dict()
    expected = [ex.prompt for _, ex in mixer.next_batch(15)]  # crosses into the next pass
    resumed = TaskMixer([task], seed=0)
    resumed.load_state_dict(state)
    assert [ex.prompt for _, ex in resumed.next_batch(15)] == expected


def test_streaming_bad_row_past_the_preview_is_reported_when_drawn(tmp_path):
    prompts = [f"p{i}" for i in range(100)]
    prompts[90] = ""
    datasets.Dataset.from_dict({"prompt": prompts}).to_parquet(str(tmp_path / "big.parquet"))
    (task,) = tasks(tmp_path, {"path": str(tmp_path / "big.parquet"), "streaming": True})
    mixer = TaskMixer([task], seed=0)
    with pytest.raises(DataError, match=r"big\.parquet \(train\) row 91, column 'prompt' = '': "
                                        r"empty"):
        mixer.next_batch(100)


def test_streaming_strict_refuses_a_repaired_value_past_the_preview(tmp_path):
    prompts = [f"p{i}" for i in range(100)]
    prompts[90] = " p90 "  # read as "p90": a warning, an error under strict
    datasets.Dataset.from_dict({"prompt": prompts}).to_parquet(str(tmp_path / "big.parquet"))
    spec = {"path": str(tmp_path / "big.parquet"), "streaming": True}
    (task,) = tasks(tmp_path, spec)
    assert len(TaskMixer([task], seed=0).next_batch(100)) == 100
    (task,) = tasks(tmp_path, spec, strict=True)
    with pytest.raises(DataError, match=r"big\.parquet \(train\) row 91, column 'prompt' = "
                                        r"' p90 ': read as 'p90'"):
        TaskMixer([task], seed=0).next_batch(100)
