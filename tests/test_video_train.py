"""Video through the training paths on the tiny Qwen2.5-VL, in process: train_sft.py on sharegpt video rows, and
the GRPO log-prob passes (plain, unshared-expanded and shared-prompt) equal to a plain forward of the model with
Qwen2.5-VL's video timing (second_per_grid_ts) in its 3-row rope."""

import json
import os

import pytest
import torch

from tests.video_helpers import write_frames, write_video
from utils.video import VideoBudget

torch.set_num_threads(1)

BUDGET = VideoBudget(fps=2.0, max_frames=4, min_frames=2, min_pixels=28 * 28, max_pixels=56 * 56,
                     total_pixels=10**8, factor=28, temporal_patch=2)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_media")
    write_video(root / "clip.mp4", n_frames=10, fps=4)
    write_video(root / "slow.mp4", n_frames=8, fps=2, colour=(0, 0, 120))  # other timing: other second_per_grid
    write_frames(root / "frames", n_frames=5)
    return root


@pytest.fixture(scope="module")
def qwen():
    from tiny.cache import tiny_vlm_path
    from utils.models import load_model_and_processor

    model, processor = load_model_and_processor(tiny_vlm_path(), dtype="float32")
    return tiny_vlm_path(), model.eval(), processor


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_train_sft_on_video_rows_lowers_the_loss(media, qwen, tmp_path):
    from train_sft import SFTConfig, main

    rows = [{"messages": [{"role": "user", "content": "<video>Which way does the bar move?"},
                          {"role": "assistant", "content": "right"}], "videos": ["clip.mp4"]},
            {"messages": [{"role": "user", "content": "<video>And here? <video>"},
                          {"role": "assistant", "content": "right twice"}], "videos": ["frames", "slow.mp4"]}]
    data = _write_jsonl(media / "sft_video.jsonl", rows)
    out = tmp_path / "run"
    main(SFTConfig(model_name_or_path=qwen[0], dataset_name=data, dataset_format="sharegpt",
                   per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="constant", max_steps=3,
                   save_steps=3, logging_steps=1, max_length=512, output_dir=str(out), report_to="none", seed=0,
                   fps=2.0, max_frames=4, video_min_pixels=28 * 28, video_max_pixels=56 * 56))
    with open(out / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert os.path.isfile(out / "checkpoint-3" / "model.safetensors")
