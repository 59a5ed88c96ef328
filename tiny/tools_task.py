"""The tiny tool task: a question whose answer is too small to survive the first image's pixel budget, and an image
tool that returns it at full budget (docs/tools.md).

Each 630 x 630 image holds 2-4 small shapes, each of its own colour, one near the centre of each of 2-4 cells of a
3 x 3 grid. The question asks for the shape of one colour: "What shape is the red object?". The model's processor
sees the image at 84 x 84 pixels (`--max_pixels 7056`, 7.5 times smaller): a shape is a blob of 2-3 px there, its
colour kept, its outline gone (the three shapes have the same area, so the blob's mass does not give it away).
`zoom_image` on the box around the colour's cell centre (the middle fifth of the cell, 42 px, `object_box`) returns
it at 84 x 84, where the shape is 24-45 px: fifteen times larger than in the overview. tests/test_tiny_tools_task.py
checks both on the pixels the processor makes.

The data set is in TRL's conversational format (a `prompt` column of chat messages, an `images` column, the
`answer`), so GRPO and evaluation read it through the same path as a user's TRL data set. The warm start is SFT on
three kinds of rows (`warm_start_rows`): with the tool offered, zoom (mostly into the right box) then answer;
without it, answer from the overview alone; and the zoomed box alone with "What shape is this?", which teaches the
eye to read it. GRPO with and without `--tools` then start from the same model.
"""

from __future__ import annotations

import json
import math
import os
import random

import datasets
from PIL import Image, ImageDraw

from tiny.shapes import DEFAULT_COLORS, SHAPES, draw_shape
from tiny.tokenizer import _FAMILY_TOKENS
from utils.core.image_tools import zoom_image
from utils.core.tools import ToolBox

IMAGE_SIZE = 630  # the data's images
GRID = 3
ZOOM_PARTS = 5  # the zoom box is the middle fifth of a cell (42 px), so the tool enlarges 15 times the overview's scale
SEEN_PIXELS = 84 * 84  # the processor's budget (--max_pixels): the model sees a 84 x 84 image
AREA = (150, 250)  # every shape's area in the 630 px image, in px (a square of 12-16 px, a triangle of 17-22 px)
FILL = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}  # a shape's area over its size's square
JITTER = 5  # px the shape's centre moves around the zoom box's centre, in the 630 px image
MAX_OBJECTS = 4
TOOL = "zoom_image"
ZOOM_QUESTION = "What shape is this?"
SPLITS = {"train": dict(n=2048, seed=0), "test": dict(n=256, seed=1)}
WARM_START = dict(n=4096, seed=2)  # the SFT rows: rows of their own seed
WARM_START_SHARES = dict(tool=0.4, plain=0.3, zoom=0.3)  # the kinds of warm-start rows
WRONG_CALLS = 0.2  # the share of warm-start tool traces that zoom into an empty cell (then answer anyway)


def object_box(cell: int) -> list[int]:
    """The 0-1000 box of a cell's middle fifth (row-major cells), as zoom_image takes it: edges rounded inwards so
    the box is exactly 42 px of the 630 px image."""
    row, col = divmod(cell, GRID)
    parts = GRID * ZOOM_PARTS
    first = ZOOM_PARTS // 2
    x1, y1 = (math.ceil((k * ZOOM_PARTS + first) * 1000 / parts) for k in (col, row))
    x2, y2 = (math.floor((k * ZOOM_PARTS + first + 1) * 1000 / parts) for k in (col, row))
    return [x1, y1, x2, y2]


def shape_size(shape: str, area: float) -> int:
    """The size (draw_shape's box side) that gives `shape` this area."""
    return round(math.sqrt(area / FILL[shape]))


def draw_object(draw, shape, colour, x, y, area):
    """A shape of `area` px with its centroid at (x, y) (a triangle's is a sixth of its size below its box's
    centre)."""
    size = shape_size(shape, area)
    draw_shape(draw, shape, colour, x, y - (size // 6 if shape == "triangle" else 0), size)


def task_rows(n: int, *, seed: int = 0) -> list[dict]:
    """n rows (PIL images): id, image, question, answer, the target's cell and colour, and the cells used."""
    rows = []
    cell_px = IMAGE_SIZE // GRID
    for i in range(n):
        rng = random.Random(f"tools-{seed}-{i}")
        k = rng.randint(2, MAX_OBJECTS)
        cells = rng.sample(range(GRID * GRID), k)
        colours = rng.sample(DEFAULT_COLORS, k)
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        shapes = []
        for cell, colour in zip(cells, colours):
            shape, area = rng.choice(SHAPES), rng.uniform(*AREA)
            row, col = divmod(cell, GRID)
            x = col * cell_px + cell_px // 2 + rng.randint(-JITTER, JITTER)
            y = row * cell_px + cell_px // 2 + rng.randint(-JITTER, JITTER)
            draw_object(draw, shape, colour, x, y, area)
            shapes.append(shape)
        target = rng.randrange(k)
        rows.append(dict(id=f"tools-{seed}-{i}", image=image, question=f"What shape is the {colours[target]} object?",
                         answer=shapes[target], cell=cells[target], colour=colours[target], cells=cells))
    return rows


def zoom_prompt():
    """The prompt of a zoomed box on its own (the warm start's eye rows and the forced-zoom check)."""
    return prompt_of(ZOOM_QUESTION)


def prompt_of(question):
    """The row's prompt in TRL's conversational format (the image before the question)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def zoomed(row, cell=None):
    """What zoom_image returns for the box of `cell` (default: the asked colour's) of a row's image."""
    return zoom_image(object_box(row["cell"] if cell is None else cell), images=[row["image"]],
                      max_pixels=SEEN_PIXELS)


def make_tools_dataset(n: int, *, seed: int = 0, zoom: bool = False):
    """A `datasets.Dataset` in TRL's conversational VLM format: prompt, images, answer, id, cell. With `zoom`, each
    row's image is the asked box already zoomed and the question "What shape is this?": the forced-zoom check
    (can the model read the zoomed shape at all?)."""
    rows = task_rows(n, seed=seed)
    part = {"type": datasets.Value("string"), "text": datasets.Value("string")}
    features = datasets.Features({
        "id": datasets.Value("string"),
        "prompt": datasets.List({"role": datasets.Value("string"), "content": datasets.List(part)}),
        "images": datasets.List(datasets.Image()),
        "answer": datasets.Value("string"),
        "cell": datasets.Value("int32"),
    })
    return datasets.Dataset.from_dict({
        "id": [r["id"] for r in rows],
        "prompt": [prompt_of(ZOOM_QUESTION if zoom else r["question"]) for r in rows],
        "images": [[zoomed(r) if zoom else r["image"]] for r in rows], "answer": [r["answer"] for r in rows],
        "cell": [r["cell"] for r in rows]}, features=features)


def warm_start_rows(n: int, *, seed: int = 0, shares: dict = None, wrong_calls: float = WRONG_CALLS) -> list[dict]:
    """sharegpt SFT rows (utils.core.data.load_sharegpt) of three kinds, drawn with `shares`
    (WARM_START_SHARES): `tool`, the tool offered, a call on the asked colour's box (or, for a `wrong_calls` share,
    an empty cell's), the zoomed box as its result, the answer; `plain`, answered from the overview alone; `zoom`,
    the zoomed box alone with "What shape is this?"."""
    shares = shares or WARM_START_SHARES
    schemas = json.dumps(ToolBox([TOOL]).schemas)
    out = []
    for k, row in enumerate(task_rows(n, seed=seed)):
        rng = random.Random(f"tools-mode-{seed}-{k}")
        kind = rng.choices(list(shares), weights=list(shares.values()))[0]
        answer = {"from": "gpt", "value": f"<answer>{row['answer']}</answer>"}
        question = {"from": "human", "value": "<image>" + row["question"]}
        if kind == "tool":
            empty = [c for c in range(GRID * GRID) if c not in row["cells"]]
            cell = rng.choice(empty) if rng.random() < wrong_calls else row["cell"]
            call = {"from": "function_call",
                    "value": json.dumps({"name": TOOL, "arguments": {"box": object_box(cell)}})}
            out.append(dict(id=row["id"], messages=[question, call, {"from": "observation", "value": "<image>"},
                                                    answer], images=[row["image"], zoomed(row, cell)], tools=schemas))
        elif kind == "zoom":
            out.append(dict(id=row["id"], messages=[{"from": "human", "value": "<image>" + ZOOM_QUESTION}, answer],
                            images=[zoomed(row)], tools=""))
        else:
            out.append(dict(id=row["id"], messages=[question, answer], images=[row["image"]], tools=""))
    return out


def save_warm_start(rows, out):
    """`warm_start_rows` as a save_to_disk folder that train_sft.py's sharegpt loader reads."""
    features = datasets.Features({
        "id": datasets.Value("string"),
        "messages": datasets.List({"from": datasets.Value("string"), "value": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()), "tools": datasets.Value("string")})
    datasets.Dataset.from_list(rows, features=features).save_to_disk(out)
    return out


def save_template(out):
    """The tiny ChatML template with Qwen's tool format, as a .jinja file (the warm start's --chat_template_path:
    a cached tiny-sft saved before the template rendered tools gets it)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(_FAMILY_TOKENS["qwen2_5_vl"]["template"]())
    return out
