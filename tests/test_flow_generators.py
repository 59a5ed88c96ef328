"""The flow generator adapters against diffusers' own pipelines (tiny random components built locally, as diffusers'
pipeline tests build them; tokenizers are made offline), the SDE-step log-prob recompute, LoRA and conditioning."""

import math
import os

import pytest
import torch

from tests.flow_helpers import PROMPTS, SIZE
from tests.flow_helpers import assert_close as _close
from tests.flow_helpers import random_image as _image
from tests.flow_helpers import seeded as _gen
from tiny.pipelines import make_tiny_flux, make_tiny_klein, make_tiny_qwenimage, make_tiny_sd3
from utils.t2i.adapters import (
    Flux2KleinGenerator,
    FluxGenerator,
    QwenImageGenerator,
    SD3Generator,
    load_flow_generator,
    template_prefix_length,
)
from utils.t2i.generators import Guidance, SDEStep, edit_start, sample, step_logprob
from utils.t2i.sde import sde_std_t

# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwenimage(tmp_path_factory.mktemp("qwenimage"))


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return make_tiny_sd3(tmp_path_factory.mktemp("sd3"))


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return make_tiny_flux(tmp_path_factory.mktemp("flux"))


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory):
    return make_tiny_klein(tmp_path_factory.mktemp("klein"))


# --------------------------------------------------------------------------------------------------
# ODE parity with the pipelines' own __call__
# --------------------------------------------------------------------------------------------------


def test_qwenimage_ode_matches_pipeline(qwen_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen_dir)
    pipe.prompt_template_encode_start_idx = template_prefix_length(pipe)  # as the adapter (Qwen's tokenizer: 34)
    ref = pipe(PROMPTS, negative_prompt=" ", true_cfg_scale=4.0, height=SIZE, width=SIZE, num_inference_steps=3,
               generator=_gen(), output_type="pt", max_sequence_length=128).images
    gen = QwenImageGenerator.from_pretrained(qwen_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, negative_prompt=" ", max_sequence_length=128)
    assert cond.pos["mask"] is not None  # prompts of two lengths: the padding mask is exercised
    out = sample(gen, cond, num_steps=3, guidance=Guidance(scale=4.0), generator=_gen())
    _close(out.images, ref)


def test_qwenimage_edit_ode_matches_pipeline(qwen_dir, monkeypatch):
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_module

    # The edit pipeline resizes its input to a 1024^2 area (a 1024 px tiny-VAE encode takes ~30 s on a CPU):
    # the test shrinks that constant in the pipeline and passes the same edit_area to the adapter.
    original = edit_module.calculate_dimensions
    monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: original(SIZE * SIZE, ratio))
    image = _image()
    pipe = QwenImageEditPipeline.from_pretrained(qwen_dir)
    pipe.prompt_template_encode_start_idx = template_prefix_length(pipe)  # as the adapter (Qwen's tokenizer: 64)
    ref = pipe(image=image, prompt=PROMPTS[0], negative_prompt=" ", true_cfg_scale=4.0, height=SIZE, width=SIZE,
               num_inference_steps=2, generator=_gen(), output_type="pt", max_sequence_length=128).images
    gen = QwenImageGenerator.from_pretrained(qwen_dir, edit_area=SIZE * SIZE)
    cond = gen.encode_condition(PROMPTS[:1], [image], height=SIZE, width=SIZE, max_sequence_length=128)
    assert cond.image_latents is not None and len(cond.shared["img_shapes"]) == 2
    out = sample(gen, cond, num_steps=2, guidance=Guidance(scale=4.0), generator=_gen())
    _close(out.images, ref)


def test_qwen_encodings_start_at_the_prompt_for_any_tokenizer(qwen_dir):
    """The dropped template prefix is counted with the pipeline's own tokenizer: the first state kept is the
    prompt's first token (with diffusers' constant 34, this tokenizer's longer system prompt would leave dozens of
    template states, the same for every prompt, in front of it)."""
    gen = QwenImageGenerator.from_pretrained(qwen_dir, edit_area=SIZE * SIZE)
    for pipe, diffusers_constant in ((gen.t2i, 34), (gen.edit, 64)):
        template = pipe.prompt_template_encode
        ids = pipe.tokenizer(template.format("a red circle"))["input_ids"]
        kept = pipe.tokenizer.decode(ids[template_prefix_length(pipe):])
        assert kept.startswith("a red circle"), kept
        assert template_prefix_length(pipe) != diffusers_constant  # this tokenizer is not Qwen's
    cond = gen.encode_condition(["red circle", "blue circle"], height=SIZE, width=SIZE, negative_prompt=None)
    first = cond.pos["embeds"][:, 0]
    assert (first[0] - first[1]).abs().max() > 1e-3  # the first kept state already reads the prompt


def test_sd3_ode_matches_pipeline(sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    ref = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=5.0, generator=_gen(),
               output_type="pt", max_sequence_length=16).images
    gen = SD3Generator.from_pretrained(sd3_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=16)
    out = sample(gen, cond, num_steps=3, guidance=Guidance(scale=5.0), generator=_gen())
    _close(out.images, ref)


def test_flux_ode_matches_pipeline(flux_dir):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux_dir)
    ref = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=3.5, generator=_gen(),
               output_type="pt", max_sequence_length=16).images
    gen = FluxGenerator.from_pretrained(flux_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=16)
    out = sample(gen, cond, num_steps=3, guidance=Guidance(scale=1.0, embedded=3.5), generator=_gen())
    _close(out.images, ref)


@pytest.mark.parametrize("with_image", [False, True])
def test_klein_ode_matches_pipeline(klein_dir, with_image):
    from diffusers import Flux2KleinPipeline

    image = _image(1, 64) if with_image else None  # the pipeline takes reference images of 64 px and more
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    ref = pipe(prompt=PROMPTS[0], image=image, height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=4.0,
               generator=_gen(), output_type="pt", max_sequence_length=32, text_encoder_out_layers=(1,)).images
    gen = Flux2KleinGenerator.from_pretrained(klein_dir, text_encoder_out_layers=(1,))
    cond = gen.encode_condition(PROMPTS[:1], None if image is None else [image], height=SIZE, width=SIZE,
                                max_sequence_length=32)
    out = sample(gen, cond, num_steps=3, guidance=Guidance(scale=4.0), generator=_gen())
    _close(out.images, ref)


# --------------------------------------------------------------------------------------------------
# SDE steps: the recorded log-prob is what training recomputes (ratio 1 with unchanged weights)
# --------------------------------------------------------------------------------------------------


def _loaded(kind, dirs):
    if kind == "qwen":
        gen = QwenImageGenerator.from_pretrained(dirs["qwen"], edit_area=SIZE * SIZE)
        return gen, dict(negative_prompt=" ", max_sequence_length=128)
    if kind == "sd3":
        return SD3Generator.from_pretrained(dirs["sd3"]), dict(max_sequence_length=16)
    if kind == "flux":
        return FluxGenerator.from_pretrained(dirs["flux"]), dict(negative_prompt="", max_sequence_length=16)
    gen = Flux2KleinGenerator.from_pretrained(dirs["klein"], text_encoder_out_layers=(1,))
    return gen, dict(max_sequence_length=32)


@pytest.fixture(scope="module")
def dirs(qwen_dir, sd3_dir, flux_dir, klein_dir):
    return {"qwen": qwen_dir, "sd3": sd3_dir, "flux": flux_dir, "klein": klein_dir}


@pytest.mark.parametrize("kind,edit", [("qwen", False), ("qwen", True), ("sd3", False), ("sd3", True),
                                       ("flux", False), ("flux", True), ("klein", True)])
def test_step_logprob_recompute_ratio_one(dirs, kind, edit):
    gen, kw = _loaded(kind, dirs)
    images = [_image(2, 64 if kind == "klein" else SIZE), _image(3, 64 if kind == "klein" else SIZE)] if edit else None
    cond = gen.encode_condition(PROMPTS, images, height=SIZE, width=SIZE, **kw)
    guidance = Guidance(scale=4.0, interval=(0.4, 1.0))
    sde = [edit_start(4, 0.6)] if (edit and kind in ("sd3", "flux")) else [0, 2]  # SDEdit starts later
    out = sample(gen, cond, num_steps=4, sde_steps=sde, guidance=guidance, generator=[_gen(1), _gen(2)])
    assert [int(s.index[0]) for s in out.steps] == sde
    for step in out.steps:
        log_prob, mean, std = step_logprob(gen, cond, step)
        assert log_prob.requires_grad or not gen.trainable_parameters()
        ratio = torch.exp(log_prob - step.log_prob)
        _close(ratio.detach(), torch.ones(2), atol=1e-5)
        _close(mean.detach(), step.mean, atol=1e-5)
        _close(std, step.std)
    # training minibatches: steps of different sigmas in one batch (the guidance interval splits it), and a subset
    step = SDEStep.cat(out.steps)
    log_prob, _, _ = step_logprob(gen, cond.select([0, 1] * len(out.steps)), step)
    _close(log_prob.detach(), step.log_prob, atol=1e-4)
    log_prob, _, _ = step_logprob(gen, cond.select([1]), step.select([1]))
    _close(log_prob.detach(), step.log_prob[1:2], atol=1e-4)


@pytest.mark.parametrize("edit", [False, True])
def test_qwen_batched_cfg_and_left_padding_tokenizer(qwen_dir, edit):
    gen = QwenImageGenerator.from_pretrained(qwen_dir, edit_area=SIZE * SIZE)
    gen.t2i.tokenizer.padding_side = "left"  # a policy tokenizer set up for generation
    images = [_image(5), _image(6)] if edit else None
    cond = gen.encode_condition(PROMPTS, images, height=SIZE, width=SIZE, max_sequence_length=128)
    assert gen.t2i.tokenizer.padding_side == "left"
    gen.t2i.tokenizer.padding_side = "right"
    _close(cond.pos["embeds"], gen.encode_condition(PROMPTS, images, height=SIZE, width=SIZE,
                                                    max_sequence_length=128).pos["embeds"], atol=0)
    x = gen.prepare_latents(2, SIZE, SIZE, _gen())
    t = torch.tensor([900.0, 700.0])
    separate = gen.velocity(x, t, cond, Guidance(scale=4.0))
    gen.cfg_batched = True  # one forward for both branches (DDP: one forward per backward)
    _close(gen.velocity(x, t, cond, Guidance(scale=4.0)), separate, atol=1e-5)
    out = sample(gen, cond, num_steps=3, sde_steps=[1], guidance=Guidance(scale=4.0), generator=_gen(),
                 output_type=None)
    _close(step_logprob(gen, cond, out.steps[0])[0].detach(), out.steps[0].log_prob, atol=1e-6)


def test_qwen_edit_image_cfg_is_bagels_formula_inside_the_interval(qwen_dir):
    gen = QwenImageGenerator.from_pretrained(qwen_dir, edit_area=SIZE * SIZE)
    images = [_image(5), _image(6)]
    cond = gen.encode_condition(PROMPTS, images, height=SIZE, width=SIZE, max_sequence_length=128,
                                image_guidance=True)
    assert cond.no_image is not None and cond.no_image["drop_image"]
    x = gen.prepare_latents(2, SIZE, SIZE, _gen())
    t = torch.tensor([900.0, 200.0])  # sigma 0.9 inside (0.4, 1], 0.2 outside
    text = Guidance(scale=4.0, interval=(0.4, 1.0))
    both = Guidance(scale=4.0, interval=(0.4, 1.0), image_scale=1.5)
    v_text = gen.velocity(x, t, cond, text)
    # the branch without the input image is the text-to-image velocity of the same prompts
    t2i = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=128)
    v_free = gen.velocity(x, t, t2i, Guidance(scale=1.0))
    v = gen.velocity(x, t, cond, both)
    _close(v[0], v_free[0] + 1.5 * (v_text[0] - v_free[0]), atol=1e-5)
    _close(v[1], v_text[1], atol=0)  # outside the interval: neither CFG (the conditional velocity)
    assert (v[0] - v_text[0]).abs().max() > 1e-4  # the image branch does something
    # without the no_image branch (image_guidance off) image_scale changes nothing; the SDE recompute keeps it
    plain = gen.encode_condition(PROMPTS, images, height=SIZE, width=SIZE, max_sequence_length=128)
    _close(gen.velocity(x, t, plain, both), v_text, atol=0)
    out = sample(gen, cond, num_steps=3, sde_steps=[0], guidance=both, generator=_gen(), output_type=None)
    _close(step_logprob(gen, cond, out.steps[0])[0].detach(), out.steps[0].log_prob, atol=1e-6)
    assert (step_logprob(gen, cond, out.steps[0], guidance=text)[0] - out.steps[0].log_prob).abs().max() > 1e-6


def _bagel_guided(v_cond, v_neg, v_free, scale, image_scale, kind, renorm_min):
    """BAGEL's guided velocity from the three branches' velocities, one image and one latent token at a time in numpy
    (float64): text CFG, then (text_channel) each token rescaled by min(max(|v_cond| / (|v_text| + 1e-8), min), 1),
    then the image CFG, then (global) the whole image rescaled the same way."""
    import numpy as np

    cond, neg, free = (np.asarray(v.double()) for v in (v_cond, v_neg, v_free))
    out = np.empty_like(cond)
    for b in range(cond.shape[0]):
        text = neg[b] + scale * (cond[b] - neg[b])
        if kind == "text_channel":
            for i in range(text.shape[0]):
                ratio = math.sqrt((cond[b, i] ** 2).sum()) / (math.sqrt((text[i] ** 2).sum()) + 1e-8)
                text[i] = text[i] * min(max(ratio, renorm_min), 1.0)
        full = free[b] + image_scale * (text - free[b])
        if kind == "global":
            ratio = math.sqrt((cond[b] ** 2).sum()) / (math.sqrt((full ** 2).sum()) + 1e-8)
            full = full * min(max(ratio, renorm_min), 1.0)
        out[b] = full
    return torch.from_numpy(out).float()


@pytest.mark.parametrize("kind, renorm_min", [("text_channel", 0.0), ("global", 0.0)])
def test_bagel_cfg_renorms_match_an_independent_computation(qwen_dir, kind, renorm_min):
    """R3's edit guidance (cfg_renorm_type_edit text_channel) and generation guidance (global), as BAGEL defines
    them, against the same formula computed by hand from the three branches' velocities; outside the CFG interval
    the conditional velocity. The SDE recompute keeps it (ratio 1), and it is not the pipeline's own rescale."""
    gen = QwenImageGenerator.from_pretrained(qwen_dir, edit_area=SIZE * SIZE)
    cond = gen.encode_condition(PROMPTS, [_image(5), _image(6)], height=SIZE, width=SIZE, max_sequence_length=128,
                                image_guidance=True)
    x = gen.prepare_latents(2, SIZE, SIZE, _gen())
    t = torch.tensor([900.0, 200.0])  # sigma 0.9 inside (0.4, 1], 0.2 outside
    one = Guidance(scale=1.0)
    with torch.no_grad():
        v_cond, v_neg, v_free = (gen.forward(x.to(gen.dtype), t, cond, branch, one).float()
                                 for branch in (cond.pos, cond.neg, cond.no_image))
        guidance = Guidance(scale=4.0, interval=(0.4, 1.0), image_scale=1.5, renorm=kind, renorm_min=renorm_min)
        v = gen.velocity(x, t, cond, guidance)
        expected = _bagel_guided(v_cond, v_neg, v_free, 4.0, 1.5, kind, renorm_min)
        _close(v[0], expected[0], atol=1e-5)
        _close(v[1], v_cond[1], atol=0)
        pipeline = gen.velocity(x, t, cond, Guidance(scale=4.0, interval=(0.4, 1.0), image_scale=1.5))
        assert (v[0] - pipeline[0]).abs().max() > 1e-3  # Qwen-Image's own (unclamped, per-token) rescale differs
    out = sample(gen, cond, num_steps=3, sde_steps=[0], guidance=guidance, generator=_gen(), output_type=None)
    _close(step_logprob(gen, cond, out.steps[0])[0].detach(), out.steps[0].log_prob, atol=1e-6)
    with pytest.raises(ValueError, match="renorm='channels'"):
        Guidance(renorm="channels")


def test_bagel_renorm_only_shrinks_and_keeps_the_floor():
    """The clamp of BAGEL's ratio to [renorm_min, 1]: a guided velocity shorter than the conditional one is kept as it
    is, a longer one shrunk to its norm (per token or per image), never below renorm_min of itself."""
    from utils.t2i.guidance import renormalize

    cond = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])  # token norms 5 and 1, image norm sqrt(26)
    guided = torch.tensor([[[0.6, 0.8], [0.0, 4.0]]])  # token norms 1 and 4, image norm sqrt(17)
    _close(renormalize(guided, cond, "channel"), torch.tensor([[[0.6, 0.8], [0.0, 1.0]]]), atol=1e-6)
    _close(renormalize(guided, cond, "channel", renorm_min=0.5), torch.tensor([[[0.6, 0.8], [0.0, 2.0]]]), atol=1e-6)
    _close(renormalize(guided, cond, "global"), guided, atol=0)  # sqrt(26) / sqrt(17) > 1: kept
    _close(renormalize(4 * guided, cond, "global"), 4 * guided * math.sqrt(26) / math.sqrt(17 * 16), atol=1e-6)
    _close(renormalize(guided, cond, "pipeline"), torch.tensor([[[3.0, 4.0], [0.0, 1.0]]]), atol=1e-6)  # unclamped


def test_ode_trajectory_unchanged_before_sde_step(qwen_dir):
    gen = QwenImageGenerator.from_pretrained(qwen_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=128)
    ode = sample(gen, cond, num_steps=4, guidance=Guidance(scale=4.0), generator=_gen(), output_type=None)
    assert ode.steps == []
    sde = sample(gen, cond, num_steps=4, sde_steps=[2], guidance=Guidance(scale=4.0), generator=_gen(),
                 output_type=None)
    _close(sde.noise, ode.noise, atol=0)
    # the two runs agree up to the SDE step's input, and the SDE step's mean is near the ODE step
    ode_steps = sample(gen, cond, num_steps=4, sde_steps=[2], guidance=Guidance(scale=4.0), generator=_gen(),
                       noise_level=1e-6, output_type=None)
    _close(ode_steps.steps[0].latents, sde.steps[0].latents, atol=0)
    assert not torch.allclose(ode.latents, sde.latents)
    _close(ode_steps.latents, ode.latents, atol=1e-4)


def test_per_sample_sde_steps_draw_each_sample_as_it_would_be_drawn_alone(qwen_dir):
    gen = QwenImageGenerator.from_pretrained(qwen_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=128)
    noise = gen.prepare_latents(2, SIZE, SIZE, _gen())
    kw = dict(num_steps=5, guidance=Guidance(scale=4.0, interval=(0.4, 1.0)), output_type=None)
    both = sample(gen, cond, sde_steps=[[3, 0], [1, 3]], latents=noise, generator=[_gen(1), _gen(2)], **kw)
    for b, (sde, seed) in enumerate([([0, 3], 1), ([1, 3], 2)]):
        alone = sample(gen, cond.select([b]), sde_steps=sde, latents=noise[b:b + 1], generator=[_gen(seed)], **kw)
        _close(both.latents[b:b + 1], alone.latents, atol=1e-5)
        for position, step in enumerate(alone.steps):  # the batch's k-th steps are each sample's k-th step
            mine = both.steps[position].select([b])
            assert mine.index.tolist() == [sde[position]]
            for name in ("latents", "next_latents", "mean", "std", "log_prob", "sigma", "timestep"):
                _close(getattr(mine, name), getattr(step, name), atol=1e-5)
    assert [s.index.tolist() for s in both.steps] == [[0, 1], [3, 3]]
    # a shared list is every sample's: one record per step over the whole batch, as the per-sample form gives
    shared = sample(gen, cond, sde_steps=[1, 3], latents=noise, generator=[_gen(1), _gen(2)], **kw)
    listed = sample(gen, cond, sde_steps=[[1, 3], [3, 1]], latents=noise, generator=[_gen(1), _gen(2)], **kw)
    assert [s.index.tolist() for s in shared.steps] == [[1, 1], [3, 3]]
    _close(listed.latents, shared.latents, atol=0)
    with pytest.raises(ValueError, match="as many SDE steps"):
        sample(gen, cond, sde_steps=[[1], [1, 3]], latents=noise, **kw)
    with pytest.raises(ValueError, match="2 lists of SDE steps for a batch of 1"):
        sample(gen, cond.select([0]), sde_steps=[[1], [3]], latents=noise[:1], **kw)


def test_guidance_interval_and_schedule_shift(qwen_dir):
    gen = QwenImageGenerator.from_pretrained(qwen_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=128)
    x = gen.prepare_latents(2, SIZE, SIZE, _gen())
    timesteps, sigmas = gen.schedule(4, x, shift=3.0)
    t = torch.linspace(1, 0.25, 4)
    _close(sigmas[:-1], 3 * t / (1 + 2 * t), atol=1e-6)  # R3's shift t' = 3t / (1 + 2t)
    assert sigmas[-1] == 0
    guidance = Guidance(scale=4.0, interval=(0.4, 1.0))
    low = torch.tensor([0.3 * 1000, 0.9 * 1000])
    mixed = gen.velocity(x, low, cond, guidance)
    _close(mixed[0], gen.velocity(x, low, cond, Guidance(scale=1.0))[0], atol=1e-6)  # outside: conditional only
    _close(mixed[1], gen.velocity(x, low, cond, Guidance(scale=4.0))[1], atol=1e-5)  # inside: CFG


def test_r3_noise_cap(sd3_dir):
    gen = SD3Generator.from_pretrained(sd3_dir)
    cond = gen.encode_condition(PROMPTS[:1], height=SIZE, width=SIZE, max_sequence_length=16)
    out = sample(gen, cond, num_steps=3, sde_steps=[0, 1], guidance=Guidance(scale=5.0), noise_level=1.0,
                 noise_cap="r3", generator=_gen(), output_type=None)
    for step in out.steps:
        sigma = float(step.sigma[0])
        assert float(step.std_t[0]) == pytest.approx((sigma / (1 - min(sigma, 0.95))) ** 0.5, rel=1e-6)
    assert float(out.steps[0].sigma[0]) == 1.0


def test_sdedit_refine_starts_from_previous_image(sd3_dir):
    gen = SD3Generator.from_pretrained(sd3_dir)
    image = _image(4)
    cond = gen.encode_condition(PROMPTS[:1], [image], height=SIZE, width=SIZE, max_sequence_length=16)
    start = edit_start(5, 0.6)
    out = sample(gen, cond, num_steps=5, sde_steps=[start], guidance=Guidance(scale=5.0), edit_strength=0.6,
                 generator=_gen(), output_type=None)
    sigma = out.sigmas[start]
    _close(out.steps[0].latents, sigma * out.noise + (1 - sigma) * cond.init_latents, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Training: LoRA, reference, checkpointing, conditioning, loading
# --------------------------------------------------------------------------------------------------


def test_lora_only_lora_params_get_grads_and_reference_is_base(qwen_dir):
    gen = QwenImageGenerator.from_pretrained(qwen_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=128)
    out = sample(gen, cond, num_steps=3, sde_steps=[1], guidance=Guidance(scale=4.0), generator=_gen(),
                 output_type=None)
    params = gen.add_lora(r=4)
    assert params and all("lora" in n for n, p in gen.transformer.named_parameters() if p.requires_grad)
    log_prob, _, _ = step_logprob(gen, cond, out.steps[0])
    _close(log_prob.detach(), out.steps[0].log_prob)  # LoRA B = 0: the policy is still the base
    log_prob.sum().backward()
    grads = {n: p.grad for n, p in gen.transformer.named_parameters()}
    assert all(g is None for n, g in grads.items() if "lora" not in n)
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    assert all(p.grad is None for p in gen.text_encoder.parameters())
    assert all(p.grad is None for p in gen.vae.parameters())
    with torch.no_grad():
        for n, p in gen.transformer.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
        moved, _, _ = step_logprob(gen, cond, out.steps[0])
        with gen.reference():
            base, _, _ = step_logprob(gen, cond, out.steps[0])
    assert not torch.allclose(moved, out.steps[0].log_prob, atol=1e-4)
    _close(base, out.steps[0].log_prob)
    assert all(p.requires_grad for p in params)  # the reference context leaves the adapter trainable


def test_gradient_checkpointing_same_grads(sd3_dir):
    gen = SD3Generator.from_pretrained(sd3_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=16)
    out = sample(gen, cond, num_steps=3, sde_steps=[1], guidance=Guidance(scale=5.0), generator=_gen(),
                 output_type=None)
    params = gen.add_lora(r=4)
    with torch.no_grad():
        for p in params:
            p.add_(0.01)
    grads = []
    for checkpointing in (False, True):
        gen.enable_gradient_checkpointing(checkpointing)
        for p in params:
            p.grad = None
        step_logprob(gen, cond, out.steps[0])[0].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    _close(grads[0], grads[1], atol=1e-6)


def test_conditioning_base_weights_vs_policy(qwen_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    from utils.t2i.adapters import QwenImageGenerator as Q

    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(qwen_dir, "text_encoder"))
    frozen = Q.from_pretrained(qwen_dir)
    base = frozen.encode_condition(PROMPTS, height=SIZE, width=SIZE).pos["embeds"]
    policy = get_peft_model(vlm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    comps = {"text_encoder": policy}
    gen = Q.from_pretrained(qwen_dir, components=comps)
    assert gen.text_encoder is policy.get_base_model()  # adapters present: no copy
    _close(gen.encode_condition(PROMPTS, height=SIZE, width=SIZE).pos["embeds"], base, atol=1e-6)
    trains = Q.from_pretrained(qwen_dir, components=comps, conditioning="policy")
    embeds = trains.encode_condition(PROMPTS, height=SIZE, width=SIZE).pos["embeds"]
    assert embeds.requires_grad and not torch.allclose(embeds, base, atol=1e-4)
    full = Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(qwen_dir, "text_encoder"))
    copied = Q.from_pretrained(qwen_dir, components={"text_encoder": full})
    assert copied.text_encoder is not full and not any(p.requires_grad for p in copied.text_encoder.parameters())
    with torch.no_grad():
        next(full.parameters()).add_(1.0)  # full fine-tuning of the policy moves it, not the conditioning
    _close(copied.encode_condition(PROMPTS, height=SIZE, width=SIZE).pos["embeds"], base, atol=1e-6)


def test_load_by_folder_and_bf16(dirs):
    for kind, cls in (("qwen", QwenImageGenerator), ("sd3", SD3Generator), ("flux", FluxGenerator),
                      ("klein", Flux2KleinGenerator)):
        assert type(load_flow_generator(dirs[kind])) is cls
    for kind, kw in (("sd3", dict(max_sequence_length=16)), ("qwen", dict(max_sequence_length=128))):
        gen = load_flow_generator(dirs[kind], dtype=torch.bfloat16)
        assert gen.dtype == gen.vae.dtype == torch.bfloat16
        cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, **kw)
        out = sample(gen, cond, num_steps=2, sde_steps=[0], guidance=Guidance(scale=5.0), generator=_gen())
        step = out.steps[0]
        assert out.latents.dtype == torch.float32 and step.log_prob.dtype == torch.float32
        assert torch.isfinite(step.log_prob).all() and out.images.shape == (2, 3, SIZE, SIZE)
        log_prob, _, _ = step_logprob(gen, cond, step)
        _close(log_prob, step.log_prob, atol=1e-5)


def test_generator_without_text_encoders_from_embeds(tmp_path):
    """The project's tiny flow model (SD3 classes, no text encoders) conditioned on embeddings from elsewhere."""
    from tiny.models import make_tiny_flow_model
    gen = load_flow_generator(make_tiny_flow_model(tmp_path / "flow"))
    assert type(gen) is SD3Generator and gen.pipe.text_encoder is None
    embeds, pooled = torch.randn(2, 7, 128), torch.randn(2, 128)
    cond = gen.condition_from_embeds(embeds, pooled, torch.zeros_like(embeds), torch.zeros_like(pooled),
                                     height=SIZE, width=SIZE)
    out = sample(gen, cond, num_steps=3, sde_steps=[1], guidance=Guidance(scale=4.0), generator=_gen())
    _close(step_logprob(gen, cond, out.steps[0])[0].detach(), out.steps[0].log_prob, atol=1e-6)


def test_qwen_condition_from_embeds_equals_encoded(qwen_dir):
    gen = QwenImageGenerator.from_pretrained(qwen_dir)
    cond = gen.encode_condition(PROMPTS, height=SIZE, width=SIZE, max_sequence_length=128)
    again = gen.condition_from_embeds(cond.pos["embeds"], cond.pos["mask"], cond.neg["embeds"], cond.neg["mask"],
                                      height=SIZE, width=SIZE)
    x = gen.prepare_latents(2, SIZE, SIZE, _gen())
    _close(gen.velocity(x, 800.0, again, Guidance(4.0)), gen.velocity(x, 800.0, cond, Guidance(4.0)), atol=0)


def test_sigma_one_std_uses_second_sigma(sd3_dir):
    gen = SD3Generator.from_pretrained(sd3_dir)
    cond = gen.encode_condition(PROMPTS[:1], height=SIZE, width=SIZE, max_sequence_length=16)
    out = sample(gen, cond, num_steps=3, sde_steps=[0], guidance=Guidance(scale=5.0), generator=_gen(),
                 output_type=None)
    expect = sde_std_t(torch.tensor(1.0), noise_level=0.7, sigma_max=out.sigmas[1])
    assert float(out.steps[0].std_t[0]) == pytest.approx(float(expect), rel=1e-6)
