"""A `stop` health check ends `mogrpo train` with exit status 3, leaving a resumable run."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from mogrpo.checkpoint import list_checkpoints
from mogrpo.cli import main
from mogrpo.demo import demo_base

USER_REWARDS = Path(__file__).with_name("user_rewards.py")




def test_no_signal_stop_leaves_metrics_and_a_checkpoint(tmp_path, tiny_model, capsys):
    config = demo_base()
    config["model"]["name_or_path"] = str(tiny_model)
    config["output"] = {"dir": str(tmp_path / "run"), "save_every": 0}
    config["tasks"] = {"t": {"data": "builtin:bias_probe?size=40", "eval_size": 4,
                             "rewards": [{"fn": f"{USER_REWARDS}:constant"}]}}
    config["train"].update(max_steps=10, micro_batch_size=8, warmup_steps=0)
    config["rollout"].update(num_generations=4)
    config["sft"]["enabled"] = False
    config["eval"].update(max_samples=4, every_steps=0)
    config["logging"] = {"progress_bar": False}
    config["health"] = {"no_signal": {"patience": 3, "action": "stop"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))

    assert main(["train", str(path)]) == 3
    err = capsys.readouterr().err
    assert "error: run stopped by the health monitor: [health] no_signal at step 3" in err
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3]
    events = [m for m in lines if m.get("event") == "health_alert"]
    assert [(e["check"], e["step"]) for e in events] == [("no_signal", 3)]
    assert [c.step for c in list_checkpoints(run)] == [3]  # resumable after a fix
    assert list_checkpoints(run)[0].ok
    summary = json.loads((run / "summary.json").read_text())
    assert summary["health"][0]["check"] == "no_signal"
