"""The tiny reflector's data and its score: tiny.reflector.reflector_sft_rows (reflect rows with planner rows replayed;
their encoding under recipes/stages/tiny_reflector.yaml is checked in test_tiny_edits.py, which builds the VLM) and
tiny.reflector's reading of a reflection (right when its edit, carried out on the draft, gives the prompt's
render)."""

import json

import pytest

from tiny.edits import FLAWS, reflector_rows
from tiny.reflector import reflection_outcome, reflection_scores, reflector_sft_rows
from utils.r3_format import NO_EDIT

SIZE = 32


@pytest.fixture(scope="module")
def rows():
    return reflector_rows(25, seed=5, image_size=SIZE)  # 5 of each flaw


def _answer(row):
    return row["messages"][1]["content"]


def test_the_rows_own_reflection_fixes_every_draft(rows):
    outcomes = [reflection_outcome(_answer(r), r, image_size=SIZE) for r in rows]
    assert all(o["fixed"] and o["format"] == 1.0 for o in outcomes)
    assert [o["kept"] for o in outcomes] == [r["flaw"] == "none" for r in rows]
    scores = reflection_scores([_answer(r) for r in rows], rows, image_size=SIZE)
    assert scores["fixed"] == 1.0 and all(scores[f"fixed/{f}"] == 1.0 for f in FLAWS)
    assert (scores["kept_perfect"], scores["kept_flawed"]) == (1.0, 0.0)


def test_keeping_every_draft_is_right_only_on_the_flawless_ones(rows):
    texts = [f"<think>fine</think> {NO_EDIT}"] * len(rows)
    scores = reflection_scores(texts, rows, image_size=SIZE)
    assert scores["fixed"] == pytest.approx(1 / len(FLAWS))
    assert scores["fixed/none"] == 1.0 and scores["fixed/missing"] == 0.0
    assert (scores["kept_perfect"], scores["kept_flawed"]) == (1.0, 1.0)


def test_a_wrong_or_unreadable_edit_does_not_fix_the_draft(rows):
    missing = next(r for r in rows if r["flaw"] == "missing")
    target = json.loads(missing["target"])
    draft_keys = {(o["cell"], o["color"], o["shape"]) for o in json.loads(missing["draft"])}
    absent = next(o for o in target if (o["cell"], o["color"], o["shape"]) not in draft_keys)
    right = _answer(missing).rpartition("</think>")[2].strip()
    other = "blue" if absent["color"] != "blue" else "red"
    wrong = right.replace(f" {absent['color']} ", f" {other} ", 1)
    assert wrong != right
    for text, fixed in ((f"<think>x</think> {right}", True), (f"<think>x</think> {wrong}", False),
                        ("<think>x</think> paint it all green", False), ("no think block at all", False)):
        assert reflection_outcome(text, missing, image_size=SIZE)["fixed"] is fixed, text
    # without a think block the format is 0 and the image is kept, as the reflect stage reads it
    assert reflection_outcome("add a red circle", missing, image_size=SIZE) == dict(format=0.0, kept=True,
                                                                                    fixed=False)


def test_reflector_sft_rows_replay_planner_rows_among_the_reflect_rows():
    plans = [{"id": f"plan-{i}", "messages": [{"role": "user", "content": "plan"}]} for i in range(8)]
    mixed = reflector_sft_rows(reflector_rows(6, seed=0, image_size=SIZE), plans[:4])
    assert [r["id"] for r in mixed] == ["reflect-0-0", "plan-0", "reflect-0-1", "plan-1", "reflect-0-2", "plan-2",
                                        "reflect-0-3", "plan-3", "reflect-0-4", "reflect-0-5"]
    assert all(set(r) == {"id", "messages", "images"} for r in mixed)
    assert [len(r["images"]) for r in mixed] == [1 if r["id"].startswith("reflect") else 0 for r in mixed]
    # more plans than reflect rows: the rest at the end
    assert [r["id"] for r in reflector_sft_rows(reflector_rows(2, seed=0, image_size=SIZE), plans[:4])][-2:] == [
        "plan-2", "plan-3"]


def test_with_eye_takes_the_vision_tower_and_nothing_else(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from tiny.reflector import with_eye

    def folder(name, value, vision_shape=(2, 2)):
        (tmp_path / name).mkdir()
        save_file({"visual.blocks.0.w": torch.full(vision_shape, value), "visual.merger.w": torch.full((3,), value),
                   "model.layers.0.w": torch.full((2,), value), "lm_head.weight": torch.full((4,), value)},
                  str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(name)
        return str(tmp_path / name)

    out = with_eye(folder("planner", 1.0), folder("sft", 2.0), str(tmp_path / "out"))
    weights = load_file(f"{out}/model.safetensors")
    assert {k: float(v[0]) if v.ndim == 1 else float(v[0, 0]) for k, v in weights.items()} == {
        "visual.blocks.0.w": 2.0, "visual.merger.w": 2.0, "model.layers.0.w": 1.0, "lm_head.weight": 1.0}
    assert (tmp_path / "out" / "config.json").read_text() == "planner"  # the planner's config and tokenizer
    with pytest.raises(ValueError, match="does not match"):
        with_eye(folder("planner2", 1.0), folder("other", 2.0, vision_shape=(3, 2)), str(tmp_path / "out2"))
