"""Synthetic data that needs no download: shapes VQA, a GenEval-style prompt set and a local scorer.

- `make_shapes_vqa` draws coloured circles/squares/triangles on a white canvas and asks colour,
  count, count-of-a-colour, comparison and left/right questions, with CRYSTAL-style
  `reference_steps` that are true of the drawn image. With `layout="grid"` every object sits in its
  own grid cell (84 px, 3x3 -> 28 px cells = one merged vision token of a patch-14/merge-2 VLM): that
  is what a tiny model can learn to count (DESIGN.md section 8).
- `make_t2i_prompts` writes prompts in GenEval's metadata schema using the same shapes and colours;
  `score_t2i` grades an image against a row locally (colour segmentation + shape by fill ratio), so
  the Mix-GRPO loop has a reward without a detector server.

Every row is drawn from its own `random.Random(f"...-{seed}-{index}")`, so a row depends only on the
seed and its index: the first k rows are the same whatever n is, on every machine.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import deque

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# Clearly distinct, saturated colours; orange sits between red and yellow, so it is not a default.
PALETTE = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 190),
    "orange": (245, 140, 30),
}
DEFAULT_COLORS = ("red", "green", "blue", "yellow", "purple")
SHAPES = ("circle", "square", "triangle")
KINDS = ("color", "count", "count_color", "compare", "position")
T2I_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
POSITIONS = ("left of", "right of", "above", "below")
BACKGROUND = (255, 255, 255)
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


# --------------------------------------------------------------------------------------------------
# Drawing and layout (shared by the VQA set and the T2I renderer)


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, color: str, x: int, y: int, size: int) -> None:
    """Draw one filled shape centred at (x, y) inside a size x size box, without anti-aliasing so
    every object pixel has exactly its palette colour."""
    x0, y0 = x - size // 2, y - size // 2
    x1, y1 = x0 + size - 1, y0 + size - 1
    fill = PALETTE[color]
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def render_objects(objects: list[dict], image_size: int) -> Image.Image:
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        draw_shape(draw, obj["shape"], obj["color"], obj["x"], obj["y"], obj["size"])
    return image


def _place_in_cell(rng: random.Random, cell: int, grid: int, image_size: int, size_frac) -> tuple[int, int, int]:
    """Centre and size of an object that stays strictly inside its cell (small jitter)."""
    cell_px = image_size / grid
    size = max(4, int(round(cell_px * rng.uniform(*size_frac))))
    slack = max(0, int((cell_px - size) / 2) - 1)  # keep a 1 px gap to the cell border
    jitter = min(3, slack)
    row, col = divmod(cell, grid)
    x = int(round((col + 0.5) * cell_px)) + rng.randint(-jitter, jitter)
    y = int(round((row + 0.5) * cell_px)) + rng.randint(-jitter, jitter)
    return x, y, size


def _place_free(rng: random.Random, count: int, image_size: int, size_px: tuple[int, int]) -> list[tuple[int, int, int]]:
    """Non-overlapping boxes anywhere on the canvas (2 px margin between objects)."""
    for _ in range(200):
        placed: list[tuple[int, int, int]] = []
        for _ in range(count):
            for _ in range(100):
                size = rng.randint(*size_px)
                x = rng.randint(size // 2 + 1, image_size - size + size // 2 - 1)
                y = rng.randint(size // 2 + 1, image_size - size + size // 2 - 1)
                if all(abs(x - px) * 2 >= size + ps + 4 or abs(y - py) * 2 >= size + ps + 4 for px, py, ps in placed):
                    placed.append((x, y, size))
                    break
            else:
                break
        if len(placed) == count:
            return placed
    raise ValueError(f"cannot place {count} objects on a {image_size}px canvas without overlap")


def region_name(x: float, y: float, image_size: int) -> str:
    """Where a point is, in words, by thirds of the image: '<top|middle|bottom> <left|center|right>',
    or 'center' for the middle third."""
    row = min(int(y * 3 / image_size), 2)
    col = min(int(x * 3 / image_size), 2)
    name = f"{('top', 'middle', 'bottom')[row]} {('left', 'center', 'right')[col]}"
    return "center" if name == "middle center" else name


def _grid_region(cell: int, grid: int) -> str:
    row, col = divmod(cell, grid)
    if grid == 3:
        name = f"{('top', 'middle', 'bottom')[row]} {('left', 'center', 'right')[col]}"
        return "center" if name == "middle center" else name
    return f"row {row + 1}, column {col + 1}"


# --------------------------------------------------------------------------------------------------
# Shapes VQA


def _plural(word: str, count: int) -> str:
    return word if count == 1 else word + "s"


def _be(count: int) -> str:
    return "is" if count == 1 else "are"


def _join(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Scene:
    """Chooses (shape, colour) for each object, places them, and names their regions."""

    def __init__(self, rng, *, image_size, grid, layout, size_frac):
        self.rng, self.image_size, self.grid, self.layout, self.size_frac = rng, image_size, grid, layout, size_frac

    def place(self, specs: list[tuple[str, str]]) -> list[dict]:
        rng = self.rng
        if self.layout == "grid":
            cells = rng.sample(range(self.grid * self.grid), len(specs))
            boxes = [_place_in_cell(rng, c, self.grid, self.image_size, self.size_frac) for c in cells]
        else:
            cell_px = self.image_size / self.grid
            lo, hi = (max(4, int(round(cell_px * f))) for f in self.size_frac)
            cells = [None] * len(specs)
            boxes = _place_free(rng, len(specs), self.image_size, (lo, hi))
        objects = []
        for (shape, color), cell, (x, y, size) in zip(specs, cells, boxes):
            region = _grid_region(cell, self.grid) if cell is not None else region_name(x, y, self.image_size)
            objects.append(dict(shape=shape, color=color, cell=cell, x=x, y=y, size=size, region=region))
        return objects


def _where(objects: list[dict]) -> str:
    return _join([f"the {o['region']}" for o in sorted(objects, key=lambda o: (o["y"], o["x"]))])


def _q_color(rng, scene, colors, shapes, max_objects):
    target_shape = rng.choice(shapes)
    others = [s for s in shapes if s != target_shape]
    total = rng.randint(1, max_objects) if others else 1
    color = rng.choice(colors)
    specs = [(target_shape, color)] + [(rng.choice(others), rng.choice(colors)) for _ in range(total - 1)]
    objects = scene.place(specs)
    target = objects[0]
    question = f"What color is the {target_shape}?"
    steps = [
        f"There is one {target_shape} in the image",
        f"The {target_shape} is in the {target['region']}",
        f"The {target_shape} is {color}",
    ]
    return objects, question, color, steps


def _q_count(rng, scene, colors, shapes, max_objects):
    shape = rng.choice(shapes)
    count = rng.randint(1, max_objects)
    objects = scene.place([(shape, rng.choice(colors)) for _ in range(count)])
    question = f"How many {shape}s are there?"
    seen = f"There is {_article(shape)} {shape}" if count == 1 else f"There are {shape}s"
    steps = [f"{seen} in {_where(objects)}", f"There {_be(count)} {count} {_plural(shape, count)}"]
    return objects, question, str(count), steps


def _q_count_color(rng, scene, colors, shapes, max_objects):
    color = rng.choice(colors)
    others = [c for c in colors if c != color]
    count = rng.randint(1, max_objects)
    n_other = rng.randint(0, max_objects - count) if others else 0
    specs = [(rng.choice(shapes), color) for _ in range(count)]
    specs += [(rng.choice(shapes), rng.choice(others)) for _ in range(n_other)]
    objects = scene.place(specs)
    mine = objects[:count]
    question = f"How many {color} shapes are there?"
    found = _join([f"{_article(o['shape'])} {color} {o['shape']} in the {o['region']}"
                   for o in sorted(mine, key=lambda o: (o["y"], o["x"]))])
    steps = [f"I see {found}", f"There {_be(count)} {count} {color} {_plural('shape', count)}"]
    if n_other:
        other_colors = sorted({o["color"] for o in objects[count:]})
        steps.insert(1, f"The other {_plural('shape', n_other)} {_be(n_other)} {_join(other_colors)}")
    return objects, question, str(count), steps


def _q_compare(rng, scene, colors, shapes, max_objects):
    a, b = rng.sample(colors, 2)
    answer = rng.choice(("yes", "no"))
    pairs = [(x, y) for x in range(max_objects + 1) for y in range(max_objects + 1)
             if x != y and min(x, y) >= 1 and x + y <= max_objects]
    if not pairs:  # max_objects == 2: allow an absent colour
        pairs = [(x, y) for x in range(max_objects + 1) for y in range(max_objects + 1)
                 if x != y and 1 <= x + y <= max_objects]
    pairs = [(x, y) for x, y in pairs if (x > y) == (answer == "yes")]
    na, nb = rng.choice(pairs)
    rest = [c for c in colors if c not in (a, b)]
    n_other = rng.randint(0, max_objects - na - nb) if rest else 0
    specs = [(rng.choice(shapes), a) for _ in range(na)] + [(rng.choice(shapes), b) for _ in range(nb)]
    specs += [(rng.choice(shapes), rng.choice(rest)) for _ in range(n_other)]
    objects = scene.place(specs)
    question = f"Are there more {a} shapes than {b} shapes?"
    steps = [
        f"There {_be(na)} {na} {a} {_plural('shape', na)}",
        f"There {_be(nb)} {nb} {b} {_plural('shape', nb)}",
        f"{na} is more than {nb}, so yes" if na > nb else f"{na} is fewer than {nb}, so no",
    ]
    return objects, question, answer, steps


def _q_position(rng, scene, colors, shapes, max_objects):
    kinds = [(s, c) for s in shapes for c in colors]
    first, second = rng.sample(kinds, 2)
    answer = rng.choice(("left", "right"))
    rest = [k for k in kinds if k not in (first, second)]
    n_other = rng.randint(0, max(0, max_objects - 2))
    specs = [first, second] + [rng.choice(rest) for _ in range(n_other)]
    for _ in range(1000):
        objects = scene.place(specs)
        a, b = objects[0], objects[1]
        # Clearly separated columns, on the side the answer says.
        if abs(a["x"] - b["x"]) * 2 >= a["size"] + b["size"] and (a["x"] < b["x"]) == (answer == "left"):
            break
    else:  # pragma: no cover - only with a degenerate layout
        raise ValueError("cannot place two objects side by side; use a larger grid or image")
    name_a, name_b = f"{first[1]} {first[0]}", f"{second[1]} {second[0]}"
    question = f"Is the {name_a} left or right of the {name_b}?"
    steps = [
        f"The {name_a} is in the {a['region']}",
        f"The {name_b} is in the {b['region']}",
        f"So the {name_a} is {answer} of the {name_b}",
    ]
    return objects, question, answer, steps


_QUESTION_MAKERS = {
    "color": _q_color,
    "count": _q_count,
    "count_color": _q_count_color,
    "compare": _q_compare,
    "position": _q_position,
}


def _difficulty(kind: str, n_objects: int) -> str:
    level = 0 if n_objects <= 2 else 1 if n_objects == 3 else 2
    if kind in ("compare", "position"):
        level = max(level, 1)
    return ("easy", "medium", "hard")[level]


def _check_names(values, allowed, what):
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{what}: unknown or empty {bad or list(values)}; choose from {list(allowed)}")


def shapes_vqa_rows(n: int, *, seed: int = 0, image_size: int = 84, grid: int = 3, layout: str = "grid",
                    kinds=KINDS, max_objects: int = 4, colors=DEFAULT_COLORS, shapes=SHAPES,
                    size_frac=(0.5, 0.65)) -> list[dict]:
    """The rows of `make_shapes_vqa` as plain dicts (image = PIL.Image)."""
    kinds, colors, shapes = tuple(kinds), tuple(colors), tuple(shapes)
    _check_names(kinds, _QUESTION_MAKERS, "kinds")
    _check_names(colors, PALETTE, "colors")
    _check_names(shapes, SHAPES, "shapes")
    if layout not in ("grid", "free"):
        raise ValueError(f"layout={layout!r}; expected 'grid' or 'free'")
    if max_objects < 1 or (layout == "grid" and max_objects > grid * grid):
        raise ValueError(f"max_objects={max_objects} must be in 1..grid*grid={grid * grid}")
    if "compare" in kinds and len(colors) < 2:
        raise ValueError("kind 'compare' needs at least two colors")
    if "compare" in kinds and max_objects < 2:
        raise ValueError("kind 'compare' needs max_objects >= 2")
    if "position" in kinds and max_objects < 2:
        raise ValueError("kind 'position' needs max_objects >= 2")

    rows = []
    for i in range(n):
        rng = random.Random(f"shapes-{seed}-{i}")
        kind = kinds[i % len(kinds)]  # round-robin keeps every kind equally represented
        scene = _Scene(rng, image_size=image_size, grid=grid, layout=layout, size_frac=size_frac)
        objects, question, answer, steps = _QUESTION_MAKERS[kind](rng, scene, colors, shapes, max_objects)
        rows.append(dict(
            id=f"shapes-{seed}-{i}",
            image=render_objects(objects, image_size),
            question=question,
            answer=answer,
            reference_steps=steps,
            difficulty=_difficulty(kind, len(objects)),
            kind=kind,
            objects=json.dumps([{k: o[k] for k in ("shape", "color", "cell", "x", "y", "size")} for o in objects]),
            source="synthetic-shapes",
        ))
    return rows


def make_shapes_vqa(n: int, *, seed: int = 0, image_size: int = 84, grid: int = 3, layout: str = "grid",
                    kinds=KINDS, max_objects: int = 4, colors=DEFAULT_COLORS, shapes=SHAPES,
                    size_frac=(0.5, 0.65)):
    """A `datasets.Dataset` of n shapes-VQA rows in the CRYSTAL schema.

    Columns: id, image (Image feature), question, answer (digit / colour / yes|no / left|right),
    reference_steps (2-4 true sentences), difficulty (easy|medium|hard by object count; compare and
    position are at least medium), kind, objects (JSON list of {shape, color, cell, x, y, size};
    cell = row * grid + col, or null with layout="free"), source.
    `size_frac` is the object side as a fraction of a cell side (image_size / grid).
    """
    import datasets

    rows = shapes_vqa_rows(n, seed=seed, image_size=image_size, grid=grid, layout=layout, kinds=kinds,
                           max_objects=max_objects, colors=colors, shapes=shapes, size_frac=size_frac)
    features = datasets.Features({
        "id": datasets.Value("string"),
        "image": datasets.Image(),
        "question": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "reference_steps": datasets.List(datasets.Value("string")),
        "difficulty": datasets.Value("string"),
        "kind": datasets.Value("string"),
        "objects": datasets.Value("string"),
        "source": datasets.Value("string"),
    })
    columns = {name: [row[name] for row in rows] for name in features}
    return datasets.Dataset.from_dict(columns, features=features)


def save_shapes_vqa(out_dir: str, n: int, *, seed: int = 0, **kwargs) -> str:
    """Write `make_shapes_vqa(n, seed=seed, **kwargs)` as a `save_to_disk` folder; returns out_dir."""
    make_shapes_vqa(n, seed=seed, **kwargs).save_to_disk(out_dir)
    return out_dir


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


def render_t2i(meta, *, image_size: int = 64, seed: int = 0) -> Image.Image:
    """Draw an image that satisfies a GenEval-schema row: exactly `count` objects per include item,
    in the item's colour (a random palette colour otherwise), placed in grid cells so that every
    `position` relation holds. Deterministic per seed."""
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
            objects.append(dict(item=idx, shape=shape, color=color, x=x, y=y, size=size))
        if all(_position_holds(objects, idx, item) for idx, item in enumerate(items)):
            return render_objects(objects, image_size)
    raise ValueError(f"cannot lay out {meta.get('prompt', meta)!r} on a {grid}x{grid} grid")


def _position_holds(objects, idx, item) -> bool:
    if not item.get("position"):
        return True
    relation, target = item["position"]
    mine = [o for o in objects if o["item"] == idx]
    theirs = [o for o in objects if o["item"] == target]
    return all(relation in relative_position(_box(a), _box(b)) for a in mine for b in theirs)


# --------------------------------------------------------------------------------------------------
# Local scorer: segment by colour, label connected components, classify shape by fill ratio.


def _to_rgb_array(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float32)
    array = np.asarray(image, dtype=np.float32)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(1, 2, 0)  # CHW -> HWC
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    if array.max() <= 1.0:  # float images in [0, 1]
        array = array * 255.0
    return array


def color_labels(image, colors=tuple(PALETTE), min_alpha: float = 0.5, max_residual: float = 0.35) -> np.ndarray:
    """Per-pixel palette index (-1 = background).

    A pixel p of colour c blended with the white background lies on the segment white -> c, i.e.
    255 - p = alpha * (255 - c). Fitting alpha per palette colour and keeping the colour with the
    smallest off-line residual makes blurred or anti-aliased edges keep their object's colour
    instead of looking like a lighter, different colour. Pixels need alpha >= min_alpha (at least
    half ink) and a residual below max_residual * |alpha * (255 - c)|."""
    rgb = _to_rgb_array(image)
    ink = 255.0 - rgb  # [H, W, 3]
    dirs = np.array([[255.0 - v for v in PALETTE[c]] for c in colors])  # [K, 3]
    alpha = np.einsum("hwc,kc->hwk", ink, dirs) / (dirs**2).sum(-1)  # [H, W, K]
    residual = np.linalg.norm(ink[:, :, None, :] - alpha[..., None] * dirs, axis=-1)
    scale = np.maximum(alpha, 1e-6) * np.linalg.norm(dirs, axis=-1)
    rel = np.where(alpha >= min_alpha, residual / scale, np.inf)
    best = rel.argmin(-1)
    ok = np.take_along_axis(rel, best[..., None], -1)[..., 0] <= max_residual
    return np.where(ok, best, -1)


def label_components(mask_labels: np.ndarray) -> list[np.ndarray]:
    """4-connected components of equal non-negative labels; returns one (N, 2) array of (y, x) each.
    A plain BFS: images here are at most a few hundred pixels wide."""
    height, width = mask_labels.shape
    seen = np.zeros_like(mask_labels, dtype=bool)
    components = []
    for start_y, start_x in zip(*np.nonzero(mask_labels >= 0)):
        if seen[start_y, start_x]:
            continue
        value = mask_labels[start_y, start_x]
        seen[start_y, start_x] = True
        queue, pixels = deque([(start_y, start_x)]), []
        while queue:
            y, x = queue.popleft()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and not seen[ny, nx] and mask_labels[ny, nx] == value:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        components.append(np.array(pixels))
    return components


def classify_fill(fill: float) -> str:
    """Shape from the fraction of its bounding box it covers: square ~1, circle ~pi/4, triangle ~1/2."""
    if fill >= 0.9:
        return "square"
    if fill >= 0.66:
        return "circle"
    return "triangle"


def is_noisy(rgb: np.ndarray, level: float = 2.0) -> bool:
    """Flat renders have (almost) no difference between neighbouring pixels; generated images do."""
    return float(np.median(np.abs(np.diff(rgb, axis=1)))) > level


def detect_shapes(image, *, colors=tuple(PALETTE), min_area: int | None = None, denoise="auto") -> list[dict]:
    """Objects in an image of flat shapes on white: [{shape, color, box=(x0, y0, x1, y1), area, fill}].
    Components smaller than min_area pixels (default 0.25% of the image, at least 6) are noise.
    `denoise` applies a 3x3 median first (True, False, or "auto" = only when `is_noisy`): per-pixel
    noise from a small generator otherwise splits shapes and breaks their fill ratio, but on clean
    images the median would shave the tips of small triangles."""
    rgb = _to_rgb_array(image)
    if denoise == "auto":
        denoise = is_noisy(rgb)
    if denoise:
        rgb = np.asarray(Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).filter(ImageFilter.MedianFilter(3)),
                         dtype=np.float32)
    labels = color_labels(rgb, colors)
    if min_area is None:
        min_area = max(6, int(0.0025 * labels.size))
    found = []
    for pixels in label_components(labels):
        if len(pixels) < min_area:
            continue
        y0, x0 = pixels.min(0)
        y1, x1 = pixels.max(0) + 1
        fill = len(pixels) / float((y1 - y0) * (x1 - x0))
        found.append(dict(shape=classify_fill(fill), color=colors[labels[pixels[0][0], pixels[0][1]]],
                          box=(int(x0), int(y0), int(x1), int(y1)), area=int(len(pixels)), fill=float(fill)))
    return found


def score_t2i(image, meta, *, min_area: int | None = None, denoise="auto") -> dict:
    """Grade an image against a GenEval-schema row; returns {"score": float in [0, 1], "strict": 0/1}.

    Semantics follow GenEval (include = at least `count`, exclude = fewer than `count`, colour on the
    counted objects, position against every object of the referenced include item) with partial
    credit for `score`:
    - include item: the mean of its checks, each min(k, count) / count where k is the number of
      detected objects that pass it: the class; + the colour (if given); + the position relation to
      all objects of the referenced item (if given);
    - exclude item: 1 if fewer than `count` objects match, else (count - 1) / found;
    - score = mean over include and exclude items; strict = 1 only when every item scores 1.
    `image` may be a PIL image or an HWC/CHW array (uint8, or float in [0, 1]).
    """
    meta = _meta(meta)
    objects = detect_shapes(image, min_area=min_area, denoise=denoise)

    def matching(item):
        return [o for o in objects if o["shape"] == item["class"]
                and (item.get("color") is None or o["color"] == item["color"])]

    includes = meta["include"]
    credits = []
    for item in includes:
        want = int(item["count"])
        of_class = [o for o in objects if o["shape"] == item["class"]]
        checks = [min(len(of_class), want) / want]
        matched = matching(item)
        if item.get("color") is not None:
            checks.append(min(len(matched), want) / want)
        if item.get("position"):
            relation, target = item["position"]
            targets = matching(includes[int(target)])[: int(includes[int(target)]["count"])]
            placed = [o for o in matched if targets and all(relation in relative_position(o["box"], t["box"]) for t in targets)]
            checks.append(min(len(placed), want) / want)
        credits.append(sum(checks) / len(checks))
    for item in meta.get("exclude") or []:
        limit, found = int(item["count"]), len(matching(item))
        credits.append(1.0 if found < limit else (limit - 1) / found)
    score = sum(credits) / len(credits) if credits else 0.0
    strict = float(bool(credits) and all(c >= 1.0 - 1e-9 for c in credits))
    return {"score": float(score), "strict": strict}
