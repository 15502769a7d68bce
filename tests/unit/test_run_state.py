"""Log repair on resume: the append-only logs agree with the checkpoint after a kill."""

from __future__ import annotations

import json

from mogrpo.trainer.state import repair_logs


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_metrics_are_cut_back_to_the_checkpoint_step_and_a_torn_line_is_dropped(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [
        '{"step": 1, "loss": 0.5}',
        '{"event": "health_alert", "step": 2, "check": "truncation"}',
        '{"step": 2, "loss": 0.25}',
        '{"step": 3, "loss": 0.125}',
        '{"step": 4, "lo',  # the kill cut this line
    ])
    repair_logs(tmp_path, {"step": 2, "quick_eval": {"records": []}})
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]
    assert not list(tmp_path.glob(".*.tmp"))  # replaced atomically, nothing left behind


def test_eval_log_is_rewritten_from_the_checkpointed_records(tmp_path):
    # killed during the final save: the `end` eval is on disk but not in the checkpoint
    write_lines(tmp_path / "eval.jsonl", [
        '{"step": 0, "tag": "start", "fairness": {"score": 0.25}}',
        '{"step": 4, "tag": "end", "fairness": {"score": 0.5}}',
    ])
    records = [{"step": 0, "tag": "start", "fairness": {"score": 0.25, "title": "Grüße"}}]
    repair_logs(tmp_path, {"step": 4, "quick_eval": {"records": records}})
    assert (tmp_path / "eval.jsonl").read_text(encoding="utf-8") == (
        '{"step": 0, "tag": "start", "fairness": {"score": 0.25, "title": "Grüße"}}\n')


def test_a_checkpoint_without_eval_records_cuts_the_eval_log_by_step(tmp_path):
    write_lines(tmp_path / "eval.jsonl", ['{"step": 0, "tag": "start"}', '{"step": 3, "tag": "3"}'])
    state = {"step": 2, "quick_eval": {"scores": {}}}
    repair_logs(tmp_path, state)
    assert (tmp_path / "eval.jsonl").read_text() == '{"step": 0, "tag": "start"}\n'
    assert state["quick_eval"]["records"] == [{"step": 0, "tag": "start"}]


def test_a_rollback_needs_the_checkpoint_intact_in_every_process(tmp_path):
    """Under DDP each process reads its own checkpoint of the step (process r > 0: its state
    and RNG, process 0's weights). One damaged: no process rolls back, where process 0 once
    went back alone and the next save failed with "the processes' weights differ"."""
    from types import SimpleNamespace

    import torch

    from mogrpo.checkpoint import save_checkpoint
    from mogrpo.config import RunConfig
    from mogrpo.trainer.distributed import Dist
    from mogrpo.trainer.state import RunState

    class OtherProcessDamaged(Dist):  # process 0 of 2; process 1 finds its checkpoint damaged
        def gather(self, value):
            return [value, False]

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, state={}, config_yaml="")
    with torch.no_grad():
        model.weight.add_(1.0)
    trained = model.weight.detach().clone()
    trainer = SimpleNamespace(optimizer=optimizer, parallel=SimpleNamespace(is_fsdp=False))
    state = RunState(RunConfig.model_validate({}), SimpleNamespace(policy=model), trainer,
                     None, None, {}, False, OtherProcessDamaged(0, 2), tmp_path, tmp_path)
    assert state.rollback(3) is None
    assert torch.equal(model.weight, trained)  # still the weights process 1 holds
    state.dist = Dist()  # one process: its checkpoint is intact, so it goes back
    assert state.rollback(3) is not None
    assert not torch.equal(model.weight, trained)
