"""The tiny world's shapes: the palette, drawing and layout, and the shapes VQA set.

`make_shapes_vqa` draws coloured circles/squares/triangles on a white canvas and asks colour, count,
count-of-a-colour, comparison and left/right questions, with CRYSTAL-style `reference_steps` that are true of
the drawn image. With `layout="grid"` every object sits in its own grid cell (84 px, 3x3 -> 28 px cells = one
merged vision token of a patch-14/merge-2 VLM): that is what a tiny model can learn to count (docs/tiny.md).
The text-to-image prompts built from the same shapes are `tiny.t2i`; the detector that scores images is
`tiny.detector`.

Every row is drawn from its own `random.Random(f"...-{seed}-{index}")`, so a row depends only on the
seed and its index: the first k rows are the same whatever n is, on every machine.
"""

from __future__ import annotations

import json
import random

from PIL import Image, ImageDraw

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


def _place_free(rng: random.Random, count: int, image_size: int,
                size_px: tuple[int, int]) -> list[tuple[int, int, int]]:
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
