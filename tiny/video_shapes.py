"""The tiny world's video task: short clips of moving and appearing shapes, with VQA rows about them.

Three kinds of question, each answerable only from several frames:

- direction: a circle crosses the frame; "Which way does the {color} circle move?" (left / right / up / down)
- frames: a red square shows in some frames only; "In how many frames is there a red square?"
- last: shapes appear one after another; "Which shape appears last?"

Clips are mp4 files (PyAV's mpeg4 encoder, 84 x 84, --fps 4 by default) beside a `{split}.jsonl` of CRYSTAL-style
rows (`video`, question, answer, choices, reference_steps), read by `utils.data.load_vqa`. With 8 frames, the
default --fps 2 sampling keeps 4 of them (first and last included), so a task that needs every frame ("frames")
wants `--fps 4`. Every row is drawn from its own `random.Random(f"video-{seed}-{index}")`: a row depends only on the
seed and its index.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
from PIL import Image, ImageDraw

from tiny.shapes import BACKGROUND, DEFAULT_COLORS, SHAPES, draw_shape

VIDEO_KINDS = ("direction", "frames", "last")
DIRECTIONS = ("left", "right", "up", "down")


def _frames(objects_per_frame, image_size):
    frames = []
    for objects in objects_per_frame:
        image = Image.new("RGB", (image_size, image_size), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for obj in objects:
            draw_shape(draw, obj["shape"], obj["color"], obj["x"], obj["y"], obj["size"])
        frames.append(np.asarray(image))
    return frames


def _direction(rng, n_frames, image_size):
    color, direction = rng.choice(DEFAULT_COLORS), rng.choice(DIRECTIONS)
    size = image_size // 5
    low, high = size // 2 + 2, image_size - size // 2 - 3
    across = rng.randint(low, high)
    path = [round(low + (high - low) * t / (n_frames - 1)) for t in range(n_frames)]
    if direction in ("left", "up"):
        path = path[::-1]
    objects = [[{"shape": "circle", "color": color, "size": size,
                 "x": p if direction in ("left", "right") else across,
                 "y": across if direction in ("left", "right") else p}] for p in path]
    question = f"Which way does the {color} circle move?"
    side = {"left": "left", "right": "right", "up": "top", "down": "bottom"}
    start = side[{"left": "right", "right": "left", "up": "down", "down": "up"}[direction]]
    steps = [f"In the first frame the {color} circle is at the {start}",
             f"In the last frame it is at the {side[direction]}", f"So it moves {direction}"]
    return objects, question, direction, list(DIRECTIONS), steps


def _count_frames(rng, n_frames, image_size):
    shown = sorted(rng.sample(range(n_frames), rng.randint(1, n_frames - 1)))
    size = image_size // 4
    x, y = rng.randint(size, image_size - size), rng.randint(size, image_size - size)
    distractor = {"shape": "circle", "color": "blue", "size": size, "x": image_size - x, "y": image_size - y}
    square = {"shape": "square", "color": "red", "size": size, "x": x, "y": y}
    objects = [[distractor] + ([square] if t in shown else []) for t in range(n_frames)]  # the square on top
    answer = str(len(shown))
    return (objects, "In how many frames is there a red square?", answer, None,
            [f"The red square is in frames {', '.join(str(t + 1) for t in shown)}",
             f"That is {answer} frames"])


def _last(rng, n_frames, image_size):
    order = rng.sample(SHAPES, len(SHAPES))
    starts = sorted(rng.sample(range(n_frames - 1), len(order)))  # the last shape still appears before the end
    size = image_size // 4
    spots = [(size, size), (image_size - size, size), (image_size // 2, image_size - size)]
    rng.shuffle(spots)
    objects = [[{"shape": shape, "color": "green", "size": size, "x": spots[i][0], "y": spots[i][1]}
                for i, shape in enumerate(order) if starts[i] <= t] for t in range(n_frames)]
    return (objects, "Which shape appears last?", order[-1], list(SHAPES),
            [f"The {order[0]} appears first", f"then the {order[1]}", f"and the {order[2]} last"])


_MAKERS = {"direction": _direction, "frames": _count_frames, "last": _last}


def write_clip(path: str, frames, fps: int) -> str:
    """Encode RGB frames (H x W x 3 uint8) as an mp4 (mpeg4, yuv420p) with PyAV."""
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def save_video_vqa(out_dir: str, n: int, *, seed: int = 0, split: str = "train", n_frames: int = 8, fps: int = 4,
                   image_size: int = 84, kinds=VIDEO_KINDS) -> str:
    """Write n clips under out_dir/clips and their rows to out_dir/{split}.jsonl (video paths relative to out_dir);
    returns the jsonl path. Row i uses kind kinds[i % len(kinds)]."""
    unknown = [k for k in kinds if k not in _MAKERS]
    if unknown or not kinds:
        raise ValueError(f"unknown video kinds {unknown or kinds}; expected some of {VIDEO_KINDS}")
    if n_frames < 4:
        raise ValueError(f"n_frames {n_frames}: the tasks need at least 4 frames")
    os.makedirs(os.path.join(out_dir, "clips"), exist_ok=True)
    path = os.path.join(out_dir, f"{split}.jsonl")
    with open(path, "w") as f:
        for index in range(n):
            rng = random.Random(f"video-{seed}-{index}")
            kind = kinds[index % len(kinds)]
            objects, question, answer, choices, steps = _MAKERS[kind](rng, n_frames, image_size)
            clip = os.path.join("clips", f"{split}-{index:05d}.mp4")
            write_clip(os.path.join(out_dir, clip), _frames(objects, image_size), fps)
            row = {"id": f"{split}-{index}", "video": clip, "question": question, "answer": answer,
                   "choices": choices, "reference_steps": steps, "kind": kind}
            f.write(json.dumps(row) + "\n")
    return path
