"""The tiny Qwen-Image generator: the cached build is atomic and reused, the folder loads through the Qwen-Image
adapter and samples images, flow-matching pre-training lowers its loss, and the VAE round trip keeps the score."""

import os
import subprocess

import pytest
import torch

import tiny.cache as cache
from tiny.generator import (
    SUMMARY,
    TinyGeneratorConfig,
    encode_images,
    encode_prompts,
    flow_matching_loss,
    heldout_rows,
    make_scheduler,
    make_transformer,
    make_vae,
    pad_embeds,
    render_rows,
    sample_images,
    score_images,
    set_latent_stats,
    train_flow,
    vae_roundtrip,
)
from tiny.models import make_tiny_vlm
from tiny.t2i import make_t2i_prompts

# A build of seconds: few rows and steps, a small transformer, a fresh tiny VLM as text encoder.
SMALL = dict(train_rows=64, vae_steps=3, vae_batch_size=4, steps=3, batch_size=4, num_layers=1,
             num_attention_heads=2, attention_head_dim=16, log_every=1)


pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm"), seed=0)


@pytest.fixture(scope="module")
def built(tmp_path_factory, vlm_dir):
    """A small cached build in a private cache folder: (cache dir, overrides, path)."""
    root = str(tmp_path_factory.mktemp("cache"))
    overrides = dict(SMALL, text_encoder=vlm_dir)
    mp = pytest.MonkeyPatch()
    mp.setattr(cache, "CACHE_DIR", root)
    try:
        path = cache.tiny_generator_path(**overrides)
    finally:
        mp.undo()
    return root, overrides, path


def test_cached_build_is_atomic_and_reused(built, monkeypatch):
    root, overrides, path = built
    assert os.path.isdir(path) and os.path.basename(path).startswith(cache.TINY_GENERATOR + "-")
    assert os.path.isfile(os.path.join(path, "model_index.json")) and os.path.isfile(os.path.join(path, SUMMARY))
    assert not [n for n in os.listdir(root) if ".tmp-" in n]
    monkeypatch.setattr(cache, "CACHE_DIR", root)

    def no_build(*a, **k):
        raise AssertionError("the cached generator was rebuilt")

    monkeypatch.setattr("subprocess.run", no_build)
    assert cache.tiny_generator_path(**overrides) == path  # same spec: reused, nothing run

    def half_build(cmd, **kw):  # another spec builds another folder; this build dies half way
        out = cmd[cmd.index("--output_dir") + 1]
        os.makedirs(os.path.join(out, "vae"))
        open(os.path.join(out, "model_index.json"), "w").close()
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr("subprocess.run", half_build)
    with pytest.raises(subprocess.CalledProcessError):
        cache.tiny_generator_path(**dict(overrides, steps=4))
    assert sorted(os.listdir(root)) == [os.path.basename(path)]  # neither it nor its temporary folder is left


def test_bad_text_encoder_fails_before_training(tmp_path):
    from tiny.generator import build_tiny_generator

    cfg = TinyGeneratorConfig(output_dir=str(tmp_path / "out"), text_encoder=str(tmp_path / "missing"), **SMALL)
    with pytest.raises(FileNotFoundError, match="--text_encoder"):
        build_tiny_generator(cfg)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="--image_size"):
        TinyGeneratorConfig(image_size=30)


def test_folder_loads_through_adapter_and_samples(built, vlm_dir):
    from diffusers import QwenImagePipeline
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from utils.t2i.adapters import QwenImageGenerator, load_flow_generator

    _, _, path = built
    gen = QwenImageGenerator.from_pretrained(path)
    assert type(load_flow_generator(path)) is QwenImageGenerator
    images = sample_images(gen, ["a photo of a red circle", "a photo of two squares", "a photo of a triangle"],
                           size=32, num_steps=3, guidance_scale=4.0)
    assert images.shape == (3, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    again = sample_images(gen, ["a photo of two squares"], size=32, num_steps=3, guidance_scale=4.0, seeds=[1])
    torch.testing.assert_close(again[0], images[1], atol=1e-5, rtol=0)  # an image does not depend on its batch
    # the saved text encoder and tokenizer condition exactly as the VLM the transformer was trained on
    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    source = QwenImageGenerator(QwenImagePipeline(scheduler=gen.scheduler, vae=gen.vae, text_encoder=vlm,
                                                  tokenizer=AutoProcessor.from_pretrained(vlm_dir).tokenizer,
                                                  transformer=gen.transformer))
    prompts = ["a photo of a blue square below a yellow circle", " "]
    for a, b in zip(encode_prompts(gen, prompts, 32), encode_prompts(source, prompts, 32)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert os.path.isfile(os.path.join(path, "processor", "processor_config.json"))


def _small_generator(vlm_dir, cfg):
    from diffusers import QwenImagePipeline
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from utils.t2i.adapters import QwenImageGenerator

    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    vae = make_vae(cfg)
    transformer = make_transformer(cfg, vlm.config.text_config.hidden_size)
    pipe = QwenImagePipeline(scheduler=make_scheduler(cfg), vae=vae, text_encoder=vlm,
                             tokenizer=AutoProcessor.from_pretrained(vlm_dir).tokenizer, transformer=transformer)
    transformer.requires_grad_(True)
    return QwenImageGenerator(pipe)


@pytest.mark.slow
@pytest.mark.full  # trains the tiny generator's flow for minutes: the full tier, with the generator's other builds
def test_flow_matching_pretraining_lowers_loss(vlm_dir):
    cfg = TinyGeneratorConfig(**dict(SMALL, steps=40, batch_size=16, num_layers=2, learning_rate=2e-3,
                                     warmup_steps=5, log_every=100))
    gen = _small_generator(vlm_dir, cfg)
    rows = make_t2i_prompts(64, seed=0)
    images = render_rows(rows, cfg.image_size)
    set_latent_stats(gen.vae, images)
    latents = encode_images(gen, images)
    assert latents.shape == (64, (cfg.image_size // 4) ** 2, 4 * cfg.vae_z_dim)
    prompts = sorted({r["prompt"] for r in rows})
    embeds = encode_prompts(gen, prompts, cfg.image_size)
    row_prompt = [prompts.index(r["prompt"]) for r in rows]

    def held_loss():  # the same sigmas, noise and rows every time
        e, m = pad_embeds([embeds[i] for i in row_prompt[:32]])
        with torch.no_grad():
            return float(flow_matching_loss(gen, latents[:32], e, m, cfg.image_size, torch.Generator().manual_seed(7),
                                            cfg))

    before = held_loss()
    assert held_loss() == before
    history = train_flow(gen, latents, row_prompt, embeds, encode_prompts(gen, [" "], cfg.image_size)[0], cfg,
                         log=lambda msg: None)
    assert len(history) == cfg.steps
    after = held_loss()
    assert after < 0.8 * before, (before, after)


@pytest.mark.full
@pytest.mark.slow
def test_default_generator_vae_roundtrip_keeps_score_and_leaves_headroom():
    """The default build (shipped in tiny/weights/, about 27 CPU minutes to retrain): its VAE reconstructs held-out
    renders as the scorer sees them, and its ODE samples score well above an untrained model and below 1."""
    from tiny.generator import evaluate_generator
    from utils.t2i.adapters import QwenImageGenerator

    path = cache.tiny_generator_path()
    gen = QwenImageGenerator.from_pretrained(path)
    rows = heldout_rows(60)
    truth = render_rows(rows, 32, seed_offset=10**6)
    assert score_images(truth, rows)["table"]["all"]["score"] == 1.0
    recon = score_images(vae_roundtrip(gen, truth), rows)["table"]["all"]
    assert recon["score"] >= 0.95, recon
    result = evaluate_generator(path, n=60, gen=gen)["table"]["all"]
    assert 0.2 < result["score"] < 0.9, result
