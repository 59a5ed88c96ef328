"""Video in evaluation (evaluate.py on video rows, the same frames as training) and in the vLLM engine arguments and
prompts (limit_mm_per_prompt, mm_processor_kwargs, already-sampled frames with their timing), against a fake vLLM."""

import json
from types import SimpleNamespace

import pytest
import torch

from tests.video_helpers import write_video
from tests.vllm_helpers import DIST_KEYS
from utils.core.video import VideoBudget

torch.set_num_threads(1)

BUDGET = VideoBudget(fps=2.0, max_frames=4, min_frames=2, min_pixels=28 * 28, max_pixels=56 * 56,
                     total_pixels=10**8, factor=28, temporal_patch=2)
FLAGS = dict(fps=2.0, max_frames=4, video_min_pixels=28 * 28, video_max_pixels=56 * 56, video_total_pixels=10**8)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_eval")
    write_video(root / "clip.mp4", n_frames=10, fps=4)
    write_video(root / "slow.mp4", n_frames=8, fps=2, colour=(0, 0, 120))
    rows = [{"id": f"r{i}", "question": "Which way does the bar move?", "answer": "right",
             "video": ["clip.mp4", "slow.mp4"][i % 2]} for i in range(3)]
    with open(root / "test.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return root


@pytest.fixture(scope="module")
def tiny_path():
    from tiny.cache import tiny_vlm_path

    return tiny_vlm_path()


@pytest.mark.slow
@pytest.mark.full
def test_evaluate_on_video_rows_is_deterministic_and_independent_of_batch_size(media, tiny_path, tmp_path):
    import evaluate
    from evaluate import EvalConfig
    from utils.eval.keywords import load_texts

    common = dict(model=tiny_path, dataset=str(media / "test.jsonl"), split="train",
                  max_new_tokens=6, temperature=1.0, seed=3, metrics=["accuracy"], **FLAGS)
    first = evaluate.main(EvalConfig(**common, batch_size=3, output_dir=str(tmp_path / "a")))
    evaluate.main(EvalConfig(**common, batch_size=1, output_dir=str(tmp_path / "b")))
    assert first["samples"] == 3
    assert load_texts(str(tmp_path / "a")) == load_texts(str(tmp_path / "b"))


def test_generate_answers_sees_the_training_frames_and_remote_refuses_videos(media, tiny_path):
    from utils.core.data import load_vqa
    from utils.core.models import load_model_and_processor
    from utils.eval.heldout import generate_answers, generate_answers_remote

    model, processor = load_model_and_processor(tiny_path)
    rows = list(load_vqa(str(media / "test.jsonl"), require_steps=False))  # video only: no image column needed
    kwargs = dict(prompt_template="plain", max_new_tokens=4, temperature=1.0, seed=1)
    budgeted = generate_answers(model, processor, rows, video_budget=BUDGET, **kwargs)
    assert len(budgeted) == 3
    # the prompt length counts the video tokens (8 per clip under the budget)
    with pytest.raises(Exception, match="over --max_prompt_length"):
        generate_answers(model, processor, rows, video_budget=BUDGET, max_prompt_length=10, **kwargs)
    with pytest.raises(ValueError, match="'r0' has videos"):
        generate_answers_remote("http://localhost:1", "m", rows, prompt_template="plain")


@pytest.fixture
def clean_env(monkeypatch):
    for key in DIST_KEYS:
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)


def _cfg(**over):
    base = dict(seed=3, temperature=0.9, top_p=1.0, top_k=None, max_completion_length=4, max_prompt_length=512,
                bf16=False, dtype="auto", max_pixels=None, min_pixels=None, max_anyres_num=None)
    return SimpleNamespace(**{**base, **over})


def test_vllm_engine_arguments_with_video():
    from utils.core.vllm_rollout import engine_kwargs, mm_processor_kwargs

    mm = mm_processor_kwargs(None, _cfg(max_pixels=3136), BUDGET)
    assert mm == {"max_pixels": 3136, "videos_kwargs": {
        "do_sample_frames": False, "cap_pixels_per_frame": False,
        "size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}}}
    kwargs = engine_kwargs("/m", _cfg(), vision_language=True, seed=0, mm_kwargs=mm, max_videos_per_prompt=2)
    assert kwargs["limit_mm_per_prompt"] == {"image": 4, "video": 2} and kwargs["mm_processor_kwargs"] == mm
    # no video in the data: no video limit (vLLM then reserves no memory for videos)
    assert engine_kwargs("/m", _cfg(), vision_language=True, seed=0)["limit_mm_per_prompt"] == {"image": 4}


def test_vllm_gets_the_trainers_prompt_ids_and_the_sampled_frames(media, tiny_path, clean_env):
    from tests.video_helpers import fake_vllm_video_rollout
    from utils.core.models import load_model_and_processor

    model, processor = load_model_and_processor(tiny_path)
    llm, clips = fake_vllm_video_rollout(model, processor, str(media), _cfg(), BUDGET)
    assert llm.kwargs["limit_mm_per_prompt"] == {"image": 4, "video": 1}
    assert llm.kwargs["mm_processor_kwargs"]["videos_kwargs"]["do_sample_frames"] is False
    for prompt, clip in zip(llm.prompts, clips):
        (frames, meta), = prompt["multi_modal_data"]["video"]
        assert frames.shape == (4, 56, 56, 3)
        # vLLM's processor derives second_per_grid_ts = 2 / (len(indices) / total * fps): the trainer's timing
        assert len(meta["frames_indices"]) / meta["total_num_frames"] * meta["fps"] == pytest.approx(
            clip[0].sampled_fps)
