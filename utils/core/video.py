"""Video inputs: decoding (PyAV), deterministic frame sampling and the frame pixel budget, shared by training, the HF
rollout, vLLM and evaluation so that every path sees the same frames (docs/data.md, "Video").

A video is a file path (anything ffmpeg decodes: mp4, webm, avi, mkv ...), a folder of frame images (sorted by
name, numbers compared as numbers) or a list of frame image paths. The rules follow Qwen's own tooling
(qwen-vl-utils), so a model sees frames the way it was trained on them:

- Frames: a file of N frames at r frames/s lasts N / r seconds; it is sampled at `fps` frames per second,
  n = N / r * fps, clamped to [min_frames, min(max_frames, N)] and floored to a multiple of the temporal patch
  (Qwen2.5-VL: 2). A folder or list of N frames counts as a clip already sampled at `fps` (r = fps). The n frame
  indices are round(linspace(0, N - 1, n)): the first and last frames are always kept, and the choice depends only
  on N and the flags, so resume and every process see the same frames. A clip shorter than the temporal patch
  repeats its last frame.
- Pixels per frame: max = max(min(max_pixels, total_pixels / n * temporal_patch), 1.05 * min_pixels); each frame is
  resized (bicubic, antialiased) to Qwen's smart_resize of its size: sides multiples of patch * merge (28),
  aspect ratio kept, area within [min_pixels, max]. So a long video gets smaller frames instead of an
  unbounded prompt; a frame costs h * w / (patch * merge)^2 * 1 / temporal_patch tokens.
- The sampled clip's rate is n / N * r; Qwen2.5-VL's rope spaces its temporal patches by
  temporal_patch / that rate seconds (`second_per_grid_ts`).

The processor then gets the frames already sampled and sized (`processor_video_kwargs`): its own sampling and
resizing are switched off, so the HF processor and vLLM (whose resize is a no-op on frames that already fit
`mm_processor_kwargs`) tokenize the same pixels.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass

import torch

from utils.core.errors import InputError

FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
VIDEO_MARKER = "<video>"

# qwen-vl-utils' defaults (the per-frame pixel defaults come from the model's video processor)
DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 768


class VideoError(InputError):
    """A video that cannot be used; the message names the file."""


@dataclass(frozen=True)
class VideoBudget:
    """How a video becomes frames: sampling rate and caps, and pixels per frame / per clip."""

    fps: float = DEFAULT_FPS
    max_frames: int = DEFAULT_MAX_FRAMES
    min_frames: int = DEFAULT_MIN_FRAMES
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)
    factor: int = 28  # frame sides are multiples of this (patch size * spatial merge)
    temporal_patch: int = 2  # frames per temporal patch: the frame count is a multiple of it


@dataclass
class Clip:
    """Sampled, resized frames [T, 3, H, W] uint8, the rate they were sampled at, and where they came from."""

    frames: torch.Tensor
    sampled_fps: float
    source: str
    indices: list[int]


def budget_for(processor, *, fps=None, max_frames=None, min_pixels=None, max_pixels=None,
               total_pixels=None) -> VideoBudget:
    """The budget from the flags; a flag left None takes the model's video processor default (its size and patch
    geometry), else qwen-vl-utils' default. Bad values are errors naming the flag."""
    vp = getattr(processor, "video_processor", None)
    if vp is None:
        raise InputError(f"the processor {type(processor).__name__} has no video processor: the model takes no video")
    size = getattr(vp, "size", None) or {}
    factor = int(getattr(vp, "patch_size", 14)) * int(getattr(vp, "merge_size", 2))
    budget = VideoBudget(
        fps=float(fps) if fps is not None else DEFAULT_FPS,
        max_frames=int(max_frames) if max_frames is not None else int(getattr(vp, "max_frames", DEFAULT_MAX_FRAMES)),
        min_frames=min(DEFAULT_MIN_FRAMES, int(max_frames)) if max_frames is not None else DEFAULT_MIN_FRAMES,
        min_pixels=int(min_pixels if min_pixels is not None else size.get("shortest_edge") or 128 * factor * factor),
        max_pixels=int(max_pixels if max_pixels is not None else size.get("longest_edge") or 768 * factor * factor),
        total_pixels=int(total_pixels if total_pixels is not None
                         else int(getattr(vp, "max_video_tokens", 128000)) * factor * factor * 0.9),
        factor=factor, temporal_patch=int(getattr(vp, "temporal_patch_size", 2) or 1),
    )
    check_video_flags(budget.fps, budget.max_frames, budget.min_pixels, budget.max_pixels, budget.total_pixels)
    if budget.max_frames < budget.temporal_patch:
        raise InputError(f"--max_frames {budget.max_frames} is under the model's temporal patch "
                         f"({budget.temporal_patch} frames)")
    return budget


def check_video_flags(fps=None, max_frames=None, min_pixels=None, max_pixels=None, total_pixels=None) -> None:
    """The video flags a script was given (None: unset) are positive and min <= max; the error names the flag."""
    for flag, value in (("--fps", fps), ("--max_frames", max_frames), ("--video_min_pixels", min_pixels),
                        ("--video_max_pixels", max_pixels), ("--video_total_pixels", total_pixels)):
        if value is not None and not value > 0:
            raise InputError(f"{flag} must be positive, got {value}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise InputError(f"--video_min_pixels {min_pixels} is over --video_max_pixels {max_pixels}")


def check_config_video_flags(cfg) -> None:
    """`check_video_flags` on a script's config (utils.core.models.ImageVideoFlags), for its validate()."""
    check_video_flags(cfg.fps, cfg.max_frames, cfg.video_min_pixels, cfg.video_max_pixels, cfg.video_total_pixels)


def sample_indices(total_frames: int, video_fps: float, budget: VideoBudget) -> list[int]:
    """The frame indices to keep of a clip of `total_frames` at `video_fps` (module doc); repeats the last frame
    of a clip shorter than the temporal patch."""
    if total_frames < 1:
        raise ValueError("a video needs at least one frame")
    step = budget.temporal_patch
    cap = max(step, budget.max_frames // step * step)
    wanted = total_frames / video_fps * budget.fps
    n = min(max(wanted, budget.min_frames), cap, total_frames)
    n = int(n // step * step)
    if n < step:  # fewer frames than one temporal patch: take them all, repeat the last
        return list(range(total_frames)) + [total_frames - 1] * (step - total_frames)
    return torch.linspace(0, total_frames - 1, n).round().long().tolist()


def frame_size(height: int, width: int, n_frames: int, budget: VideoBudget) -> tuple[int, int]:
    """(height, width) each frame is resized to (module doc)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    share = budget.total_pixels / n_frames * budget.temporal_patch
    max_pixels = max(min(budget.max_pixels, share), int(budget.min_pixels * 1.05))
    return smart_resize(height, width, factor=budget.factor, min_pixels=budget.min_pixels, max_pixels=max_pixels)


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def frame_paths(folder: str) -> list[str]:
    """The frame images of a folder, in name order (frame2 before frame10)."""
    names = sorted((n for n in os.listdir(folder) if n.lower().endswith(FRAME_EXTENSIONS)), key=_natural_key)
    return [os.path.join(folder, n) for n in names]


def describe(video) -> str:
    """How error messages name a video."""
    if isinstance(video, (list, tuple)):
        return f"frame list [{video[0]!r} ... {len(video)} frames]" if video else "empty frame list"
    return f"'{video}'"


def _open_container(path: str):
    import av

    try:
        container = av.open(path)
    except av.error.EOFError as error:  # headers, then nothing: the probe for stream details ran out of file
        raise VideoError(f"video '{path}' has no decodable frames (the file ends before its first frame)") from error
    except Exception as error:  # av raises several error types for unreadable files
        raise VideoError(f"unreadable video '{path}': {type(error).__name__}: {error}") from error
    if not container.streams.video:
        container.close()
        raise VideoError(f"unreadable video '{path}': it has no video stream")
    return container


def _stream_info(path: str) -> tuple[int, float | None]:
    """(frame count the container declares, 0 when it does not; the stream's frame rate or None)."""
    container = _open_container(path)
    try:
        stream = container.streams.video[0]
        return int(stream.frames or 0), float(stream.average_rate or stream.guessed_rate or 0) or None
    finally:
        container.close()


def _decode(path: str, keep: set[int], stop_after: int | None = None) -> tuple[dict, int]:
    """({index: HxWx3 uint8 array} for the indices in `keep`, the number of frames decoded); zero frames is an
    error."""
    container = _open_container(path)
    kept, count = {}, 0
    try:
        for frame in container.decode(container.streams.video[0]):
            if count in keep:
                kept[count] = frame.to_ndarray(format="rgb24")
            count += 1
            if count == stop_after:
                break
    except Exception as error:
        what = "has no decodable frames" if count == 0 else f"is unreadable at frame {count}"
        raise VideoError(f"video '{path}' {what}: {type(error).__name__}: {error}") from error
    finally:
        container.close()
    if count == 0:
        raise VideoError(f"video '{path}' has no decodable frames")
    return kept, count


def probe(video) -> int:
    """Check a video can be used before training; returns its frame count. A file must open and decode at least
    one frame; a folder must hold frame images; every listed frame must exist. Raises VideoError naming it."""
    if isinstance(video, (list, tuple)):
        if not video:
            raise VideoError("a video given as a frame list has no frames")
        for path in video:
            if not isinstance(path, str) or not os.path.isfile(path):
                raise VideoError(f"video frame not found: {path!r}")
        return len(video)
    if os.path.isdir(video):
        frames = frame_paths(video)
        if not frames:
            raise VideoError(f"video folder '{video}' has no frame images ({'/'.join(FRAME_EXTENSIONS)})")
        return len(frames)
    if not os.path.isfile(video):
        raise VideoError(f"video file not found: '{video}'")
    declared, _ = _stream_info(video)
    _decode(video, set(), stop_after=1)
    return declared or 1


def _resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    import torchvision.transforms.v2.functional as tvf

    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    out = tvf.resize(frames.float(), list(size), interpolation=tvf.InterpolationMode.BICUBIC, antialias=True)
    return out.round().clamp(0, 255).to(torch.uint8)


def load_clip(video, budget: VideoBudget) -> Clip:
    """Decode and sample a video (a file, a folder of frames or a list of frame paths) under `budget`."""
    import numpy as np
    import PIL.Image

    if isinstance(video, (list, tuple)) or os.path.isdir(video):
        paths = list(video) if isinstance(video, (list, tuple)) else frame_paths(video)
        probe(paths if paths else video)
        indices = sample_indices(len(paths), budget.fps, budget)
        arrays = {}
        for i in sorted(set(indices)):
            try:
                with PIL.Image.open(paths[i]) as image:
                    arrays[i] = np.asarray(image.convert("RGB"))
            except Exception as error:
                raise VideoError(f"unreadable video frame '{paths[i]}': {type(error).__name__}: {error}") from error
        total, rate, source = len(paths), budget.fps, describe(video)
    else:
        if not os.path.isfile(video):
            raise VideoError(f"video file not found: '{video}'")
        declared, rate = _stream_info(video)
        rate = rate or budget.fps
        arrays, total = _decode(video, set(sample_indices(declared, rate, budget)) if declared else set())
        indices = sample_indices(total, rate, budget)
        if total != declared:  # the container's count was missing or an estimate: sample the true count
            arrays, _ = _decode(video, set(indices))
        source = f"'{video}'"
    first = arrays[indices[0]]
    if any(arrays[i].shape != first.shape for i in indices):
        raise VideoError(f"video {source}: its frames differ in size")
    frames = torch.from_numpy(np.stack([arrays[i] for i in indices])).permute(0, 3, 1, 2).contiguous()
    try:
        size = frame_size(frames.shape[2], frames.shape[3], len(indices), budget)
    except ValueError as error:  # smart_resize refuses extreme aspect ratios
        raise VideoError(f"video {source}: {error}") from error
    return Clip(_resize(frames, size), len(indices) / total * rate * _repeat_factor(indices), source, indices)


def _repeat_factor(indices):
    """A clip padded by repeating its last frame plays its frames at the clip's rate, not faster."""
    return len(set(indices)) / len(indices)


def processor_video_kwargs(clips: list[Clip]) -> dict:
    """Keyword arguments for a processor call with these clips (in prompt order): the frames, their timing (the
    processor derives `second_per_grid_ts` from it), and its own sampling and resizing off."""
    from transformers.video_utils import VideoMetadata

    if not clips:
        return {}
    # frames_indices over the sampled frames at the sampled rate: Qwen3-VL writes each frame's timestamp (index / fps,
    # seconds from the clip's start) into the prompt; Qwen2.5-VL's second_per_grid_ts reads the same rate
    metadata = [VideoMetadata(total_num_frames=len(c.indices), fps=c.sampled_fps, height=c.frames.shape[2],
                              width=c.frames.shape[3], frames_indices=list(range(len(c.indices)))) for c in clips]
    return {"videos": [c.frames for c in clips],
            "videos_kwargs": {"video_metadata": metadata, "do_sample_frames": False, "do_resize": False,
                              "return_metadata": True, "cap_pixels_per_frame": False}}


def load_clips(videos_per_row, budget: VideoBudget) -> list[list[Clip]]:
    """Clips for a batch: one list per row of its videos (see `videos_of`). The last clips are kept
    (a group's prompt is encoded for the rollout, then again for vLLM or a regrouped micro-batch)."""
    return [[_cached_clip(tuple(v) if isinstance(v, list) else v, budget) for v in videos] for videos in videos_per_row]


@functools.lru_cache(maxsize=64)
def _cached_clip(video, budget: VideoBudget) -> Clip:
    return load_clip(list(video) if isinstance(video, tuple) else video, budget)


def video_token_runs(input_ids, video_token_id: int) -> list[list[int]]:
    """Per row, the lengths of its runs of consecutive video tokens (one run per video)."""
    runs = []
    for row in input_ids.tolist():
        lengths, current = [], 0
        for token in row + [None]:
            if token == video_token_id:
                current += 1
            elif current:
                lengths.append(current)
                current = 0
        runs.append(lengths)
    return runs


def check_video_tokens(processor, input_ids, video_grid_thw, clips_per_row, sample_ids) -> None:
    """The video-token guard: every row holds, in order, exactly the tokens each of its videos expands to, as one
    run per video (Qwen2.5-VL) or one run per temporal grid step (Qwen3-VL, which puts a timestamp before each).
    A cut video (a prompt cut inside it), a repeated or a missing one is an error naming the sample and video."""
    video_token_id = getattr(processor, "video_token_id", None)
    if video_token_id is None:
        return
    merge = int(getattr(processor.video_processor, "merge_size", 1)) ** 2
    grids = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
    for sid, runs, clips in zip(sample_ids, video_token_runs(input_ids, video_token_id), clips_per_row):
        thw = [next(grids) for _ in clips]
        expected = [math.prod(g) // merge for g in thw]
        per_step = [g[1] * g[2] // merge for g in thw for _ in range(g[0])]
        if runs not in (expected, per_step):
            sources = ", ".join(c.source for c in clips) or "none"
            raise InputError(f"sample {sid!r}: video tokens {runs} do not match its videos {expected} "
                             f"(videos: {sources}); a video cut by a length limit or a repeated/missing <video> "
                             "placeholder")


def budget_from_config(processor, cfg) -> VideoBudget:
    """The budget of a script's flags (utils.core.models.ImageVideoFlags)."""
    return budget_for(processor, fps=cfg.fps, max_frames=cfg.max_frames, min_pixels=cfg.video_min_pixels,
                      max_pixels=cfg.video_max_pixels, total_pixels=cfg.video_total_pixels)


def vllm_video(clip: Clip) -> tuple:
    """A clip as vLLM's `multi_modal_data["video"]` item: frames [T, H, W, 3] uint8 and metadata that says they are
    already sampled (at `sampled_fps`, so vLLM's processor derives the same second_per_grid_ts)."""
    frames = clip.frames.permute(0, 2, 3, 1).contiguous().numpy()
    count = frames.shape[0]
    return frames, {"fps": clip.sampled_fps, "total_num_frames": count, "frames_indices": list(range(count)),
                    "duration": count / clip.sampled_fps, "video_backend": "pyav", "do_sample_frames": False}


def vllm_video_processor_kwargs(budget: VideoBudget) -> dict:
    """vLLM's `mm_processor_kwargs` entry for videos: no resampling of the frames it is given, and the per-frame
    pixel bounds of the flags, under which smart_resize leaves frames sized by `load_clip` as they are (the bounds
    still size vLLM's own dummy videos when it profiles memory)."""
    return {"videos_kwargs": {"do_sample_frames": False, "cap_pixels_per_frame": False,
                              "size": {"shortest_edge": budget.min_pixels, "longest_edge": budget.max_pixels}}}


def videos_of(row) -> list:
    """A row's videos (column 'videos' of the loaders): each a file or folder path, or a list of frame paths."""
    return [paths[0] if len(paths) == 1 and not paths[0].lower().endswith(FRAME_EXTENSIONS) else list(paths)
            for paths in (row.get("videos") or [])]


def row_clips(processor, rows, cfg) -> list[list[Clip]]:
    """The clips of data rows (column 'videos'), under the budget of a script's flags; [] per row without video."""
    videos = [videos_of(row) for row in rows]
    if not any(videos):
        return [[] for _ in rows]
    return load_clips(videos, budget_from_config(processor, cfg))
