"""The greedy quick-eval split over processes: each process decodes and scores its share of the
held-out prompts, every prompt is scored exactly once (a judge is not called twice), and every
process ends with the results one process would have computed alone."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from mogrpo.eval.quick_eval import evaluate


def length_score(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A graded score; each completion it is called with is appended to $SCORED_LOG."""
    with open(os.environ["SCORED_LOG"], "a", encoding="utf-8") as log:
        log.writelines(json.dumps(c) + "\n" for c in completions)
    return [float(len(c) % 3) for c in completions]


class Processes:
    """Process `rank` of 2; `gather` hands back what the other process sent (recorded in
    `sent` by running that process first)."""

    def __init__(self, rank: int, sent: list) -> None:
        self.rank, self.sent, self.calls = rank, sent, 0

    def shard(self, items: list) -> list:
        return items[self.rank::2]

    def gather(self, value):
        self.calls += 1
        if self.rank == 1:
            self.sent.append(value)
            return [value]  # what process 1 does with it is not under test
        return [value, self.sent[self.calls - 1]]


@pytest.fixture(scope="module")
def ctx(tiny_model_dir, tmp_path_factory):
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.run import build_context, seed_everything

    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path_factory.mktemp("run"))
    for task in base["tasks"].values():
        task["data"] += "?size=40"
        task["eval_size"] = 7  # odd: the processes get 4 and 3 prompts
        task["rewards"] = [{"fn": f"{__file__}:length_score"}]
    base["rollout"].update(max_completion_length=6)
    config, _ = load_config(None, ["eval.max_samples=7"], base=base)
    seed_everything(0)
    return build_context(config, load_tasks(config))


def scored(log: Path) -> list[str]:
    calls = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    log.unlink()
    return calls


def test_two_processes_score_each_prompt_once_and_agree_with_one(ctx, tmp_path, monkeypatch):
    log = tmp_path / "scored.jsonl"
    monkeypatch.setenv("SCORED_LOG", str(log))
    alone = evaluate(ctx, batch_size=3, samples=7)
    scored_alone = scored(log)
    sent: list = []
    evaluate(ctx, batch_size=3, samples=7, processes=Processes(1, sent))
    split = evaluate(ctx, batch_size=3, samples=7, processes=Processes(0, sent))
    scored_split = scored(log)
    assert len(scored_split) == len(scored_alone) == 7 * len(ctx.tasks)  # not 7 per process
    assert sorted(scored_split) == sorted(scored_alone)
    assert split.keys() == alone.keys()
    for task in alone:
        assert asdict(split[task]) == asdict(alone[task])  # prompts and samples in order too
        assert split[task].num_samples == 7


def test_every_batch_of_the_eval_decodes_on_one_build_of_the_weights(ctx, tmp_path,
                                                                     monkeypatch):
    """The quick eval's batches (3 of each task here) share one fused, packed copy of the
    weights (`held_projections`), let go when the eval ends."""
    from mogrpo.rollout import projections

    monkeypatch.setenv("SCORED_LOG", str(tmp_path / "scored.jsonl"))
    built = []
    build = projections._build_projections
    monkeypatch.setattr(projections, "_build_projections", lambda *a: built.append(1) or build(*a))
    results = evaluate(ctx, batch_size=3)
    assert len(results) == 2 and all(r.num_samples == 7 for r in results.values())
    assert len(built) == 1 and not projections._HELD


def test_eval_decodes_no_more_rows_at_once_than_the_generation_batch(ctx, tmp_path, monkeypatch):
    # the planner's generation phase (and the ladder's smaller-generation-batch rung) assume it
    import mogrpo.eval.quick_eval as quick_eval

    monkeypatch.setenv("SCORED_LOG", str(tmp_path / "scored.jsonl"))
    rows: list[int] = []
    generate = quick_eval.generate_rollout

    def counted(policy, tokenizer, texts, *args, **kwargs):
        rows.append(len(texts))
        return generate(policy, tokenizer, texts, *args, **kwargs)

    monkeypatch.setattr(quick_eval, "generate_rollout", counted)
    monkeypatch.setattr(ctx.config.rollout, "generation_batch_size", 3)
    evaluate(ctx)
    assert rows == [3, 3, 1] * len(ctx.tasks)  # 7 held-out prompts a task, 32 at most a batch
