"""The tiny tool task (tiny/tools_task.py): rows in TRL's conversational format that GRPO's loader reads, an overview
(the image at the recipe's pixel budget, resized as the processor resizes it) that keeps each object's colour and
loses its shape, a zoom on the asked colour's box that shows the shape, warm-start rows that train_sft.py's sharegpt
loader reads, and the results table (bench/experiments/tiny_tools_table.py)."""

import itertools
import json
import random

import numpy as np
import torch
import yaml
from PIL import Image, ImageDraw
from transformers import Qwen2VLImageProcessor
from transformers.image_processing_utils import SizeDict

from bench.experiments.tiny_tools_table import table
from tiny import tools_task
from tiny.shapes import DEFAULT_COLORS, PALETTE, SHAPES
from tiny.tools_task import IMAGE_SIZE, SEEN_PIXELS, ZOOM_QUESTION, make_tools_dataset, object_box, task_rows, zoomed
from utils.core.conversations import load_prompt_set, prompt_images, prompt_messages
from utils.core.data import load_sharegpt
from utils.core.sft_data import sharegpt_conversation, sharegpt_tools


def _seen(image):
    """The image as the model sees it: Qwen2-VL's processor resize to the recipe's budget (float pixels, HWC)."""
    processor = Qwen2VLImageProcessor()
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()
    out = processor.resize(pixels, size=SizeDict(shortest_edge=56 * 56, longest_edge=SEEN_PIXELS),
                           resample=processor.resample, factor=28)
    return out[0].permute(1, 2, 0).clamp(0, 255).numpy()


def test_the_recipe_sees_the_budget_the_task_is_made_for():
    with open("recipes/tiny_tools.yaml") as f:
        recipe = yaml.safe_load(f)
    assert recipe["max_pixels"] == SEEN_PIXELS and recipe["tools"] == [tools_task.TOOL]
    assert _seen(Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))).shape == (84, 84, 3)


def test_the_overview_loses_the_shape_and_the_zoom_shows_it():
    # one object drawn as each of the three shapes (same colour, area and centre): in the overview no two of them
    # differ by more than a quarter of the pixel range on more than 2 pixels, in the zoom on over 100
    rng = random.Random(0)
    centre = IMAGE_SIZE // 2
    for _ in range(6):
        colour, area = rng.choice(DEFAULT_COLORS), rng.uniform(*tools_task.AREA)
        jitter = tools_task.JITTER
        x, y = centre + rng.randint(-jitter, jitter), centre + rng.randint(-jitter, jitter)
        seen, zoom = {}, {}
        for shape in SHAPES:
            image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
            tools_task.draw_object(ImageDraw.Draw(image), shape, colour, x, y, area)
            seen[shape] = _seen(image)
            zoom[shape] = np.array(zoomed(dict(image=image, cell=4)), dtype=np.float32)
        for a, b in itertools.combinations(SHAPES, 2):
            assert (np.abs(seen[a] - seen[b]).max(-1) > 64).sum() <= 2, (a, b, colour, area)
            assert (np.abs(zoom[a] - zoom[b]).max(-1) > 64).sum() > 100, (a, b, colour, area)


def test_the_overview_keeps_the_colour_in_its_cell():
    for row in task_rows(16, seed=1):
        seen = _seen(row["image"])
        r, c = divmod(row["cell"], 3)
        cell = (255 - seen[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28]).reshape(-1, 3)  # distance from white
        ink = cell[cell.sum(-1).argmax()]
        assert ink.sum() > 150  # a visible blob
        cosine = {name: float(ink @ (255 - np.array(PALETTE[name])) / np.linalg.norm(255 - np.array(PALETTE[name])))
                  for name in DEFAULT_COLORS}
        assert max(cosine, key=cosine.get) == row["colour"]


def test_rows_are_trl_conversations_and_the_zoom_is_the_asked_box(tmp_path):
    make_tools_dataset(8, seed=0).save_to_disk(str(tmp_path / "tools"))
    data = load_prompt_set(str(tmp_path / "tools"))
    rows = task_rows(8, seed=0)
    for row, loaded in zip(rows, data):
        assert prompt_messages(loaded)[0]["content"][0] == {"type": "image"}
        assert prompt_images(loaded)[0].size == (IMAGE_SIZE, IMAGE_SIZE) and loaded["answer"] == row["answer"]
        zoom = zoomed(row)
        assert zoom.size == (84, 84)  # the box is exactly 42 px, enlarged twice
        assert sum(1 for p in zoom.getdata() if p == PALETTE[row["colour"]]) > 200  # the asked object fills it
    assert task_rows(3, seed=0)[2]["question"] == rows[2]["question"]  # a row depends on its seed and index
    assert object_box(0) == [134, 134, 200, 200] and object_box(5) == [800, 467, 866, 533]
    forced = make_tools_dataset(4, seed=0, zoom=True)
    assert forced[0]["prompt"][0]["content"][1]["text"] == ZOOM_QUESTION and forced[0]["images"][0].size == (84, 84)


def test_warm_start_rows_call_the_zoom_mostly_on_the_right_box(tmp_path):
    n = 64
    rows = tools_task.warm_start_rows(n, seed=2, wrong_calls=0.5)
    data = load_sharegpt(tools_task.save_warm_start(rows, str(tmp_path / "traces")))
    kinds, right = [], 0
    for raw, row in zip(task_rows(n, seed=2), data):
        messages, images = sharegpt_conversation(row)
        assert messages[-1]["content"][0]["text"] == f"<answer>{raw['answer']}</answer>"
        if row["tools"]:
            call = messages[1]["tool_calls"][0]["function"]
            assert call["name"] == "zoom_image" and len(images) == 2
            assert sharegpt_tools(row)[0]["function"]["name"] == "zoom_image"
            cell = [object_box(c) for c in range(9)].index(call["arguments"]["box"])
            assert cell == raw["cell"] or cell not in raw["cells"]  # the asked box, or an empty cell's
            right += cell == raw["cell"]
            kinds.append("tool")
        else:
            question = messages[0]["content"][-1]["text"]
            kinds.append("zoom" if question == ZOOM_QUESTION else "plain")
            assert len(messages) == 2 and images[0].size == ((84, 84) if kinds[-1] == "zoom" else (630, 630))
    assert set(kinds) == {"tool", "plain", "zoom"} and 0 < right < kinds.count("tool")


def test_the_table_reports_the_targets_on_the_means():
    text = table([(0.40, 0.60), (0.42, 0.58)], [(0.35, 0.38), (0.34, 0.36)])
    assert "| mean | 0.410 | 0.590 | 0.345 | 0.370 | +0.180 | +0.220 |" in text
    assert "| with tools: after GRPO >= the warm start + 0.10 | +0.180 | yes |" in text
    assert json.dumps(text)  # plain text
