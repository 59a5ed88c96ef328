"""The new tiny families through the scripts, in process: train_grpo.py (HF rollout, the shared prompt pass where the
family has it, two steps, a checkpoint after each, and a resume from the first that ends on the same weights),
evaluate.py on that checkpoint (VLMs) and train_sft.py (one step)."""

import pytest
from datasets import DatasetDict
from safetensors.torch import load_file

import evaluate
import train_grpo
import train_sft
from tiny.shapes import make_shapes_vqa
from utils.core.tracking import read_jsonl

FAMILIES = ["qwen2_vl", "qwen3_vl", "qwen3_5", "gemma3", "gemma4", "internvl3_5", "smolvlm", "llava_onevision", "qwen3"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    path = tmp_path_factory.mktemp("family-scripts") / "shapes"
    DatasetDict({"train": make_shapes_vqa(8, seed=0, kinds=("color", "count")),
                 "test": make_shapes_vqa(4, seed=1, kinds=("color", "count"))}).save_to_disk(str(path))
    return str(path)


def _model(tmp_path, family):
    from tiny.models import make_tiny_llm, make_tiny_vlm

    if family == "qwen3":
        return make_tiny_llm(str(tmp_path / family), family=family, seed=0), dict(image_column=None)
    return make_tiny_vlm(str(tmp_path / family), family=family, seed=0), {}


def _fresh_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_with_grpo_and_sft(shapes, tmp_path, family):
    model, extra = _model(tmp_path, family)

    def grpo(out, **resume):
        try:
            train_grpo.main(train_grpo.GRPOConfig(
                model_name_or_path=model, dataset_name=shapes, output_dir=str(tmp_path / out),
                per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_prompt_length=512,
                max_steps=2, learning_rate=1e-3, report_to="none", save_steps=1, logging_steps=1, seed=0,
                reward_funcs=["tests.grpo_helpers:completion_length"], **extra, **resume))
        finally:
            _fresh_state()
        return read_jsonl(tmp_path / out / "metrics.jsonl")

    metrics = grpo("grpo")
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["grad_norm"] > 0
    # resumed from checkpoint-1 in a fresh run: step 2 is the uninterrupted run's, weights bit for bit
    resumed = grpo("resumed", resume_from_checkpoint=str(tmp_path / "grpo" / "checkpoint-1"))
    assert [m["step"] for m in resumed] == [2] and resumed[0]["loss"] == metrics[-1]["loss"]
    a, b = (load_file(str(tmp_path / d / "checkpoint-2" / "model.safetensors")) for d in ("grpo", "resumed"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    if family != "qwen3":  # the checkpoint loads back as its family and evaluates on the held-out rows
        result = evaluate.main(evaluate.EvalConfig(model=str(tmp_path / "grpo" / "checkpoint-2"), dataset=shapes,
                                                   max_new_tokens=6, batch_size=4, seed=0,
                                                   output_dir=str(tmp_path / "eval")))
        assert result["samples"] == 4
    try:
        train_sft.main(train_sft.SFTConfig(
            model_name_or_path=model, dataset_name=shapes, output_dir=str(tmp_path / "sft"),
            per_device_train_batch_size=4, learning_rate=1e-3, max_steps=1, save_steps=1, logging_steps=1,
            max_length=512, report_to="none", seed=0, **extra))
    finally:
        _fresh_state()
    losses = [m["loss"] for m in read_jsonl(tmp_path / "sft" / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 1 and losses[0] > 0
