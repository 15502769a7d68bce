"""Pareto front, best per task and the tracker on hand-made points."""

from __future__ import annotations

import json
import math

from mogrpo.eval.pareto import ParetoTracker, Point, best_per_task, pareto_front

NAN = math.nan


def P(step: int, f: float, h: float) -> Point:
    return Point(f"step-{step}", step, {"fairness": f, "hallucination": h})


def steps(points: list[Point]) -> list[int]:
    return [p.step for p in points]


def test_front_of_a_hand_made_set():
    points = [
        P(20, 0.40, 0.40),  # front: nobody is >= on both with one strictly better
        P(40, 0.50, 0.30),  # front: best fairness
        P(60, 0.30, 0.50),  # front: best hallucination
        P(80, 0.40, 0.30),  # dominated by 20 (tie on f, worse on h) and by 40
        P(100, 0.35, 0.35),  # dominated by 20 on both
    ]
    assert steps(pareto_front(points)) == [20, 40, 60]


def test_a_tie_on_one_task_and_worse_on_the_other_is_dominated():
    assert steps(pareto_front([P(1, 0.5, 0.4), P(2, 0.5, 0.3)])) == [1]
    assert steps(pareto_front([P(1, 0.5, 0.3), P(2, 0.5, 0.4)])) == [2]


def test_exact_duplicates_are_both_kept():
    points = [P(20, 0.5, 0.3), P(40, 0.4, 0.4), P(60, 0.5, 0.3)]
    assert steps(pareto_front(points)) == [20, 40, 60]
    # ... but a point beating both duplicates removes both.
    assert steps(pareto_front(points + [P(80, 0.5, 0.31)])) == [40, 80]


def test_single_task_keeps_every_point_at_the_maximum():
    points = [Point("a", 1, {"f": 0.2}), Point("b", 2, {"f": 0.7}), Point("c", 3, {"f": 0.7})]
    assert steps(pareto_front(points)) == [2, 3]


def test_nan_and_missing_scores_count_as_worst():
    # NaN on f but the best h: nobody beats it on h, so it stays on the front.
    assert steps(pareto_front([P(1, NAN, 0.9), P(2, 0.1, 0.1)])) == [1, 2]
    # NaN on f and equal on h: the scored point dominates it.
    assert steps(pareto_front([P(1, NAN, 0.1), P(2, 0.1, 0.1)])) == [2]
    # A missing task is NaN; two all-NaN points are equal to each other.
    missing = Point("m", 3, {"hallucination": 0.1})
    assert steps(pareto_front([missing, P(2, 0.1, 0.1)])) == [2]
    assert steps(pareto_front([P(1, NAN, NAN), P(2, NAN, NAN)])) == [1, 2]


def test_explicit_task_list_restricts_the_comparison():
    points = [P(1, 0.5, 0.1), P(2, 0.4, 0.9)]
    assert steps(pareto_front(points, tasks=["fairness"])) == [1]
    assert pareto_front([]) == []


def test_best_per_task_ties_go_to_the_earliest_step():
    points = [P(60, 0.5, 0.2), P(20, 0.5, 0.1), P(40, 0.3, 0.2), P(80, NAN, 0.2)]
    best = best_per_task(points)
    assert best["fairness"].step == 20  # 0.5 at steps 60 and 20
    assert best["hallucination"].step == 40  # 0.2 at 60, 40, 80
    assert list(best_per_task([P(1, NAN, 0.3)])) == ["hallucination"]  # no finite f: no entry


def make_tracker() -> ParetoTracker:
    tracker = ParetoTracker()
    for point in [P(20, 0.452, 0.397), P(40, 0.431, 0.497), P(60, 0.40, 0.39),
                  P(80, 0.452, 0.2)]:
        tracker.add(point)
    return tracker


def test_tracker_front_best_and_add_result():
    tracker = ParetoTracker()
    assert tracker.add(P(20, 0.452, 0.397)) is True
    assert tracker.add(P(40, 0.431, 0.497)) is True
    assert tracker.add(P(60, 0.40, 0.39)) is False  # dominated by step 20
    assert tracker.add(P(80, 0.452, 0.2)) is False  # ties step 20 on f, worse on h
    assert steps(tracker.front) == [20, 40]
    assert {t: p.step for t, p in tracker.best.items()} == {"fairness": 20, "hallucination": 40}


def test_tracker_replaces_a_re_evaluated_step():
    tracker = make_tracker()
    tracker.add(P(40, 0.1, 0.1))  # step 40 evaluated again after a resume
    assert steps(tracker.points) == [20, 40, 60, 80]
    assert steps(tracker.front) == [20]


def test_tracker_format_text():
    assert make_tracker().format() == (
        "[Pareto] 2 of 4 evaluated steps on the front (* = best on that task)\n"
        "    step  fairness  hallucination\n"
        "      20     0.452*          0.397\n"
        "      40     0.431           0.497*"
    )
    assert ParetoTracker().format() == "[Pareto] no evaluated steps yet"


def test_format_marks_every_tied_best_and_shows_nan():
    tracker = ParetoTracker(tasks=["f"])
    tracker.add(Point("a", 1, {"f": 0.5}))
    tracker.add(Point("b", 2, {"f": 0.5}))
    assert tracker.format().splitlines()[2:] == ["       1   0.500*", "       2   0.500*"]
    tracker = ParetoTracker()
    tracker.add(P(1, NAN, 0.9))
    assert tracker.format().splitlines()[2] == "       1       nan           0.900*"


def test_tracker_json_and_save(tmp_path):
    tracker = make_tracker()
    tracker.add(P(100, NAN, 0.6))
    path = tmp_path / "pareto.json"
    tracker.save(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data == tracker.to_json()
    assert data["tasks"] == ["fairness", "hallucination"]
    # step 100 is best on h and step 40 still beats it on f (NaN is the worst score)
    assert [p["step"] for p in data["front"]] == [20, 40, 100]
    assert data["front"][2] == {"name": "step-100", "step": 100,
                                "scores": {"fairness": None, "hallucination": 0.6}}
    assert data["best"]["fairness"]["step"] == 20
    assert data["best"]["hallucination"]["step"] == 100
    assert [p.name for p in tmp_path.iterdir()] == ["pareto.json"]  # no temp file left
    tracker.add(P(120, 0.9, 0.9))
    tracker.save(path)  # overwrite in place
    assert [p["step"] for p in json.loads(path.read_text())["front"]] == [120]


def test_tracker_state_round_trip_through_json():
    tracker = make_tracker()
    tracker.add(P(100, NAN, 0.6))
    state = json.loads(json.dumps(tracker.state_dict(), allow_nan=False))
    restored = ParetoTracker()
    restored.load_state_dict(state)
    assert restored.to_json() == tracker.to_json()
    assert restored.format() == tracker.format()
    assert math.isnan(restored.points[-1].scores["fairness"])
    # the same subsequent point gives the same front in both
    for t in (tracker, restored):
        t.add(P(120, 0.46, 0.7))
    assert steps(restored.front) == steps(tracker.front) == [120]
