"""The tiny tool task: a question whose answer is too small to survive the first image's pixel budget, and an image
tool that returns it at full budget (docs/tools.md).

Each 252 x 252 image holds 2-4 small shapes (10-16 px), each of its own colour in its own cell of a 3 x 3 grid. The
question asks for the shape of one colour: "What shape is the red object?". The model's processor sees the image at
84 x 84 pixels (`--max_pixels 7056`, a third of each side): the colours survive as a few pixels in their cell, the
shapes do not (sizes vary, so a shape's area does not give it away). `zoom_image` on the colour's cell
(`[x1, y1, x2, y2]` at thirds of 0-1000) returns the cell at full budget, where the shape is 10-16 px again.

The data set is in TRL's conversational format (a `prompt` column of chat messages, an `images` column, the
`answer`), so GRPO and evaluation read it through the same path as a user's TRL data set. The warm start is SFT on
two kinds of traces (`warm_start_rows`): with the tool offered, zoom into the right cell then answer; without it,
answer from the small image alone. GRPO with and without `--tools` then start from the same model.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from tiny.shapes import DEFAULT_COLORS, SHAPES, draw_shape

IMAGE_SIZE = 252  # the data's images
GRID = 3
SEEN_PIXELS = 84 * 84  # the processor's budget (--max_pixels): the model sees a 84 x 84 image
OBJECT_PX = (10, 16)  # shape sizes in the 252 px image (about 3-5 px at 84)
MAX_OBJECTS = 4
TOOL = "zoom_image"
SPLITS = {"train": dict(n=2048, seed=0), "test": dict(n=256, seed=1)}
WARM_START = dict(n=4096, seed=2)  # the SFT traces: rows of their own seed


def cell_box(cell: int) -> list[int]:
    """The 0-1000 box of a grid cell (row-major), as zoom_image takes it."""
    row, col = divmod(cell, GRID)
    edges = [round(i * 1000 / GRID) for i in range(GRID + 1)]
    return [edges[col], edges[row], edges[col + 1], edges[row + 1]]


def task_rows(n: int, *, seed: int = 0) -> list[dict]:
    """n rows (PIL images): id, image, question, answer, and the target's cell and colour."""
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
            shape, size = rng.choice(SHAPES), rng.randint(*OBJECT_PX)
            row, col = divmod(cell, GRID)
            jitter = (cell_px - size) // 2 - 4
            x = col * cell_px + cell_px // 2 + rng.randint(-jitter, jitter)
            y = row * cell_px + cell_px // 2 + rng.randint(-jitter, jitter)
            draw_shape(draw, shape, colour, x, y, size)
            shapes.append(shape)
        target = rng.randrange(k)
        rows.append(dict(id=f"tools-{seed}-{i}", image=image, question=f"What shape is the {colours[target]} object?",
                         answer=shapes[target], cell=cells[target], colour=colours[target]))
    return rows


def prompt_of(question):
    """The row's prompt in TRL's conversational format (the image before the question)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def make_tools_dataset(n: int, *, seed: int = 0):
    """A `datasets.Dataset` in TRL's conversational VLM format: prompt, images, answer, id, cell."""
    import datasets

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
        "id": [r["id"] for r in rows], "prompt": [prompt_of(r["question"]) for r in rows],
        "images": [[r["image"]] for r in rows], "answer": [r["answer"] for r in rows],
        "cell": [r["cell"] for r in rows]}, features=features)


def warm_start_rows(n: int, *, seed: int = 0, tool_share: float = 0.5) -> list[dict]:
    """sharegpt SFT rows (utils.core.data.load_sharegpt): a `tool_share` of them with the tool offered (the call
    on the right cell, the zoomed cell as its result, the answer), the others answered from the small image."""
    import json

    from utils.core.image_tools import zoom_image
    from utils.core.tools import ToolBox

    schemas = json.dumps(ToolBox([TOOL]).schemas)
    out = []
    for k, row in enumerate(task_rows(n, seed=seed)):
        answer = {"from": "gpt", "value": f"<answer>{row['answer']}</answer>"}
        question = {"from": "human", "value": "<image>" + row["question"]}
        if random.Random(f"tools-mode-{seed}-{k}").random() < tool_share:
            box = cell_box(row["cell"])
            zoomed = zoom_image(box, images=[row["image"]], max_pixels=SEEN_PIXELS)
            call = {"from": "function_call", "value": json.dumps({"name": TOOL, "arguments": {"box": box}})}
            out.append(dict(id=row["id"], messages=[question, call, {"from": "observation", "value": "<image>"},
                                                    answer], images=[row["image"], zoomed], tools=schemas))
        else:
            out.append(dict(id=row["id"], messages=[question, answer], images=[row["image"]], tools=""))
    return out


def save_warm_start(rows, out):
    """`warm_start_rows` as a save_to_disk folder that train_sft.py's sharegpt loader reads."""
    import datasets

    features = datasets.Features({
        "id": datasets.Value("string"),
        "messages": datasets.List({"from": datasets.Value("string"), "value": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()), "tools": datasets.Value("string")})
    datasets.Dataset.from_list(rows, features=features).save_to_disk(out)
    return out


def save_template(out):
    """The tiny ChatML template with Qwen's tool format, as a .jinja file (the warm start's --chat_template_path:
    a cached tiny-sft saved before the template rendered tools gets it)."""
    import os

    from tiny.tokenizer import _FAMILY_TOKENS

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(_FAMILY_TOKENS["qwen2_5_vl"]["template"]())
    return out
