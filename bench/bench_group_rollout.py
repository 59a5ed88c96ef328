"""Mix-GRPO's image rollout of one training step on the CPU: P prompt groups of G images, each group with its own
SDE step (R3), drawn one batch per prompt group against all in one batch (the sampler takes one list of SDE steps
per image); and a refine step that draws only the edited images against one that draws every image.

    python bench/bench_group_rollout.py                       # the tiny job's generators and shapes (4 x 4, 32 px)
    python bench/bench_group_rollout.py --prompts 8 --group 8 --edited 0.5

Uses the tiny job's pre-trained generators (tiny.cache: copied from the shipped weights, or built). Timed
interleaved, best of --repeats; prints each phase's seconds and the ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tiny.cache import tiny_edit_generator_path, tiny_generator_path  # noqa: E402
from utils.t2i.adapters import load_flow_generator  # noqa: E402
from utils.t2i.generators import Guidance, sample  # noqa: E402

PROMPT = "two red circles and a blue square\nI draw a red circle at top left, a red circle at right, a blue square"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4, help="prompt groups per step (the tiny job: 4)")
    p.add_argument("--group", type=int, default=4, help="images per prompt (the tiny job: 4)")
    p.add_argument("--steps", type=int, default=8, help="flow steps (the tiny job: 8)")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--edited", type=float, default=0.6, help="share of refine images whose reflection edits")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def groups(gen, args, cond, sde, generators, noise, guidance, rows=None):
    """Each prompt group (or its rows in `rows`) in a batch of its own."""
    for q in range(args.prompts):
        part = [r for r in range(q * args.group, (q + 1) * args.group) if rows is None or r in rows]
        if part:
            sample(gen, cond.select(part), num_steps=args.steps, sde_steps=[sde[q]], guidance=guidance,
                   generator=[generators[r] for r in part], latents=noise[part], output_type="pil")


def one_batch(gen, args, cond, sde, generators, noise, guidance, rows=None):
    part = list(range(args.prompts * args.group)) if rows is None else rows
    sample(gen, cond.select(part), num_steps=args.steps, sde_steps=[[sde[r // args.group]] for r in part],
           guidance=guidance, generator=[generators[r] for r in part], latents=noise[part], output_type="pil")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from PIL import Image

    n = args.prompts * args.group
    t2i = load_flow_generator(tiny_generator_path(), conditioning="base")
    edit = load_flow_generator(tiny_edit_generator_path(), conditioning="base")
    edit.edit_area = args.size ** 2
    for gen in (t2i, edit):
        gen.cfg_batched = gen.cfg_batchable
    drafts = [Image.new("RGB", (args.size, args.size), "white")] * n
    conds = {"reason": t2i.encode_condition([PROMPT] * n, height=args.size, width=args.size, negative_prompt=" "),
             "refine": edit.encode_condition([PROMPT] * n, images=drafts, height=args.size, width=args.size,
                                             negative_prompt=" ", image_guidance=True)}
    guidance = {"reason": Guidance(4.0, interval=(0.4, 1.0)),
                "refine": Guidance(4.0, interval=(0.4, 1.0), image_scale=1.5)}
    sde = [q % 3 for q in range(args.prompts)]  # groups at different SDE steps
    noise = torch.cat([t2i.prepare_latents(1, args.size, args.size, torch.Generator().manual_seed(q))
                       for q in range(args.prompts) for _ in range(args.group)])
    edited = [r for r in range(n) if (r * 0.6180339887) % 1 < args.edited]  # spread over the groups
    phases = {
        "reason, a batch per prompt": lambda g: groups(t2i, args, conds["reason"], sde, g, noise, guidance["reason"]),
        "reason, one batch": lambda g: one_batch(t2i, args, conds["reason"], sde, g, noise, guidance["reason"]),
        "refine all, a batch per prompt": lambda g: groups(edit, args, conds["refine"], sde, g, noise,
                                                           guidance["refine"]),
        "refine edited, one batch": lambda g: one_batch(edit, args, conds["refine"], sde, g, noise,
                                                        guidance["refine"], rows=edited),
    }
    best = {name: float("inf") for name in phases}
    for _ in range(args.repeats):
        for name, run in phases.items():
            generators = [torch.Generator().manual_seed(1000 + r) for r in range(n)]
            start = time.perf_counter()
            run(generators)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.prompts} prompts x {args.group} images, {args.steps} flow steps, {args.size} px, "
          f"{len(edited)}/{n} refine images edited, {args.threads} threads, best of {args.repeats}")
    for name, seconds in best.items():
        print(f"  {name:32s} {seconds:7.3f} s")
    print(f"reason: one batch / a batch per prompt = "
          f"{best['reason, one batch'] / best['reason, a batch per prompt']:.2f}x")
    print(f"refine: edited in one batch / all a batch per prompt = "
          f"{best['refine edited, one batch'] / best['refine all, a batch per prompt']:.2f}x")


if __name__ == "__main__":
    main()
