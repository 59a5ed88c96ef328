"""The new tiny families through the scripts, in process: train_grpo.py (HF rollout, the shared prompt pass where the
family has it, two steps and a checkpoint), evaluate.py on that checkpoint (VLMs) and train_sft.py (one step)."""

import pytest
from datasets import DatasetDict

import evaluate
import train_grpo
import train_sft
from tiny.shapes import make_shapes_vqa
from utils.tracking import read_jsonl

FAMILIES = ["qwen3_vl", "qwen3_5", "gemma3", "gemma4", "internvl3_5", "smolvlm", "llava_onevision", "qwen3"]


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
    try:
        train_grpo.main(train_grpo.GRPOConfig(
            model_name_or_path=model, dataset_name=shapes, output_dir=str(tmp_path / "grpo"),
            per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_prompt_length=512,
            max_steps=2, learning_rate=1e-3, report_to="none", save_steps=2, logging_steps=1, seed=0,
            reward_funcs=["tests.grpo_helpers:completion_length"], **extra))
    finally:
        _fresh_state()
    metrics = read_jsonl(tmp_path / "grpo" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["grad_norm"] > 0
    assert (tmp_path / "grpo" / "checkpoint-2" / "model.safetensors").is_file()
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
