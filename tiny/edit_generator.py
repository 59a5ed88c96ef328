"""The tiny edit generator: the tiny Qwen-Image generator taught to edit, for R3's refine stage in the tiny world.

A `QwenImageEditPipeline` folder with the tiny generator's VAE, scheduler and frozen text encoder (and its
processor, which shows the VLM the input image), whose transformer starts from the generator's and is trained by
rectified flow matching on the synthetic edit triples of `tiny.edits` (scene, instruction, edited scene):
the target is the edited scene's latents, the input scene's latents join the sequence beside the noise as the
adapter's edit path joins them (`QwenImageGenerator.encode_condition(..., images=...)`), and the text is
"prompt\\ninstruction", what train_mixgrpo's refine stage hands the edit generator (`image_condition`), read by
the same frozen encoder with the input image. A share of rows is trained on the negative prompt (with the image:
text CFG's branch) and a share without the image (image CFG's branch). By default the transformer modulates the
input image's tokens at timestep 0 (diffusers' zero_cond_t, saved in its config): it learns to copy them faster.
The loop, the encodings and the sampler are tiny/generator.py's.

`python -m tiny.edit_generator --output_dir DIR` builds one (`tiny.cache.tiny_edit_generator_path()`: the
default, cached); `evaluate_edit_generator` measures held-out edit success (the detector finds exactly the edited
scene's objects) against the identity edit and the untrained transformer, per edit kind.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from itertools import count

import numpy as np
import torch
from diffusers import QwenImageEditPipeline
from PIL import Image, ImageDraw

from tiny.cache import TINY_GENERATOR, tiny_generator_path
from tiny.detector import detected_scene
from tiny.edits import EDIT_KINDS, edit_triples, parse_instruction, scene_key
from tiny.generator import (
    _log,
    _timed,
    encode_images,
    encode_prompts,
    fit_transformer,
    flow_matching_loss,
    pad_embeds,
    pinned_threads,
    sample_images,
    save_summary,
    to_tensor,
    to_uint8,
)
from tiny.generator_config import TinyEditGeneratorConfig
from utils.core.config import parse_config
from utils.t2i.adapters import QwenImageGenerator
from utils.t2i.mixgrpo_model import own_processor

SUMMARY = "tiny_edit_generator.json"  # what a build measured, next to model_index.json
# R3's refine guidance as the tiny Mix-GRPO recipe sets it (text CFG 4 within sigma (0.4, 1], image CFG 1.5,
# shift 3) and its held-out evaluation's 12 ODE steps
EVAL_GUIDANCE = dict(num_steps=12, guidance_scale=4.0, image_scale=1.5, interval=(0.4, 1.0), shift=3.0)
OUTCOMES = ("success", "kept", "carried")


def edit_texts(rows) -> list[str]:
    """What the edit generator reads: "prompt\\ninstruction", as train_mixgrpo's refine stage joins them."""
    return [f"{r['prompt']}\n{r['instruction']}" for r in rows]


def load_generator(path, image_size):
    """A Qwen-Image folder (a QwenImagePipeline with its processor saved beside, or an edit pipeline) through the
    Qwen-Image adapter, editing at image_size (the edit pipeline's own area is 1024 x 1024)."""
    gen = QwenImageGenerator.from_pretrained(path, components=own_processor(path))
    if gen.edit is None:
        raise ValueError(f"--generator {path}: no processor (processor/ beside its text encoder) to show the VLM "
                         "the input image")
    gen.edit_area = image_size ** 2
    return gen


# ---- training ------------------------------------------------------------------------------------------------------


def encode_edit_rows(gen, rows, size, negative_prompt=" "):
    """Each row's training inputs, encoded once: target (the edited render's packed latents), source (the input
    render's, what the edit path joins beside the noise), and the text states of three branches: pos (the edit
    text with the input image), neg (the negative prompt with the input image) and free (the edit text alone)."""
    before, after = to_tensor([r["image_before"] for r in rows]), to_tensor([r["image_after"] for r in rows])
    texts = edit_texts(rows)
    return dict(target=encode_images(gen, after), source=encode_images(gen, before),
                pos=encode_prompts(gen, texts, size, images=before),
                neg=encode_prompts(gen, [negative_prompt] * len(rows), size, images=before),
                free=encode_prompts(gen, texts, size))


def edit_loss(gen, data, idx, g, cfg):
    """The flow-matching loss of rows idx: per row, a draw picks the negative prompt (cfg_dropout), no input image
    (image_dropout) or the edit text with its image; rows with the image take one forward with their input latents
    beside the noise, rows without it another. The mean over the rows."""
    u = torch.rand(len(idx), generator=g)
    no_text, no_image = u < cfg.cfg_dropout, (u >= cfg.cfg_dropout) & (u < cfg.cfg_dropout + cfg.image_dropout)
    total = 0.0
    for rows, texts, image in ((idx[~no_image & ~no_text], data["pos"], True), (idx[no_text], data["neg"], True),
                               (idx[no_image], data["free"], False)):
        if len(rows):
            embeds, mask = pad_embeds([texts[i] for i in rows])
            loss = flow_matching_loss(gen, data["target"][rows], embeds, mask, cfg.image_size, g, cfg,
                                      image_latents=data["source"][rows] if image else None)
            total = total + loss * len(rows)
    return total / len(idx)


def pick_rows(idx, g, step, copy_rows, cfg):
    """The rows a step trains on: idx, each row swapped for a random "no change" row (copy_rows: their indices)
    with probability cfg.copy_share, or every row while step < cfg.copy_steps (a copy-first curriculum). Draws
    nothing from g when neither is set, so a build without them sees the batches it always did."""
    first = step < cfg.copy_steps
    if not len(copy_rows) or not (first or cfg.copy_share > 0):
        return idx
    swap = torch.ones(len(idx), dtype=torch.bool) if first else torch.rand(len(idx), generator=g) < cfg.copy_share
    return torch.where(swap, copy_rows[torch.randint(0, len(copy_rows), (len(idx),), generator=g)], idx)


def set_zero_cond_t(transformer, on=True):
    """Modulate the input image's tokens at timestep 0 (diffusers' zero_cond_t, no new weights): set on the model,
    its blocks and its config, so that the saved folder loads with it."""
    transformer.register_to_config(zero_cond_t=on)
    transformer.zero_cond_t = on
    for block in transformer.transformer_blocks:
        block.zero_cond_t = on
    return transformer


def build_tiny_edit_generator(cfg: TinyEditGeneratorConfig, log=_log) -> str:
    """Encode the edit triples, train the transformer, save the QwenImageEditPipeline folder (plus SUMMARY).
    Returns cfg.output_dir."""
    stages = {}
    with pinned_threads(cfg.threads):
        path = tiny_generator_path() if cfg.generator == TINY_GENERATOR else cfg.generator
        gen = load_generator(path, cfg.image_size)  # a bad --generator fails before any training
        if not cfg.warm_start:
            torch.manual_seed(cfg.seed + 1)
            gen.transformer.load_state_dict(type(gen.transformer).from_config(gen.transformer.config).state_dict())
        if cfg.zero_cond_t:
            set_zero_cond_t(gen.transformer)
        with _timed(stages, "render"):
            rows = edit_triples(cfg.train_rows, seed=cfg.seed, image_size=cfg.image_size)
        with _timed(stages, "encode"):
            data = encode_edit_rows(gen, rows, cfg.image_size, cfg.negative_prompt)
        gen.transformer.requires_grad_(True)
        copy_rows, step = torch.tensor([i for i, r in enumerate(rows) if r["kind"] == "none"]), count()

        def batch_loss(idx, g):
            return edit_loss(gen, data, pick_rows(idx, g, next(step), copy_rows, cfg), g, cfg)

        with _timed(stages, "flow"):
            history = fit_transformer(gen, len(rows), batch_loss, cfg, log)
        gen.transformer.requires_grad_(False)
        pipe = QwenImageEditPipeline(scheduler=gen.scheduler, vae=gen.vae, text_encoder=gen.text_encoder,
                                     tokenizer=gen.t2i.tokenizer, processor=gen.edit.processor,
                                     transformer=gen.transformer)
        pipe.save_pretrained(cfg.output_dir)
        summary = {"config": cfg.spec(), "generator_path": os.path.abspath(path), "timings": stages,
                   "image_tokens": int(data["target"].shape[1]),
                   "text_tokens_mean": round(float(np.mean([e.shape[0] for e in data["pos"]])), 1),
                   "flow_loss_first_last50": [float(np.mean(history[:50])), float(np.mean(history[-50:]))],
                   "flow_s_per_step": {k: round(v / max(1, cfg.steps), 3) for k, v in stages["flow"].items()}}
        save_summary(cfg.output_dir, SUMMARY, summary, log)
        return cfg.output_dir


# ---- evaluation ----------------------------------------------------------------------------------------------------


def edit_outcome(image, row) -> dict:
    """Whether an edit of row's input image did what its instruction says, as the detector sees it: `carried` (the
    cells the instruction names hold what the edited scene holds there), `kept` (every other cell holds what it
    held) and `success` (both: the detector finds exactly the edited scene's objects)."""
    edit = parse_instruction(row["instruction"])
    named = {c for c in (edit.cell, edit.to_cell) if c is not None}
    found, want = detected_scene(image), scene_key(json.loads(row["after"]))

    def split(key, inside):
        return [k for k in key if (k[0] in named) == inside]

    kept, carried = split(found, False) == split(want, False), split(found, True) == split(want, True)
    return {"success": kept and carried, "kept": kept, "carried": carried}


def outcome_table(images, rows) -> dict:
    """Mean outcomes per edit kind and over all rows ({kind: {success, kept, carried, n}})."""
    per = [dict(edit_outcome(im, r), kind=r["kind"]) for im, r in zip(to_uint8(images), rows)]
    table = {}
    for kind in [k for k in EDIT_KINDS if any(p["kind"] == k for p in per)] + ["all"]:
        sel = [p for p in per if kind in ("all", p["kind"])]
        table[kind] = {k: round(float(np.mean([p[k] for p in sel])), 3) for k in OUTCOMES} | {"n": len(sel)}
    return table


def heldout_edits(n, seed, image_size):
    """Held-out triples: edit_triples(n, seed) (synthetic:edits test is seed 1)."""
    return edit_triples(n, seed=seed, image_size=image_size)


@torch.no_grad()
def evaluate_edit_generator(path, *, n=256, seed=1, untrained=True, gen=None, **guidance) -> dict:
    """Held-out edit success of the edit generator at `path` (ODE edits of edit_triples(n, seed), the guidance of
    EVAL_GUIDANCE unless given), of the identity edit (output = input) and, with `untrained`, of the transformer the
    build started from. Returns {"tables": {label: outcome_table}, "images": {label: [N, 3, H, W]}, "rows"}."""
    with open(os.path.join(path, SUMMARY)) as f:
        summary = json.load(f)
    size = summary["config"]["image_size"]
    gen = gen if gen is not None else load_generator(path, size)
    rows = heldout_edits(n, seed, size)
    before = to_tensor([r["image_before"] for r in rows])
    draw = partial(sample_images, gen, edit_texts(rows), size=size, images=before, seeds=range(len(rows)),
                   **(EVAL_GUIDANCE | guidance))
    images = {"trained": draw(), "identity": before}
    if untrained:
        trained = {k: v.clone() for k, v in gen.transformer.state_dict().items()}
        gen.transformer.load_state_dict(start_weights(summary, gen.transformer))
        try:
            images["untrained"] = draw()
        finally:
            gen.transformer.load_state_dict(trained)
    return {"tables": {label: outcome_table(ims, rows) for label, ims in images.items()}, "images": images,
            "rows": rows}


def start_weights(summary, transformer):
    """The weights the build's transformer started from: the generator's (warm start) or a fresh initialisation."""
    if summary["config"]["warm_start"]:
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel.from_pretrained(os.path.join(summary["generator_path"],
                                                                        "transformer")).state_dict()
    torch.manual_seed(summary["config"]["seed"] + 1)
    return type(transformer).from_config(transformer.config).state_dict()


def grid_png(path, rows, columns, scale=4):
    """Rows of (input | instruction | output | target...): `columns` is a list of (title, [N, 3, H, W]) image
    columns, the first of them the input; images enlarged `scale` x (nearest)."""
    size = columns[0][1].shape[-1] * scale
    text_w, pad, top = 400, 4, 16
    xs = [0] + [size + text_w + pad + c * (size + pad) for c in range(len(columns) - 1)]
    canvas = Image.new("RGB", (xs[-1] + size, top + len(rows) * (size + pad)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((size + pad, 2), "instruction", fill="black")
    for x, (title, _) in zip(xs, columns):
        draw.text((x, 2), title, fill="black")
    for r, row in enumerate(rows):
        y = top + r * (size + pad)
        draw.text((size + 2 * pad, y + size // 2 - 12), f"[{row['kind']}] {row['instruction']}", fill="black")
        draw.text((size + 2 * pad, y + size // 2 + 2), row["prompt"].removeprefix("a photo of "), fill="gray")
        for x, (_, images) in zip(xs, columns):
            canvas.paste(Image.fromarray(to_uint8(images[r:r + 1])[0]).resize((size, size), Image.NEAREST), (x, y))
            draw.rectangle((x - 1, y - 1, x + size, y + size), outline=(190, 190, 190))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    canvas.save(path)
    return path


if __name__ == "__main__":
    build_tiny_edit_generator(parse_config(TinyEditGeneratorConfig, sys.argv[1:]))
