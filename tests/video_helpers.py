"""Real tiny video files for the video tests, written with PyAV's own encoders: frame i shows a white bar at
column 6 * i (so a decoded frame says which frame it was) on a colour that differs per clip."""

import os

import numpy as np


def bar_frame(i, height=48, width=64, colour=(0, 0, 0)):
    array = np.zeros((height, width, 3), np.uint8)
    array[:] = colour
    array[:, (6 * i) % width: (6 * i) % width + 6] = 255
    return array


def bar_position(frame):
    """Which frame a decoded frame [3, H, W] (or H x W x 3) was, from its bar's column."""
    frame = np.asarray(frame)
    if frame.shape[0] == 3:
        frame = frame.transpose(1, 2, 0)
    columns = frame.astype(float).mean(axis=(0, 2))
    return int(np.argmax(columns)) // 6


def write_video(path, n_frames=10, fps=4, *, codec=None, height=48, width=64, colour=(0, 0, 0)):
    """A clip of `n_frames` bar frames at `fps`; the codec follows the extension (mp4: mpeg4, webm: vp9, which
    declares no frame count, so readers must count)."""
    import av

    codec = codec or {".webm": "libvpx-vp9", ".mkv": "ffv1"}.get(os.path.splitext(path)[1], "mpeg4")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(bar_frame(i, height, width, colour), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def write_frames(folder, n_frames=6, *, height=48, width=96):
    """A folder of PNG frames named frame1.png .. frameN.png (frame10 sorts after frame9)."""
    import PIL.Image

    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in range(n_frames):
        path = os.path.join(folder, f"frame{i + 1}.png")
        PIL.Image.fromarray(bar_frame(i, height, width)).save(path)
        paths.append(path)
    return paths


def write_headers_only(path):
    """A Matroska file whose headers declare a video stream but which holds no frames (cut before the first
    cluster): it opens, and decodes to zero frames."""
    full = write_video(str(path) + ".full.mkv", n_frames=4)
    with open(full, "rb") as f:
        data = f.read()
    os.remove(full)
    with open(path, "wb") as f:
        f.write(data[: data.index(b"\x1f\x43\xb6\x75")])  # the Matroska Cluster element id
    return str(path)


def fake_vllm_video_rollout(model, processor, media, cfg, budget, *, name="/tiny"):
    """Two one-video prompts (clip.mp4, slow.mp4 under `media`) through VLLMRollout on the fake engine; checks that
    the engine gets the trainer's prompt ids and its sampled frames, and returns (engine, clips)."""
    import torch
    from accelerate import Accelerator

    from tests.vllm_helpers import FakeVLLM
    from utils.core.encoding import encode_prompts
    from utils.core.logprobs import CompletionLogProbs
    from utils.core.prompts import build_messages
    from utils.core.rollout import stop_token_ids
    from utils.core.video import load_clips
    from utils.core.vllm_rollout import VLLMRollout, prompt_token_ids

    FakeVLLM.engines.clear()
    rollout = VLLMRollout(name, Accelerator(cpu=True), cfg, processor=processor, model_config=model.config,
                          vllm=FakeVLLM, max_videos_per_prompt=1, video_budget=budget)
    llm = FakeVLLM.engines[0]
    clips = load_clips([[os.path.join(media, "clip.mp4")], [os.path.join(media, "slow.mp4")]], budget)
    messages = [build_messages("Which way?", num_images=0, num_videos=1, template="plain")] * 2
    batch = encode_prompts(processor, messages, [[], []], sample_ids=["a", "b"], videos=clips)
    rollout.generate(CompletionLogProbs(model), processor, messages, [[], []], [1, 2], step=0,
                     stop_ids=stop_token_ids(model, processor.tokenizer), prompt_batch=batch, videos=clips)
    assert [p["prompt_token_ids"] for p in llm.prompts] == prompt_token_ids(batch)
    for prompt, clip in zip(llm.prompts, clips):
        (frames, meta), = prompt["multi_modal_data"]["video"]
        assert frames.dtype.name == "uint8" and meta["do_sample_frames"] is False
        assert torch.equal(torch.from_numpy(frames).permute(0, 3, 1, 2), clip[0].frames)
    return llm, clips
