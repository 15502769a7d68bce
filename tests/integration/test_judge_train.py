"""A GRPO step scored by two judges over real HTTP: `mogrpo serve` as the judge of one task, and
a faulty provider (failing over to it) for the other. The step completes, the scores land in the
metrics, every fault is counted, and the API key appears nowhere in the run directory or logs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from judge_server import (
    FaultServer,
    build_seven_model,
    drop,
    judge_options,
    malformed,
    reply,
    status,
)
from mogrpo.cli import main
from mogrpo.demo import demo_base, tokenizer_corpus
from mogrpo.modeling.tiny import build_tiny_model
from mogrpo.rewards.base import resolve_reward
from mogrpo.serve.server import start_server

KEY = "sk-judge-train-leak-check-93c1d0"

JUDGES = '''
from pathlib import Path
from mogrpo.rewards.judge import JudgeReward

CACHE = Path({cache!r})
local = JudgeReward.from_options({local!r}, where="tasks.fairness.rewards.1.kwargs", cache_dir=CACHE)
flaky = JudgeReward.from_options({flaky!r}, where="tasks.hallucination.rewards.1.kwargs",
                                 cache_dir=CACHE)
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_train")
    policy = build_tiny_model(root / "policy", tokenizer_corpus(demo_base(), 0), seed=0,
                              hidden_size=32, num_layers=2, num_heads=2, vocab_size=300)
    return policy, build_seven_model(root / "seven")


def write_run(tmp_path: Path, policy: Path, local: dict, flaky: dict) -> Path:
    judges = tmp_path / "judges.py"
    judges.write_text(JUDGES.format(cache=str(tmp_path / "judge_cache"), local=local, flaky=flaky))
    config = demo_base()
    config["model"]["name_or_path"] = str(policy)
    config["output"]["dir"] = str(tmp_path / "run")
    for task in config["tasks"].values():
        task["data"] += "?size=40"
        task["eval_size"] = 4
    config["tasks"]["fairness"]["rewards"].append({"fn": f"{judges}:local", "name": "judge"})
    config["tasks"]["hallucination"]["rewards"].append({"fn": f"{judges}:flaky", "name": "judge"})
    config["train"].update(max_steps=1, micro_batch_size=8, gradient_accumulation_steps=1,
                           warmup_steps=0)
    config["rollout"].update(num_generations=4)
    config["sft"]["enabled"] = False
    config["eval"].update(max_samples=4)
    config["logging"] = {"progress_bar": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_training_step_scored_by_judges(tmp_path, models, monkeypatch, capsys):
    policy, seven = models
    monkeypatch.setenv("MOGRPO_JUDGE_TRAIN_KEY", KEY)
    server, thread = start_server(str(seven), port=0, max_batch=8, max_new_tokens=4)
    faults = [status(500), drop(), malformed(), status(429, retry_after="0"), reply("??")]
    try:
        with FaultServer(script=faults, default=reply("7")) as faulty:
            local = judge_options(server.url, timeout=30)
            flaky = judge_options(faulty.url, server.url, timeout=30)
            flaky["providers"][0]["api_key_env"] = "MOGRPO_JUDGE_TRAIN_KEY"
            path = write_run(tmp_path, policy, local, flaky)
            assert main(["train", str(path)]) == 0
            requests_seen = faulty.calls
    finally:
        server.close()
        thread.join(timeout=10)

    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1
    step = metrics[0]
    # The served "7" model gives every fairness completion 7/10.
    assert step["task/fairness/reward/judge/mean"] == pytest.approx(0.7)
    # Exactly one hallucination completion drew the unparseable "??"; the rest scored 0.7.
    # The trainer reports each step's judge calls as metrics (and a [Judge@1] line).
    judge = "task/hallucination/judge/judge"
    assert (step[f"{judge}/failed"], step[f"{judge}/unparseable"]) == (1, 1)
    errors = {kind: step[f"{judge}/errors/{kind}"] for kind in
              ("timeout", "connection", "http_429", "http_5xx", "http_4xx", "bad_body")}
    assert errors == {"timeout": 0, "connection": 1, "http_429": 1, "http_5xx": 1,
                      "http_4xx": 0, "bad_body": 1}
    assert step[f"{judge}/provider/primary/requests"] == requests_seen
    assert step["task/fairness/judge/judge/failed"] == 0
    logs = capsys.readouterr().err
    assert "[Judge@1] 4 calls" in logs and "failed 1 (hallucination/judge)" in logs
    assert step["task/hallucination/reward/judge/mean"] == pytest.approx(0.7)
    assert 0 < step["task/hallucination/reward/judge/missing_frac"] < 1
    assert not math.isnan(step["loss"])
    # The key went to the faulty provider only as a header: nowhere on disk, nowhere in the logs.
    assert KEY not in logs
    for file in [*(tmp_path / "run").rglob("*"), *(tmp_path / "judge_cache").rglob("*")]:
        if file.is_file():
            assert KEY.encode() not in file.read_bytes(), file
    for name in ("local", "flaky"):
        resolve_reward(f"{tmp_path / 'judges.py'}:{name}").close()
