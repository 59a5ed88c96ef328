"""vLLM engine arguments per model family (utils/core/vllm_rollout.py), built from each tiny family's own processor:
the multimodal limits, the processor overrides that make vLLM expand an image to the tokens the trainer's prompt ids
hold, and the prompt ids themselves."""

import pytest
import torch
from PIL import Image

from tests.family_helpers import VLM_FAMILIES
from utils.core.encoding import encode_prompts
from utils.core.models import image_token_id
from utils.core.vllm_rollout import engine_kwargs, mm_processor_kwargs, prompt_token_ids, vllm_prompts


class Flags:
    vllm_gpu_memory_utilization, vllm_enable_sleep_mode, vllm_enforce_eager = 0.3, False, True
    vllm_max_model_len = vllm_max_num_seqs = vllm_max_num_batched_tokens = None
    max_prompt_length, max_completion_length, dtype, bf16 = 256, 16, "float32", False


# What each family's vLLM processor is given, from the tiny family's own image processor (the settings
# tiny/models.py builds it with): checked against the family's module in vLLM's model_executor/models.
EXPECTED_MM_KWARGS = {
    "qwen2_vl": {"size": {"shortest_edge": 28 * 28, "longest_edge": 4 * 84 * 84}},
    "qwen2_5_vl": {"size": {"shortest_edge": 28 * 28, "longest_edge": 4 * 84 * 84}},
    "qwen3_vl": {"size": {"shortest_edge": 32 * 32, "longest_edge": 4 * 96 * 96}},
    "qwen3_5": {"size": {"shortest_edge": 32 * 32, "longest_edge": 4 * 96 * 96}},
    "glm4v": {"size": {"shortest_edge": 2 * 28 * 28, "longest_edge": 2 * 4 * 84 * 84}},
    "internvl": {"crop_to_patches": True, "max_patches": 4},
    "internvl3_5": {"crop_to_patches": True, "max_patches": 4},
    "gemma3": {"do_pan_and_scan": False},
    "smolvlm": {"size": {"longest_edge": 128}},
    "llava_onevision": {},
    "gemma4": {"max_soft_tokens": 70},
}
VIDEO = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "llava_onevision", "gemma4"}


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_engine_arguments_per_family(family_models, family):
    model, processor = family_models(family)
    mm = mm_processor_kwargs(processor)
    assert mm == EXPECTED_MM_KWARGS[family]
    kwargs = engine_kwargs("/m", Flags(), vision_language=True, seed=0, mm_kwargs=mm, max_images_per_prompt=2,
                           model_type=model.config.model_type)
    assert kwargs["limit_mm_per_prompt"] == ({"image": 2, "video": 0} if family in VIDEO else {"image": 2})
    assert kwargs.get("mm_processor_kwargs", {}) == mm
    if family == "smolvlm":  # vLLM's Idefics3 processor asserts the resize edge is a multiple of the tile edge
        assert mm["size"]["longest_edge"] % processor.image_processor.max_image_size["longest_edge"] == 0


def test_gemma3_pan_and_scan_settings_go_to_vllm(family_models):
    _, processor = family_models("gemma3")
    processor.image_processor.do_pan_and_scan = True
    try:
        mm = mm_processor_kwargs(processor)
    finally:
        processor.image_processor.do_pan_and_scan = False
    assert mm["do_pan_and_scan"] is True and mm["pan_and_scan_max_num_crops"] == 4
    assert mm["pan_and_scan_min_crop_size"] == 28 and mm["pan_and_scan_min_ratio_to_activate"] == 1.2


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_prompt_ids_hold_each_image_expanded_once(family_models, family):
    """vLLM gets the trainer's own prompt ids, images already expanded (it finds the expansion in place and does not
    add another): each row's image tokens are exactly those of its one image, padding dropped."""
    model, processor = family_models(family)
    images = [[Image.new("RGB", (84, 60), (200, 30, 30))], [Image.new("RGB", (60, 84), (30, 30, 200))]]
    messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}]
                for t in ("What colour?", "How many shapes are there?")]
    batch = encode_prompts(processor, messages, images, sample_ids=["a", "b"])
    rows = prompt_token_ids(batch, torch.tensor([1, 0, 0]))
    token = image_token_id(model.config)
    mask = batch["attention_mask"].bool()
    assert rows[1] == rows[2] == batch["input_ids"][0][mask[0]].tolist()
    assert rows[0] == batch["input_ids"][1][mask[1]].tolist()
    assert rows[0].count(token) == int((batch["input_ids"][1] == token).sum()) > 0
    prompts = vllm_prompts(rows, [images[1], images[0], images[0]])
    assert prompts[0]["multi_modal_data"]["image"] is images[1][0]


def test_gemma4_images_expand_to_the_soft_tokens_vllm_counts(family_models):
    """vLLM's Gemma 4 processor finds each image's expansion in the prompt ids by its own count of soft tokens:
    the image scaled (aspect kept) so its 16 px patches fill the budget's pooled patches, each side floored to whole
    pooling cells, the pooled cells capped at the budget. The trainer's processor must give the same count at the
    budget it sends (max_soft_tokens)."""
    import math

    from utils.core.encoding import image_tokens_per_image

    _, processor = family_models("gemma4")
    budget = mm_processor_kwargs(processor)["max_soft_tokens"]
    patch, pool = processor.image_processor.patch_size, processor.image_processor.pooling_kernel_size
    cell = patch * pool
    for width, height in [(84, 60), (60, 84), (300, 40), (37, 512), (640, 480)]:
        scale = math.sqrt(budget * pool * pool / ((height / patch) * (width / patch)))
        rows, cols = (max(cell, math.floor(side * scale / cell) * cell) // patch for side in (height, width))
        expected = min(rows * cols // (pool * pool), budget)
        assert image_tokens_per_image(processor, Image.new("RGB", (width, height))) == expected, (width, height)
