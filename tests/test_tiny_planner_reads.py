"""bench/experiments/tiny_planner_reads.py: the numbers it prints about a planner's greedy plans."""

import pytest

from bench.experiments.tiny_planner_reads import plan_columns, plan_stats

ROWS = [{"prompt": "a photo of a red square", "include": [{"class": "square", "count": 1, "color": "red"}]},
        {"prompt": "a photo of two circles", "include": [{"class": "circle", "count": 2}]},
        {"prompt": "a photo of a blue circle and a green square",
         "include": [{"class": "circle", "count": 1, "color": "blue"},
                     {"class": "square", "count": 1, "color": "green"}]}]


def test_plan_columns_reads_each_objects_column():
    assert plan_columns("red square top left, blue circle middle center") == ["left", "center"]
    assert plan_columns("") == []


def test_plan_stats_counts_colours_named_columns_and_the_first_colour():
    plans = ["red square top left",  # right
             "yellow circle top right, yellow circle bottom right, red circle middle right",  # one circle too many
             "yellow circle middle left, green square bottom right"]  # blue not named
    s = plan_stats(plans, ROWS)
    assert s["right"] == pytest.approx(1 / 3)
    assert s["objects"] == pytest.approx(6 / 3) and s["asked"] == pytest.approx(5 / 3)
    assert s["coloured_rows"] == 2 and s["coloured_named"] == pytest.approx(1 / 2)
    assert s["first_colour"] == ("yellow", pytest.approx(2 / 3))
    assert s["columns"] == {"left": pytest.approx(2 / 6), "center": 0.0, "right": pytest.approx(4 / 6)}
