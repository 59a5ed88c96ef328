"""Video on the tiny Qwen3-VL through every path: SFT labels (assistant text only; video tokens and the per-step
timestamps masked), the vLLM rollout's prompt ids and frames (fake engine), and train_sft.py, train_grpo.py and
evaluate.py on video rows."""

import json

import pytest
import torch

from tests.video_helpers import write_video

torch.set_num_threads(1)

# Qwen3-VL: 16 px patches merged 2 x 2, so sizes are multiples of 32
FLAGS = dict(fps=2.0, max_frames=4, video_min_pixels=32 * 32, video_max_pixels=64 * 64)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_qwen3_vl")
    write_video(root / "clip.mp4", n_frames=10, fps=4)
    write_video(root / "slow.mp4", n_frames=8, fps=2, colour=(0, 0, 120))
    return root


def _budget(processor):
    from utils.core.video import budget_for

    return budget_for(processor, fps=FLAGS["fps"], max_frames=FLAGS["max_frames"],
                      min_pixels=FLAGS["video_min_pixels"], max_pixels=FLAGS["video_max_pixels"])


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_sft_labels_are_the_assistant_text_with_video_tokens_and_timestamps_masked(media, family_models):
    from utils.core.data import load_sharegpt
    from utils.core.sft_data import IGNORE_INDEX, encode_sft_batch, sharegpt_conversation
    from utils.core.video import videos_of

    _, processor = family_models("qwen3_vl")
    rows = [{"messages": [{"role": "user", "content": "<video>Which way does the bar move?"},
                          {"role": "assistant", "content": "Right."}], "videos": ["clip.mp4"]},
            {"messages": [{"role": "user", "content": "And here <video>?"},
                          {"role": "assistant", "content": "Also right."}], "videos": ["slow.mp4"]}]
    table = load_sharegpt(_write_jsonl(media / "sft.jsonl", rows))
    convs = [sharegpt_conversation(r) for r in table]
    batch = encode_sft_batch(processor, [c[0] for c in convs], [c[1] for c in convs], sample_ids=["a", "b"],
                             videos=[videos_of(r) for r in table], video_budget=_budget(processor))
    tokenizer = processor.tokenizer
    for row, answer in enumerate(["Right.", "Also right."]):
        ids, labelled = batch["input_ids"][row], batch["labels"][row] != IGNORE_INDEX
        assert (ids == processor.video_token_id).sum() > 0 and not labelled[ids == processor.video_token_id].any()
        text = tokenizer.decode(ids)
        assert "seconds>" in text  # Qwen3-VL's timestamps, in the user turn
        assert "seconds" not in tokenizer.decode(ids[labelled])
        assert tokenizer.decode(ids[labelled]) == answer + "<|im_end|>"


def test_vllm_gets_the_trainers_prompt_ids_and_the_sampled_frames(media, family_models, monkeypatch):
    from tests.test_video_eval import _cfg
    from tests.video_helpers import fake_vllm_video_rollout
    from tests.vllm_helpers import DIST_KEYS

    for key in DIST_KEYS:  # set, then unset: the engine's setup writes them, and the teardown must remove them
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    model, processor = family_models("qwen3_vl")
    llm, clips = fake_vllm_video_rollout(model, processor, str(media), _cfg(), _budget(processor),
                                         name="/tiny-qwen3-vl")
    assert llm.kwargs["limit_mm_per_prompt"]["video"] == 1
    # the frame indices the trainer gave the processor (Qwen3-VL's timestamps) go to vLLM at the sampled rate
    for prompt, clip in zip(llm.prompts, clips):
        (_, meta), = prompt["multi_modal_data"]["video"]
        assert meta["frames_indices"] == list(range(len(clip[0].indices)))
        assert meta["fps"] == pytest.approx(clip[0].sampled_fps)


@pytest.mark.slow
@pytest.mark.full
def test_train_sft_train_grpo_and_evaluate_on_video_rows(media, tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    import evaluate
    import train_grpo
    import train_sft
    from tiny.models import make_tiny_vlm
    from utils.core.tracking import read_jsonl

    def fresh_state():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    model = make_tiny_vlm(str(tmp_path / "qwen3_vl"), family="qwen3_vl", seed=0)
    sft_rows = [{"messages": [{"role": "user", "content": "<video>Which way does the bar move?"},
                              {"role": "assistant", "content": "right"}], "videos": [clip]}
                for clip in ("clip.mp4", "slow.mp4")]
    sft_out = tmp_path / "sft"
    try:
        train_sft.main(train_sft.SFTConfig(
            model_name_or_path=model, dataset_name=_write_jsonl(media / "sft3.jsonl", sft_rows),
            dataset_format="sharegpt", per_device_train_batch_size=2, learning_rate=1e-3,
            lr_scheduler_type="constant", max_steps=3, save_steps=3, logging_steps=1, max_length=512,
            output_dir=str(sft_out), report_to="none", seed=0, **FLAGS))
    finally:
        fresh_state()
    losses = [m["loss"] for m in read_jsonl(sft_out / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 3 and losses[2] < losses[0]

    vqa = _write_jsonl(media / "vqa3.jsonl", [{"id": f"v{i}", "question": "Which way does the bar move?",
                                               "answer": "right", "video": ["clip.mp4", "slow.mp4"][i % 2]}
                                              for i in range(4)])
    grpo_out = tmp_path / "grpo"
    try:
        train_grpo.main(train_grpo.GRPOConfig(
            model_name_or_path=str(sft_out / "checkpoint-3"), dataset_name=vqa, output_dir=str(grpo_out),
            per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_prompt_length=512,
            max_steps=2, learning_rate=1e-3, beta=0.04, report_to="none", save_steps=100, logging_steps=1, seed=0,
            reward_funcs=["format", "accuracy"], eval_dataset_name=vqa, eval_split="train", eval_samples=2,
            eval_max_new_tokens=4, **FLAGS))
    finally:
        fresh_state()
    metrics = read_jsonl(grpo_out / "metrics.jsonl")
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert all(m["kl"] >= 0 for m in metrics if "kl" in m)
    summary = json.loads((grpo_out / "train_summary.json").read_text())
    assert summary["heldout_samples_after"] == 2

    result = evaluate.main(evaluate.EvalConfig(
        model=str(sft_out / "checkpoint-3"), dataset=vqa, split="train", max_new_tokens=4, metrics=["accuracy"],
        batch_size=2, output_dir=str(tmp_path / "eval"), **FLAGS))
    assert result["samples"] == 4


@torch.no_grad()
def test_a_groups_completions_share_one_video_prompt_pass_and_prefill(media, family_models):
    """Qwen3-VL video prompts take the shared prompt pass: log-probs (padded and packed) equal a plain forward of
    the expanded prompts, and a shared-prefill rollout samples what the unshared one does."""
    from tests.test_video_train import _completions, _plain_forward_logprobs
    from utils.core.encoding import encode_prompts
    from utils.core.logprobs import CompletionLogProbs, can_share_prompts
    from utils.core.prompts import build_messages
    from utils.core.rollout import generate_completions
    from utils.core.video import load_clips

    model, processor = family_models("qwen3_vl")
    assert can_share_prompts(model, [0, 0], [1, 1]) and not can_share_prompts(model, [0, 0], [2, 1])
    clips = load_clips([[str(media / "clip.mp4")], [str(media / "slow.mp4")]], _budget(processor))
    messages = [build_messages(q, num_images=0, num_videos=1, template="plain") for q in ("Which way?", "And now?")]
    index = [0, 0, 1, 1]
    expanded = encode_prompts(processor, [messages[i] for i in index], [[] for _ in index],
                              sample_ids=[str(i) for i in index], videos=[clips[i] for i in index])
    shared = encode_prompts(processor, messages, [[], []], sample_ids=["0", "1"], videos=clips)
    ids, mask = _completions(processor)
    reference = _plain_forward_logprobs(model, expanded, ids, mask)
    for padding_free in (False, True):
        scorer = CompletionLogProbs(model, padding_free=padding_free).eval()
        together = scorer(shared, ids, mask, prompt_index=torch.tensor(index))
        torch.testing.assert_close(together * mask, reference, atol=2e-5, rtol=1e-4)
    kwargs = dict(row_seeds=torch.arange(4), max_new_tokens=5, temperature=1.0,
                  eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id)
    alone = generate_completions(model, expanded, **kwargs)
    together = generate_completions(model, shared, prompt_index=index, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
