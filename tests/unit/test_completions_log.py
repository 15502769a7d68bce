"""The completions table (`logging.log_completions`): its rows, the JSONL file, and what the
TensorBoard and MLflow trackers receive."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from mogrpo.data.schema import Example
from mogrpo.tracking.trackers import MlflowTracker, TensorBoardTracker, markdown
from mogrpo.trainer.completions import CompletionLog, completion_rows, table

CHAT = [{"role": "user", "content": "2+2?"}]


def batch():
    """Two prompts of two tasks, K = 2; task 1's reward function logged a column."""
    return SimpleNamespace(
        picks=[(0, Example("Say hi", {}, "a:1")), (1, Example(CHAT, {}, "b:1"))],
        rollout=SimpleNamespace(num_generations=2, texts=["hi", "hello", "4", "five"]),
        rewards=[torch.tensor([[1.0, 0.5], [0.0, math.nan]]), torch.tensor([[1.0], [0.0]])],
        extras=[{}, {"parsed": ["4", "[unparseable]"]}],
    )


def test_rows_hold_prompt_completion_each_reward_and_advantage():
    rows = completion_rows(7, ["greet", "math"], [["polite", "short"], ["accuracy"]], batch(),
                           torch.tensor([0.5, -0.5, 1.0, -1.0]))
    assert rows[0] == {"step": 7, "task": "greet", "prompt": "Say hi", "completion": "hi",
                       "reward/polite": 1.0, "reward/short": 0.5, "advantage": 0.5}
    assert rows[1]["reward/short"] is None  # not scored, never a 0
    assert rows[3] == {"step": 7, "task": "math", "prompt": CHAT, "completion": "five",
                       "reward/accuracy": 0.0, "advantage": -1.0, "parsed": "[unparseable]"}


def test_table_unions_columns_and_renders_chat_prompts():
    rows = completion_rows(1, ["greet", "math"], [["polite", "short"], ["accuracy"]], batch(),
                           torch.zeros(4))
    columns, cells = table(rows)
    assert columns == ["step", "task", "prompt", "completion", "reward/polite", "reward/short",
                       "advantage", "reward/accuracy", "parsed"]
    assert cells[2][2] == "user: 2+2?" and cells[2][4] is None and cells[2][8] == "4"
    assert markdown(["a", "b"], [["x|y", 0.123456], ["two\nlines", None]]) == (
        "| a | b |\n|---|---|\n| x\\|y | 0.1235 |\n| two lines |  |")


def test_jsonl_every_n_steps_and_trackers(tmp_path):
    sent = []
    tracker = SimpleNamespace(log_table=lambda *args: sent.append(args))
    log = CompletionLog(tmp_path, every=2, trackers=tracker)
    assert [s for s in range(1, 7) if log.due(s)] == [2, 4, 6]
    rows = completion_rows(2, ["greet", "math"], [["polite", "short"], ["accuracy"]], batch(),
                           torch.zeros(4))
    log.write(2, rows)
    written = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert written[3]["prompt"] == CHAT and written[1]["reward/short"] is None
    assert sent[0][:2] == ("completions", 2) and len(sent[0][3]) == 4


def test_tensorboard_text_and_mlflow_artifact(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardTracker(tmp_path, {}, None)
    tb.log_table("completions", 3, ["prompt", "reward/acc"], [["2+2?", 1.0]])
    tb.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("completions/text_summary")
    assert text.step == 3
    assert text.tensor_proto.string_val[0].decode() == "| prompt | reward/acc |\n|---|---|\n| 2+2? | 1 |"

    mlflow = MlflowTracker(tmp_path, {}, None, "exp", "run", {})
    mlflow.log_table("completions", 3, ["prompt", "reward/acc"], [["2+2?", None]])
    path = mlflow.client.download_artifacts(mlflow.run_id, "completions/step_000003.jsonl",
                                            str(tmp_path / "dl"))
    assert json.loads(open(path).read()) == {"prompt": "2+2?", "reward/acc": None}
    mlflow.close()
