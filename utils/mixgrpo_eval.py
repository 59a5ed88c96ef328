"""Mix-GRPO's held-out evaluation (beside utils.evaluation, GRPO's and SFT's): greedy reasoning, ODE images scored
by the image reward, optionally reflected on and refined; the before / after summary of a run. Shared by
train_mixgrpo.py and bench/tiny_mixgrpo_eval.py."""

from __future__ import annotations

import math
import os

import torch
from accelerate.utils import gather_object

from utils.encoding import encode_prompts
from utils.flow.generators import Guidance, sample
from utils.mixgrpo_model import edit_guidance, image_condition
from utils.r3_format import REASON_PROMPT, REFLECT_PROMPT, reasoning_of, reflection_of, user_message
from utils.reward_calls import score_images
from utils.rollout import generate_completions


def greedy_texts(cfg, messages, images, idx, max_new_tokens, *, policy, processor, accelerator, stop_ids,
                 suppress_ids):
    """Greedy completions of a held-out batch (chat messages, one image list per row)."""
    tokenizer = processor.tokenizer
    batch = encode_prompts(processor, messages, images, sample_ids=[f"held-out row {i}" for i in idx],
                           max_prompt_length=cfg.max_prompt_length).to(accelerator.device)
    ids, mask = generate_completions(policy.model, batch, row_seeds=torch.tensor(idx), temperature=0.0,
                                     max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                                     pad_token_id=tokenizer.pad_token_id, suppress_token_ids=suppress_ids)
    return tokenizer.batch_decode(ids.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)


def scored_mean(values):
    """Mean over the values that are not NaN (unscored images), NaN when there are none."""
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def refine_heldout(cfg, batch_rows, idx, images, gen, accelerator, noise_offset=0, **generate):
    """Held-out reflect + refine of the reason images: greedy reflection on each image, then an ODE refine with
    --eval_num_timesteps from noise seeded by the row (+ `noise_offset`: another image of the row); "no further
    edit needed" keeps the image. Returns (reflections, refined images, no-edit flags)."""
    messages = [user_message(REFLECT_PROMPT.format(prompt=r["prompt"]), True) for r in batch_rows]
    texts = greedy_texts(cfg, messages, [[im] for im in images], idx, cfg.max_output_token_n_edit,
                         accelerator=accelerator, **generate)
    parsed = [reflection_of(t) for t in texts]
    cond = image_condition(cfg, gen, batch_rows, [instruction for _, instruction, _ in parsed], images)
    noise = torch.cat([gen.prepare_latents(1, cfg.image_size, cfg.image_size, torch.Generator(
        device=accelerator.device).manual_seed(cfg.seed + 7919 + i + noise_offset)) for i in idx])
    out = sample(gen, cond, num_steps=cfg.eval_num_timesteps,
                 guidance=edit_guidance(cfg), shift=cfg.timestep_shift,
                 latents=noise, output_type="pil")
    no_edit = [keep for _, _, keep in parsed]
    return texts, [im if keep else new for im, new, keep in zip(images, out.images, no_edit)], no_edit


@torch.no_grad()
def evaluate_reason(cfg, rows, *, policy, processor, gen, accelerator, stop_ids, suppress_ids, reward_fn,
                    grid_path, edit_gen=None):
    """Held-out reason stage: greedy reasoning, ODE images with --eval_num_timesteps, --eval_images_per_prompt per
    row, each from its own noise (row i's image j from seed + i + j x rows), scored by --reward_fn; rows are shared
    out over the processes. Writes a grid PNG of the first 64 images (rows first). Returns the means over all
    images of reward and format. With --reflect_refine also reason + refine (`refine_heldout`): `refine_reward`
    (the refined image's score), `refine_no_edit` (the share kept as drawn) and a second grid (`*_refine.png`)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(rows), world))
    results = []
    generate = dict(policy=policy, processor=processor, stop_ids=stop_ids, suppress_ids=suppress_ids)
    shapes = cfg.dataset_name == "shapes_t2i"
    was_training = policy.training
    policy.eval()
    for start in range(0, len(mine), 16):
        idx = mine[start:start + 16]
        batch_rows = [rows[i] for i in idx]
        texts = greedy_texts(cfg, [user_message(REASON_PROMPT.format(prompt=r["prompt"])) for r in batch_rows],
                             [[] for _ in idx], idx, cfg.max_output_token_n_gen, accelerator=accelerator, **generate)
        parsed = [reasoning_of(t) for t in texts]
        cond = image_condition(cfg, gen, batch_rows, [reasoning for _, reasoning in parsed])
        for copy in range(cfg.eval_images_per_prompt):  # one greedy reasoning per row, several images of it
            offset = copy * len(rows)
            noise = torch.cat([gen.prepare_latents(1, cfg.image_size, cfg.image_size, torch.Generator(
                device=accelerator.device).manual_seed(cfg.seed + i + offset)) for i in idx])
            out = sample(gen, cond, num_steps=cfg.eval_num_timesteps,
                         guidance=Guidance(cfg.cfg_scale_gen, interval=tuple(cfg.cfg_interval)),
                         shift=cfg.timestep_shift, latents=noise, output_type="pil")
            scores = score_images(cfg, reward_fn, texts, out.images, batch_rows).tolist()  # NaN: unscored
            details = [shapes_details(im, r) if shapes else {} for im, r in zip(out.images, batch_rows)]
            for d, r in zip(details, batch_rows):
                d["tag"] = r.get("tag", r.get("type"))  # per-tag means (GenEval's tag, TIIF's type)
            refined = [None] * len(idx)
            if cfg.reflect_refine:
                images, new_scores, stopped = list(out.images), list(scores), [False] * len(idx)
                for n in range(1, cfg.eval_refine_rounds + 1):  # R3: rounds until "no further edit"
                    prev = new_scores
                    reflections, candidates, no_edit = refine_heldout(
                        cfg, batch_rows, idx, images, edit_gen or gen, accelerator,
                        noise_offset=offset + (n - 1) * 104729, **generate)  # each round its own noise
                    stopped = [a or b for a, b in zip(stopped, no_edit)]
                    images = [im if stop else new for im, new, stop in zip(images, candidates, stopped)]
                    new_scores = score_images(cfg, reward_fn, reflections, images, batch_rows).tolist()
                    if cfg.eval_refine_rounds > 1:  # per round: its score and the change from the round before
                        for d, a, b in zip(details, prev, new_scores):
                            d.update({f"round{n}_reward": b, f"round{n}_improved": float(b > a),
                                      f"round{n}_worse": float(b < a), f"round{n}_same": float(b == a)})
                refined = [dict(refine_reward=s, refine_no_edit=float(k), image=im)
                           for s, k, im in zip(new_scores, stopped, images)]
                if shapes:
                    for d, r, im in zip(details, batch_rows, images):
                        d.update({f"refine_{k}": v for k, v in shapes_details(im, r).items() if k != "requested"})
            results += [(i + offset, s, f, im, d, ref) for i, s, (f, _), im, d, ref in zip(
                idx, scores, parsed, out.images, details, refined)]
    policy.train(was_training)
    # every process's rows, the grid's first 64 images included (PIL images pickle; the rest go without theirs)
    mine_rows = [(i, s, f, {**d, **{k: v for k, v in (ref or {}).items() if k != "image"}},
                  im if i < 64 else None, ref["image"] if ref and i < 64 else None)
                 for i, s, f, im, d, ref in results]
    gathered = sorted((r for part in gather_object([mine_rows]) for r in part), key=lambda r: r[0])
    if accelerator.is_main_process:
        for position, path in ((4, grid_path), (5, grid_path.replace(".png", "_refine.png"))):
            grid_images = [r[position] for r in gathered if r[position] is not None]
            if grid_images:
                save_grid(grid_images, path)
    n = len(gathered)
    result = dict(reward=scored_mean([r[1] for r in gathered]), format=sum(r[2] for r in gathered) / n, samples=n,
                  unscored=sum(math.isnan(r[1]) for r in gathered) / n)
    for key in sorted({k for r in gathered for k in r[3]} - {"tag"}):  # refine, the shapes scorer's view
        result[key] = scored_mean([r[3][key] for r in gathered])
    for tag in sorted({r[3]["tag"] for r in gathered if r[3].get("tag") is not None}):
        result[f"tag_{tag}"] = scored_mean([r[1] for r in gathered if r[3].get("tag") == tag])
    return result


def shapes_details(image, row):
    """What the tiny world's scorer sees besides the score: strict (every item holds), objects detected and
    requested, so a gain bought with extra objects or speckle shows (the reward itself is only the score)."""
    from tiny.detector import score_t2i

    out = score_t2i(image, row)
    return {"strict": float(out["strict"]), "detected": float(out["detected"]), "requested": float(out["requested"])}


def save_grid(images, path, columns=8):
    """Paste PIL images into one grid PNG (the first held-out rows' images, in row order)."""
    from PIL import Image

    w, h = images[0].size
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (w * min(columns, len(images)), h * rows), "white")
    for n, im in enumerate(images):
        grid.paste(im.convert("RGB"), ((n % columns) * w, (n // columns) * h))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid.save(path)
    return path


def heldout_summary(after, before=None):
    """A run's summary entries of its held-out results: heldout_<key>_after (and _before), samples left out."""
    out = {}
    for when, result in (("after", after), ("before", before)):
        out.update({f"heldout_{k}_{when}": v for k, v in (result or {}).items() if k != "samples"})
    return out


def heldout_lines(before, after, described):
    """What a run prints of its held-out results, before -> after (`described`: how many prompts and images)."""
    extra = "".join(f", {k} {before[k]:.3f} -> {after[k]:.3f}" for k in ("strict", "detected")
                    if k in after and k in before)
    lines = [f"held-out reward (reason): before {before['reward']:.4f} -> after {after['reward']:.4f} "
             f"({described}{extra})"]
    if "refine_reward" in after and "refine_reward" in before:
        lines.append(f"held-out reward (reason + refine): before {before['refine_reward']:.4f} -> after "
                     f"{after['refine_reward']:.4f} (kept as drawn: {before['refine_no_edit']:.2f} -> "
                     f"{after['refine_no_edit']:.2f})")
    return lines
