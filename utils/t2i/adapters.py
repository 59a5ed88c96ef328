"""Adapters of diffusers flow pipelines to the `utils.t2i.generators` interface, and the registry that loads one
by its pipeline class: the Qwen-Image family (in `utils.t2i.qwen_image`), SD3, FLUX.1 and FLUX.2 Klein (here).
Each one calls its pipeline's own encode_prompt, prepare_latents, packing and timestep-shift code, and copies only
the lines of `__call__` that have no method (the transformer call, the VAE normalisation)."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, FluxPipeline, StableDiffusion3Pipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from utils.t2i.generators import DEFAULT_LORA_TARGETS, FlowCondition, FlowGenerator, pipeline_schedule, to_pil
from utils.t2i.qwen_image import (
    QwenImage21Generator,
    QwenImageEditPlusGenerator,
    QwenImageGenerator,
    template_prefix_length,
)


def _linear_sigmas(scheduler, num_steps):
    # The FLUX-family pipelines pass linspace(1, 1/N, N) unless the scheduler brings its own flow sigmas.
    if getattr(scheduler.config, "use_flow_sigmas", False):
        return None
    return np.linspace(1.0, 1 / num_steps, num_steps)



# --------------------------------------------------------------------------------------------------
# Pipelines with their own frozen text encoders
# --------------------------------------------------------------------------------------------------


class _VaeScaled:
    """SD3 / FLUX.1 VAE convention: latents = (z - shift_factor) * scaling_factor."""

    def _to_vae(self, lat):
        cfg = self.vae.config
        return lat / cfg.scaling_factor + (cfg.shift_factor or 0.0)

    def _from_vae(self, z):
        cfg = self.vae.config
        return (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor

    def _vae_encode(self, images, height, width):
        image = self.pipe.image_processor.preprocess(to_pil(images, self.pipe.image_processor), height, width)
        # The mode, not a draw: an image has one latent, so a refine's start does not depend on the VAE noise.
        z = self.vae.encode(image.to(self.device, self.vae.dtype)).latent_dist.mode()
        return self._from_vae(z).float()


class _PackedLatents:
    """FLUX.1 / FLUX.2 Klein latents: 2x2 patches packed into tokens, so the transformer's input channels are four
    times the latent's; the pipeline's own `prepare_latents` draws the noise."""

    def prepare_latents(self, batch_size, height, width, generator=None):
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(batch_size, channels, height, width, torch.float32, self.device,
                                         generator)[0]

    def _latent_size(self, height, width):
        """(h, w) of the unpacked latent for an image of height x width: even, so that 2x2 patches tile it."""
        vsf = self.pipe.vae_scale_factor
        return 2 * (int(height) // (vsf * 2)), 2 * (int(width) // (vsf * 2))


class SD3Generator(_VaeScaled, FlowGenerator):
    """StableDiffusion3Pipeline (SD3 / SD3.5): CLIP-L + CLIP-G + T5 prompt encoding, standard CFG in one batch.
    Refine = SDEdit from the previous image. `condition_from_embeds` takes embeddings from elsewhere."""

    pipeline_class = StableDiffusion3Pipeline
    cfg_batched = True
    channel_dim = 1  # unpacked [B, C, h, w] latents
    lora_targets = DEFAULT_LORA_TARGETS[:7]

    def encode_condition(self, prompts, images=None, *, height, width, negative_prompt="", max_sequence_length=256):
        prompts, negs = self._prompts(prompts, negative_prompt)
        with torch.no_grad():
            embeds, neg_embeds, pooled, neg_pooled = self.pipe.encode_prompt(
                prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
                do_classifier_free_guidance=negs is not None, negative_prompt=negs,
                max_sequence_length=max_sequence_length)
            init = None if images is None else self.encode_image(images, height, width)
        return self.condition_from_embeds(embeds, pooled, neg_embeds, neg_pooled, height=height, width=width,
                                          init_latents=init)

    def condition_from_embeds(self, embeds, pooled, neg_embeds=None, neg_pooled=None, *, height, width,
                              init_latents=None):
        neg = None if neg_embeds is None else {"embeds": neg_embeds, "pooled": neg_pooled}
        return FlowCondition(pos={"embeds": embeds, "pooled": pooled}, neg=neg, height=height, width=width,
                             init_latents=init_latents)

    def prepare_latents(self, batch_size, height, width, generator=None):
        channels = self.transformer.config.in_channels
        return self.pipe.prepare_latents(batch_size, channels, height, width, torch.float32, self.device, generator)

    def schedule(self, num_steps, latents, shift=None):
        sched, mu = self._scheduler(shift), None
        if sched.config.get("use_dynamic_shifting", None):
            p = self.transformer.config.patch_size
            cfg = sched.config
            mu = calculate_shift((latents.shape[2] // p) * (latents.shape[3] // p), cfg.get("base_image_seq_len", 256),
                                 cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                 cfg.get("max_shift", 1.16))
        # the pipeline spaces its own timesteps; a fixed shift (R3) shifts linear steps, as the other adapters do
        sigmas = None if shift is None else np.linspace(1.0, 1 / num_steps, num_steps)
        return pipeline_schedule(sched, num_steps, self.device, sigmas, mu)

    def forward(self, x, timestep, cond, branch, guidance):
        return self.denoiser(hidden_states=x, timestep=timestep, encoder_hidden_states=branch["embeds"],
                             pooled_projections=branch["pooled"], return_dict=False)[0]

    def decode(self, latents, height, width, output_type="pt"):
        image = self.vae.decode(self._to_vae(latents.to(self.vae.dtype)), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type=output_type)

    def encode_image(self, images, height, width):
        return self._vae_encode(images, height, width)


class FluxGenerator(_PackedLatents, _VaeScaled, FlowGenerator):
    """FluxPipeline (FLUX.1): CLIP pooled + T5 sequence; guidance-distilled (Guidance.embedded, default 3.5) with
    optional true CFG when a negative prompt is given. Refine = SDEdit from the previous image."""

    pipeline_class = FluxPipeline

    def encode_condition(self, prompts, images=None, *, height, width, negative_prompt=None, max_sequence_length=512):
        prompts, negs = self._prompts(prompts, negative_prompt)
        with torch.no_grad():
            embeds, pooled, txt_ids = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                              max_sequence_length=max_sequence_length)
            neg = None
            if negs is not None:
                neg_embeds, neg_pooled, _ = self.pipe.encode_prompt(prompt=negs, prompt_2=None, device=self.device,
                                                                    max_sequence_length=max_sequence_length)
                neg = {"embeds": neg_embeds, "pooled": neg_pooled}
            init = None if images is None else self.encode_image(images, height, width)
        h, w = self._latent_size(height, width)
        img_ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, torch.float32)
        return FlowCondition(pos={"embeds": embeds, "pooled": pooled}, neg=neg, height=height, width=width,
                             init_latents=init, shared={"txt_ids": txt_ids, "img_ids": img_ids})

    def schedule(self, num_steps, latents, shift=None):
        sched = self._scheduler(shift)
        cfg = sched.config
        mu = calculate_shift(latents.shape[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        return pipeline_schedule(sched, num_steps, self.device, _linear_sigmas(sched, num_steps), mu)

    def forward(self, x, timestep, cond, branch, guidance):
        embedded = None
        if self.transformer.config.guidance_embeds:
            value = 3.5 if guidance.embedded is None else guidance.embedded  # FluxPipeline's default guidance_scale
            embedded = torch.full([x.shape[0]], value, device=x.device, dtype=torch.float32)
        return self.denoiser(hidden_states=x, timestep=timestep.to(x.dtype) / 1000, guidance=embedded,
                             pooled_projections=branch["pooled"], encoder_hidden_states=branch["embeds"],
                             txt_ids=cond.shared["txt_ids"], img_ids=cond.shared["img_ids"], return_dict=False)[0]

    def decode(self, latents, height, width, output_type="pt"):
        lat = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        image = self.vae.decode(self._to_vae(lat.to(self.vae.dtype)), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type=output_type)

    def encode_image(self, images, height, width):
        z = self._vae_encode(images, height, width)
        return self.pipe._pack_latents(z, *z.shape)


class Flux2KleinGenerator(_PackedLatents, FlowGenerator):
    """Flux2KleinPipeline (FLUX.2 Klein): Qwen3 hidden states of chosen layers, CFG with the empty prompt (base
    models; distilled ones run without), refine = the pipeline's reference-image path (tokens joined, time id 10)."""

    pipeline_class = Flux2KleinPipeline
    # A regex (peft matches it whole): "to_out" is a Linear in the single-stream blocks but a ModuleList (Linear,
    # Dropout) in the double-stream ones, which peft cannot wrap, so a plain name list cannot take both.
    lora_targets = (r".*\.(" + "|".join(t.replace(".", r"\.") for t in DEFAULT_LORA_TARGETS + ("to_qkv_mlp_proj",))
                    + r")$|.*single_transformer_blocks\.\d+\.attn\.to_out$")

    def __init__(self, pipe, *, text_encoder_out_layers=(9, 18, 27)):
        super().__init__(pipe)
        self.text_encoder_out_layers = tuple(text_encoder_out_layers)

    @property
    def cfg_allowed(self):
        return not self.pipe.config.is_distilled

    def encode_condition(self, prompts, images=None, *, height, width, negative_prompt="", max_sequence_length=512):
        prompts, negs = self._prompts(prompts, negative_prompt)
        kw = dict(device=self.device, max_sequence_length=max_sequence_length,
                  text_encoder_out_layers=self.text_encoder_out_layers)
        with torch.no_grad():
            embeds, txt_ids = self.pipe.encode_prompt(prompt=prompts, **kw)
            neg = None
            if negs is not None:
                neg_embeds, neg_ids = self.pipe.encode_prompt(prompt=negs, **kw)
                neg = {"embeds": neg_embeds, "txt_ids": neg_ids}
            image_latents = image_ids = None
            if images is not None:
                image_latents, image_ids = self._reference_latents(images)
        h, w = self._latent_size(height, width)
        latent_ids = self.pipe._prepare_latent_ids(torch.empty(1, 1, h // 2, w // 2)).to(self.device)
        extra = {} if image_ids is None else {"image_ids": image_ids}
        return FlowCondition(pos={"embeds": embeds, "txt_ids": txt_ids}, neg=neg, height=height, width=width,
                             image_latents=image_latents, extra=extra, shared={"latent_ids": latent_ids})

    def _reference_latents(self, images):
        # Per sample, as Flux2KleinPipeline.__call__ prepares one reference image (its batch shares one list).
        latents, ids = [], []
        multiple_of = self.pipe.vae_scale_factor * 2
        for img in to_pil(images, self.pipe.image_processor):
            if img.size[0] * img.size[1] > 1024 * 1024:
                img = self.pipe.image_processor._resize_to_target_area(img, 1024 * 1024)
            w, h = img.size[0] // multiple_of * multiple_of, img.size[1] // multiple_of * multiple_of
            img = self.pipe.image_processor.preprocess(img, height=h, width=w, resize_mode="crop")
            lat, lat_ids = self.pipe.prepare_image_latents([img], 1, None, self.device, self.vae.dtype)
            latents.append(lat)
            ids.append(lat_ids)
        if len({t.shape for t in latents}) != 1:
            raise ValueError("Klein refine: all reference images of a batch must have one size")
        return torch.cat(latents).float(), torch.cat(ids)

    def schedule(self, num_steps, latents, shift=None):
        sched = self._scheduler(shift)
        mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=num_steps)
        return pipeline_schedule(sched, num_steps, self.device, _linear_sigmas(sched, num_steps), mu)

    def forward(self, x, timestep, cond, branch, guidance):
        batch, n = x.shape[:2]
        ids = cond.shared["latent_ids"].expand(batch, -1, -1)
        if cond.image_latents is not None:
            x = torch.cat([x, cond.image_latents.to(x.dtype)], dim=1)
            ids = torch.cat([ids, cond.extra["image_ids"]], dim=1)
        out = self.denoiser(hidden_states=x, timestep=timestep.to(x.dtype) / 1000, guidance=None,
                            encoder_hidden_states=branch["embeds"], txt_ids=branch["txt_ids"], img_ids=ids,
                            return_dict=False)[0]
        return out[:, :n]

    def _bn(self, dtype, device):
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(device, dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(device, dtype)
        return mean, std

    def decode(self, latents, height, width, output_type="pt"):
        h, w = self._latent_size(height, width)
        ids = self.pipe._prepare_latent_ids(torch.empty(latents.shape[0], 1, h // 2, w // 2)).to(latents.device)
        lat = self.pipe._unpack_latents_with_ids(latents, ids, h // 2, w // 2)
        mean, std = self._bn(lat.dtype, lat.device)
        lat = self.pipe._unpatchify_latents(lat * std + mean)
        image = self.vae.decode(lat.to(self.vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type=output_type)

    def encode_image(self, images, height, width):
        image = self.pipe.image_processor.preprocess(to_pil(images, self.pipe.image_processor), height, width)
        lat = self.pipe._encode_vae_image(image.to(self.device, self.vae.dtype), None)
        return self.pipe._pack_latents(lat).float()


ADAPTERS = {
    "QwenImagePipeline": QwenImageGenerator,
    "QwenImageEditPipeline": QwenImageGenerator,
    "QwenImageEditPlusPipeline": QwenImageEditPlusGenerator,
    "QwenImage21Pipeline": QwenImage21Generator,
    "StableDiffusion3Pipeline": SD3Generator,
    "FluxPipeline": FluxGenerator,
    "Flux2KleinPipeline": Flux2KleinGenerator,
}


def load_flow_generator(name_or_path, *, dtype=torch.float32, device=None, components=None, **options):
    """Pick the adapter from the folder's (or hub repo's) model_index.json and load it."""
    from diffusers import DiffusionPipeline

    name = DiffusionPipeline.load_config(name_or_path)["_class_name"]
    if name not in ADAPTERS:
        raise ValueError(f"load_flow_generator: no adapter for {name}; known: {sorted(ADAPTERS)}")
    return ADAPTERS[name].from_pretrained(name_or_path, dtype=dtype, device=device, components=components, **options)


__all__ = ["ADAPTERS", "Flux2KleinGenerator", "FluxGenerator", "QwenImage21Generator", "QwenImageEditPlusGenerator",
           "QwenImageGenerator", "SD3Generator", "load_flow_generator", "template_prefix_length"]
