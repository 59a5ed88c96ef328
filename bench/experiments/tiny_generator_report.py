"""Held-out `shapes_t2i` scores of the tiny generator's ODE samples, per tag, and a grid of its images.

    python bench/experiments/tiny_generator_report.py                # the cached default generator (built on first use)
    python bench/experiments/tiny_generator_report.py --path DIR --guidance_scale 1 2 4 --grid docs/results/grid.png

For every guidance scale it samples the held-out rows (make_t2i_prompts(n, seed=1): layouts and prompts never
rendered for training, though the prompt strings repeat: the tiny world has ~180 of them) with `num_steps` ODE
steps, scores them with score_t2i (the "tiny" behaviour: score, strict, detected vs requested objects) and prints
a Markdown table. As references it scores the same rows' ground-truth renders, their VAE round trips and the
untrained transformer (the same pipeline with freshly initialised transformer weights), and for a build that reads
scene plans, each row's prompt with another row's plan (how much the plan is followed) and how much the velocity
moves when one word of a plan changes (its colour, shape or cell: which of them the generator reads); with
`--planner` also the plans a planner VLM writes greedily for train_mixgrpo's reason prompt (what the policy starts
from; it prints the share of those plans that name exactly the requested objects, tiny.t2i.plan_matches_request,
and how often the planner's first object is the shape the prompt names: chance when it does not read the prompt).
The grid (first scale) shows, per row, the prompt, its ground-truth render and `grid_samples` samples of seeds 0,
1, ...; from those samples it also prints how much the prompt changes an image compared with how much the noise
seed does.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiny.cache import tiny_generator_path
from tiny.generator import (  # noqa: E402
    SUMMARY,
    TinyGeneratorConfig,
    condition_texts,
    evaluate_generator,
    heldout_rows,
    make_transformer,
    render_rows,
    sample_images,
    score_images,
    to_uint8,
    vae_roundtrip,
)
from tiny.planner import load_planner, planner_plans, shape_reading  # noqa: E402
from tiny.shapes import SHAPES  # noqa: E402
from tiny.t2i import plan_matches_request  # noqa: E402
from utils.t2i.adapters import QwenImageGenerator


def markdown_table(tables):
    """tables: {label: score_images(...)["table"]} -> one Markdown table, a column group per label."""
    labels = list(tables)
    tags = list(next(iter(tables.values())))
    head = "| tag | n | " + " | ".join(f"{lab}: score / strict / objects" for lab in labels) + " |"
    lines = [head, "|---|---|" + "---|" * len(labels)]
    for tag in tags:
        cells = []
        for lab in labels:
            r = tables[lab][tag]
            cells.append(f"{r['score']:.2f} / {r['strict']:.2f} / {r['detected']:.1f} of {r['requested']:.1f}")
        lines.append(f"| {tag} | {tables[labels[0]][tag]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def grid_png(path, rows, truth, samples, scale=3):
    """Rows of (prompt label | ground truth | samples...), images enlarged `scale` x (nearest)."""
    from PIL import Image, ImageDraw

    size = truth.shape[-1] * scale
    label_w, pad = 300, 4
    n_cols = 1 + samples.shape[1]
    canvas = Image.new("RGB", (label_w + n_cols * (size + pad), len(rows) * (size + pad) + 16), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((label_w, 2), "truth", fill="black")
    draw.text((label_w + size + pad, 2), "ODE samples (seeds 0, 1, ...)", fill="black")
    for r, row in enumerate(rows):
        y = 16 + r * (size + pad)
        draw.text((4, y + size // 2 - 6), f"[{row['tag']}] {row['prompt'].removeprefix('a photo of ')}", fill="black")
        tiles = [truth[r]] + list(samples[r])
        for c, tile in enumerate(tiles):
            im = Image.fromarray(to_uint8(tile[None])[0]).resize((size, size), Image.NEAREST)
            x = label_w + c * (size + pad)
            canvas.paste(im, (x, y))
            draw.rectangle((x - 1, y - 1, x + size, y + size), outline=(190, 190, 190))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    canvas.save(path)
    return path


PLAN_EDITS = {  # one word of a plan changed: what the generator should draw differently
    "colour": ("a photo of a red circle\nred circle top left", "a photo of a blue circle\nblue circle top left"),
    "shape": ("a photo of a red circle\nred circle top left", "a photo of a red square\nred square top left"),
    "cell": ("a photo of a red circle\nred circle top left", "a photo of a red circle\nred circle bottom right"),
}


@torch.no_grad()
def plan_sensitivity(gen, size, sigmas=(0.95, 0.8, 0.6), seeds=8):
    """Mean |velocity change| when one word of the plan changes (colour, shape, cell), from the same noisy latents
    (`seeds` noises at each sigma): which parts of the text the generator reads."""
    noise = torch.cat([gen.prepare_latents(1, size, size, torch.Generator().manual_seed(i)) for i in range(seeds)])
    noise = noise.repeat(2, 1, 1)  # the same latents under both texts
    out = {}
    for name, (a, b) in PLAN_EDITS.items():
        cond = gen.encode_condition([a] * seeds + [b] * seeds, height=size, width=size, negative_prompt=None)
        out[name] = []
        for sigma in sigmas:
            v = gen.velocity(noise, torch.full((2 * seeds,), sigma * 1000.0), cond)
            out[name].append(round(float((v[:seeds] - v[seeds:]).abs().mean()), 4))
    return {"sigmas": list(sigmas), **out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="generator folder (default: tiny.cache.tiny_generator_path())")
    ap.add_argument("--n", type=int, default=120, help="held-out rows (20 per tag at 120)")
    ap.add_argument("--seed", type=int, default=1, help="make_t2i_prompts seed of the held-out rows")
    ap.add_argument("--num_steps", type=int, default=20)
    ap.add_argument("--guidance_scale", type=float, nargs="+", default=[4.0])
    ap.add_argument("--shift", type=float, default=None, help="sampling shift (default: the saved scheduler's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--grid", default=None, help="write a grid PNG here")
    ap.add_argument("--grid_rows_per_tag", type=int, default=2)
    ap.add_argument("--grid_samples", type=int, default=6)
    ap.add_argument("--json", default=None, help="write the tables here")
    ap.add_argument("--planner", default=None, help="also draw the greedy plans of this VLM (tiny-planner: the cached "
                                                    "Mix-GRPO warm start, or a folder)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.path is None:
        args.path = tiny_generator_path()
    with open(os.path.join(args.path, SUMMARY)) as f:
        summary = json.load(f)
    cfg = TinyGeneratorConfig(**summary["config"])
    gen = QwenImageGenerator.from_pretrained(args.path)
    rows = heldout_rows(args.n, args.seed)
    truth = render_rows(rows, cfg.image_size, seed_offset=10**6)
    tables = {"ground truth": score_images(truth, rows)["table"],
              "VAE round trip": score_images(vae_roundtrip(gen, truth), rows)["table"]}
    results = {}
    for scale in args.guidance_scale:
        results[scale] = evaluate_generator(args.path, n=args.n, seed=args.seed, num_steps=args.num_steps,
                                            guidance_scale=scale, shift=args.shift, gen=gen)
        tables[f"CFG {scale:g}"] = results[scale]["table"]
    trained = gen.transformer
    gen.transformer = gen.denoiser = make_transformer(cfg, trained.config.joint_attention_dim).eval()
    gen.t2i.transformer = gen.transformer
    untrained = evaluate_generator(args.path, n=args.n, seed=args.seed, num_steps=args.num_steps,
                                   guidance_scale=args.guidance_scale[0], shift=args.shift, gen=gen)
    tables[f"untrained, CFG {args.guidance_scale[0]:g}"] = untrained["table"]
    gen.transformer = gen.denoiser = gen.t2i.transformer = trained
    texts = condition_texts(rows, cfg.image_size, plan=cfg.plan, seed_offset=10**6)
    if cfg.plan:  # does it follow the plan? each row's prompt with the next row's plan
        plans = [t.split("\n", 1)[1] for t in texts]
        other = [f"{r['prompt']}\n{p}" for r, p in zip(rows, plans[1:] + plans[:1])]
        images = sample_images(gen, other, size=cfg.image_size, num_steps=args.num_steps,
                               guidance_scale=args.guidance_scale[0], shift=args.shift)
        tables[f"another row's plan, CFG {args.guidance_scale[0]:g}"] = score_images(images, rows)["table"]
    sensitivity = plan_sensitivity(gen, cfg.image_size) if cfg.plan else None
    if sensitivity:
        print(f"mean |velocity change| at sigma {sensitivity['sigmas']} when one plan word changes: "
              + "; ".join(f"{k} {v}" for k, v in sensitivity.items() if k != "sigmas"))
    if args.planner:
        planner, processor = load_planner(args.planner)
        plans = planner_plans(planner, processor, rows)
        right = sum(plan_matches_request(p, r) for p, r in zip(plans, rows))
        print(f"{args.planner}: {right} of {len(rows)} greedy plans name exactly the requested objects; "
              f"P(its first object is the shape the prompt names) = {shape_reading(planner, processor):.3f} "
              f"(chance {1 / len(SHAPES):.3f})")
        images = sample_images(gen, [f"{r['prompt']}\n{p}" for r, p in zip(rows, plans)], size=cfg.image_size,
                               num_steps=args.num_steps, guidance_scale=args.guidance_scale[0], shift=args.shift)
        tables[f"planner's plan, CFG {args.guidance_scale[0]:g}"] = score_images(images, rows)["table"]

    print(f"generator {args.path}: {args.n} held-out rows (seed {args.seed}), {args.num_steps} ODE steps, "
          f"shift {args.shift if args.shift is not None else gen.scheduler.config.shift}")
    print(markdown_table(tables))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "args": vars(args), "tables": tables, "build": summary,
                       "plan_sensitivity": sensitivity}, f, indent=2)
    if args.grid:
        by_tag = {}
        for i, row in enumerate(rows):
            if len(by_tag.setdefault(row["tag"], [])) < args.grid_rows_per_tag:
                by_tag[row["tag"]].append(i)
        picked = [i for idx in by_tag.values() for i in idx]
        k = args.grid_samples
        samples = sample_images(gen, [texts[i] for i in picked for _ in range(k)], size=cfg.image_size,
                                num_steps=args.num_steps, guidance_scale=args.guidance_scale[0],
                                seeds=list(range(k)) * len(picked), shift=args.shift)
        samples = samples.view(len(picked), k, *samples.shape[1:])
        # How much the prompt moves an image, against how much the noise does: mean absolute pixel difference
        # between two prompts drawn from the same seed, and between two seeds of the same prompt.
        n = len(picked)
        prompts_diff = (samples[:, None] - samples[None]).abs().mean((2, 3, 4, 5)).sum() / (n * n - n)
        seeds_diff = (samples[:, :, None] - samples[:, None]).abs().mean((0, 3, 4, 5)).sum() / (k * k - k)
        print(f"mean |image difference|: two prompts, same seed {prompts_diff:.4f}; "
              f"one prompt, two seeds {seeds_diff:.4f}")
        print("grid:", grid_png(args.grid, [rows[i] for i in picked], truth[picked], samples))


if __name__ == "__main__":
    main()
