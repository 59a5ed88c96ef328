"""The tiny text-to-image generator: a Qwen-Image pipeline small enough to pre-train on a CPU, conditioned on the
last hidden states of a frozen tiny Qwen2.5-VL (by default the untrained one, which keeps every word), pre-trained
by rectified flow matching on the synthetic text-to-image rows of `tiny.t2i`, and saved as a `QwenImagePipeline`
folder that `utils.flow.adapters.QwenImageGenerator.from_pretrained` loads (docs/tiny.md, "The tiny generator").

Two stages, both on `render_t2i` ground truth at `image_size` px:
1. the VAE (`AutoencoderKLQwenImage`, 2x down-sampling, 4 latent channels) is trained to reconstruct the renders;
   its latent statistics become the pipeline's `latents_mean` / `latents_std`;
2. the transformer (`QwenImageTransformer2DModel`) learns the velocity noise - x0 of the packed, normalised latents
   at logit-normal sigmas, through the adapter's own `velocity` (so training sees exactly what sampling sees);
   each row's text (its prompt, and by default the scene plan of its render, what the tiny planner writes) is
   encoded once by the adapter's `encode_condition`; a share of rows gets the negative prompt's encoding
   instead, the unconditional branch of classifier-free guidance.
`python -m tiny.generator --output_dir DIR` builds one (`tiny.cache.tiny_generator_path()`: the default, cached);
`evaluate_generator` scores its ODE samples per tag with the `shapes_t2i` scorer. Over 400 lines on purpose: the
build, its components and its scoring are one recipe, read in one place.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from tiny.cache import TINY_MODELS
from tiny.detector import score_t2i
from tiny.generator_config import TinyGeneratorConfig
from tiny.shapes import T2I_TAGS
from tiny.t2i import make_t2i_prompts, render_t2i, scene_plan
from utils.core.config import parse_config
from utils.t2i.adapters import QwenImageGenerator
from utils.t2i.generators import Guidance, sample

_log = partial(print, flush=True)
SUMMARY = "tiny_generator.json"  # what a build measured (timings, losses, scores), next to model_index.json


@contextmanager
def _timed(stages, name):
    """Record the wall and CPU seconds of a stage (CPU seconds: what an unshared core would take, one thread)."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    stages[name] = {"wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1)}


@contextmanager
def pinned_threads(n):
    """torch's thread count set to n inside (the count changes float sums, and with them a cached build)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def save_summary(out_dir, name, summary, log=_log):
    """A build's summary (config, timings, losses) as out_dir/name, and its timings logged."""
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"{out_dir}: saved ({json.dumps(summary['timings'])})")


def render_rows(rows, image_size, seed_offset=0) -> torch.Tensor:
    """Ground-truth renders [N, 3, H, W] in [0, 1]; row i drawn with seed seed_offset + i (so repeated prompts
    get different layouts)."""
    return to_tensor([render_t2i(row, image_size=image_size, seed=seed_offset + i) for i, row in enumerate(rows)])


def to_tensor(images) -> torch.Tensor:
    """PIL images -> [N, 3, H, W] float32 in [0, 1] (the inverse of `to_uint8`)."""
    return torch.from_numpy(np.stack([np.asarray(im.convert("RGB")) for im in images])).permute(0, 3, 1, 2) / 255.0


def _cosine(step, total, warmup):
    return min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * step / total))


# ---- components ----------------------------------------------------------------------------------------------------


def make_vae(cfg):
    torch.manual_seed(cfg.seed)
    z = cfg.vae_z_dim
    downs = len(cfg.vae_dim_mult) - 1  # spatial 2x each; none temporal (single images)
    return AutoencoderKLQwenImage(base_dim=cfg.vae_base_dim, z_dim=z, dim_mult=list(cfg.vae_dim_mult),
                                  num_res_blocks=1, temperal_downsample=[False] * downs, latents_mean=[0.0] * z,
                                  latents_std=[1.0] * z)


def make_transformer(cfg, joint_attention_dim):
    torch.manual_seed(cfg.seed + 1)
    hd = cfg.attention_head_dim
    frame, height = hd // 8 * 2, (hd - hd // 8 * 2) // 4 * 2
    rope = (frame, height, hd - frame - height)  # RoPE dims of the frame, height and width axes (even, sum hd)
    return QwenImageTransformer2DModel(patch_size=2, in_channels=4 * cfg.vae_z_dim, out_channels=cfg.vae_z_dim,
                                       num_layers=cfg.num_layers, attention_head_dim=hd,
                                       num_attention_heads=cfg.num_attention_heads,
                                       joint_attention_dim=joint_attention_dim, axes_dims_rope=rope)


def make_scheduler(cfg):
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift, use_dynamic_shifting=False)


def load_text_encoder(name):
    """tiny | tiny-sft (built and cached on first use) | a folder -> (frozen Qwen2.5-VL, processor, folder)."""
    path = TINY_MODELS[name]() if name in TINY_MODELS else name
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--text_encoder {name!r}: no such folder")
    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return vlm.requires_grad_(False), AutoProcessor.from_pretrained(path), path


def vae_loss(vae, images, cfg):
    """Ink-weighted squared error + a small KL, on images [B, 3, H, W] in [0, 1]."""
    x = (images * 2 - 1).unsqueeze(2)  # [-1, 1], and the video VAE's frame axis
    posterior = vae.encode(x).latent_dist
    z = posterior.sample()
    if cfg.vae_latent_noise > 0:
        level = cfg.vae_latent_noise * torch.rand(z.shape[0], 1, 1, 1, 1)
        z = z + level * z.detach().std((0, 2, 3, 4), keepdim=True) * torch.randn_like(z)
    recon = vae.decode(z).sample
    ink = torch.nn.functional.max_pool2d((images < 0.95).any(1, keepdim=True).float(), 3, 1, 1).unsqueeze(2)
    weight = 1 + (cfg.vae_ink_weight - 1) * ink
    err = ((recon - x) ** 2 * weight).mean()
    kl = posterior.kl().mean() / x[0].numel()
    return err + cfg.vae_kl_weight * kl, err


def train_vae(vae, images, cfg, log=_log):
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed)
    vae.train()
    history = []
    for step in range(cfg.vae_steps):
        idx = torch.randint(0, len(images), (cfg.vae_batch_size,), generator=g)
        for group in opt.param_groups:
            group["lr"] = cfg.vae_lr * _cosine(step, cfg.vae_steps, 20)
        loss, err = vae_loss(vae, images[idx], cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        history.append(err.item())
        if step % cfg.log_every == 0 or step == cfg.vae_steps - 1:
            log(f"vae step {step}/{cfg.vae_steps}  weighted mse {history[-1]:.4f}")
    vae.eval().requires_grad_(False)
    return history


@torch.no_grad()
def set_latent_stats(vae, images, batch=256):
    """Per-channel mean / std of the latent modes of `images`, stored where the pipeline reads them."""
    modes = torch.cat([vae.encode((images[i:i + batch] * 2 - 1).unsqueeze(2)).latent_dist.mode()
                       for i in range(0, len(images), batch)])
    mean, std = modes.mean((0, 2, 3, 4)), modes.std((0, 2, 3, 4))
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])


@torch.no_grad()
def encode_images(gen, images, batch=256):
    """Packed, normalised latents [N, tokens, 4 z] of images [N, 3, H, W] in [0, 1], through the adapter."""
    size = images.shape[-1]
    return torch.cat([gen.encode_image(images[i:i + batch], size, size) for i in range(0, len(images), batch)])


@torch.no_grad()
def encode_prompts(gen, prompts, size, batch=64, images=None):
    """The adapter's conditioning of each prompt (unpadded [L_i, D] tensors, in order); with `images` ([N, 3, H, W]
    in [0, 1], one per prompt) through its edit path, where the VLM reads each prompt beside its input image."""
    out = []
    for i in range(0, len(prompts), batch):
        cond = gen.encode_condition(prompts[i:i + batch], None if images is None else images[i:i + batch],
                                    height=size, width=size, negative_prompt=None)
        embeds, mask = cond.pos["embeds"], cond.pos["mask"]  # mask None: no padding in this batch
        out += list(embeds) if mask is None else [e[m.bool()] for e, m in zip(embeds, mask)]
    return out


def pad_embeds(embeds):
    """A batch of [L_i, D] encodings -> (embeds [B, L, D] zero-padded, mask [B, L]), as encode_prompt pads them."""
    length = max(e.shape[0] for e in embeds)
    out = torch.zeros(len(embeds), length, embeds[0].shape[1], dtype=embeds[0].dtype)
    mask = torch.zeros(len(embeds), length, dtype=torch.long)
    for i, e in enumerate(embeds):
        out[i, :e.shape[0]], mask[i, :e.shape[0]] = e, 1
    return out, mask


def flow_matching_loss(gen, x0, embeds, mask, size, generator, cfg, image_latents=None):
    """Rectified flow: x_t = (1 - sigma) x0 + sigma noise, target velocity noise - x0 (what the Euler step
    x + v (sigma_next - sigma) follows); the velocity comes from the adapter, timestep = sigma * 1000.
    image_latents: an edit's input-image latents, joined to the sequence beside x_t as the edit path joins them."""
    sigma = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(x0.shape[0], generator=generator))
    noise = torch.randn(x0.shape, generator=generator)
    s = sigma.view(-1, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    cond = gen.condition_from_embeds(embeds, mask, height=size, width=size, image_latents=image_latents)
    v = gen.velocity(x_t, sigma * gen.scheduler.config.num_train_timesteps, cond)
    return torch.nn.functional.mse_loss(v, noise - x0)


def train_flow(gen, latents, row_prompt, prompt_embeds, neg_embeds, cfg, log=_log):
    """AdamW on the transformer; row_prompt[i] indexes prompt_embeds for latents[i]."""
    def batch_loss(idx, g):
        drop = torch.rand(len(idx), generator=g) < cfg.cfg_dropout
        embeds, mask = pad_embeds([neg_embeds if d else prompt_embeds[row_prompt[i]] for i, d in zip(idx, drop)])
        return flow_matching_loss(gen, latents[idx], embeds, mask, cfg.image_size, g, cfg)

    return fit_transformer(gen, len(latents), batch_loss, cfg, log)


def fit_transformer(gen, n_rows, batch_loss, cfg, log=_log):
    """AdamW on the transformer's trainable weights: each step batch_loss(row indices, torch.Generator) of
    cfg.batch_size rows drawn from n_rows; warm-up then cosine to 0, grad clip 1, optional EMA (saved in place of
    the weights). Returns the loss history."""
    params = [p for p in gen.transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed + 2)
    gen.transformer.train()
    ema = [p.detach().clone() for p in params] if cfg.ema_decay > 0 else None
    history = []
    for step in range(cfg.steps):
        idx = torch.randint(0, n_rows, (cfg.batch_size,), generator=g)
        for group in opt.param_groups:
            group["lr"] = cfg.learning_rate * _cosine(step, cfg.steps, cfg.warmup_steps)
        loss = batch_loss(idx, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if ema is not None:
            decay = min(cfg.ema_decay, (1 + step) / (10 + step))  # a short average while the weights move fast
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        history.append(loss.item())
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            recent = history[-cfg.log_every:]
            log(f"flow step {step}/{cfg.steps}  loss {sum(recent) / len(recent):.4f}")
    if ema is not None:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in params], ema)
    gen.transformer.eval()
    return history


# ---- scoring -------------------------------------------------------------------------------------------------------


def to_uint8(images) -> np.ndarray:
    """[B, 3, H, W] in [0, 1] -> [B, H, W, 3] uint8 (what a reward server receives)."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def score_images(images, rows) -> dict:
    """Per-tag and overall means of score_t2i ("tiny" score, strict, detected and requested objects)."""
    per = [dict(score_t2i(img, row), tag=row["tag"]) for img, row in zip(to_uint8(images), rows)]
    table = {}
    for tag in [t for t in T2I_TAGS if any(p["tag"] == t for p in per)] + ["all"]:
        sel = [p for p in per if tag in ("all", p["tag"])]
        table[tag] = {k: round(float(np.mean([p[k] for p in sel])), 3)
                      for k in ("score", "strict", "detected", "requested")} | {"n": len(sel)}
    return {"table": table, "per_image": per}


def heldout_rows(n=120, seed=1):
    return make_t2i_prompts(n, seed=seed)


def condition_texts(rows, image_size, *, plan, seed_offset=0):
    """The text each row's image is conditioned on: its prompt, and with `plan` the scene plan of its render
    (row i: seed seed_offset + i), joined by a newline as train_mixgrpo joins prompt and reasoning."""
    if not plan:
        return [r["prompt"] for r in rows]
    return [f"{r['prompt']}\n{scene_plan(r, image_size=image_size, seed=seed_offset + i)}" for i, r in enumerate(rows)]


@torch.no_grad()
def vae_roundtrip(gen, images):
    size = images.shape[-1]
    return gen.decode(gen.encode_image(images, size, size), size, size)


@torch.no_grad()
def sample_images(gen, prompts, *, size, num_steps=20, guidance_scale=4.0, seeds=None, batch=40, shift=None,
                  images=None, image_scale=1.0, interval=None):
    """ODE samples (CFG against the negative prompt " " when guidance_scale > 1, within `interval` of sigma when
    given), image i drawn from its own torch.Generator seeded seeds[i] (default i), so an image does not depend on
    the batch it is drawn in. images ([N, 3, H, W] in [0, 1]): edits of them through the adapter's edit path, with
    image CFG (against the prompt without the image) when image_scale > 1."""
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    guidance = Guidance(scale=guidance_scale, interval=interval, image_scale=image_scale)
    extra = dict(image_guidance=True) if images is not None and image_scale > 1 else {}
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        cond = gen.encode_condition(chunk, None if images is None else images[i:i + batch], height=size, width=size,
                                    negative_prompt=" " if guidance_scale > 1 else None, **extra)
        gens = [torch.Generator().manual_seed(s) for s in seeds[i:i + batch]]
        out.append(sample(gen, cond, num_steps=num_steps, guidance=guidance, shift=shift, generator=gens).images)
    return torch.cat(out)


def evaluate_generator(path, *, n=120, seed=1, num_steps=20, guidance_scale=4.0, shift=None, gen=None):
    """Held-out score of ODE samples (rows of make_t2i_prompts(n, seed=seed)), per tag. Returns
    {"table", "per_image", "images", "rows"}."""
    gen = gen if gen is not None else QwenImageGenerator.from_pretrained(path)
    rows = heldout_rows(n, seed)
    with open(os.path.join(path, SUMMARY)) as f:
        config = json.load(f)["config"]
    size = config["image_size"]
    texts = condition_texts(rows, size, plan=config.get("plan", False), seed_offset=10**6)
    images = sample_images(gen, texts, size=size, num_steps=num_steps,
                           guidance_scale=guidance_scale, shift=shift)
    return dict(score_images(images, rows), images=images, rows=rows)


# ---- build ---------------------------------------------------------------------------------------------------------


def build_tiny_generator(cfg: TinyGeneratorConfig, log=_log) -> str:
    """Train the VAE, then the transformer, and save the QwenImagePipeline folder (plus `processor/` and
    SUMMARY). Returns cfg.output_dir."""
    stages = {}
    with pinned_threads(cfg.threads):
        vlm, processor, vlm_path = load_text_encoder(cfg.text_encoder)  # a bad --text_encoder fails before any training
        with _timed(stages, "render"):
            rows, held = make_t2i_prompts(cfg.train_rows, seed=cfg.seed), heldout_rows()
            images, held_images = render_rows(rows, cfg.image_size), render_rows(held, cfg.image_size, 10**6)
        with _timed(stages, "vae"):
            vae = make_vae(cfg)
            vae_history = train_vae(vae, images, cfg, log)
            set_latent_stats(vae, images[:1024])
        transformer = make_transformer(cfg, vlm.config.text_config.hidden_size)
        pipe = QwenImagePipeline(scheduler=make_scheduler(cfg), vae=vae, text_encoder=vlm,
                                 tokenizer=processor.tokenizer, transformer=transformer)
        gen = QwenImageGenerator(pipe)
        transformer.requires_grad_(True)
        with _timed(stages, "encode"):
            latents = encode_images(gen, images)
            texts = condition_texts(rows, cfg.image_size, plan=cfg.plan)
            prompts = sorted(set(texts))
            index = {p: i for i, p in enumerate(prompts)}
            prompt_embeds = encode_prompts(gen, prompts, cfg.image_size)
            neg_embeds = encode_prompts(gen, [cfg.negative_prompt], cfg.image_size)[0]
        with _timed(stages, "flow"):
            flow_history = train_flow(gen, latents, [index[t] for t in texts], prompt_embeds, neg_embeds, cfg, log)
        with _timed(stages, "score"):
            recon = score_images(vae_roundtrip(gen, held_images), held)["table"]["all"]
        log(f"VAE round trip of {len(held)} held-out renders: score {recon['score']}, strict {recon['strict']}")
        transformer.requires_grad_(False)
        os.makedirs(cfg.output_dir, exist_ok=True)
        pipe.save_pretrained(cfg.output_dir)
        processor.save_pretrained(os.path.join(cfg.output_dir, "processor"))
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        summary = {"config": cfg.spec(), "text_encoder_path": vlm_path, "timings": stages,
                   "params": {"transformer": count(transformer), "vae": count(vae)},
                   "text_tokens": [int(e.shape[0]) for e in (prompt_embeds[0], neg_embeds)],
                   "image_tokens": int(latents.shape[1]), "distinct_prompts": len(prompts),
                   "vae_roundtrip_heldout": recon, "vae_mse_last50": float(np.mean(vae_history[-50:])),
                   "flow_loss_first_last50": [float(np.mean(flow_history[:50])), float(np.mean(flow_history[-50:]))],
                   "flow_s_per_step": {k: round(v / cfg.steps, 3) for k, v in stages["flow"].items()}}
        save_summary(cfg.output_dir, SUMMARY, summary, log)
        return cfg.output_dir


if __name__ == "__main__":
    build_tiny_generator(parse_config(TinyGeneratorConfig, sys.argv[1:]))
