"""Adapters of the Qwen-Image family of diffusers pipelines to the `utils.t2i.generators` interface: Qwen-Image
(+ Edit), Qwen-Image Edit Plus and Qwen-Image 2.1, all conditioned on a Qwen2.5-VL's last hidden states. Each calls
its pipeline's own encode_prompt, prepare_latents, packing and timestep-shift code, and copies only the lines of
`__call__` that have no method (the transformer call, the VAE normalisation). `utils.t2i.adapters` holds the
other pipelines and the registry that loads any of them."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import numpy as np
import torch
from diffusers import QwenImage21Pipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions, retrieve_latents
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as plus_dimensions

from utils.core.models import adapters_disabled, has_adapters
from utils.t2i.generators import (
    DEFAULT_LORA_TARGETS,
    FlowCondition,
    FlowGenerator,
    absent_components,
    pipeline_schedule,
    to_pil,
)


def _image_sets(images, batch, image_processor):
    """Each prompt's input images as a list of PIL images: `images` holds one image (PIL) or a list of images per
    prompt, or is a [B, 3, H, W] tensor in [0, 1] (one each). A batch shares the count and the sizes, as the
    transformers' joint sequences share one layout."""
    if torch.is_tensor(images):
        images = to_pil(images, image_processor)
    sets = [to_pil(im, image_processor) if isinstance(im, (list, tuple)) else [im] for im in images]
    if len(sets) != batch or len({tuple(im.size for im in s) for s in sets}) != 1:
        raise ValueError(f"edit: {len(sets)} image sets for {batch} prompts; one set per prompt, all of one count "
                         "and sizes")
    return sets


def _pad_stack(encoded):
    """Per-prompt encodings (tuples of [1, L, ...] tensors or None) -> one batch, each tensor right-padded with zeros
    to the longest L, as the pipelines pad a batch of prompts. A None mask (no padding) counts as all ones; a mask
    that comes out all ones is None again, as the pipelines return it."""
    length = max(parts[0].shape[1] for parts in encoded)
    out = []
    for i, first in enumerate(encoded[0]):
        rows = []
        for parts in encoded:
            t = parts[i] if parts[i] is not None else torch.ones(parts[0].shape[:2], dtype=torch.long,
                                                                  device=parts[0].device)
            pad = [0, 0] * (t.ndim - 2) + [0, length - t.shape[1]]
            rows.append(torch.nn.functional.pad(t, pad))
        out.append(torch.cat(rows))
    mask = out[1]
    out[1] = None if bool(mask.all()) else mask
    return tuple(out)


def _latent_stats(vae, dtype, device):
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(device, dtype)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(device, dtype)
    return mean, std


# --------------------------------------------------------------------------------------------------
# Qwen-Image: conditioned on a Qwen2.5-VL's last hidden states; edit joins the input image's tokens
# --------------------------------------------------------------------------------------------------


def template_prefix_length(pipe) -> int:
    """How many tokens of a Qwen-Image pipeline's prompt template come before the prompt, counted with its own
    tokenizer: the hidden states the pipeline drops (the system prompt). diffusers keeps that count as a constant
    measured with Qwen2.5-VL's tokenizer (34 for text-to-image, 64 for edit), which this count reproduces there;
    with another tokenizer (the tiny world's BPE splits the system prompt into ~108 tokens) the constant would keep
    part of the system prompt in every encoding, or cut the start of the prompt."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    return len(pipe.tokenizer(prefix)["input_ids"])


class QwenImageGenerator(FlowGenerator):
    """QwenImagePipeline for text-to-image, QwenImageEditPipeline (same modules) when `images` are given.

    The text encoder may be the policy VLM (components={"text_encoder": vlm, "tokenizer": ..., "processor": ...}).
    conditioning="base": encode with its base weights and no grad (LoRA layers off; a policy VLM without LoRA is
    deep-copied and frozen once, copy_text_encoder=None deciding so), so RL on the text does not move the image
    model's input. conditioning="policy": the VLM as it is (LoRA on), with grad when enabled: a caller that keeps the
    graph would train the VLM through the image loss; train_mixgrpo.py detaches the rollout's condition, so there the
    image loss trains the generator only.
    edit_area: the pixel area the edit pipeline resizes the input image to (its constant 1024 * 1024).
    Both pipelines drop the template's system prompt as counted by their tokenizer (`template_prefix_length`).
    """

    pipeline_class = QwenImagePipeline
    edit_pipeline_class = QwenImageEditPipeline
    cfg_renorm = True

    def __init__(self, pipe, *, processor=None, conditioning="base", copy_text_encoder=None, edit_area=1024 * 1024,
                 shared_text_encoder=False):
        if conditioning not in ("base", "policy"):
            raise ValueError(f"conditioning must be 'base' or 'policy', got {conditioning!r}")
        text_encoder = pipe.text_encoder
        if hasattr(text_encoder, "get_base_model"):  # a PeftModel: the pipeline calls the model underneath
            text_encoder = text_encoder.get_base_model()
        if copy_text_encoder is None:  # a policy trained without LoRA would drag the conditioning along
            copy_text_encoder = conditioning == "base" and shared_text_encoder and not has_adapters(text_encoder)
        if copy_text_encoder:
            text_encoder = copy.deepcopy(text_encoder)
        if copy_text_encoder or not shared_text_encoder:
            text_encoder.requires_grad_(False).eval()
        processor = processor if processor is not None else getattr(pipe, "processor", None)
        parts = dict(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=text_encoder, tokenizer=pipe.tokenizer,
                     transformer=pipe.transformer)
        self.t2i = QwenImagePipeline(**parts)
        self.edit = self.edit_pipeline_class(**parts, processor=processor) if processor is not None else None
        for p in (self.t2i, self.edit):
            if p is not None:
                p.prompt_template_encode_start_idx = template_prefix_length(p)
        self.pipe, self.vae, self.scheduler, self.transformer = self.t2i, pipe.vae, pipe.scheduler, pipe.transformer
        self.denoiser = self.transformer
        self.vae.requires_grad_(False)
        self.text_encoder, self.conditioning, self.edit_area = text_encoder, conditioning, edit_area

    @classmethod
    def from_pretrained(cls, name_or_path, *, dtype=torch.float32, device=None, components=None, **options):
        """A QwenImagePipeline or QwenImageEditPipeline folder (or hub name)."""
        from diffusers import DiffusionPipeline

        components = dict(components or {})
        processor = components.pop("processor", None)
        options.setdefault("shared_text_encoder", components.get("text_encoder") is not None)
        pipe = DiffusionPipeline.from_pretrained(name_or_path, dtype=dtype,
                                                 **absent_components(name_or_path, components))
        if device is not None:
            pipe.to(device)
        return cls(pipe, processor=processor, **options)

    @contextmanager
    def _conditioning(self):
        # The pipeline tokenizes with right padding; a policy tokenizer may be set to left for generation.
        toks = [self.t2i.tokenizer] + ([self.edit.processor.tokenizer] if self.edit is not None else [])
        sides = [(t, t.padding_side) for t in {id(t): t for t in toks}.values()]
        for t, _ in sides:
            t.padding_side = "right"
        training = self.text_encoder.training
        try:
            if self.conditioning == "policy":
                yield
                return
            self.text_encoder.eval()  # base weights, no dropout
            with torch.no_grad(), adapters_disabled(self.text_encoder):
                yield
        finally:
            self.text_encoder.train(training)
            for t, side in sides:
                t.padding_side = side

    def _merge_branches(self, neg, pos):
        # Batched CFG: the shorter prompt is padded (masked) to the longer one's length.
        length = max(neg["embeds"].shape[1], pos["embeds"].shape[1])
        embeds, masks = [], []
        for b in (neg, pos):
            e = b["embeds"]
            m = b["mask"] if b["mask"] is not None else torch.ones(e.shape[:2], dtype=torch.long, device=e.device)
            embeds.append(torch.nn.functional.pad(e, (0, 0, 0, length - e.shape[1])))
            masks.append(torch.nn.functional.pad(m, (0, length - m.shape[1])))
        return {"embeds": torch.cat(embeds), "mask": torch.cat(masks)}

    def encode_condition(self, prompts, images=None, *, height, width, negative_prompt=" ", max_sequence_length=512,
                         image_guidance=False):
        """prompts: the text the image model reads (prompt, or prompt + reasoning). images: the previous images
        (PIL or [B, 3, H, W] in [0, 1]; Edit Plus: a list per prompt) for an edit; the VLM sees them as the edit
        pipeline shows them.
        image_guidance: an edit also gets the `no_image` branch of Guidance(image_scale=...): the prompts encoded as
        text-to-image prompts, drawn without the input image's tokens."""
        prompts, negs = self._prompts(prompts, negative_prompt)
        vsf, dev = self.pipe.vae_scale_factor, self.device
        shapes = [(1, height // vsf // 2, width // vsf // 2)]
        image_latents = None
        with self._conditioning():
            if images is None:
                def encode(texts):
                    return self.t2i.encode_prompt(texts, device=dev, max_sequence_length=max_sequence_length)
            else:
                if self.edit is None:
                    raise ValueError("Qwen-Image edit needs a processor (components={'processor': ...})")
                encode, image_latents, image_shapes = self._edit_inputs(images, len(prompts), max_sequence_length)
                shapes += image_shapes
            embeds, mask = encode(prompts)
            neg = None
            if negs is not None:
                neg_embeds, neg_mask = encode(negs)
                neg = {"embeds": neg_embeds, "mask": neg_mask}
            no_image = None
            if image_guidance and images is not None:
                free, free_mask = self.t2i.encode_prompt(prompts, device=dev, max_sequence_length=max_sequence_length)
                no_image = {"embeds": free, "mask": free_mask, "drop_image": True}
        return FlowCondition(pos={"embeds": embeds, "mask": mask}, neg=neg, height=height, width=width,
                             image_latents=image_latents, no_image=no_image, shared={"img_shapes": shapes})

    def _edit_inputs(self, images, batch, max_sequence_length):
        """(encode(texts) -> (embeds, mask), the input images' packed latents, their RoPE shapes) of an edit."""
        vsf = self.pipe.vae_scale_factor
        pil = [s[0] for s in _image_sets(images, batch, self.edit.image_processor)]
        # As QwenImageEditPipeline.__call__: the input image is resized to ~edit_area pixels for both the VLM and
        # the VAE, and its tokens carry their own RoPE shape.
        cw, ch, _ = calculate_dimensions(self.edit_area, pil[0].size[0] / pil[0].size[1])
        pil = [self.edit.image_processor.resize(im, ch, cw) for im in pil]

        def encode(texts):
            return self.edit.encode_prompt(texts, image=pil, device=self.device,
                                           max_sequence_length=max_sequence_length)
        return encode, self.encode_image(pil, ch, cw), [(1, ch // vsf // 2, cw // vsf // 2)]

    def condition_from_embeds(self, embeds, mask=None, neg_embeds=None, neg_mask=None, *, height, width,
                              image_latents=None):
        """A condition from hidden states computed elsewhere (as encode_prompt returns them): text-to-image, or with
        image_latents (an input image's packed latents at height x width, as `encode_image` returns them) an edit
        whose input-image tokens join the sequence as `encode_condition`'s edit path joins them."""
        vsf = self.pipe.vae_scale_factor
        neg = None if neg_embeds is None else {"embeds": neg_embeds, "mask": neg_mask}
        shapes = [(1, height // vsf // 2, width // vsf // 2)] * (1 if image_latents is None else 2)
        return FlowCondition(pos={"embeds": embeds, "mask": mask}, neg=neg, height=height, width=width,
                             image_latents=image_latents, shared={"img_shapes": shapes})

    def prepare_latents(self, batch_size, height, width, generator=None):
        channels = self.transformer.config.in_channels // 4
        return self.t2i.prepare_latents(batch_size, channels, height, width, torch.float32, self.device, generator)

    def schedule(self, num_steps, latents, shift=None):
        cfg = self.scheduler.config
        mu = calculate_shift(latents.shape[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        return pipeline_schedule(self._scheduler(shift), num_steps, self.device, sigmas, mu)

    def forward(self, x, timestep, cond, branch, guidance):
        batch, n = x.shape[:2]
        with_image = cond.image_latents is not None and not branch.get("drop_image", False)
        hidden = torch.cat([x, cond.image_latents.to(x.dtype)], dim=1) if with_image else x
        shapes = cond.shared["img_shapes"] if with_image else cond.shared["img_shapes"][:1]
        embedded = None
        if self.transformer.config.guidance_embeds:  # guidance-distilled checkpoints take the scale as input
            if guidance.embedded is None:
                raise ValueError("this Qwen-Image transformer is guidance-distilled: set Guidance(embedded=...)")
            embedded = torch.full([batch], guidance.embedded, device=x.device, dtype=torch.float32)
        out = self.denoiser(hidden_states=hidden, timestep=timestep.to(x.dtype) / 1000, guidance=embedded,
                            encoder_hidden_states_mask=branch["mask"], encoder_hidden_states=branch["embeds"],
                            img_shapes=[shapes] * batch, attention_kwargs={},
                            return_dict=False)[0]
        return out[:, :n]

    def decode(self, latents, height, width, output_type="pt"):
        lat = self.t2i._unpack_latents(latents, height, width, self.t2i.vae_scale_factor).to(self.vae.dtype)
        mean, std = _latent_stats(self.vae, lat.dtype, lat.device)
        image = self.vae.decode(lat / (1.0 / std) + mean, return_dict=False)[0][:, :, 0]  # the pipeline's rounding
        return self.t2i.image_processor.postprocess(image, output_type=output_type)

    def encode_image(self, images, height, width):
        """Clean packed latents of images (PIL list or [B, 3, H, W] in [0, 1]) at height x width."""
        image = self.t2i.image_processor.preprocess(to_pil(images, self.t2i.image_processor), height, width)
        image = image.unsqueeze(2).to(self.device, self.vae.dtype)  # the video VAE's frame axis
        lat = retrieve_latents(self.vae.encode(image), sample_mode="argmax")
        mean, std = _latent_stats(self.vae, lat.dtype, lat.device)
        lat = (lat - mean) / std
        return self.t2i._pack_latents(lat, lat.shape[0], lat.shape[1], lat.shape[3], lat.shape[4]).float()


class QwenImageEditPlusGenerator(QwenImageGenerator):
    """QwenImageEditPlusPipeline (Qwen-Image-Edit 2509 / 2511) for edits, QwenImagePipeline (same modules) for
    text-to-image. An edit takes one image or a list of images per prompt; as its __call__ (which draws one prompt at
    a time) the VLM sees each image at ~condition_area pixels, named "Picture i", before the prompt, the VAE at
    ~edit_area pixels (its constant 1024 * 1024), and every image's tokens join the sequence after the target's.
    A batch is encoded prompt by prompt (each with its own images) and right-padded, as a batch of prompts is."""

    edit_pipeline_class = QwenImageEditPlusPipeline

    def __init__(self, pipe, *, condition_area=CONDITION_IMAGE_SIZE, **options):
        super().__init__(pipe, **options)
        self.condition_area = condition_area

    def _edit_inputs(self, images, batch, max_sequence_length):
        vsf, proc = self.pipe.vae_scale_factor, self.edit.image_processor
        sets = _image_sets(images, batch, proc)
        latents, shapes, shown = [], [], [[] for _ in sets]
        for j, first in enumerate(sets[0]):
            ratio = first.size[0] / first.size[1]
            cw, ch = plus_dimensions(self.condition_area, ratio)
            vw, vh = plus_dimensions(self.edit_area, ratio)
            latents.append(self.encode_image([s[j] for s in sets], vh, vw))
            shapes.append((1, vh // vsf // 2, vw // vsf // 2))
            for seen, s in zip(shown, sets):
                seen.append(proc.resize(s[j], ch, cw))

        def encode(texts):
            return _pad_stack([self.edit.encode_prompt([t], image=seen, device=self.device,
                                                       max_sequence_length=max_sequence_length)
                               for t, seen in zip(texts, shown)])
        return encode, torch.cat(latents, dim=1), shapes


class QwenImage21Generator(FlowGenerator):
    """QwenImage21Pipeline (Qwen-Image 2.1): its frozen Qwen3-VL reads the prompt and, for a refine, the input
    images (one or a list per prompt, each resized to ~edit_area pixels, the pipeline's output_resolution ** 2);
    the transformer fills the VLM's image slots with the images' latents and appends the target's (block-causal,
    single stream). No CFG unless a negative prompt is given (its pipeline's true_cfg_scale is 1), plain true CFG
    then. The branches run one forward each (`cfg_batchable` off): padding one branch to the other's length would
    move the target's RoPE positions. A batch with images is encoded prompt by prompt and right-padded; with a
    configured `sample_sigmas` grid of num_steps sigmas the schedule uses it, as the pipeline does."""

    pipeline_class = QwenImage21Pipeline
    cfg_batchable = False
    lora_targets = DEFAULT_LORA_TARGETS[:4]  # one single-stream attention: to_q, to_k, to_v, to_out.0

    def __init__(self, pipe, *, edit_area=1024 * 1024):
        super().__init__(pipe)
        self.edit_area = edit_area

    def _merge_branches(self, neg, pos):
        raise ValueError("Qwen-Image 2.1 runs each CFG branch alone (padding moves its RoPE): keep cfg_batched off")

    def encode_condition(self, prompts, images=None, *, height, width, negative_prompt=None, image_guidance=False):
        """image_guidance: an edit also gets the `no_image` branch (the prompts without the input images)."""
        prompts, negs = self._prompts(prompts, negative_prompt)
        vsf, dev = self.pipe.vae_scale_factor, self.device
        target = (1, height // vsf, width // vsf)
        shapes, image_latents, shown = [], None, None
        with torch.no_grad():
            if images is not None:
                sets = _image_sets(images, len(prompts), self.pipe.image_processor)
                latents, shown = [], [[] for _ in sets]
                for j, first in enumerate(sets[0]):
                    w, h, _ = calculate_dimensions(self.edit_area, first.size[0] / first.size[1])
                    column = [im if im.mode == "RGBA" else im.convert("RGBA") for im in (s[j] for s in sets)]
                    latents.append(self.encode_image(column, h, w))
                    shapes.append((1, h // vsf, w // vsf))
                    for seen, im in zip(shown, column):
                        seen.append(self.pipe.image_processor.resize(im, width=w, height=h))
                image_latents = torch.cat(latents, dim=1)
            n_slots = target[1] * target[2] // 4  # one VLM slot per 2x2 target tokens

            def encode(texts, seen=None):
                if seen is None:
                    embeds, mask, img_mask = self.pipe.encode_prompt(texts, device=dev)
                else:
                    embeds, mask, img_mask = _pad_stack([self.pipe.encode_prompt([t], image=s, device=dev)
                                                         for t, s in zip(texts, seen)])
                img_mask = torch.cat([img_mask, img_mask.new_ones(img_mask.shape[0], n_slots)], dim=1)
                return {"embeds": embeds, "mask": mask, "img_mask": img_mask}

            pos = encode(prompts, shown)
            neg = None if negs is None else encode(negs, shown)
            no_image = None
            if image_guidance and images is not None:
                no_image = {**encode(prompts), "drop_image": True}
        return FlowCondition(pos=pos, neg=neg, height=height, width=width, image_latents=image_latents,
                             no_image=no_image, shared={"img_shapes": shapes + [target]})

    def prepare_latents(self, batch_size, height, width, generator=None):
        channels = self.transformer.config.in_channels
        return self.pipe.prepare_latents(None, batch_size, channels, height, width, torch.float32, self.device,
                                         generator)[0]

    def schedule(self, num_steps, latents, shift=None):
        cfg = self.scheduler.config
        mu = calculate_shift(latents.shape[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sigmas = self.pipe.config.sample_sigmas
        if sigmas is None or len(sigmas) != num_steps or shift is not None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        return pipeline_schedule(self._scheduler(shift), num_steps, self.device, sigmas, mu)

    def forward(self, x, timestep, cond, branch, guidance):
        n = x.shape[1]
        with_image = cond.image_latents is not None and not branch.get("drop_image", False)
        hidden = torch.cat([cond.image_latents.to(x.dtype), x], dim=1) if with_image else x  # inputs, then target
        shapes = cond.shared["img_shapes"] if with_image else cond.shared["img_shapes"][-1:]
        out = self.denoiser(hidden_states=hidden, timestep=timestep.to(x.dtype) / 1000,
                            encoder_hidden_states=branch["embeds"], encoder_hidden_states_mask=branch["mask"],
                            img_shapes=[shapes] * x.shape[0], img_mask=branch["img_mask"], attention_kwargs={},
                            return_dict=False)[0]
        return out[:, -n:]

    def decode(self, latents, height, width, output_type="pt"):
        lat = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor).to(self.vae.dtype)
        mean, std = _latent_stats(self.vae, lat.dtype, lat.device)
        image = self.vae.decode(lat * std + mean, return_dict=False)[0][:, :, 0]
        return self.pipe.image_processor.postprocess(image, output_type=output_type)

    def encode_image(self, images, height, width):
        """Clean packed latents of images (PIL list or [B, 3, H, W] in [0, 1]; the VAE reads RGBA) at height x width."""
        pil = [im if im.mode == "RGBA" else im.convert("RGBA") for im in to_pil(images, self.pipe.image_processor)]
        image = self.pipe.image_processor.preprocess(pil, height, width).unsqueeze(2).to(self.device, self.vae.dtype)
        lat = self.pipe._encode_vae_image(image, None)
        return self.pipe._pack_latents(lat, *lat.shape[:2], *lat.shape[3:]).float()
