"""Synthetic shapes VQA, GenEval-style prompts and the local T2I scorer.

Answers are checked against the pixels of the drawn image with a flood fill written here, so a
generator whose bookkeeping (objects JSON, answers, steps) drifted from what it drew would fail."""

import json
import re
import time

import numpy as np
import pytest
from PIL import Image, ImageFilter

from utils.synthetic import (
    PALETTE,
    detect_shapes,
    make_shapes_vqa,
    make_t2i_prompts,
    relative_position,
    render_objects,
    render_t2i,
    save_shapes_vqa,
    score_t2i,
    shapes_vqa_rows,
    write_jsonl,
)


# ---------------------------------------------------------------------------- independent pixel reader


def pixel_objects(image):
    """Objects from exact palette colours: [(color, shape, cx, cy, (x0, y0, x1, y1))]."""
    rgb = np.asarray(image.convert("RGB")).astype(int)
    found = []
    for color, value in PALETTE.items():
        mask = np.all(rgb == np.array(value), axis=-1)
        seen = np.zeros_like(mask)
        for y, x in zip(*np.nonzero(mask)):
            if seen[y, x]:
                continue
            stack, pixels = [(y, x)], []
            seen[y, x] = True
            while stack:
                py, px = stack.pop()
                pixels.append((py, px))
                for ny, nx in ((py + 1, px), (py - 1, px), (py, px + 1), (py, px - 1)):
                    if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
            ys, xs = np.array(pixels).T
            box = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
            fill = len(pixels) / ((box[2] - box[0]) * (box[3] - box[1]))
            shape = "square" if fill > 0.93 else "circle" if fill > 0.7 else "triangle"
            found.append((color, shape, xs.mean(), ys.mean(), box))
    # Only white background and palette colours are drawn.
    assert (np.all(rgb == 255, axis=-1) | np.any([np.all(rgb == np.array(v), axis=-1) for v in PALETTE.values()], 0)).all()
    return found


def check_answer(row):
    objects = pixel_objects(row["image"])
    question, answer = row["question"], row["answer"]
    if m := re.fullmatch(r"What color is the (\w+)\?", question):
        matches = [o for o in objects if o[1] == m.group(1)]
        assert len(matches) == 1 and matches[0][0] == answer
    elif m := re.fullmatch(r"How many (\w+)s are there\?", question):
        assert sum(o[1] == m.group(1) for o in objects) == int(answer)
    elif m := re.fullmatch(r"How many (\w+) shapes are there\?", question):
        assert sum(o[0] == m.group(1) for o in objects) == int(answer)
    elif m := re.fullmatch(r"Are there more (\w+) shapes than (\w+) shapes\?", question):
        more = sum(o[0] == m.group(1) for o in objects) > sum(o[0] == m.group(2) for o in objects)
        assert answer == ("yes" if more else "no")
        assert sum(o[0] == m.group(1) for o in objects) != sum(o[0] == m.group(2) for o in objects)
    elif m := re.fullmatch(r"Is the (\w+) (\w+) left or right of the (\w+) (\w+)\?", question):
        (a,) = [o for o in objects if o[:2] == (m.group(1), m.group(2))]
        (b,) = [o for o in objects if o[:2] == (m.group(3), m.group(4))]
        assert answer == ("left" if a[2] < b[2] else "right")
    else:
        raise AssertionError(f"unexpected question {question!r}")
    return objects


# ---------------------------------------------------------------------------- shapes VQA


def test_shapes_vqa_answers_match_the_drawn_pixels():
    rows = shapes_vqa_rows(150, seed=7)
    assert {r["kind"] for r in rows} == {"color", "count", "count_color", "compare", "position"}
    for row in rows:
        objects = check_answer(row)
        # The objects column describes what was drawn.
        listed = json.loads(row["objects"])
        assert sorted((o["color"], o["shape"]) for o in listed) == sorted(o[:2] for o in objects)
        assert 2 <= len(row["reference_steps"]) <= 4 and all(s.strip() for s in row["reference_steps"])
        assert row["difficulty"] in ("easy", "medium", "hard")


def region(obj, size=84):
    row = ("top", "middle", "bottom")[int(obj[3] * 3 // size)]
    col = ("left", "center", "right")[int(obj[2] * 3 // size)]
    return "center" if (row, col) == ("middle", "center") else f"{row} {col}"


def test_reference_steps_state_the_answer_and_true_locations():
    for row in shapes_vqa_rows(80, seed=3):
        steps, answer, objects = row["reference_steps"], row["answer"], pixel_objects(row["image"])
        assert re.search(rf"\b{answer}\b", steps[-1]), (steps, answer)
        if row["kind"] == "color":
            (target,) = [o for o in objects if o[1] == row["question"].split()[-1].rstrip("?")]
            assert steps[1].endswith(f"in the {region(target)}")
        if row["kind"] == "count":
            assert all(f"the {region(o)}" in steps[0] for o in objects)
        if row["kind"] == "position":
            words = row["question"].rstrip("?").split()
            for step, (color, shape) in zip(steps, [(words[2], words[3]), (words[-2], words[-1])]):
                (obj,) = [o for o in objects if o[:2] == (color, shape)]
                assert step == f"The {color} {shape} is in the {region(obj)}"


def test_shapes_vqa_is_deterministic_per_seed_and_prefix_stable():
    a, b = shapes_vqa_rows(12, seed=5), shapes_vqa_rows(12, seed=5)
    longer, other = shapes_vqa_rows(30, seed=5), shapes_vqa_rows(12, seed=6)

    def key(row):
        return (row["question"], row["answer"], row["objects"], np.asarray(row["image"]).tobytes())

    assert [key(r) for r in a] == [key(r) for r in b] == [key(r) for r in longer[:12]]
    assert [key(r) for r in a] != [key(r) for r in other]


def test_grid_layout_keeps_each_object_inside_its_own_cell():
    for row in shapes_vqa_rows(60, seed=1, kinds=("count",)):
        cells = set()
        for _, _, _, _, (x0, y0, x1, y1) in pixel_objects(row["image"]):
            cell = (x0 // 28, y0 // 28)
            assert ((x1 - 1) // 28, (y1 - 1) // 28) == cell  # the whole box in one 28 px cell
            cells.add(cell)
        assert len(cells) == int(row["answer"])


def test_count_answers_cover_one_to_max_objects():
    answers = [int(r["answer"]) for r in shapes_vqa_rows(120, seed=2, kinds=("count", "count_color"), max_objects=4)]
    assert set(answers) == {1, 2, 3, 4}
    answers = [int(r["answer"]) for r in shapes_vqa_rows(60, seed=2, kinds=("count",), max_objects=2)]
    assert set(answers) == {1, 2}


def test_free_layout_other_sizes_and_colour_subsets():
    rows = shapes_vqa_rows(40, seed=4, layout="free", image_size=112, colors=("red", "blue"))
    for row in rows:
        assert row["image"].size == (112, 112)
        assert json.loads(row["objects"])[0]["cell"] is None
        assert {o[0] for o in check_answer(row)} <= {"red", "blue"}


def test_yes_no_and_left_right_are_both_used():
    rows = shapes_vqa_rows(100, seed=9, kinds=("compare", "position"))
    assert {r["answer"] for r in rows} == {"yes", "no", "left", "right"}


def test_make_shapes_vqa_dataset_and_save_to_disk(tmp_path):
    import datasets

    ds = make_shapes_vqa(10, seed=0, kinds=("color",))
    assert isinstance(ds.features["image"], datasets.Image)
    assert ds.column_names[:8] == ["id", "image", "question", "answer", "reference_steps", "difficulty", "kind", "objects"]
    assert set(ds["kind"]) == {"color"}
    folder = save_shapes_vqa(str(tmp_path / "shapes"), 10, seed=0, kinds=("color",))
    loaded = datasets.load_from_disk(folder)
    assert loaded["question"] == ds["question"]
    assert np.array_equal(np.asarray(loaded[3]["image"]), np.asarray(ds[3]["image"]))


def test_thousand_rows_are_fast():
    start = time.perf_counter()
    make_shapes_vqa(1000, seed=0)
    assert time.perf_counter() - start < 15  # ~1 s on an idle 2-core machine


def test_bad_generator_arguments_are_named():
    with pytest.raises(ValueError, match="kinds"):
        shapes_vqa_rows(2, kinds=("colour",))
    with pytest.raises(ValueError, match="max_objects"):
        shapes_vqa_rows(2, max_objects=10)
    with pytest.raises(ValueError, match="layout"):
        shapes_vqa_rows(2, layout="spiral")


# ---------------------------------------------------------------------------- T2I prompts and scorer


def test_t2i_prompts_follow_the_geneval_schema(tmp_path):
    rows = make_t2i_prompts(60, seed=1)
    assert rows == make_t2i_prompts(60, seed=1) and rows != make_t2i_prompts(60, seed=2)
    assert {r["tag"] for r in rows} == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    for row in rows:
        assert set(row) == {"tag", "include", "exclude", "prompt"}
        for item in row["include"]:
            assert item["class"] in row["prompt"]
            assert item.get("color", "") in row["prompt"]
        if row["tag"] == "counting":
            (item,) = row["include"]
            assert row["exclude"] == [{"class": item["class"], "count": item["count"] + 1}]
        if row["tag"] == "position":
            relation, target = row["include"][1]["position"]
            assert target == 0 and relation in row["prompt"]
    path = write_jsonl(rows, str(tmp_path / "prompts.jsonl"))
    assert [json.loads(line) for line in open(path)] == rows


def test_renders_of_every_prompt_score_one():
    rows = make_t2i_prompts(120, seed=3)
    for i, row in enumerate(rows):
        assert score_t2i(render_t2i(row, seed=i), row) == {"score": 1.0, "strict": 1.0}, row


def meta(tag, include, exclude=()):
    return {"tag": tag, "include": include, "exclude": list(exclude), "prompt": tag}


def objects_image(*objects, size=64):
    return render_objects([dict(shape=s, color=c, x=x, y=y, size=12) for s, c, x, y in objects], size)


def test_wrong_colour_count_and_position_score_lower_and_not_strict():
    # colour: a blue circle for "a red circle"
    row = meta("colors", [{"class": "circle", "count": 1, "color": "red"}])
    good, wrong = objects_image(("circle", "red", 32, 32)), objects_image(("circle", "blue", 32, 32))
    assert score_t2i(good, row)["strict"] == 1.0
    assert score_t2i(wrong, row) == {"score": 0.5, "strict": 0.0}  # class right, colour wrong

    # count: "two circles" (exclude 3) with one or three circles: partial credit
    row = meta("counting", [{"class": "circle", "count": 2}], [{"class": "circle", "count": 3}])
    one = objects_image(("circle", "red", 10, 10))
    three = objects_image(("circle", "red", 10, 10), ("circle", "red", 32, 32), ("circle", "green", 54, 54))
    assert score_t2i(one, row) == {"score": pytest.approx(0.75), "strict": 0.0}
    assert score_t2i(three, row) == {"score": pytest.approx((1 + 2 / 3) / 2), "strict": 0.0}

    # position: "a square right of a circle" drawn the other way round
    row = meta("position", [{"class": "circle", "count": 1}, {"class": "square", "count": 1, "position": ["right of", 0]}])
    right = objects_image(("circle", "red", 12, 32), ("square", "blue", 50, 32))
    left = objects_image(("circle", "red", 50, 32), ("square", "blue", 12, 32))
    assert score_t2i(right, row)["strict"] == 1.0
    assert score_t2i(left, row) == {"score": pytest.approx((1 + 0.5) / 2), "strict": 0.0}

    # a missing object and a blank canvas
    row = meta("two_object", [{"class": "circle", "count": 1}, {"class": "triangle", "count": 1}])
    assert score_t2i(objects_image(("circle", "red", 20, 20)), row) == {"score": 0.5, "strict": 0.0}
    assert score_t2i(Image.new("RGB", (64, 64), "white"), row) == {"score": 0.0, "strict": 0.0}


def test_wrong_renders_of_generated_prompts_fail_strict():
    for i, row in enumerate(make_t2i_prompts(36, seed=5, tags=("colors", "counting", "color_attr"))):
        broken = json.loads(json.dumps(row))
        item = broken["include"][0]
        if "color" in item:
            item["color"] = next(c for c in ("red", "green", "blue") if c != item["color"])
        else:
            item["count"] += 1
        result = score_t2i(render_t2i(broken, seed=i), row)
        assert result["strict"] == 0.0 and result["score"] < 1.0, (row, broken)


def test_scorer_survives_mild_noise_and_blur():
    rng = np.random.default_rng(0)
    rows = make_t2i_prompts(60, seed=8)
    strict = []
    for i, row in enumerate(rows):
        image = render_t2i(row, seed=i).filter(ImageFilter.GaussianBlur(0.6))
        noisy = np.clip(np.asarray(image, dtype=float) + rng.normal(0, 10, (64, 64, 3)), 0, 255).astype(np.uint8)
        strict.append(score_t2i(Image.fromarray(noisy), row)["strict"])
    assert np.mean(strict) >= 0.85  # ~0.95 measured


def test_scorer_accepts_arrays_and_rejects_unknown_classes():
    row = meta("colors", [{"class": "square", "count": 1, "color": "green"}])
    image = objects_image(("square", "green", 30, 30))
    array = np.asarray(image)
    assert score_t2i(array, row)["strict"] == 1.0
    assert score_t2i(array.transpose(2, 0, 1) / 255.0, row)["strict"] == 1.0  # CHW floats
    assert score_t2i(image, json.dumps(row))["strict"] == 1.0  # JSON metadata
    with pytest.raises(ValueError, match="bus"):
        score_t2i(image, meta("colors", [{"class": "bus", "count": 1}]))


def test_detect_shapes_agrees_with_the_vqa_generator():
    for row in shapes_vqa_rows(80, seed=11, layout="free"):
        found = sorted((d["shape"], d["color"]) for d in detect_shapes(row["image"]))
        assert found == sorted((o["shape"], o["color"]) for o in json.loads(row["objects"]))


def test_relative_position_follows_geneval():
    assert relative_position((0, 0, 10, 10), (30, 0, 40, 10)) == {"left of"}
    assert relative_position((30, 30, 40, 40), (0, 0, 10, 10)) == {"right of", "below"}
    assert relative_position((0, 0, 10, 10), (1, 1, 11, 11)) == set()  # overlapping: no relation
