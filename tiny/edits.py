"""Edits in the tiny shapes world: the data behind R3's reflect -> refine stage.

A scene is the list of objects `tiny.t2i.layout_t2i` draws (shape, colour, cell of the 3 x 3 grid, centre, size),
one object per cell. An edit changes one object and is written the way a reflection writes its instruction, in the
words of the tiny planner's scene plans ("top left", "middle center"):

| kind | instruction |
|---|---|
| `add` | add a red circle at the top left |
| `remove` | remove the blue square at the middle center |
| `recolor` | make the green triangle at the bottom right yellow |
| `move` | move the red circle at the top left to the bottom center |
| `none` | no further edit needed (`utils.r3_format.NO_EDIT`, what the reflect stage reads as "keep the image") |

`parse_instruction` reads an instruction back and `apply_edit` carries it out, so every row below can be checked
against what it says. Two row sets are built from them, each row from its own `random.Random(f"...-{seed}-{i}")`:

- **edit triples** (`edit_triples`): (scene, instruction, edited scene) with both renders, the edit generator's
  training data. Half of the rows edit a prompt's render into something else (`direction` "free"), half repair a
  perturbed render back into the prompt's render ("repair"), so the instruction, not the prompt, decides the edit.
- **reflector rows** (`reflector_rows`): sharegpt rows (train_sft.py's `--dataset_format sharegpt`) that show a
  flawed draft of a prompt under train_mixgrpo's reflect prompt and answer `<think>what is wrong</think>` + the one
  edit that turns the draft into the prompt's render, or "no further edit needed" when the draft has no flaw.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass

from tiny.detector import RENDER_SIZE_FRAC
from tiny.shapes import DEFAULT_COLORS, PALETTE, SHAPES, T2I_TAGS, _article, _place_in_cell, render_objects
from tiny.t2i import _box, _t2i_row, layout_t2i, relative_position
from utils.r3_format import NO_EDIT, NO_EDIT_MATCH, REFLECT_PROMPT

GRID = 3  # layout_t2i's grid for up to 9 objects; an edit names cells in its words
EDIT_KINDS = ("add", "remove", "recolor", "move", "none")
INVERSE = {"add": "remove", "remove": "add", "recolor": "recolor", "move": "move", "none": "none"}
FLAWS = ("missing", "wrong_color", "wrong_position", "extra", "none")
FLAW_EDIT = {"missing": "add", "wrong_color": "recolor", "wrong_position": "move", "extra": "remove", "none": "none"}
ROWS, COLS = ("top", "middle", "bottom"), ("left", "center", "right")
OBJECT_KEYS = ("shape", "color", "cell", "x", "y", "size")


@dataclass(frozen=True)
class Edit:
    """One edit of one object: `kind` in EDIT_KINDS; the object it names (for `add`: the one it draws) by colour,
    shape and cell; `to_color` (recolor) or `to_cell` (move)."""
    kind: str
    shape: str | None = None
    color: str | None = None
    cell: int | None = None
    to_color: str | None = None
    to_cell: int | None = None


def cell_name(cell: int) -> str:
    """A cell of the 3 x 3 grid in the words of a scene plan: "top left" ... "middle center" ... "bottom right"."""
    row, col = divmod(cell, GRID)
    return f"{ROWS[row]} {COLS[col]}"


def _object_words(edit: Edit) -> str:
    return f"{edit.color} {edit.shape} at the {cell_name(edit.cell)}"


def instruction_of(edit: Edit) -> str:
    """The instruction a reflection writes for an edit (the table above)."""
    if edit.kind == "none":
        return NO_EDIT
    if edit.kind == "add":
        return f"add {_article(edit.color)} {_object_words(edit)}"
    if edit.kind == "remove":
        return f"remove the {_object_words(edit)}"
    if edit.kind == "recolor":
        return f"make the {_object_words(edit)} {edit.to_color}"
    if edit.kind == "move":
        return f"move the {_object_words(edit)} to the {cell_name(edit.to_cell)}"
    raise ValueError(f"unknown edit kind {edit.kind!r}; expected one of {EDIT_KINDS}")


_COLOR = "|".join(PALETTE)
_OBJECT = rf"({_COLOR}) ({'|'.join(SHAPES)}) at the ({'|'.join(ROWS)}) ({'|'.join(COLS)})"
_CELL = rf"({'|'.join(ROWS)}) ({'|'.join(COLS)})"
_PATTERNS = {
    "add": re.compile(rf"add an? {_OBJECT}"),
    "remove": re.compile(rf"remove the {_OBJECT}"),
    "recolor": re.compile(rf"make the {_OBJECT} ({_COLOR})"),
    "move": re.compile(rf"move the {_OBJECT} to the {_CELL}"),
}


def _cell(row: str, col: str) -> int:
    return ROWS.index(row) * GRID + COLS.index(col)


def parse_instruction(text: str) -> Edit:
    """The Edit an instruction asks for (the inverse of `instruction_of`); an instruction that says "no further
    edit" (any case, as the reflect stage reads it) is `none`. Anything else is a ValueError naming the text."""
    text = " ".join(text.strip().rstrip(".").lower().split())
    if NO_EDIT_MATCH in text:
        return Edit("none")
    for kind, pattern in _PATTERNS.items():
        m = pattern.fullmatch(text)
        if m:
            color, shape, row, col, *rest = m.groups()
            edit = dict(kind=kind, shape=shape, color=color, cell=_cell(row, col))
            if kind == "recolor":
                edit["to_color"] = rest[0]
            if kind == "move":
                edit["to_cell"] = _cell(*rest)
            return Edit(**edit)
    raise ValueError(f"not an edit instruction of the tiny world: {text!r}")


def _at(objects: list[dict], edit: Edit) -> int:
    found = [i for i, o in enumerate(objects) if o["cell"] == edit.cell]
    if not found or (objects[found[0]]["color"], objects[found[0]]["shape"]) != (edit.color, edit.shape):
        raise ValueError(f"the scene has no {edit.color} {edit.shape} at the {cell_name(edit.cell)}")
    return found[0]


def _free(objects: list[dict], cell: int) -> None:
    if any(o["cell"] == cell for o in objects):
        raise ValueError(f"the {cell_name(cell)} already holds an object (one object per cell)")


def _moved(obj: dict, cell: int, image_size: int) -> dict:
    """The object in another cell, at the same offset from the cell's centre (so still strictly inside it)."""
    def centre(c):  # _place_in_cell's centre of a cell, before its jitter
        row, col = divmod(c, GRID)
        return int(round((col + 0.5) * image_size / GRID)), int(round((row + 0.5) * image_size / GRID))

    (x0, y0), (x1, y1) = centre(obj["cell"]), centre(cell)
    return dict(obj, cell=cell, x=obj["x"] - x0 + x1, y=obj["y"] - y0 + y1)


def apply_edit(objects: list[dict], edit: Edit, *, image_size: int, rng: random.Random | None = None) -> list[dict]:
    """The scene after an edit (a new list; the objects it does not name are kept as they are). An added object is
    placed in its cell as layout_t2i places objects, from `rng` (default: one seeded by the edit, so the result is a
    function of the scene and the instruction). An edit that names an object the scene does not hold, or a cell
    that is not free, is a ValueError."""
    out = [dict(o) for o in objects]
    if edit.kind == "none":
        return out
    if edit.kind == "add":
        if edit.color not in PALETTE or edit.shape not in SHAPES or not 0 <= edit.cell < GRID * GRID:
            raise ValueError(f"cannot add {edit}: colour, shape or cell outside the tiny world")
        _free(out, edit.cell)
        rng = rng or random.Random(f"add-{edit.color}-{edit.shape}-{edit.cell}-{image_size}")
        x, y, size = _place_in_cell(rng, edit.cell, GRID, image_size, RENDER_SIZE_FRAC)
        return out + [dict(shape=edit.shape, color=edit.color, cell=edit.cell, x=x, y=y, size=size)]
    i = _at(out, edit)
    if edit.kind == "remove":
        return out[:i] + out[i + 1:]
    if edit.kind == "recolor":
        if edit.to_color not in PALETTE or edit.to_color == edit.color:
            raise ValueError(f"cannot recolor the {edit.color} {edit.shape} to {edit.to_color!r}")
        out[i]["color"] = edit.to_color
        return out
    if edit.kind == "move":
        _free(out, edit.to_cell)
        out[i] = _moved(out[i], edit.to_cell, image_size)
        return out
    raise ValueError(f"unknown edit kind {edit.kind!r}; expected one of {EDIT_KINDS}")


def scene_key(objects: list[dict]) -> list[tuple[int, str, str]]:
    """What an instruction can say about a scene: the (cell, colour, shape) of each object, sorted by cell."""
    return sorted((o["cell"], o["color"], o["shape"]) for o in objects)


def diff_edit(before: list[dict], after: list[dict]) -> Edit:
    """The one edit that turns scene `before` into `after` (by their scene keys), or a ValueError when they differ
    by more than one edit."""
    old, new = set(scene_key(before)), set(scene_key(after))
    gone, came = sorted(old - new), sorted(new - old)
    if not gone and not came:
        return Edit("none")
    if len(gone) + len(came) == 1:
        (cell, color, shape), = gone or came
        return Edit("remove" if gone else "add", shape=shape, color=color, cell=cell)
    if len(gone) == 1 and len(came) == 1:
        (cell, color, shape), (to_cell, to_color, to_shape) = gone[0], came[0]
        if cell == to_cell and shape == to_shape:
            return Edit("recolor", shape=shape, color=color, cell=cell, to_color=to_color)
        if cell != to_cell and (color, shape) == (to_color, to_shape):
            return Edit("move", shape=shape, color=color, cell=cell, to_cell=to_cell)
    raise ValueError(f"the scenes differ by more than one edit: {gone} -> {came}")


def perturb(objects: list[dict], kind: str, rng: random.Random, *, image_size: int,
            colors=DEFAULT_COLORS, shapes=SHAPES) -> tuple[list[dict], Edit]:
    """A random edit of `kind` of a scene and the scene after it: add an object of `colors` x `shapes` in a free
    cell; remove, recolour (to another of `colors`) or move (to a free cell) one of its objects."""
    free = [c for c in range(GRID * GRID) if all(o["cell"] != c for o in objects)]
    if kind == "add":
        edit = Edit("add", shape=rng.choice(shapes), color=rng.choice(colors), cell=rng.choice(free))
    elif kind == "none":
        edit = Edit("none")
    else:
        if not objects:
            raise ValueError(f"cannot {kind} an object of an empty scene")
        obj = rng.choice(objects)
        named = dict(shape=obj["shape"], color=obj["color"], cell=obj["cell"])
        if kind == "remove":
            edit = Edit("remove", **named)
        elif kind == "recolor":
            edit = Edit("recolor", **named, to_color=rng.choice([c for c in colors if c != obj["color"]]))
        elif kind == "move":
            edit = Edit("move", **named, to_cell=rng.choice(free))
        else:
            raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")
    return apply_edit(objects, edit, image_size=image_size, rng=rng), edit


def target_scene(meta: dict, *, image_size: int, seed: int) -> list[dict]:
    """The objects of a prompt's render (layout_t2i), with the keys a scene keeps."""
    objects = layout_t2i(meta, image_size=image_size, seed=seed)
    if any(o["grid"] != GRID for o in objects):
        raise ValueError(f"edits name cells of the {GRID} x {GRID} grid; {meta['prompt']!r} is laid out on another")
    return [{k: o[k] for k in OBJECT_KEYS} for o in objects]


def _dumps(objects: list[dict]) -> str:
    return json.dumps(objects, sort_keys=True)


# --------------------------------------------------------------------------------------------------
# Edit triples


def edit_triples(n: int, *, seed: int = 0, image_size: int = 32) -> list[dict]:
    """n rows (scene, instruction, edited scene), kinds round-robin over EDIT_KINDS: {id, kind, direction, prompt,
    metadata (the GenEval row, JSON), instruction, before, after (objects, JSON), image_before, image_after (PIL)}.
    Each starts from a tiny text-to-image prompt (tags round-robin) and its render; `free` rows edit the render,
    `repair` rows perturb it by the inverse edit and edit it back."""
    rows = []
    for i in range(n):
        rng = random.Random(f"edit-{seed}-{i}")
        kind = EDIT_KINDS[i % len(EDIT_KINDS)]
        meta = _t2i_row(rng, T2I_TAGS[(i // len(EDIT_KINDS)) % len(T2I_TAGS)], DEFAULT_COLORS, SHAPES, 4)
        render = target_scene(meta, image_size=image_size, seed=i)
        direction = rng.choice(("free", "repair"))
        if direction == "free":
            before, (after, edit) = render, perturb(render, kind, rng, image_size=image_size)
        else:
            (before, _), after = perturb(render, INVERSE[kind], rng, image_size=image_size), render
            edit = diff_edit(before, after)
        rows.append(dict(id=f"edit-{seed}-{i}", kind=edit.kind, direction=direction, prompt=meta["prompt"],
                         metadata=json.dumps(meta), instruction=instruction_of(edit), edit=json.dumps(asdict(edit)),
                         before=_dumps(before), after=_dumps(after), image_before=render_objects(before, image_size),
                         image_after=render_objects(after, image_size)))
    return rows


def make_edit_triples(n: int, *, seed: int = 0, image_size: int = 32):
    """`edit_triples` as a `datasets.Dataset` (the two images as Image features)."""
    import datasets

    rows = edit_triples(n, seed=seed, image_size=image_size)
    features = datasets.Features({k: datasets.Image() if k.startswith("image_") else datasets.Value("string")
                                  for k in rows[0]})
    return datasets.Dataset.from_list(rows, features=features)


# --------------------------------------------------------------------------------------------------
# Reflector rows

# the tags whose prompts a flaw can break: a colour is only wrong where the prompt names it, a place only where
# the prompt asks for a relation; an object missing or extra breaks any prompt
FLAW_TAGS = {"wrong_color": ("colors", "color_attr"), "wrong_position": ("position",)}


def plan_of(objects: list[dict]) -> str:
    """What a scene shows in the words of a scene plan ("red circle top left, blue square middle center")."""
    return ", ".join(f"{o['color']} {o['shape']} {cell_name(o['cell'])}" for o in sorted(objects,
                                                                                        key=lambda o: o["cell"]))


def _relations_hold(objects: list[dict], meta: dict) -> bool:
    """Whether every `position` item of the row holds, object by object (render_t2i's rule)."""
    by_item = [[o for o in objects if o["shape"] == item["class"]] for item in meta["include"]]
    return all(relation in relative_position(_box(a), _box(b))
               for item, mine in zip(meta["include"], by_item) if item.get("position")
               for relation, target in [item["position"]] for a in mine for b in by_item[int(target)])


def flawed_draft(target: list[dict], meta: dict, flaw: str, rng: random.Random, *, image_size: int) -> list[dict]:
    """A draft of the prompt `meta` whose render is `target`, with one flaw: an object `missing`, one `extra`, one
    in the `wrong_color` (an object whose colour the prompt names) or the `wrong_position` (moved to a free cell
    where the prompt's relation no longer holds), or `none` (the target itself)."""
    if flaw in ("missing", "extra", "none"):
        return perturb(target, {"missing": "remove", "extra": "add", "none": "none"}[flaw], rng,
                       image_size=image_size)[0]
    if flaw == "wrong_color":
        named = {item["class"] for item in meta["include"] if item.get("color")}
        obj = rng.choice([o for o in target if o["shape"] in named])
        edit = Edit("recolor", shape=obj["shape"], color=obj["color"], cell=obj["cell"],
                    to_color=rng.choice([c for c in DEFAULT_COLORS if c != obj["color"]]))
        return apply_edit(target, edit, image_size=image_size)
    if flaw == "wrong_position":
        free = [c for c in range(GRID * GRID) if all(o["cell"] != c for o in target)]
        moves = [Edit("move", shape=o["shape"], color=o["color"], cell=o["cell"], to_cell=c)
                 for o in target for c in free]
        drafts = [apply_edit(target, e, image_size=image_size) for e in moves]
        return rng.choice([d for d in drafts if not _relations_hold(d, meta)])
    raise ValueError(f"unknown flaw {flaw!r}; expected one of {FLAWS}")


def reflection_text(draft: list[dict], edit: Edit) -> str:
    """The reflection that the reflector learns for a draft: `<think>what it shows and what is wrong</think>` and
    the instruction of `edit` (the one edit from the draft to the prompt's render)."""
    seen = f"I see {plan_of(draft)}" if draft else "I see nothing"
    if edit.kind == "none":
        wrong = "that is what was asked"
    elif edit.kind == "add":
        wrong = f"{_article(edit.color)} {edit.color} {edit.shape} is missing"
    elif edit.kind == "remove":
        wrong = f"the {_object_words(edit)} was not asked for"
    elif edit.kind == "recolor":
        wrong = f"the {edit.shape} at the {cell_name(edit.cell)} should be {edit.to_color}, not {edit.color}"
    else:
        wrong = f"the {_object_words(edit)} is in the wrong place"
    return f"<think>{seen}; {wrong}</think> {instruction_of(edit)}"


def reflector_rows(n: int, *, seed: int = 0, image_size: int = 32) -> list[dict]:
    """n sharegpt rows, flaws round-robin over FLAWS: {id, messages (user: `<image>` + the reflect prompt of
    train_mixgrpo; assistant: `reflection_text`), images ([the draft's render, PIL]), flaw, prompt, metadata (the
    GenEval row, JSON), draft, target (objects, JSON)}. The prompt's tag fits the flaw (FLAW_TAGS; otherwise
    round-robin over all tags)."""
    rows = []
    for i in range(n):
        rng = random.Random(f"reflect-{seed}-{i}")
        flaw = FLAWS[i % len(FLAWS)]
        tags = FLAW_TAGS.get(flaw, T2I_TAGS)
        meta = _t2i_row(rng, tags[(i // len(FLAWS)) % len(tags)], DEFAULT_COLORS, SHAPES, 4)
        target = target_scene(meta, image_size=image_size, seed=i)
        draft = flawed_draft(target, meta, flaw, rng, image_size=image_size)
        messages = [{"role": "user", "content": "<image>" + REFLECT_PROMPT.format(prompt=meta["prompt"])},
                    {"role": "assistant", "content": reflection_text(draft, diff_edit(draft, target))}]
        rows.append(dict(id=f"reflect-{seed}-{i}", messages=messages, images=[render_objects(draft, image_size)],
                         flaw=flaw, prompt=meta["prompt"], metadata=json.dumps(meta), draft=_dumps(draft),
                         target=_dumps(target)))
    return rows
