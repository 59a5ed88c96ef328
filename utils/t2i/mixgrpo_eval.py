"""Mix-GRPO's held-out evaluation (beside utils.eval.heldout, GRPO's and SFT's): greedy reasoning (or sampled at
--eval_temperature, R3: 0.3), ODE images scored by the image reward, optionally reflected on and refined; the before /
after summary of a run. Shared by train_mixgrpo.py and bench/experiments/tiny_mixgrpo_eval.py."""

from __future__ import annotations

import math
import os
import re

import torch
from accelerate.utils import gather_object
from PIL import Image

from rewards import get_reward
from utils.core.encoding import encode_prompts
from utils.core.reward_calls import score_images
from utils.core.rollout import generate_completions
from utils.core.seeds import completion_seeds
from utils.t2i.generators import sample
from utils.t2i.mixgrpo_model import edit_guidance, image_condition, reason_guidance
from utils.t2i.r3_format import REASON_PROMPT, REFLECT_PROMPT, reasoning_of, reflection_of, user_message

# Held-out text sampled at --eval_temperature > 0 draws its noise from rounds no training step uses (steps are >= 0).
HELDOUT_REASON_ROUND, HELDOUT_REFLECT_ROUND = -1, -2


def greedy_texts(cfg, messages, images, idx, max_new_tokens, *, policy, processor, accelerator, stop_ids,
                 suppress_ids, seed_ids=None, seed_round=HELDOUT_REASON_ROUND):
    """Completions of a held-out batch (chat messages, one image list per row): greedy, or with --eval_temperature
    sampled from counter-based noise keyed by (--seed, `seed_round`, `seed_ids` (default: the rows `idx`))."""
    tokenizer = processor.tokenizer
    batch = encode_prompts(processor, messages, images, sample_ids=[f"held-out row {i}" for i in idx],
                           max_prompt_length=cfg.max_prompt_length).to(accelerator.device)
    seeds = completion_seeds(cfg.seed, seed_round, idx if seed_ids is None else seed_ids)
    ids, mask = generate_completions(policy.model, batch, row_seeds=seeds, temperature=cfg.eval_temperature,
                                     max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                                     pad_token_id=tokenizer.pad_token_id, suppress_token_ids=suppress_ids)
    return tokenizer.batch_decode(ids.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)


def scored_mean(values):
    """Mean over the values that are not NaN (unscored images), NaN when there are none."""
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def refine_heldout(cfg, batch_rows, idx, images, gen, accelerator, noise_ids, **generate):
    """Held-out reflect + refine of the reason images: greedy (or --eval_temperature) reflection on each image (of
    held-out row `idx[k]`), then an ODE refine with --eval_num_timesteps from noise seeded by `noise_ids[k]` (the
    image and the round; the reflection's text noise too); "no further edit needed" keeps the image. Returns
    (reflections, refined images, no-edit flags)."""
    messages = [user_message(REFLECT_PROMPT.format(prompt=r["prompt"]), True) for r in batch_rows]
    texts = greedy_texts(cfg, messages, [[im] for im in images], idx, cfg.max_output_token_n_edit,
                         accelerator=accelerator, seed_ids=noise_ids, seed_round=HELDOUT_REFLECT_ROUND, **generate)
    parsed = [reflection_of(t) for t in texts]
    no_edit = [keep for _, _, keep in parsed]
    edit = [k for k, keep in enumerate(no_edit) if not keep]  # a kept image is not drawn again
    refined = list(images)
    if edit:
        cond = image_condition(cfg, gen, [batch_rows[k] for k in edit], [parsed[k][1] for k in edit],
                               [images[k] for k in edit])
        noise = torch.cat([gen.prepare_latents(1, cfg.image_size, cfg.image_size, torch.Generator(
            device=accelerator.device).manual_seed(cfg.seed + 7919 + noise_ids[k])) for k in edit])
        out = sample(gen, cond, num_steps=cfg.eval_num_timesteps, guidance=edit_guidance(cfg),
                     shift=cfg.timestep_shift, latents=noise, output_type="pil")
        for k, image in zip(edit, out.images):
            refined[k] = image
    return texts, refined, no_edit


def refine_rounds(cfg, rows, row_ids, image_ids, images, scores, details, *, reward_fn, gen, accelerator,
                  **generate):
    """R3's held-out refine of the first drafts `images` (with their `scores`; image m is of held-out row
    `row_ids[m]`, its noise keyed by `image_ids[m]`): up to --eval_refine_rounds reflect + refine rounds, each image
    stopping at its first "no further edit" (it is then neither reflected on nor scored again); only an edited image
    is scored anew. With more than one round, each image's `details` get every round's score and its change from the
    round before. Returns (images, scores, stopped flags) after the last round."""
    images, scores, stopped = list(images), list(scores), [False] * len(images)
    for n in range(1, cfg.eval_refine_rounds + 1):
        prev, scores = scores, list(scores)
        active = [m for m, stop in enumerate(stopped) if not stop]
        if active:
            reflections, candidates, no_edit = refine_heldout(
                cfg, [rows[m] for m in active], [row_ids[m] for m in active], [images[m] for m in active], gen,
                accelerator, noise_ids=[image_ids[m] + (n - 1) * 104729 for m in active],  # each round its own noise
                **generate)
            edited = []
            for m, text, keep, new in zip(active, reflections, no_edit, candidates):
                stopped[m], images[m] = keep, new
                if not keep:
                    edited.append((m, text))
            if edited:
                rescored = score_images(cfg, reward_fn, [text for _, text in edited], [images[m] for m, _ in edited],
                                        [rows[m] for m, _ in edited]).tolist()
                for (m, _), score in zip(edited, rescored):
                    scores[m] = score
        if cfg.eval_refine_rounds > 1:
            for d, a, b in zip(details, prev, scores):
                d.update({f"round{n}_reward": b, f"round{n}_improved": float(b > a), f"round{n}_worse": float(b < a),
                          f"round{n}_same": float(b == a)})
    return images, scores, stopped


@torch.no_grad()
def evaluate_reason(cfg, rows, *, policy, processor, gen, accelerator, stop_ids, suppress_ids, reward_fn,
                    grid_path, edit_gen=None):
    """Held-out reason stage: greedy reasoning (none with `policy` None, --text_free: the prompts alone draw), ODE
    images with --eval_num_timesteps, --eval_images_per_prompt per row, each from its own noise (row i's image j from
    seed + i + j x rows), scored by --reward_fn; rows are shared out over the processes. Writes a grid PNG of the
    first 64 images (rows first). Returns the means over all images of reward and format. With --reflect_refine also
    reason + refine (`refine_heldout`): `refine_reward` (the refined image's score), `refine_no_edit` (the share kept
    as drawn), `refine_change`'s shares and a second grid (`*_refine.png`)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(rows), world))
    results = []
    generate = dict(policy=policy, processor=processor, stop_ids=stop_ids, suppress_ids=suppress_ids)
    # on the tiny world's prompts, what its scorer sees besides the score: strict, objects detected and requested
    shapes = get_reward("shapes_t2i") if cfg.dataset_name == "shapes_t2i" else None
    was_training = policy is not None and policy.training
    if policy is not None:
        policy.eval()
    per_batch = max(1, cfg.eval_batch_size // cfg.eval_images_per_prompt)  # rows whose images fill a batch
    for start in range(0, len(mine), per_batch):
        idx = mine[start:start + per_batch]
        batch_rows = [rows[i] for i in idx]
        if policy is None:  # --text_free: the prompt alone draws
            texts, parsed = [r["prompt"] for r in batch_rows], [(1.0, None)] * len(idx)
            cond = image_condition(cfg, gen, batch_rows, None)
        else:
            texts = greedy_texts(cfg, [user_message(REASON_PROMPT.format(prompt=r["prompt"])) for r in batch_rows],
                                 [[] for _ in idx], idx, cfg.max_output_token_n_gen, accelerator=accelerator,
                                 **generate)
            parsed = [reasoning_of(t) for t in texts]
            cond = image_condition(cfg, gen, batch_rows, [reasoning for _, reasoning in parsed])
        # every image of these rows in one batch (one greedy reasoning per row, several images of it): item m is
        # image `copy` of row k, its noise seeded by its global index i + copy x rows as ever
        items = [(copy, k) for copy in range(cfg.eval_images_per_prompt) for k in range(len(idx))]
        ids = [idx[k] + copy * len(rows) for copy, k in items]
        item_rows, item_texts = [batch_rows[k] for _, k in items], [texts[k] for _, k in items]
        noise = torch.cat([gen.prepare_latents(1, cfg.image_size, cfg.image_size, torch.Generator(
            device=accelerator.device).manual_seed(cfg.seed + i)) for i in ids])
        out = sample(gen, cond.select(torch.tensor([k for _, k in items])), num_steps=cfg.eval_num_timesteps,
                     guidance=reason_guidance(cfg),
                     shift=cfg.timestep_shift, latents=noise, output_type="pil")
        scores = score_images(cfg, reward_fn, item_texts, out.images, item_rows).tolist()  # NaN: unscored
        details = [shapes.details(im, r) if shapes else {} for im, r in zip(out.images, item_rows)]
        for d, r in zip(details, item_rows):
            d["tag"] = r.get("tag", r.get("type"))  # per-tag means (GenEval's tag, TIIF's type)
        refined = [None] * len(items)
        if cfg.reflect_refine:
            images, new_scores, stopped = refine_rounds(
                cfg, item_rows, [idx[k] for _, k in items], ids, out.images, scores, details, reward_fn=reward_fn,
                gen=edit_gen or gen, accelerator=accelerator, **generate)
            refined = [dict(refine_reward=s, refine_no_edit=float(k), image=im, **refine_change(a, s))
                       for a, s, k, im in zip(scores, new_scores, stopped, images)]
            if shapes:
                for d, r, im in zip(details, item_rows, images):
                    d.update({f"refine_{k}": v for k, v in shapes.details(im, r).items() if k != "requested"})
        results += [(i, s, parsed[k][0], im, d, ref) for i, (_, k), s, im, d, ref in zip(
            ids, items, scores, out.images, details, refined)]
    if policy is not None:
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


def save_grid(images, path, columns=8):
    """Paste PIL images into one grid PNG (the first held-out rows' images, in row order)."""
    w, h = images[0].size
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (w * min(columns, len(images)), h * rows), "white")
    for n, im in enumerate(images):
        grid.paste(im.convert("RGB"), ((n % columns) * w, (n // columns) * h))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid.save(path)
    return path


def refine_change(draft, refined):
    """The refine's effect on one image, first draft -> last round: improved / worse (each 0 or 1), and for a perfect
    draft (score 1) whether the refine made it worse (NaN for any other draft, so its mean is over perfect drafts);
    all NaN when either image is unscored."""
    if math.isnan(draft) or math.isnan(refined):
        return dict(refine_improved=math.nan, refine_worse=math.nan, refine_perfect_worse=math.nan)
    return dict(refine_improved=float(refined > draft), refine_worse=float(refined < draft),
                refine_perfect_worse=float(refined < draft) if draft >= 1 else math.nan)


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
        rounds = sorted(int(m[1]) for m in (re.fullmatch(r"round(\d+)_reward", k) for k in after) if m)
        for when, res in (("before", before), ("after", after)):
            per_round = " ".join(f"{res.get(f'round{n}_reward', math.nan):.4f}" for n in rounds)
            lines.append(f"  refine {when}: {'by round ' + per_round + '; ' if rounds else ''}improved "
                         f"{res.get('refine_improved', math.nan):.3f}, worse {res.get('refine_worse', math.nan):.3f}, "
                         f"perfect drafts made worse {res.get('refine_perfect_worse', math.nan):.3f}")
    return lines
