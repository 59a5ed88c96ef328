"""tiny/video_shapes.py: the tiny video task's clips show what their answers say (read back through utils.core.video),
and rows depend only on the seed and their index."""

import numpy as np
import pytest

from tiny.video_shapes import save_video_vqa
from utils.core.data import load_vqa
from utils.core.video import VideoBudget, load_clip, videos_of

# every frame of an 8-frame clip at 4 fps, at its own 84 x 84 size
EVERY_FRAME = VideoBudget(fps=4.0, max_frames=8, min_frames=4, min_pixels=84 * 84, max_pixels=84 * 84,
                          total_pixels=10**8, factor=28, temporal_patch=2)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_task")
    path = save_video_vqa(str(root), 12, seed=0)
    return root, load_vqa(path, require_steps=True)


def _mask(frame, colour):
    frame = frame.permute(1, 2, 0).numpy().astype(int)
    return (np.abs(frame - np.array(colour)).sum(-1) < 120)


def test_direction_clips_move_the_circle_the_answered_way(task):
    from tiny.shapes import PALETTE

    _, rows = task
    checked = 0
    for row in rows:
        if row["kind"] != "direction":
            continue
        colour = PALETTE[row["question"].split()[4]]
        clip = load_clip(videos_of(row)[0], EVERY_FRAME)
        assert clip.frames.shape == (8, 3, 84, 84)
        (y0, x0), (y1, x1) = (np.argwhere(_mask(clip.frames[t], colour)).mean(0) for t in (0, -1))
        moved = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0}
        assert moved[row["answer"]] > 30 and row["answer"] in row["choices"]
        checked += 1
    assert checked == 4


def test_frame_counts_and_appearance_order_match_the_answers(task):
    _, rows = task
    for row in rows:
        clip = load_clip(videos_of(row)[0], EVERY_FRAME)
        if row["kind"] == "frames":
            red = [_mask(f, (220, 40, 40)).sum() > 100 for f in clip.frames]
            assert sum(red) == int(row["answer"])
        elif row["kind"] == "last":
            green = [_mask(f, (40, 170, 60)).sum() for f in clip.frames]
            steps = sum(b > a + 100 for a, b in zip([0] + green, green))
            assert steps == 3 and row["answer"] in row["choices"]  # three shapes appear one after another


def test_rows_depend_only_on_seed_and_index(task, tmp_path):
    root, rows = task
    again = load_vqa(save_video_vqa(str(tmp_path), 3, seed=0), require_steps=True)
    for a, b in zip(rows.select(range(3)), again):
        assert {k: a[k] for k in ("question", "answer", "reference_steps")} == {
            k: b[k] for k in ("question", "answer", "reference_steps")}
    other = load_vqa(save_video_vqa(str(tmp_path / "other"), 3, seed=1), require_steps=True)
    assert [r["question"] + r["answer"] for r in other] != [r["question"] + r["answer"] for r in again]
