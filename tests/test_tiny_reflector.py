"""The tiny reflector's data and its score: tiny.reflector.reflector_sft_rows (reflect rows with planner rows replayed;
their encoding under recipes/stages/tiny_reflector.yaml is checked in test_tiny_edits.py, which builds the VLM) and
tiny.reflector's reading of a reflection (right when its edit, carried out on the draft, gives the prompt's
render)."""

import json

import pytest

from tiny.edits import FLAWS, cell_name, reflector_rows
from tiny.reflector import (
    DESCRIBE_PROMPT,
    describe_rows,
    reflection_outcome,
    reflection_scores,
    reflector_sft_rows,
    seen_outcome,
    seen_scores,
)
from utils.t2i.r3_format import NO_EDIT

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


def test_describe_rows_say_what_the_draft_shows_and_score_full_marks(rows):
    described = describe_rows(rows)
    assert [r["images"] for r in described] == [r["images"] for r in rows]
    assert all(r["messages"][0]["content"] == "<image>" + DESCRIBE_PROMPT for r in described)
    answers = [r["messages"][1]["content"] for r in described]
    assert all(_answer(r).startswith("<think>" + a + ";") for r, a in zip(rows, answers))  # the reflection's start
    assert seen_scores(answers, rows) == dict(seen_count=1.0, seen_colors=1.0, seen_objects=1.0)
    assert seen_scores([_answer(r) for r in rows], rows)["seen_objects"] == 1.0


def test_seen_outcome_tells_count_colours_and_objects_apart(rows):
    row = next(r for r in rows if len(json.loads(r["draft"])) >= 2)
    objects = sorted(json.loads(row["draft"]), key=lambda o: o["cell"])

    def said(changed):
        return "I see " + ", ".join(f"{o['color']} {o['shape']} {cell_name(o['cell'])}" for o in changed)

    assert seen_outcome(said(objects), row) == dict(count=True, colors=True, objects=True)
    first = objects[0]
    other = "green" if first["color"] != "green" else "red"
    assert seen_outcome(said([{**first, "color": other}] + objects[1:]), row) == dict(count=True, colors=False,
                                                                                      objects=False)
    free = next(c for c in range(9) if all(o["cell"] != c for o in objects))
    assert seen_outcome(said([{**first, "cell": free}] + objects[1:]), row) == dict(count=True, colors=True,
                                                                                    objects=False)
    assert seen_outcome(said(objects[1:]), row)["count"] is False
    assert seen_outcome("I see nothing", row) == dict(count=False, colors=False, objects=False)
    # only the part before the first ";" counts: what is wrong is not what is seen
    assert seen_outcome(said(objects) + f"; a {other} circle bottom right is missing", row)["objects"] is True


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


def test_the_reflector_trains_on_from_the_describer_and_its_key_follows_the_describer(monkeypatch):
    """tiny-reflector's SFT starts from tiny-describer's checkpoint (describe first, then reflect), on drafts of a seed
    of their own; a changed describe recipe or describe rows rename the reflector's build too."""
    from tiny import cache

    calls = {}

    def trained(name, recipe, spec, args=()):
        with open(recipe) as f:
            spec = {"recipe": f.read(), **spec}
        calls[name] = dict(recipe=recipe, spec=spec, args=args() if callable(args) else args)
        calls[name]["path"] = f"/cache/{name}-{cache._key(calls[name]['spec'])}/checkpoint-4000"
        return calls[name]["path"]

    monkeypatch.setattr(cache, "_trained", trained)
    monkeypatch.setattr(cache, "cached", lambda name, spec, build: f"/cache/{name}-{cache._key(spec)}")
    cache.tiny_reflector_path()
    describer, reflector = calls["tiny-describer"], calls["tiny-reflector"]
    assert describer["recipe"] == cache.TINY_DESCRIBER_RECIPE and reflector["recipe"] == cache.TINY_REFLECTOR_RECIPE
    assert reflector["args"][:2] == ["--model_name_or_path", describer["path"]]
    assert describer["args"][1].startswith("/cache/planner-eye-")
    assert describer["args"][3].startswith("/cache/describe-rows-")
    assert reflector["spec"]["tiny-describer"] == describer["spec"]
    # the describe drafts are neither the reflect rows it is then trained on nor the held-out ones
    assert cache.DESCRIBE_ROWS["seed"] not in {s["seed"] for s in cache.REFLECT_SPLITS.values()}
    before = cache._key(reflector["spec"])
    monkeypatch.setattr(cache, "DESCRIBE_ROWS", dict(cache.DESCRIBE_ROWS, n=16))
    cache.tiny_reflector_path()
    assert cache._key(calls["tiny-reflector"]["spec"]) != before
