"""Video rows in the data formats (VQA `video` column, sharegpt `<video>` markers + `videos`, RL rows), refusals
that name the file and the row, and SFT encoding of video rows on the tiny Qwen2.5-VL (assistant-only labels, video
tokens masked, the video-token guard)."""

import json
import os

import PIL.Image
import pytest
import torch

from tests.video_helpers import write_frames, write_headers_only, write_video
from utils.core.data import load_rl_rows, load_sharegpt, load_vqa
from utils.core.errors import DataValidationError
from utils.core.video import VideoBudget, videos_of

BUDGET = VideoBudget(fps=2.0, max_frames=4, min_frames=2, min_pixels=28 * 28, max_pixels=56 * 56,
                     total_pixels=10**8, factor=28, temporal_patch=2)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_video(root / "clip.mp4", n_frames=10, fps=4)
    write_video(root / "other.webm", n_frames=6, fps=3)
    write_frames(root / "frames", n_frames=5)
    PIL.Image.new("RGB", (56, 56), (200, 10, 10)).save(root / "red.png")
    (root / "garbage.mp4").write_bytes(b"no video here" * 20)
    write_headers_only(root / "empty.mkv")
    return root


def test_vqa_rows_with_a_video_column_file_folder_list_and_mixed_with_images(media):
    rows = [{"question": "which way?", "answer": "left", "video": "clip.mp4", "image": "red.png"},
            {"question": "how many?", "answer": "2", "video": "frames", "image": "red.png"},
            {"question": "last?", "answer": "bar", "video": ["frames/frame1.png", "frames/frame2.png"],
             "image": "red.png"}]
    table = load_vqa(write_jsonl(media / "vqa.jsonl", rows), require_steps=False)
    assert videos_of(table[0]) == [str(media / "clip.mp4")]
    assert videos_of(table[1]) == [str(media / "frames")]
    assert videos_of(table[2]) == [[str(media / "frames/frame1.png"), str(media / "frames/frame2.png")]]
    assert table[0]["image"].size == (56, 56)
    # video only: --image_column none
    only = load_vqa(write_jsonl(media / "vqa_only.jsonl", [{k: v for k, v in r.items() if k != "image"}
                                                          for r in rows]), require_steps=False, image_column=None)
    assert "image" not in only.column_names and len(videos_of(only[2])) == 1
    # rows without a video column keep their schema
    plain = load_vqa(write_jsonl(media / "plain.jsonl", [{"question": "q", "answer": "a", "image": "red.png"}]),
                     require_steps=False)
    assert "videos" not in plain.column_names and videos_of(plain[0]) == []


@pytest.mark.parametrize("video, message", [
    ("missing.mp4", "video file not found"), ("garbage.mp4", "garbage.mp4"),
    ("empty.mkv", "no decodable frames"), ("nothing_here", "not found")])
def test_bad_videos_are_refused_naming_file_row_and_column(media, video, message):
    rows = [{"question": "q", "answer": "a", "video": "clip.mp4"}, {"question": "q", "answer": "a", "video": video}]
    path = write_jsonl(media / f"bad_{video.replace('.', '_')}.jsonl", rows)
    with pytest.raises(DataValidationError, match=rf"bad_.*jsonl row 1, column 'video'.*{message}") as info:
        load_vqa(path, require_steps=False, image_column=None)
    assert video.split(".")[0] in str(info.value)


def test_sharegpt_video_markers_and_videos(media):
    rows = [{"messages": [{"role": "user", "content": "<video>What moves in <image>?"},
                          {"role": "assistant", "content": "A bar."}],
             "images": ["red.png"], "videos": ["clip.mp4"]},
            {"messages": [{"role": "user", "content": "<video><video>Same?"}, {"role": "assistant", "content": "No"}],
             "images": [], "videos": ["clip.mp4", "other.webm"]}]
    table = load_sharegpt(write_jsonl(media / "chat.jsonl", rows))
    assert videos_of(table[1]) == [str(media / "clip.mp4"), str(media / "other.webm")]
    assert len(table[0]["images"]) == 1
    rows[1]["videos"] = ["clip.mp4"]
    with pytest.raises(DataValidationError, match=r"chat_bad.jsonl row 1, column 'messages': 2 '<video>' marker"
                                                  r"\(s\) but 1 video\(s\) in column 'videos'"):
        load_sharegpt(write_jsonl(media / "chat_bad.jsonl", rows))
    # a <video> marker without any videos column is refused too
    with pytest.raises(DataValidationError, match="1 '<video>' marker"):
        load_sharegpt(write_jsonl(media / "chat_none.jsonl", [{"messages": rows[0]["messages"],
                                                               "images": ["red.png"]}]))


def test_rl_rows_with_videos(media):
    rows = [{"images": [], "videos": ["clip.mp4"], "problem": "<video>Which way?", "answer": "right"}]
    table = load_rl_rows(write_jsonl(media / "rl.jsonl", rows))
    assert videos_of(table[0]) == [str(media / "clip.mp4")]
    rows[0]["problem"] = "<video><video>Which way?"
    with pytest.raises(DataValidationError, match="rl_bad.jsonl row 0, column 'problem': 2 '<video>'"):
        load_rl_rows(write_jsonl(media / "rl_bad.jsonl", rows))


# --------------------------------------------------------------------------------------------------
# SFT encoding on the tiny Qwen2.5-VL


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from tiny.cache import tiny_vlm_path
    from utils.core.models import load_model_and_processor

    return load_model_and_processor(tiny_vlm_path(), dtype="float32")


def test_sft_labels_cover_assistant_text_only_with_video_tokens_masked(media, qwen):
    from utils.core.sft_data import IGNORE_INDEX, encode_sft_batch, sharegpt_conversation

    _, processor = qwen
    rows = [{"messages": [{"role": "user", "content": "<video>What moves in <image>?"},
                          {"role": "assistant", "content": "A bar."}],
             "images": ["red.png"], "videos": ["clip.mp4"]},
            {"messages": [{"role": "user", "content": "Frames <video> then"},
                          {"role": "assistant", "content": "Left to right."}],
             "images": [], "videos": [["frames/frame1.png", "frames/frame3.png", "frames/frame5.png"]]}]
    table = load_sharegpt(write_jsonl(media / "sft.jsonl", rows))
    convs = [sharegpt_conversation(r) for r in table]
    batch = encode_sft_batch(processor, [c[0] for c in convs], [c[1] for c in convs], sample_ids=["a", "b"],
                             videos=[videos_of(r) for r in table], video_budget=BUDGET)
    video_id, tokenizer = processor.video_token_id, processor.tokenizer
    # 10 frames at 4 fps -> 4 frames of 56x56 (2 x 4 x 4 patches); 3 listed frames (at --fps 2) -> 2 frames of
    # 96x48 -> 56x28 (1 x 2 x 4)
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4], [1, 2, 4]]
    assert batch["second_per_grid_ts"].tolist() == pytest.approx([2 / (4 / 10 * 4), 2 / (2 / 3 * 2)])
    for row, (answer, n_video) in enumerate([("A bar.", 8), ("Left to right.", 2)]):
        ids = batch["input_ids"][row]
        assert (ids == video_id).sum() == n_video  # patches / 2x2 merge
        labelled = batch["labels"][row] != IGNORE_INDEX
        assert not labelled[ids == video_id].any()
        assert tokenizer.decode(batch["input_ids"][row][labelled]) == answer + "<|im_end|>"


def test_video_token_guard_names_the_sample_and_video(media, qwen):
    from utils.core.video import check_video_tokens, load_clips, processor_video_kwargs

    _, processor = qwen
    clips = load_clips([[str(media / "clip.mp4")]], BUDGET)
    text = "<|vision_start|><|video_pad|><|vision_end|>hi"
    batch = processor(text=[text], return_tensors="pt", **processor_video_kwargs(clips[0]))
    check_video_tokens(processor, batch["input_ids"], batch["video_grid_thw"], clips, ["ok"])
    cut = batch["input_ids"][:, :-6]  # a length limit cut inside the video
    with pytest.raises(Exception, match=r"sample 'cut': video tokens \[5\] do not match its videos \[8\].*clip.mp4"):
        check_video_tokens(processor, cut, batch["video_grid_thw"], clips, ["cut"])
    repeated = torch.cat([batch["input_ids"], batch["input_ids"]], 1)
    with pytest.raises(Exception, match=r"sample 'twice': video tokens \[8, 8\]"):
        check_video_tokens(processor, repeated, batch["video_grid_thw"], clips, ["twice"])
    assert os.path.exists(media / "clip.mp4")


def test_prompts_whose_video_placeholders_do_not_match_their_videos_are_named(media, qwen):
    from utils.core.encoding import encode_prompts
    from utils.core.prompts import build_messages
    from utils.core.video import load_clips

    _, processor = qwen
    clip = load_clips([[str(media / "clip.mp4")]], BUDGET)[0]
    one, two = (build_messages("q", num_images=0, num_videos=n, template="plain") for n in (1, 2))
    batch = encode_prompts(processor, [one, one], [[], []], sample_ids=["a", "b"], videos=[clip, clip])
    assert (batch["input_ids"] == processor.video_token_id).sum(-1).tolist() == [8, 8]
    with pytest.raises(Exception, match="sample 'twice'"):  # a repeated <video>: two placeholders, one video
        encode_prompts(processor, [one, two], [[], []], sample_ids=["ok", "twice"], videos=[clip, clip])
    with pytest.raises(Exception, match="sample 'none'"):  # a placeholder without its video
        encode_prompts(processor, [one, one], [[], []], sample_ids=["ok", "none"], videos=[clip, []])
