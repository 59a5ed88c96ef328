"""The tiny tool task (tiny/tools_task.py): rows in TRL's conversational format that GRPO's loader reads, a zoom on
the asked colour's cell that shows the shape at full budget, warm-start traces that train_sft.py's sharegpt loader
reads, and the results table (bench/tiny_tools_table.py)."""

import json

from PIL import Image

from bench.experiments.tiny_tools_table import table
from tiny.shapes import PALETTE
from tiny.tools_task import SEEN_PIXELS, cell_box, make_tools_dataset, save_warm_start, task_rows, warm_start_rows
from utils.core.conversations import load_prompt_set, prompt_images, prompt_messages
from utils.core.data import load_sharegpt
from utils.core.image_tools import zoom_image
from utils.core.sft_data import sharegpt_conversation, sharegpt_tools


def _colour_pixels(image, colour):
    return sum(1 for p in image.getdata() if p == PALETTE[colour])


def test_rows_are_trl_conversations_and_the_zoom_shows_the_asked_shape(tmp_path):
    make_tools_dataset(8, seed=0).save_to_disk(str(tmp_path / "tools"))
    data = load_prompt_set(str(tmp_path / "tools"))
    rows = task_rows(8, seed=0)
    for row, loaded in zip(rows, data):
        assert prompt_messages(loaded)[0]["content"][0] == {"type": "image"}
        assert prompt_images(loaded)[0].size == (252, 252) and loaded["answer"] == row["answer"]
        zoomed = zoom_image(cell_box(row["cell"]), images=[row["image"]], max_pixels=SEEN_PIXELS)
        assert zoomed.size[0] * zoomed.size[1] <= SEEN_PIXELS
        # the asked colour fills many pixels of the zoomed cell, where the 84 px view keeps a few
        small = row["image"].resize((84, 84), Image.BICUBIC)
        assert _colour_pixels(zoomed, row["colour"]) > 40 > _colour_pixels(small, row["colour"])
    assert task_rows(3, seed=0)[2]["question"] == rows[2]["question"]  # a row depends on its seed and index


def test_warm_start_traces_call_the_zoom_on_the_right_cell(tmp_path):
    rows = warm_start_rows(16, seed=2)
    data = load_sharegpt(save_warm_start(rows, str(tmp_path / "traces")))
    tool_rows = [r for r in data if r["tools"]]
    assert 0 < len(tool_rows) < len(data)  # both kinds of traces
    for raw, row in zip(task_rows(16, seed=2), data):
        messages, images = sharegpt_conversation(row)
        assert messages[-1]["content"][0]["text"] == f"<answer>{raw['answer']}</answer>"
        if row["tools"]:
            call = messages[1]["tool_calls"][0]["function"]
            assert call == {"name": "zoom_image", "arguments": {"box": cell_box(raw["cell"])}} and len(images) == 2
            assert sharegpt_tools(row)[0]["function"]["name"] == "zoom_image"
        else:
            assert len(messages) == 2 and len(images) == 1


def test_the_table_reports_the_targets_on_the_means():
    text = table([(0.40, 0.60), (0.42, 0.58)], [(0.35, 0.38), (0.34, 0.36)])
    assert "| mean | 0.410 | 0.590 | 0.345 | 0.370 | +0.180 | +0.220 |" in text
    assert "| with tools: after GRPO >= the warm start + 0.10 | +0.180 | yes |" in text
    assert json.dumps(text)  # plain text
