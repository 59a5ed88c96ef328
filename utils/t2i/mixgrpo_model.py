"""Mix-GRPO's policy: the VLM (text) and the flow generators (images) it trains as one module (`MixGRPOModel`),
how they load and are checked against the flags (`check_generators`, `build_policy`, `build_edit_generator`), and
how a generator is conditioned on the VLM's text and guided (`image_condition`, `reason_guidance`, `edit_guidance`).
train_mixgrpo.py's rollouts and loss, and its held-out evaluation (utils.t2i.mixgrpo_eval), use these."""

from __future__ import annotations

import json
import os

import torch

from utils.core.config import ConfigError
from utils.core.errors import InputError
from utils.core.logprobs import CompletionLogProbs, hf_core
from utils.core.models import (
    adapters_disabled,
    disable_dropout,
    load_model_and_processor,
    model_flags,
    prepare_for_training,
)
from utils.core.rollout import check_no_logits_shaping
from utils.t2i.adapters import load_flow_generator
from utils.t2i.generators import step_logprob
from utils.t2i.guidance import BAGEL_RENORMS, guidance_from_flags


def image_condition(cfg, gen, rows, texts, images=None):
    """What the generator draws from: each row's prompt + the VLM's text (its reasoning, or its edit instruction
    with the image to refine; then also the branch without the image that --cfg_img_scale_edit guides against);
    `texts` None: the prompt alone (--text_free)."""
    extra = dict(image_guidance=True) if images is not None and cfg.cfg_img_scale_edit > 1 else {}  # Qwen-Image
    prompts = [r["prompt"] if texts is None else f"{r['prompt']}\n{text}"
               for r, text in zip(rows, texts or [None] * len(rows))]
    return gen.encode_condition(prompts, images=images,
                                height=cfg.image_size, width=cfg.image_size, negative_prompt=cfg.negative_prompt,
                                **extra)


def reason_guidance(cfg):
    """The reason stage's guidance: text CFG within --cfg_interval, rescaled by --cfg_renorm_type_gen."""
    return guidance_from_flags(cfg.cfg_scale_gen, cfg.cfg_interval, cfg.cfg_renorm_type_gen, cfg.cfg_renorm_min)


def edit_guidance(cfg):
    """The refine stage's guidance: text CFG and image CFG within --cfg_interval, rescaled by --cfg_renorm_type_edit."""
    return guidance_from_flags(cfg.cfg_scale_edit, cfg.cfg_interval, cfg.cfg_renorm_type_edit, cfg.cfg_renorm_min,
                               image_scale=cfg.cfg_img_scale_edit)


def check_renorm_flags(cfg):
    """--cfg_renorm_type_gen / _edit and --cfg_renorm_min where they cannot apply: a rescale without CFG to rescale,
    an edit rescale without a refine stage, a floor without one of BAGEL's clamped rescales."""
    for stage, kind, scale in (("gen", cfg.cfg_renorm_type_gen, cfg.cfg_scale_gen),
                               ("edit", cfg.cfg_renorm_type_edit, cfg.cfg_scale_edit)):
        if kind not in ("pipeline", "none") and scale <= 1:
            raise ConfigError(f"--cfg_renorm_type_{stage} {kind}: --cfg_scale_{stage} {scale} turns the text CFG off, "
                              "so there is no guided velocity to rescale")
    if cfg.cfg_renorm_type_edit != "pipeline" and not cfg.reflect_refine:
        raise ConfigError(f"--cfg_renorm_type_edit {cfg.cfg_renorm_type_edit}: --reflect_refine is off (nothing "
                          "refines)")
    if not 0 <= cfg.cfg_renorm_min <= 1:
        raise ConfigError(f"--cfg_renorm_min {cfg.cfg_renorm_min} must lie in [0, 1] (the ratio is clamped to "
                          "[min, 1])")
    clamped = {cfg.cfg_renorm_type_gen, cfg.cfg_renorm_type_edit} & set(BAGEL_RENORMS)
    if cfg.cfg_renorm_min and not clamped:
        raise ConfigError(f"--cfg_renorm_min {cfg.cfg_renorm_min} clamps BAGEL's rescales (global, channel, "
                          "text_channel): neither --cfg_renorm_type_gen nor --cfg_renorm_type_edit is one")


def image_logprobs(gen, cond, steps, *, reference=False):
    """The SDE steps' (log-prob, mean, std) recomputed with the rollout's guidance (CFG kept); reference: LoRA off.
    `cond` has one row per step (`step_condition`)."""
    if reference:
        with torch.no_grad(), gen.reference():
            return step_logprob(gen, cond, steps)
    return step_logprob(gen, cond, steps)


def build_policy(cfg, vlm_path, gen_path, device):
    """(VLM, processor, CompletionLogProbs(VLM), generator made trainable, its trainable parameters)."""
    model, processor = load_model_and_processor(vlm_path, **model_flags(cfg))
    check_no_logits_shaping(model)  # before any compute: a sampler the log-probs cannot score
    model = prepare_for_training(model, cfg)  # with --freeze_vision_tower, its LoRA too
    if cfg.disable_dropout:  # rollout log-probs come from eval(), the loss's from train(): dropout breaks ratio 1
        disable_dropout(model)
    if cfg.conditioning == "generator":  # the pipeline's own text encoder and tokenizer read the policy's text
        hidden, components = None, own_processor(gen_path)
    else:
        hidden = hf_core(model).config.get_text_config().hidden_size
        components = {"text_encoder": hf_core(model), "tokenizer": processor.tokenizer, "processor": processor}
    gen, gen_params = load_generator(cfg, gen_path, "generator_name_or_path", device, hidden=hidden,
                                     components=components, **cfg.generator_kwargs)
    return model, processor, CompletionLogProbs(model).to(device), gen, gen_params


def own_processor(path):
    """{"processor": the processor saved beside a generator folder's own text encoder} (what its edit path shows
    the image with), or {} where there is none (a hub folder: an edit pipeline then loads its own)."""
    folder = os.path.join(path, "processor")
    if not os.path.isdir(folder):
        return {}
    from transformers import AutoProcessor

    return {"processor": AutoProcessor.from_pretrained(folder)}


# What each generator pipeline can do in the loop: read the VLM's hidden states (Qwen-Image: a Qwen2.5-VL's), refine
# an image from an instruction (an edit path: Qwen-Image-Edit and Edit Plus, Qwen-Image 2.1's input images, FLUX.2
# Klein's reference images; SD3 and FLUX.1 have none), and guide against the image (--cfg_img_scale_edit: the
# image-free branch of Qwen-Image-Edit, Edit Plus and Qwen-Image 2.1).
QWEN_PIPELINES = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
IMAGE_CFG_PIPELINES = QWEN_PIPELINES + ("QwenImage21Pipeline",)
EDIT_PIPELINES = IMAGE_CFG_PIPELINES + ("Flux2KleinPipeline",)


def pipeline_class(path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.load_config(path)["_class_name"]


def check_generators(cfg, gen_path):
    """The generators' pipelines against the flags, from their model_index.json, before anything loads."""
    for flag, path in (("generator_name_or_path", gen_path),
                       ("edit_generator_name_or_path", cfg.edit_generator_name_or_path)):
        if path is None:
            continue
        name = pipeline_class(path)
        refines = cfg.reflect_refine and (flag.startswith("edit_") or not cfg.edit_generator_name_or_path)
        if flag.startswith("edit_") and (name not in QWEN_PIPELINES or pipeline_class(gen_path) not in QWEN_PIPELINES):
            raise ConfigError(f"--{flag} {path}: a {name}; the refine stage's own generator must be a Qwen-Image-Edit "
                              "(or Edit Plus) pipeline beside a Qwen-Image --generator_name_or_path (it reads that "
                              "one's text encoder)")
        if name not in QWEN_PIPELINES and cfg.conditioning != "generator":
            raise ConfigError(f"--{flag} {path}: a {name} reads its own text encoders, not the VLM's states: use "
                              f"--conditioning generator, not {cfg.conditioning}")
        if refines and name not in EDIT_PIPELINES:
            raise ConfigError(f"--reflect_refine: --{flag} {path} is a {name}, which has no edit path to refine an "
                              "image from an instruction; use --reflect_refine false (or Qwen-Image, Qwen-Image 2.1, "
                              "FLUX.2 Klein)")
        if refines and name not in IMAGE_CFG_PIPELINES and cfg.cfg_img_scale_edit > 1:
            raise ConfigError(f"--cfg_img_scale_edit {cfg.cfg_img_scale_edit}: --{flag} {path} (a {name}) has no "
                              "image-free branch to guide against; use --cfg_img_scale_edit 1")


def check_policy(cfg, vlm_path, gen_path):
    """The policy's family against the flags, from the config files, before anything loads. Any VLM family can be
    the policy: it reasons on a text prompt and reflects on an image its own processor shows it. A text-only LLM
    cannot reflect on an image. With --conditioning base / policy a Qwen-Image generator reads the policy's hidden
    states in place of its own text encoder's (with that encoder's prompt template and image tokens), so the policy
    must be of that encoder's family (Qwen-Image: Qwen2.5-VL)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vlm_path)
    model_type = config.model_type
    if getattr(config, "vision_config", None) is None:
        raise ConfigError(f"--model_name_or_path {vlm_path}: a text-only {model_type}; Mix-GRPO's policy must be a "
                          "VLM (its reflect stage shows it the image it drew)")
    encoder = os.path.join(gen_path, "text_encoder", "config.json")
    if cfg.conditioning == "generator" or not os.path.isfile(encoder):
        return
    with open(encoder) as f:
        wanted = json.load(f).get("model_type")
    if model_type != wanted:
        raise ConfigError(f"--conditioning {cfg.conditioning}: the generator {gen_path} reads the policy's hidden "
                          f"states in place of its {wanted} text encoder's (its prompt template and image tokens), but "
                          f"--model_name_or_path {vlm_path} is a {model_type}: use --conditioning generator (the "
                          f"generator reads the policy's text with its own encoder) or a {wanted} policy")


def load_generator(cfg, path, flag, device, *, hidden, **options):
    """A generator from `path` (--`flag`) that reads `hidden`-dim text states (None: its own text encoder), made
    trainable (`train_generator`), with the settings both stages share. Returns (generator, trainable parameters)."""
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    if pipeline_class(path) in QWEN_PIPELINES:  # its conditioning: the VLM's base weights or the policy
        options["conditioning"] = "base" if cfg.conditioning == "generator" else cfg.conditioning
    gen = load_flow_generator(path, dtype=dtype, device=device, **options)
    if hidden is not None and gen.transformer.config.joint_attention_dim != hidden:
        raise InputError(f"--{flag} reads {gen.transformer.config.joint_attention_dim}-dim text states but the VLM's "
                         f"hidden size is {hidden}")
    params = train_generator(cfg, gen)
    if cfg.gradient_checkpointing:
        gen.enable_gradient_checkpointing()
    gen.cfg_batched = gen.cfg_batchable  # one transformer forward for both CFG branches, where that changes neither
    gen.edit_area = cfg.image_size ** 2  # refine at the generated size (the edit pipeline's own: 1024 x 1024)
    return gen, params


class MixGRPOModel(torch.nn.Module):
    """The two trained parts as one module: the VLM's log-prob wrapper (`text`) and the generator's transformer
    (`image`). One DDP wrapper or one DeepSpeed engine (which takes one model) holds both, and one forward
    computes both parts of the loss (DDP allows one forward per backward).

    forward(text=(batch, ids, mask, temperature), image=(cond, steps), reference=False, edit=False) ->
    {"text": log-probs, "image": (log-prob, mean, std)}; reference: the text with the VLM's LoRA off, the image
    with the generator's LoRA off (no grad); edit: the image steps are the refine stage's (its own generator, when
    --edit_generator_name_or_path gives one: `edit_image`)."""

    def __init__(self, policy, gen, edit_gen=None):
        super().__init__()
        self.text, self.image = policy, gen.transformer
        if edit_gen is not None and edit_gen is not gen:
            self.edit_image = edit_gen.transformer
        # a list: the generators' VAEs and frozen text encoders are not trained parts
        self._gens = [gen, edit_gen if edit_gen is not None else gen]

    def train(self, mode=True):
        super().train(mode)
        for gen in self._gens:  # the generators recompute their SDE steps as they sampled them
            gen.transformer.eval()
        return self

    def forward(self, text=None, image=None, reference=False, edit=False):
        out = {}
        if text is not None:
            if reference:
                with torch.no_grad(), adapters_disabled(self.text.model):  # the frozen tower's LoRA stays frozen
                    out["text"] = self.text(*text)
            else:
                out["text"] = self.text(*text)
        if image is not None:
            out["image"] = image_logprobs(self._gens[int(edit)], *image, reference=reference)
        return out


def train_generator(cfg, gen):
    """The generator's trainable parameters: LoRA on its attention, or with --generator_lora_r 0 every weight (the
    image KL's reference is then a frozen copy, made only when that KL is on)."""
    if cfg.generator_lora_r:
        return gen.add_lora(cfg.generator_lora_r, alpha=cfg.generator_lora_alpha)
    return gen.full_finetune(reference=bool(cfg.kl_weight_image and cfg.tune_image_cot))


def build_edit_generator(cfg, edit_path, gen, device):
    """The refine stage's own generator (a Qwen-Image-Edit folder), trained like the reason stage's (`train_generator`),
    reading the same text encoder as `gen` (the VLM's base weights or the policy, as --conditioning says). Returns
    (generator, its trainable parameters)."""
    return load_generator(cfg, edit_path, "edit_generator_name_or_path", device,
                          hidden=gen.transformer.config.joint_attention_dim,
                          copy_text_encoder=False,  # gen's text encoder is already the right one
                          components={"text_encoder": gen.text_encoder, "tokenizer": gen.t2i.tokenizer,
                                      "processor": gen.edit.processor if gen.edit is not None else None})
