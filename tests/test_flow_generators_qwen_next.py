"""The Qwen-Image 2.1 (Qwen3-VL text encoder) and Qwen-Image-Edit Plus (2509 / 2511, several input images) adapters
against their diffusers pipelines' own `__call__` (tiny random components), and the SDE-step recompute on them."""

import pytest
import torch

from tests.flow_helpers import PROMPTS, SIZE
from tests.flow_helpers import assert_close as _close
from tests.flow_helpers import random_image as _image
from tests.flow_helpers import seeded as _gen
from tiny import pipelines as tp
from tiny.pipelines import make_tiny_qwenimage21, make_tiny_qwenimage_edit_plus
from utils.t2i.adapters import (
    QwenImage21Generator,
    QwenImageEditPlusGenerator,
    load_flow_generator,
    template_prefix_length,
)
from utils.t2i.generators import Guidance, SDEStep, sample, step_logprob

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def q21_dir(tmp_path_factory):
    return make_tiny_qwenimage21(tmp_path_factory.mktemp("qwenimage21"))


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory):
    return make_tiny_qwenimage_edit_plus(tmp_path_factory.mktemp("qwenimage_edit_plus"))


def test_load_picks_the_adapters(q21_dir, plus_dir):
    assert type(load_flow_generator(q21_dir)) is QwenImage21Generator
    gen = load_flow_generator(plus_dir)
    assert type(gen) is QwenImageEditPlusGenerator and type(gen.edit).__name__ == "QwenImageEditPlusPipeline"


# --------------------------------------------------------------------------------------------------
# ODE parity with the pipelines' own __call__
# --------------------------------------------------------------------------------------------------


def test_qwenimage21_ode_matches_pipeline(q21_dir):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(q21_dir)
    # a negative prompt per prompt (the pipeline does not broadcast one string); its KV cache on, as by default
    ref = pipe(PROMPTS, negative_prompt=[" "] * 2, true_cfg_scale=4.0, height=SIZE, width=SIZE,
               num_inference_steps=3, generator=_gen(), output_type="pt").images
    gen = QwenImage21Generator.from_pretrained(q21_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, negative_prompt=" ")
    assert cond.pos["mask"] is not None  # prompts of two lengths: the padding mask is exercised
    out = sample(gen, cond, num_steps=3, guidance=Guidance(scale=4.0), generator=_gen())
    _close(out.images, ref)
    plain = pipe(PROMPTS[:1], height=SIZE, width=SIZE, num_inference_steps=2, generator=_gen(),
                 output_type="pt").images  # 2.1's default: no CFG
    cond = gen.encode_condition(PROMPTS[:1], height=SIZE, width=SIZE)
    _close(sample(gen, cond, num_steps=2, generator=_gen()).images, plain)


def test_qwenimage21_with_two_input_images_matches_pipeline(q21_dir):
    from diffusers import QwenImage21Pipeline

    images = [_image(1), _image(2)]
    pipe = QwenImage21Pipeline.from_pretrained(q21_dir)
    ref = pipe(PROMPTS[0], image=images, negative_prompt=" ", true_cfg_scale=4.0, height=SIZE, width=SIZE,
               num_inference_steps=3, generator=_gen(), output_type="pt", output_resolution=SIZE).images
    gen = QwenImage21Generator.from_pretrained(q21_dir, edit_area=SIZE * SIZE)  # output_resolution ** 2
    cond = gen.encode_condition(PROMPTS[:1], [images], height=SIZE, width=SIZE, negative_prompt=" ")
    assert len(cond.shared["img_shapes"]) == 3 and cond.image_latents.shape[1] == 2 * (SIZE // 16) ** 2
    out = sample(gen, cond, num_steps=3, guidance=Guidance(scale=4.0), generator=_gen())
    _close(out.images, ref)


@pytest.mark.parametrize("n_images", [1, 2])
def test_qwenimage_edit_plus_ode_matches_pipeline(plus_dir, monkeypatch, n_images):
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module

    # The pipeline's VAE sees its inputs at a 1024^2 area: the test shrinks that constant and passes the same
    # edit_area to the adapter (the VLM's 384^2 view stays as it is).
    monkeypatch.setattr(plus_module, "VAE_IMAGE_SIZE", SIZE * SIZE)
    images = [_image(3), _image(4)][:n_images]
    pipe = QwenImageEditPlusPipeline.from_pretrained(plus_dir)
    pipe.prompt_template_encode_start_idx = template_prefix_length(pipe)  # as the adapter (Qwen's tokenizer: 64)
    ref = pipe(image=images, prompt=PROMPTS[0], negative_prompt=" ", true_cfg_scale=4.0, height=SIZE, width=SIZE,
               num_inference_steps=2, generator=_gen(), output_type="pt").images
    gen = QwenImageEditPlusGenerator.from_pretrained(plus_dir, edit_area=SIZE * SIZE)
    cond = gen.encode_condition(PROMPTS[:1], [images], height=SIZE, width=SIZE, negative_prompt=" ")
    assert len(cond.shared["img_shapes"]) == 1 + n_images
    out = sample(gen, cond, num_steps=2, guidance=Guidance(scale=4.0), generator=_gen())
    _close(out.images, ref)


# --------------------------------------------------------------------------------------------------
# A batch of prompts, each with its own images: the SDE steps recompute (ratio 1), LoRA trains
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["q21", "plus"])
def test_per_prompt_images_sde_recompute_and_lora(q21_dir, plus_dir, kind):
    if kind == "q21":
        gen = QwenImage21Generator.from_pretrained(q21_dir, edit_area=SIZE * SIZE)
    else:
        gen = QwenImageEditPlusGenerator.from_pretrained(plus_dir, edit_area=SIZE * SIZE, condition_area=SIZE * SIZE)
    sets = [[_image(5), _image(6)], [_image(7), _image(8)]]
    cond = gen.encode_condition(PROMPTS, sets, height=SIZE, width=SIZE, negative_prompt=" ", image_guidance=True)
    assert cond.pos["mask"] is not None and cond.no_image["drop_image"]
    # each row is its own prompt with its own images: row 1 alone reads as row 1 of the batch up to its padding
    alone = gen.encode_condition(PROMPTS[1:], sets[1:], height=SIZE, width=SIZE)
    _close(cond.pos["embeds"][1:, :alone.pos["embeds"].shape[1]], alone.pos["embeds"], atol=1e-5)
    _close(cond.image_latents[1:], alone.image_latents, atol=1e-5)
    guidance = Guidance(scale=4.0, interval=(0.4, 1.0), image_scale=1.5)
    out = sample(gen, cond, num_steps=3, sde_steps=[0, 1], guidance=guidance, generator=[_gen(1), _gen(2)])
    params = gen.add_lora(r=2)
    step = SDEStep.cat(out.steps)
    log_prob, mean, _ = step_logprob(gen, cond.select([0, 1, 0, 1]), step)
    _close(log_prob.detach(), step.log_prob, atol=1e-4)  # LoRA B = 0: the policy is still the sampler
    log_prob.sum().backward()
    assert any(float(p.grad.abs().sum()) > 0 for p in params if p.grad is not None)
    assert all(p.grad is None for p in gen.pipe.text_encoder.parameters())


def test_qwenimage21_refuses_batched_cfg(q21_dir):
    gen = QwenImage21Generator.from_pretrained(q21_dir)
    assert not gen.cfg_batchable
    gen.cfg_batched = True
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, negative_prompt=" ")
    x = gen.prepare_latents(2, SIZE, SIZE, _gen())
    with pytest.raises(ValueError, match="each CFG branch alone"):
        gen.velocity(x, 900.0, cond, Guidance(scale=4.0))


@pytest.mark.parametrize("kind", ["q21", "plus"])
def test_fixed_shift_gives_r3s_schedule_on_their_scheduler_configs(q21_dir, plus_dir, kind):
    """R3's t' = 3t / (1 + 2t) on linear steps, with the configs' shift_terminal and dynamic shifting turned off."""
    cls, path, real = ((QwenImage21Generator, q21_dir, tp.QWEN_IMAGE_21_SCHEDULER) if kind == "q21" else
                       (QwenImageEditPlusGenerator, plus_dir, tp.QWEN_IMAGE_EDIT_PLUS_SCHEDULER))
    gen = cls.from_pretrained(path)
    assert all(gen.scheduler.config[k] == v for k, v in real.items())
    x = gen.prepare_latents(1, SIZE, SIZE, _gen())
    _, sigmas = gen.schedule(8, x, shift=3.0)
    t = torch.linspace(1, 1 / 8, 8, dtype=torch.float64)
    assert torch.allclose(sigmas[:-1].double(), 3 * t / (1 + 2 * t), atol=1e-6) and sigmas[-1] == 0
    _, own = gen.schedule(8, x)  # the pipeline's own schedule (shift_terminal 0.02 ends it there)
    assert abs(float(own[-2]) - 0.02) < 1e-6
