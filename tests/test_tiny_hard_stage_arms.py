"""bench/experiments/tiny_hard_stage_arms.py's arms: the names it reads, the random-questions draw, the per-answer
checks."""

import json
from collections import Counter

import pytest

from bench.experiments.tiny_hard_stage_arms import answer_stats, parse_arm, random_levels


def test_arm_names():
    assert parse_arm("unfrozen-hard") == {"freeze_vision_tower": False, "data": "hard", "learning_rate": None}
    assert parse_arm("frozen-random-lr3e-06") == {"freeze_vision_tower": True, "data": "random",
                                                  "learning_rate": 3e-06}
    for bad in ("thawed-hard", "frozen-easy", "frozen-hard-1e-5", "frozen-hard-lrfast", "frozen"):
        with pytest.raises(SystemExit, match="--arms"):
            parse_arm(bad)


def test_random_questions_match_the_hard_count_and_come_from_every_bucket():
    levels = ["easy"] * 300 + ["medium"] * 300 + ["hard"] * 300
    drawn = random_levels(levels, seed=1)
    assert Counter(drawn) == {"hard": 300, "easy": 600}
    assert drawn == random_levels(levels, seed=1) != random_levels(levels, seed=2)
    picked = Counter(level for level, new in zip(levels, drawn) if new == "hard")
    assert set(picked) == {"easy", "medium", "hard"} and min(picked.values()) > 60  # ~100 each, not the hard third


def test_answer_stats_count_errors_and_listed_objects():
    objects = json.dumps([{"shape": "circle", "color": "red", "cell": 0},
                          {"shape": "circle", "color": "blue", "cell": 4},
                          {"shape": "square", "color": "red", "cell": 8}])
    row = {"question": "How many circles are there?", "answer": "2", "kind": "count", "objects": objects}
    rows = [{**row, "difficulty": "medium"}, {**row, "difficulty": "hard"}, {**row, "difficulty": "hard"}]
    right = "<think>I see a red circle and a blue circle. There are 2 circles.</think><answer>2</answer>"
    over = "<think>I see a red circle, a blue circle and a red circle. There are 3 circles.</think><answer>3</answer>"
    unlisted = "<think>There are 4 circles.</think><answer>4</answer>"
    records = [{"completion": t, "predicted_answer": a, "correct": a == "2"}
               for t, a in ((right, "2"), (over, "3"), (unlisted, "4"))]
    stats = answer_stats(records, rows)
    assert stats["accuracy_by_difficulty"] == {"hard": 0.0, "medium": 1.0}
    assert stats["count_error"] == {"1": 1, "2": 1} and stats["over_by_one"] == 1
    assert stats["signed_error_mean"] == 1.5
    assert stats["listed_objects_correct"] == pytest.approx(1 / 3)
    assert stats["answer_matches_listed"] == pytest.approx(2 / 3)
