"""The tiny world's text-to-image prompts: GenEval-schema rows about simple shapes, and a renderer that draws
an image satisfying a row (the ground truth that tests and the scorer are checked against).

Every row is drawn from its own `random.Random(f"t2i-{seed}-{index}")`, so a row depends only on the seed
and its index.
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
from PIL import Image

from tiny.shapes import (
    DEFAULT_COLORS,
    NUMBER_WORDS,
    PALETTE,
    POSITIONS,
    SHAPES,
    T2I_TAGS,
    _article,
    _check_names,
    _place_in_cell,
    render_objects,
)

# --------------------------------------------------------------------------------------------------
# Text-to-image prompts in GenEval's metadata schema


def _an(color_or_shape: str) -> str:
    return f"{_article(color_or_shape)} {color_or_shape}"


def _t2i_row(rng: random.Random, tag: str, colors, shapes, max_count: int) -> dict:
    if tag == "single_object":
        shape = rng.choice(shapes)
        return dict(tag=tag, include=[{"class": shape, "count": 1}], exclude=[], prompt=f"a photo of {_an(shape)}")
    if tag == "two_object":
        a, b = rng.sample(shapes, 2)
        return dict(tag=tag, include=[{"class": a, "count": 1}, {"class": b, "count": 1}], exclude=[],
                    prompt=f"a photo of {_an(a)} and {_an(b)}")
    if tag == "counting":
        shape, count = rng.choice(shapes), rng.randint(2, max_count)
        # GenEval makes "exactly n" out of include (>= n) plus exclude (< n + 1).
        return dict(tag=tag, include=[{"class": shape, "count": count}], exclude=[{"class": shape, "count": count + 1}],
                    prompt=f"a photo of {NUMBER_WORDS.get(count, str(count))} {shape}s")
    if tag == "colors":
        shape, color = rng.choice(shapes), rng.choice(colors)
        return dict(tag=tag, include=[{"class": shape, "count": 1, "color": color}], exclude=[],
                    prompt=f"a photo of {_an(color)} {shape}")
    if tag == "position":
        a, b = rng.sample(shapes, 2)
        relation = rng.choice(POSITIONS)
        return dict(tag=tag, include=[{"class": a, "count": 1}, {"class": b, "count": 1, "position": [relation, 0]}],
                    exclude=[], prompt=f"a photo of {_an(b)} {relation} {_an(a)}")
    if tag == "color_attr":
        a, b = rng.sample(shapes, 2)
        ca, cb = rng.sample(colors, 2)
        return dict(tag=tag, include=[{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
                    exclude=[], prompt=f"a photo of {_an(ca)} {a} and {_an(cb)} {b}")
    raise ValueError(f"unknown tag {tag!r}; expected one of {T2I_TAGS}")


def make_t2i_prompts(n: int, *, seed: int = 0, tags=T2I_TAGS, colors=DEFAULT_COLORS, shapes=SHAPES,
                     max_count: int = 4) -> list[dict]:
    """n GenEval-schema rows {tag, include, exclude, prompt} about simple shapes (tags round-robin).

    As in GenEval, an include item means "at least `count` objects of `class` (with `color`)";
    counting rows add an exclude item with count + 1 so the count is exact; `position` is
    [relation, index of the include item it is relative to], relation in left of/right of/above/below.
    """
    tags, colors, shapes = tuple(tags), tuple(colors), tuple(shapes)
    _check_names(tags, T2I_TAGS, "tags")
    _check_names(colors, PALETTE, "colors")
    _check_names(shapes, SHAPES, "shapes")
    if len(shapes) < 2 and {"two_object", "position", "color_attr"} & set(tags):
        raise ValueError("tags two_object/position/color_attr need at least two shapes")
    return [_t2i_row(random.Random(f"t2i-{seed}-{i}"), tags[i % len(tags)], colors, shapes, max_count)
            for i in range(n)]


def write_jsonl(rows: list[dict], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# GenEval-like relative position (same rule as GenEval: box centres, offsets shrunk by 10% of the
# summed box sizes, then a direction counts when it carries more than half of the offset).

POSITION_THRESHOLD = 0.1


def relative_position(box_a, box_b) -> set[str]:
    """Relations of box A relative to box B; boxes are (x0, y0, x1, y1), y grows downwards."""
    a, b = np.asarray(box_a, dtype=float), np.asarray(box_b, dtype=float)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2
    dims = (a[2:] - a[:2]) + (b[2:] - b[:2])
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _box(obj: dict) -> tuple[int, int, int, int]:
    x0, y0 = obj["x"] - obj["size"] // 2, obj["y"] - obj["size"] // 2
    return (x0, y0, x0 + obj["size"], y0 + obj["size"])


def _meta(meta) -> dict:
    if isinstance(meta, str):
        meta = json.loads(meta)
    if not isinstance(meta, dict) or not isinstance(meta.get("include"), list):
        raise ValueError(f"T2I metadata must be a dict with an 'include' list, got {meta!r}")
    for item in list(meta["include"]) + list(meta.get("exclude") or []):
        if item.get("class") not in SHAPES:
            raise ValueError(f"the local T2I scorer knows the classes {SHAPES}, not {item.get('class')!r}")
        if item.get("color") is not None and item["color"] not in PALETTE:
            raise ValueError(f"the local T2I scorer knows the colors {tuple(PALETTE)}, not {item['color']!r}")
    return meta


def layout_t2i(meta, *, image_size: int = 64, seed: int = 0) -> list[dict]:
    """The objects `render_t2i` draws for a row and seed: [{item, shape, color, x, y, size, cell, grid}]."""
    meta = _meta(meta)
    rng = random.Random(f"render-{seed}-{json.dumps(meta, sort_keys=True)}")
    items = meta["include"]
    specs = [(idx, item["class"], item.get("color") or rng.choice(DEFAULT_COLORS))
             for idx, item in enumerate(items) for _ in range(int(item["count"]))]
    grid = max(3, math.ceil(math.sqrt(len(specs))))
    for _ in range(2000):
        cells = rng.sample(range(grid * grid), len(specs))
        objects = []
        for (idx, shape, color), cell in zip(specs, cells):
            x, y, size = _place_in_cell(rng, cell, grid, image_size, (0.55, 0.7))
            objects.append(dict(item=idx, shape=shape, color=color, x=x, y=y, size=size, cell=cell, grid=grid))
        if all(_position_holds(objects, idx, item) for idx, item in enumerate(items)):
            return objects
    raise ValueError(f"cannot lay out {meta.get('prompt', meta)!r} on a {grid}x{grid} grid")


def render_t2i(meta, *, image_size: int = 64, seed: int = 0) -> Image.Image:
    """Draw an image that satisfies a GenEval-schema row: exactly `count` objects per include item,
    in the item's colour (a random palette colour otherwise), placed in grid cells so that every
    `position` relation holds. Deterministic per seed."""
    return render_objects(layout_t2i(meta, image_size=image_size, seed=seed), image_size)


ROWS_3, COLS_3 = ("top", "middle", "bottom"), ("left", "center", "right")


def scene_plan(meta, *, image_size: int = 64, seed: int = 0) -> str:
    """A drawing plan of `render_t2i(meta, seed=seed)`, object by object in reading order: "red circle top left,
    blue square middle center". What the tiny planner learns to write and the tiny generator learns to draw."""
    parts = []
    for o in sorted(layout_t2i(meta, image_size=image_size, seed=seed), key=lambda o: o["cell"]):
        row, col = divmod(o["cell"], o["grid"])
        where = f"{ROWS_3[row]} {COLS_3[col]}" if o["grid"] == 3 else f"row {row + 1} column {col + 1}"
        parts.append(f"{o['color']} {o['shape']} {where}")
    return ", ".join(parts)


def plan_objects(plan: str) -> list[tuple[str, str]]:
    """The (colour, shape) of each object a scene plan names ("red circle top left, blue square ..."), in order;
    a part that does not start with a palette colour and a shape is left out."""
    found = []
    for part in plan.split(","):
        words = part.split()
        if len(words) >= 2 and words[0] in PALETTE and words[1] in SHAPES:
            found.append((words[0], words[1]))
    return found


def plan_matches_request(plan: str, meta) -> bool:
    """Whether a scene plan names exactly the objects a row asks for: every include item's count of its class, in
    its colour where the row gives one, and nothing else (cells and relations are not checked)."""
    meta = _meta(meta)
    objects, parts = plan_objects(plan), [p for p in plan.split(",") if p.strip()]
    if len(objects) != len(parts):
        return False
    for item in meta["include"]:
        mine = [color for color, shape in objects if shape == item["class"]]
        if len(mine) != int(item["count"]) or (item.get("color") and any(c != item["color"] for c in mine)):
            return False
    return len(objects) == sum(int(item["count"]) for item in meta["include"])


def planner_rows(rows, prompt_template: str, image_size: int = 64) -> list[dict]:
    """sharegpt rows teaching a VLM to plan the scene: the user asks `prompt_template.format(prompt=...)`, the
    assistant answers `<think>{scene plan of the render of row i}</think>` (render seed i)."""
    def row(i, r):
        plan = scene_plan(r, image_size=image_size, seed=i)
        return {"id": f"plan-{i}", "messages": [{"role": "user", "content": prompt_template.format(prompt=r["prompt"])},
                                                 {"role": "assistant", "content": f"<think>{plan}</think>"}]}

    return [row(i, r) for i, r in enumerate(rows)]


def _position_holds(objects, idx, item) -> bool:
    if not item.get("position"):
        return True
    relation, target = item["position"]
    mine = [o for o in objects if o["item"] == idx]
    theirs = [o for o in objects if o["item"] == target]
    return all(relation in relative_position(_box(a), _box(b)) for a in mine for b in theirs)

