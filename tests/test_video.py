"""utils/core/video.py: decoding real clips (files of several codecs, frame folders, frame lists), the frame-sampling
rule,
the per-frame and total pixel budget, and refusals that name the file."""

import os

import pytest
import torch

from tests.video_helpers import bar_position, write_frames, write_video
from utils.core.video import (
    VideoBudget,
    VideoError,
    budget_for,
    frame_size,
    load_clip,
    probe,
    processor_video_kwargs,
    sample_indices,
)

SMALL = VideoBudget(fps=2.0, max_frames=8, min_frames=4, min_pixels=28 * 28, max_pixels=56 * 56,
                    total_pixels=10**9, factor=28, temporal_patch=2)


def test_sampling_rule_uniform_at_fps_capped_and_rounded_to_the_temporal_patch():
    # 10 frames at 4 fps = 2.5 s; at 2 fps: 5 frames -> floored to 4; first and last kept
    assert sample_indices(10, 4.0, SMALL) == [0, 3, 6, 9]
    # 100 frames at 10 fps = 10 s; 20 wanted, capped at max_frames 8
    assert sample_indices(100, 10.0, SMALL) == [0, 14, 28, 42, 57, 71, 85, 99]
    # a short clip is raised to min_frames (4), but never over its frame count (3 -> floored to 2)
    assert sample_indices(40, 30.0, SMALL) == [0, 13, 26, 39]
    assert sample_indices(3, 30.0, SMALL) == [0, 2]
    # one frame: repeated to fill a temporal patch
    assert sample_indices(1, 30.0, SMALL) == [0, 0]
    # an odd max_frames is floored to the temporal patch
    odd = VideoBudget(**{**SMALL.__dict__, "max_frames": 5})
    assert len(sample_indices(100, 10.0, odd)) == 4
    with pytest.raises(ValueError):
        sample_indices(0, 4.0, SMALL)


def test_pixel_budget_per_frame_and_total_as_qwen_vl_utils():
    # per-frame cap: a 480x640 frame fits into max_pixels, sides multiples of 28
    h, w = frame_size(480, 640, 4, SMALL)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 56 * 56
    # total cap: 64 frames share total_pixels (times the temporal patch), floored at 1.05 * min_pixels
    budget = VideoBudget(**{**SMALL.__dict__, "max_pixels": 448 * 448, "total_pixels": 32 * 112 * 112})
    h4, w4 = frame_size(448, 448, 4, budget)
    h64, w64 = frame_size(448, 448, 64, budget)
    assert h4 * w4 <= 32 * 112 * 112 / 4 * 2 and h64 * w64 < h4 * w4
    assert h64 * w64 <= max(32 * 112 * 112 / 64 * 2, 28 * 28 * 1.05)
    # min pixels: a tiny frame is upscaled to at least min_pixels
    h, w = frame_size(10, 10, 2, VideoBudget(**{**SMALL.__dict__, "min_pixels": 56 * 56}))
    assert h * w >= 56 * 56


@pytest.mark.parametrize("ext", [".mp4", ".webm", ".mkv"])
def test_load_clip_from_a_file_samples_the_right_frames(tmp_path, ext):
    path = write_video(tmp_path / f"clip{ext}", n_frames=10, fps=4)
    clip = load_clip(path, SMALL)
    assert clip.indices == [0, 3, 6, 9]
    assert clip.frames.dtype == torch.uint8 and clip.frames.shape == (4, 3, 56, 56)  # 48x64 -> 56x56 under 56*56
    assert clip.sampled_fps == pytest.approx(4 / 10 * 4)
    # the decoded frames are those frames (the bar moves 6 px a frame; resized 64 -> 56 wide)
    unresized = load_clip(path, VideoBudget(**{**SMALL.__dict__, "max_pixels": 10**6, "factor": 2}))
    assert [bar_position(f) for f in unresized.frames] == [0, 3, 6, 9]
    assert probe(path) in (10, 1)  # webm/mkv declare no count: probe only proves a frame decodes


def test_load_clip_from_a_frame_folder_and_a_frame_list(tmp_path):
    paths = write_frames(tmp_path / "frames", n_frames=12)
    clip = load_clip(str(tmp_path / "frames"), SMALL)
    # 12 frames count as a clip at --fps (2): 6 s, 12 wanted, capped at 8
    assert clip.indices == [0, 2, 3, 5, 6, 8, 9, 11]
    assert [bar_position(f) for f in load_clip(str(tmp_path / "frames"),
                                                VideoBudget(**{**SMALL.__dict__, "factor": 2,
                                                               "max_pixels": 10**6})).frames] == clip.indices
    listed = load_clip(paths[:4], SMALL)
    assert listed.indices == [0, 1, 2, 3] and listed.sampled_fps == pytest.approx(2.0)
    assert torch.equal(listed.frames, load_clip(paths[:4], SMALL).frames)  # deterministic


def test_bad_videos_are_refused_naming_the_file(tmp_path):
    missing = str(tmp_path / "missing.mp4")
    with pytest.raises(VideoError, match="missing.mp4"):
        probe(missing)
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video at all" * 10)
    with pytest.raises(VideoError, match="garbage.mp4"):
        load_clip(str(garbage), SMALL)
    with pytest.raises(VideoError, match="garbage.mp4"):
        probe(str(garbage))
    empty = tmp_path / "empty"
    os.makedirs(empty)
    with pytest.raises(VideoError, match="empty"):
        probe(str(empty))
    with pytest.raises(VideoError, match="nope.png"):
        probe([str(tmp_path / "nope.png")])


def test_budget_from_the_processor_and_flags(tmp_path):
    from types import SimpleNamespace

    vp = SimpleNamespace(size={"shortest_edge": 3136, "longest_edge": 12544}, patch_size=14, merge_size=2,
                         temporal_patch_size=2, max_frames=768, max_video_tokens=1000)
    budget = budget_for(SimpleNamespace(video_processor=vp))
    assert (budget.min_pixels, budget.max_pixels, budget.factor) == (3136, 12544, 28)
    assert budget.total_pixels == int(1000 * 28 * 28 * 0.9)
    flagged = budget_for(SimpleNamespace(video_processor=vp), fps=1, max_frames=16, max_pixels=784 * 4,
                         min_pixels=784, total_pixels=784 * 64)
    assert (flagged.fps, flagged.max_frames, flagged.max_pixels, flagged.min_pixels, flagged.total_pixels) == (
        1.0, 16, 3136, 784, 784 * 64)
    with pytest.raises(Exception, match="--video_min_pixels"):
        budget_for(SimpleNamespace(video_processor=vp), min_pixels=10**6, max_pixels=10)
    with pytest.raises(Exception, match="--fps"):
        budget_for(SimpleNamespace(video_processor=vp), fps=0)
    with pytest.raises(Exception, match="no video processor"):
        budget_for(SimpleNamespace())


def test_processor_gets_the_sampled_frames_and_their_timing(tmp_path):
    path = write_video(tmp_path / "clip.mp4", n_frames=10, fps=4)
    clip = load_clip(path, SMALL)
    kwargs = processor_video_kwargs([clip])
    assert kwargs["videos"][0] is clip.frames
    meta = kwargs["videos_kwargs"]["video_metadata"][0]
    assert meta.total_num_frames == 4 and meta.sampled_fps == pytest.approx(1.6)
    assert kwargs["videos_kwargs"]["do_sample_frames"] is False and kwargs["videos_kwargs"]["do_resize"] is False
    assert processor_video_kwargs([]) == {}


def test_scripts_refuse_bad_video_flags_before_loading_a_model():
    import evaluate
    import train_grpo
    import train_sft
    from utils.core.errors import InputError

    with pytest.raises(InputError, match="--fps must be positive"):
        train_sft.validate(train_sft.SFTConfig(fps=0))
    with pytest.raises(InputError, match="--video_min_pixels 5000 is over --video_max_pixels 100"):
        train_grpo.validate(train_grpo.GRPOConfig(video_min_pixels=5000, video_max_pixels=100), 1)
    with pytest.raises(InputError, match="--max_frames must be positive"):
        evaluate.validate(evaluate.EvalConfig(model="m", max_frames=0))
