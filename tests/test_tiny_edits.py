"""tiny/edits.py: edit triples and reflector rows say exactly what differs, in words the reflect stage reads.

Each instruction is read back, carried out on the first scene and compared with the second; the renders are compared
pixel by pixel and through the detector; the reflections go through R3's format check and the real SFT loader."""

import json
import math
import os

import numpy as np
import pytest

import tiny.cache
from tiny.cache import TINY_EDITS_DATASET, TINY_REFLECT_DATASET, resolve_dataset
from tiny.detector import detected_scene, score_t2i
from tiny.edits import (
    EDIT_KINDS,
    FLAWS,
    GRID,
    Edit,
    apply_edit,
    diff_edit,
    edit_triples,
    instruction_of,
    parse_instruction,
    reflector_rows,
    scene_key,
)
from tiny.shapes import DEFAULT_COLORS, SHAPES, render_objects
from utils.core.data import load_sharegpt
from utils.core.data_sources import load_table
from utils.t2i.r3_format import NO_EDIT, REFLECT_PROMPT, reflection_of

SIZE = 32


@pytest.fixture(scope="module")
def triples():
    return edit_triples(60, seed=3, image_size=SIZE)  # 12 of each kind


@pytest.fixture(scope="module")
def reflections():
    return reflector_rows(50, seed=3, image_size=SIZE)  # 10 of each flaw


def _centre(cell):
    row, col = divmod(cell, GRID)
    return round((col + 0.5) * SIZE / GRID), round((row + 0.5) * SIZE / GRID)


def _named_cells(edit):
    return {c for c in (edit.cell, edit.to_cell) if c is not None}


def test_every_instruction_read_back_and_carried_out_gives_the_edited_scene(triples):
    assert [r["kind"] for r in triples] == [EDIT_KINDS[i % len(EDIT_KINDS)] for i in range(len(triples))]
    assert {r["direction"] for r in triples} == {"free", "repair"}
    for r in triples:
        before, after, edit = json.loads(r["before"]), json.loads(r["after"]), parse_instruction(r["instruction"])
        assert edit.kind == r["kind"] and instruction_of(edit) == r["instruction"], r["id"]
        assert scene_key(apply_edit(before, edit, image_size=SIZE)) == scene_key(after), r["id"]
        untouched = [o for o in before if o["cell"] not in _named_cells(edit)]
        assert untouched == [o for o in after if o["cell"] not in _named_cells(edit)], r["id"]  # geometry kept too
        if edit.kind == "move":  # the moved object keeps its size and its offset from its cell's centre
            old = next(o for o in before if o["cell"] == edit.cell)
            new = next(o for o in after if o["cell"] == edit.to_cell)
            (x0, y0), (x1, y1) = _centre(edit.cell), _centre(edit.to_cell)
            assert new == dict(old, cell=edit.to_cell, x=old["x"] + x1 - x0, y=old["y"] + y1 - y0), r["id"]
        if edit.kind == "none":
            assert before == after and r["instruction"] == NO_EDIT


def _cell_mask(cells):
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    step = SIZE / GRID
    for cell in cells:
        row, col = divmod(cell, GRID)
        mask[int(row * step):math.ceil((row + 1) * step), int(col * step):math.ceil((col + 1) * step)] = True
    return mask


def test_the_renders_differ_only_where_the_instruction_says(triples):
    for r in triples:
        edit = parse_instruction(r["instruction"])
        a, b = np.asarray(r["image_before"]), np.asarray(r["image_after"])
        changed = (a != b).any(-1)
        if edit.kind == "none":
            assert not changed.any(), r["id"]
        else:
            assert changed.any() and not (changed & ~_cell_mask(_named_cells(edit))).any(), r["id"]
        # the detector sees each scene as written down, so its two object lists differ by the edited object alone
        assert detected_scene(r["image_before"]) == scene_key(json.loads(r["before"])), r["id"]
        assert detected_scene(r["image_after"]) == scene_key(json.loads(r["after"])), r["id"]


def test_edits_keep_the_world_s_rules(triples):
    step = SIZE / GRID
    for r in triples:
        for scene in (json.loads(r["before"]), json.loads(r["after"])):
            assert len({o["cell"] for o in scene}) == len(scene) <= GRID * GRID, r["id"]  # one object per cell
            for o in scene:
                assert o["color"] in DEFAULT_COLORS and o["shape"] in SHAPES, r["id"]
                row, col = divmod(o["cell"], GRID)
                x0, y0 = o["x"] - o["size"] // 2, o["y"] - o["size"] // 2
                assert col * step <= x0 and x0 + o["size"] <= (col + 1) * step, r["id"]  # inside its own cell
                assert row * step <= y0 and y0 + o["size"] <= (row + 1) * step, r["id"]


def test_rows_depend_only_on_the_seed_and_their_index(triples):
    again = edit_triples(7, seed=3, image_size=SIZE)
    keys = ("instruction", "before", "after", "prompt")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in triples[:7]]
    assert all(np.array_equal(np.asarray(x["image_after"]), np.asarray(y["image_after"]))
               for x, y in zip(again, triples))
    assert [r["instruction"] for r in edit_triples(7, seed=4)] != [r["instruction"] for r in again]


def test_instructions_that_do_not_fit_the_scene_are_refused():
    scene = [dict(shape="circle", color="red", cell=0, x=5, y=5, size=7)]
    assert parse_instruction("No further edit.") == Edit("none")  # as the reflect stage reads it
    with pytest.raises(ValueError, match="not an edit instruction"):
        parse_instruction("paint it all blue")
    with pytest.raises(ValueError, match="no blue circle at the top left"):
        apply_edit(scene, parse_instruction("remove the blue circle at the top left"), image_size=SIZE)
    with pytest.raises(ValueError, match="top left already holds"):
        apply_edit(scene, parse_instruction("add a green square at the top left"), image_size=SIZE)
    with pytest.raises(ValueError, match="more than one edit"):
        diff_edit(scene, [dict(scene[0], color="blue", cell=4)])


def test_each_reflection_turns_its_draft_into_the_prompt_s_render(reflections):
    assert [r["flaw"] for r in reflections] == [FLAWS[i % len(FLAWS)] for i in range(len(reflections))]
    for r in reflections:
        user, answer = (m["content"] for m in r["messages"])
        assert user == "<image>" + REFLECT_PROMPT.format(prompt=r["prompt"])
        fmt, instruction, keep = reflection_of(answer)
        draft, target, meta = json.loads(r["draft"]), json.loads(r["target"]), json.loads(r["metadata"])
        assert fmt == 1.0 and keep == (r["flaw"] == "none"), r["id"]
        if keep:
            assert instruction == NO_EDIT and draft == target, r["id"]  # exactly the phrase the stage stops on
        fixed = apply_edit(draft, parse_instruction(instruction), image_size=SIZE)
        assert scene_key(fixed) == scene_key(target), r["id"]
        # the scorer agrees: the draft is wrong exactly when it has a flaw, the edited draft is right
        assert np.array_equal(np.asarray(r["images"][0]), np.asarray(render_objects(draft, SIZE)))
        assert score_t2i(render_objects(target, SIZE), meta)["strict"] == 1.0, r["id"]
        assert score_t2i(r["images"][0], meta)["strict"] == float(keep), r["id"]
        assert score_t2i(render_objects(fixed, SIZE), meta)["strict"] == 1.0, r["id"]


def test_reflector_rows_load_and_encode_through_the_sft_loader(reflections, tmp_path):
    import yaml
    from transformers import AutoProcessor

    from tiny.cache import TINY_PLANNER_VLM, TINY_REFLECTOR_RECIPE, save_sharegpt
    from tiny.models import make_tiny_vlm
    from tiny.reflector import reflector_sft_rows
    from utils.core.models import load_model_and_processor
    from utils.core.sft_data import IGNORE_INDEX, encode_sft_batch, sharegpt_conversation

    table = load_sharegpt(save_sharegpt(reflections[:5], str(tmp_path / "rows")))
    assert table.column_names[:2] == ["messages", "images"] and "draft" in table.column_names
    vlm = make_tiny_vlm(str(tmp_path / "vlm"), **TINY_PLANNER_VLM)
    with open(TINY_REFLECTOR_RECIPE) as f:
        recipe = yaml.safe_load(f)
    _, processor = load_model_and_processor(vlm, min_pixels=recipe["min_pixels"])  # as the reflector's SFT
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    conversations = [sharegpt_conversation(table[i]) for i in range(len(table))]
    assert all(m[0]["content"][0] == {"type": "image"} for m, _ in conversations)  # the image first, as the stage
    batch = encode_sft_batch(processor, [m for m, _ in conversations], [i for _, i in conversations],
                             sample_ids=table["id"], max_length=recipe["max_length"])
    # a 32 px draft is nine merged image tokens under the recipe, one at the processor's own 56 x 56 floor
    assert (batch["input_ids"] == pad).sum(1).tolist() == [9] * 5
    default = AutoProcessor.from_pretrained(vlm)
    one = encode_sft_batch(default, [conversations[0][0]], [conversations[0][1]], sample_ids=["r"])
    assert (one["input_ids"] == pad).sum() == 1
    for row, r in enumerate(reflections[:5]):  # every answer learnt whole within the recipe's max_length
        labels = batch["labels"][row]
        learnt = processor.tokenizer.decode(labels[labels != IGNORE_INDEX])
        assert learnt == r["messages"][1]["content"] + "<|im_end|>"
    # the reflector's SFT rows mix imageless planner rows in: one batch encodes both
    plans = [{"id": f"plan-{i}", "messages": [{"role": "user", "content": "plan the scene"},
                                              {"role": "assistant", "content": "<think>red circle</think>"}]}
             for i in range(2)]
    mixed = load_sharegpt(save_sharegpt(reflector_sft_rows(reflections[:2], plans), str(tmp_path / "mixed")))
    conversations = [sharegpt_conversation(mixed[i]) for i in range(len(mixed))]
    batch = encode_sft_batch(processor, [m for m, _ in conversations], [i for _, i in conversations],
                             sample_ids=mixed["id"], max_length=recipe["max_length"])
    assert (batch["input_ids"] == pad).sum(1).tolist() == [9, 0, 9, 0]


def test_the_tiny_mixgrpo_recipe_leaves_room_for_every_reflection(tmp_path):
    # a reflection cut at max_output_token_n_edit has no instruction: its format scores 0 and nothing is refined
    import yaml
    from transformers import AutoTokenizer

    from tiny.cache import REFLECT_SPLITS, TINY_PLANNER_VLM
    from tiny.models import make_tiny_vlm
    from train_mixgrpo import TINY_MIXGRPO_RECIPE

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_vlm(str(tmp_path / "vlm"), **TINY_PLANNER_VLM))
    with open(TINY_MIXGRPO_RECIPE) as f:
        budget = yaml.safe_load(f)["max_output_token_n_edit"]
    longest = max(len(tokenizer(r["messages"][1]["content"])["input_ids"])
                  for r in reflector_rows(**REFLECT_SPLITS["train"]))
    assert longest + 1 <= budget  # and the end-of-turn token


def test_synthetic_edits_and_reflect_build_once_per_spec(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny.cache, "CACHE_DIR", str(tmp_path))
    for name in ("EDIT_SPLITS", "REFLECT_SPLITS"):
        monkeypatch.setattr(tiny.cache, name, {"train": dict(n=6, seed=0, image_size=SIZE),
                                               "test": dict(n=3, seed=1, image_size=SIZE)})
    edits, reflect = resolve_dataset(TINY_EDITS_DATASET), resolve_dataset(TINY_REFLECT_DATASET)
    assert {os.path.dirname(edits), os.path.dirname(reflect)} == {str(tmp_path)}
    train, test = load_table(edits, split="train"), load_table(edits, split="test")
    assert (len(train), len(test)) == (6, 3)
    assert train[2]["instruction"] == edit_triples(3, seed=0)[2]["instruction"]
    assert np.array_equal(np.asarray(train[2]["image_after"]), np.asarray(edit_triples(3, seed=0)[2]["image_after"]))
    rows = load_sharegpt(reflect, split="test")
    assert rows["messages"] == [r["messages"] for r in reflector_rows(3, seed=1)]
    assert resolve_dataset(TINY_EDITS_DATASET) == edits  # reused, not rebuilt
    monkeypatch.setattr(tiny.cache, "REFLECT_SPLITS", {"train": dict(n=7, seed=0, image_size=SIZE)})
    assert resolve_dataset(TINY_REFLECT_DATASET) != reflect  # another spec, another folder
