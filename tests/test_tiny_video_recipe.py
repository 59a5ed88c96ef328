"""The tiny video recipe's pieces: `synthetic:video` resolves to a cached folder of clips and splits, and the warm
start's SFT reads the clips as the GRPO recipe does."""

import os

import yaml

import tiny.cache
from tiny.cache import TINY_VIDEO_DATASET, TINY_VIDEO_SFT_MODEL, TINY_VIDEO_SFT_RECIPE, resolve_dataset
from utils.core.data import load_vqa
from utils.core.video import videos_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIDEO_FLAGS = ("fps", "max_frames", "video_min_pixels", "video_max_pixels", "video_total_pixels")


def test_synthetic_video_builds_once_per_spec_with_disjoint_splits(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny.cache, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiny.cache, "VIDEO_SPLITS", {"train": dict(n=4, seed=0), "test": dict(n=3, seed=1)})
    folder = resolve_dataset(TINY_VIDEO_DATASET)
    assert os.path.dirname(folder) == str(tmp_path)
    train, test = (load_vqa(folder, split=split) for split in ("train", "test"))
    assert (len(train), len(test)) == (4, 3)
    assert [r["kind"] for r in train] == ["direction", "frames", "last", "direction"]
    clips = {split: {os.path.basename(videos_of(r)[0]) for r in rows} for split, rows in (("train", train),
                                                                                             ("test", test))}
    assert not clips["train"] & clips["test"] and all(len(c) == len(r) for c, r in zip(clips.values(), (train, test)))
    assert all(os.path.isfile(videos_of(r)[0]) for r in test)
    stamp = os.stat(os.path.join(folder, "train.jsonl")).st_mtime_ns
    assert resolve_dataset(TINY_VIDEO_DATASET) == folder  # reused, not rebuilt
    assert os.stat(os.path.join(folder, "train.jsonl")).st_mtime_ns == stamp
    monkeypatch.setattr(tiny.cache, "VIDEO_SPLITS", {"train": dict(n=5, seed=0), "test": dict(n=3, seed=1)})
    assert resolve_dataset(TINY_VIDEO_DATASET) != folder  # another spec, another folder
    assert resolve_dataset("some/other-set") == "some/other-set"


def test_the_video_warm_start_sees_the_frames_grpo_trains_and_evaluates_on():
    with open(os.path.join(REPO, "recipes", "tiny_video.yaml")) as f:
        grpo = yaml.safe_load(f)
    with open(TINY_VIDEO_SFT_RECIPE) as f:
        sft = yaml.safe_load(f)
    assert grpo["model_name_or_path"] == TINY_VIDEO_SFT_MODEL and grpo["dataset_name"] == TINY_VIDEO_DATASET
    assert grpo["eval_dataset_name"] == sft["eval_dataset_name"] == TINY_VIDEO_DATASET
    assert grpo["eval_split"] == sft["eval_split"] == "test"
    assert {k: grpo.get(k) for k in VIDEO_FLAGS} == {k: sft.get(k) for k in VIDEO_FLAGS}
    # every one of the 8 frames at 4 fps: the "frames" questions need all of them
    assert (grpo["fps"], grpo["max_frames"]) == (4.0, 8)
    assert TINY_VIDEO_SFT_MODEL in tiny.cache.TINY_MODELS
