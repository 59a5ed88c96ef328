"""Video through the training paths on the tiny Qwen2.5-VL, in process: train_sft.py on sharegpt video rows, and
the GRPO log-prob passes (plain, unshared-expanded and shared-prompt) equal to a plain forward of the model with
Qwen2.5-VL's video timing (second_per_grid_ts) in its 3-row rope."""

import json
import os

import pytest
import torch

from tests.video_helpers import write_frames, write_video
from utils.core.video import VideoBudget

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
    from utils.core.models import load_model_and_processor

    model, processor = load_model_and_processor(tiny_vlm_path(), dtype="float32")
    return tiny_vlm_path(), model.eval(), processor


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.full
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


def _prompts(processor, media, *, shared):
    """Two prompts with one video each (different timing: 1.6 and 1 sampled frames/s);
    completions: G = 2 per prompt."""
    from utils.core.encoding import encode_prompts
    from utils.core.prompts import build_messages
    from utils.core.video import load_clips

    clips = load_clips([[str(media / "clip.mp4")], [str(media / "slow.mp4")]], BUDGET)
    assert clips[0][0].sampled_fps != clips[1][0].sampled_fps
    messages = [build_messages("Which way?", num_images=0, num_videos=1, template="plain"),
                build_messages("And now?", num_images=0, num_videos=1, template="plain")]
    index = [0, 0, 1, 1]
    rows = [0, 1] if shared else index
    batch = encode_prompts(processor, [messages[i] for i in rows], [[] for _ in rows],
                           sample_ids=[str(i) for i in rows], videos=[clips[i] for i in rows])
    return batch, (torch.tensor(index) if shared else None)


def _completions(processor):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 200, (4, 6), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return ids.masked_fill(mask == 0, processor.tokenizer.pad_token_id), mask


def _plain_forward_logprobs(model, batch, ids, mask, **override):
    """Log-probs of the completions from one ordinary forward of the whole sequences (the model's own rope)."""
    inputs = {**batch, **override}
    full = torch.cat([inputs["input_ids"], ids], 1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    out = model(input_ids=full, attention_mask=torch.cat([inputs["attention_mask"], mask], 1),
                mm_token_type_ids=torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(ids)], 1), **extra)
    logits = out.logits[:, inputs["input_ids"].shape[1] - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] * mask


@torch.no_grad()
def test_video_log_probs_shared_unshared_and_packed_equal_a_plain_forward_with_video_timing(media, qwen):
    from utils.core.logprobs import CompletionLogProbs, can_share_prompts

    _, model, processor = qwen
    assert can_share_prompts(model, [0, 0], [1, 1]) and not can_share_prompts(model, [0, 0], [2, 1])
    ids, mask = _completions(processor)
    expanded, _ = _prompts(processor, media, shared=False)
    shared, index = _prompts(processor, media, shared=True)
    assert expanded["second_per_grid_ts"].tolist() == pytest.approx([2 / 1.6, 2 / 1.6, 2.0, 2.0])
    reference = _plain_forward_logprobs(model, expanded, ids, mask)
    scorer = CompletionLogProbs(model).eval()
    unshared = scorer(expanded, ids, mask)
    together = scorer(shared, ids, mask, prompt_index=index)
    torch.testing.assert_close(unshared * mask, reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(together * mask, reference, atol=2e-5, rtol=1e-4)
    # padding-free: each packed prompt's rope reads its own video grid and timing
    packed = CompletionLogProbs(model, padding_free=True).eval()
    torch.testing.assert_close(packed(expanded, ids, mask) * mask, reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(packed(shared, ids, mask, prompt_index=index) * mask, reference, atol=2e-5, rtol=1e-4)
    # the timing is in the rope: other second_per_grid_ts give other log-probs, so the equalities above need it
    retimed = _plain_forward_logprobs(model, expanded, ids, mask,
                                      second_per_grid_ts=expanded["second_per_grid_ts"] * 4)
    assert (retimed - reference).abs().max() > 1e-4


@torch.no_grad()
def test_video_rollout_with_a_shared_prefill_samples_what_the_unshared_one_does(media, qwen):
    from utils.core.rollout import generate_completions
    from utils.core.seeds import completion_seeds

    _, model, processor = qwen
    expanded, _ = _prompts(processor, media, shared=False)
    shared, index = _prompts(processor, media, shared=True)
    seeds = completion_seeds(0, 0, range(4))
    kwargs = dict(row_seeds=seeds, max_new_tokens=5, temperature=1.0, eos_token_id=[processor.tokenizer.eos_token_id],
                  pad_token_id=processor.tokenizer.pad_token_id)
    alone, alone_mask = generate_completions(model, expanded, **kwargs)
    together, together_mask = generate_completions(model, shared, prompt_index=index, **kwargs)
    assert torch.equal(alone, together) and torch.equal(alone_mask, together_mask)


@pytest.mark.slow
@pytest.mark.full
def test_train_grpo_on_video_rows_with_a_reference_model_and_video_evaluation(media, qwen, tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    import train_grpo
    from utils.core.tracking import read_jsonl

    rows = [{"id": f"v{i}", "question": "Which way does the bar move?", "answer": "right",
             "video": ["clip.mp4", "slow.mp4"][i % 2]} for i in range(4)]
    data = _write_jsonl(media / "grpo_video.jsonl", rows)
    cfg = train_grpo.GRPOConfig(
        model_name_or_path=qwen[0], dataset_name=data, output_dir=str(tmp_path), per_device_train_batch_size=4,
        num_generations=2, max_completion_length=6, max_prompt_length=256, max_steps=2, learning_rate=1e-3,
        beta=0.04, report_to="none", save_steps=100, logging_steps=1, seed=0, reward_funcs=["format", "accuracy"],
        eval_dataset_name=data, eval_split="train", eval_samples=2, eval_max_new_tokens=4, **{
            "fps": 2.0, "max_frames": 4, "video_min_pixels": 28 * 28, "video_max_pixels": 56 * 56})
    try:
        train_grpo.main(cfg)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert all(m["kl"] >= 0 for m in metrics if "kl" in m)
    assert json.loads((tmp_path / "train_summary.json").read_text())["heldout_samples_after"] == 2


@torch.no_grad()
def test_qwen3_vl_video_timestamps_log_probs_and_the_cut_video_guard(media, family_models):
    """Qwen3-VL writes a timestamp before each temporal step of a video (from the clip's frame indices and sampled
    rate): its prompts encode, their log-probs (padded and packed) equal a plain forward, and a cut video is named."""
    from utils.core.encoding import encode_prompts
    from utils.core.errors import InputError
    from utils.core.logprobs import CompletionLogProbs
    from utils.core.prompts import build_messages
    from utils.core.video import budget_for, check_video_tokens, load_clips

    model, processor = family_models("qwen3_vl")
    budget = budget_for(processor, fps=2.0, max_frames=4, min_pixels=32 * 32, max_pixels=64 * 64)
    clips = load_clips([[str(media / "clip.mp4")], [str(media / "slow.mp4")]], budget)
    messages = [build_messages(q, num_images=0, num_videos=1, template="plain") for q in ("Which way?", "And now?")]
    index = [0, 0, 1, 1]
    batch = encode_prompts(processor, [messages[i] for i in index], [[] for _ in index],
                           sample_ids=[str(i) for i in index], videos=[clips[i] for i in index])
    text = processor.tokenizer.decode(batch["input_ids"][0])
    # each temporal step (2 frames) is stamped with its frames' mean time at the sampled rate
    rate = clips[0][0].sampled_fps
    assert f"<{0.5 / rate:.1f} seconds>" in text and f"<{2.5 / rate:.1f} seconds>" in text, text
    ids, mask = _completions(processor)
    reference = _plain_forward_logprobs(model, batch, ids, mask)
    for padding_free in (False, True):
        logps = CompletionLogProbs(model, padding_free=padding_free).eval()(batch, ids, mask)
        torch.testing.assert_close(logps * mask, reference, atol=2e-5, rtol=1e-4)
    # the guard: both temporal steps whole pass; the last step's tokens cut short (or one step dropped) is named
    row = batch["input_ids"][:1]
    check_video_tokens(processor, row, batch["video_grid_thw"][:1], [clips[0]], ["0"])
    video = (row[0] == processor.video_token_id).nonzero().squeeze(1)
    for cut in (video[-1:], video[-video.numel() // 2:]):
        keep = torch.ones(row.shape[1], dtype=torch.bool)
        keep[cut] = False
        with pytest.raises(InputError, match=r"sample '0': video tokens .* do not match its videos"):
            check_video_tokens(processor, row[:, keep], batch["video_grid_thw"][:1], [clips[0]], ["0"])
