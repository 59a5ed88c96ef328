"""What a tiny planner reads from its prompt, and what its greedy plans look like: before and after RL.

    python bench/experiments/tiny_planner_reads.py tiny-planner                               # the shipped warm start
    python bench/experiments/tiny_planner_reads.py tiny-planner outputs/tiny-mixgrpo/checkpoint-400  # and after RL

For each planner (a tiny model name, a folder, or a train_mixgrpo checkpoint) it prints the shape reading and the
colour reading (tiny.planner: teacher-forced, renormalised over the shape / colour words; chance 1/3 and 1/5 when
nothing flows from the prompt to that position), and over the held-out prompts (make_t2i_prompts(n, seed=1)) the
greedy plans' share that names exactly the requested objects, the objects planned per prompt (asked: the mean
count), the share of coloured prompts whose plan names every requested colour, the plans' most common first colour
(a planner that ignores colours writes one colour first on every prompt) and the share of planned objects in the
left / centre / right columns. Every planner after the first also prints how many of its plans differ from the
first one's. Used for docs/results/2026-12-05-tiny-planner-colour-blind.md.
"""

import argparse
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiny.cache import TINY_MODELS  # noqa: E402
from tiny.generator import heldout_rows  # noqa: E402
from tiny.planner import colour_reading, load_planner, planner_plans, shape_reading  # noqa: E402
from tiny.t2i import COLS_3, plan_matches_request, plan_objects  # noqa: E402


def plan_columns(plan):
    """The column word ("left", "center", "right") of each object a scene plan places on the 3 x 3 grid."""
    return [part.split()[-1] for part in plan.split(",") if part.split() and part.split()[-1] in COLS_3]


def plan_stats(plans, rows):
    """The numbers printed per planner (a dict), from its greedy plans of `rows`."""
    coloured = [(p, r) for p, r in zip(plans, rows) if any("color" in item for item in r["include"])]
    objects = [plan_objects(p) for p in plans]
    columns = Counter(column for p in plans for column in plan_columns(p))
    firsts = Counter(objs[0][0] for objs in objects if objs)
    top, top_n = firsts.most_common(1)[0] if firsts else ("-", 0)
    colours_named = sum({item["color"] for item in r["include"] if "color" in item}
                        <= {c for c, _ in plan_objects(p)} for p, r in coloured)
    placed = sum(columns.values()) or 1
    return {"right": sum(plan_matches_request(p, r) for p, r in zip(plans, rows)) / len(rows),
            "objects": sum(len(o) for o in objects) / len(rows),
            "asked": sum(int(item["count"]) for r in rows for item in r["include"]) / len(rows),
            "coloured_named": colours_named / max(1, len(coloured)), "coloured_rows": len(coloured),
            "first_colour": (top, top_n / max(1, sum(firsts.values()))),
            "columns": {c: columns[c] / placed for c in COLS_3}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("planners", nargs="+", help="tiny model names or folders (the first is the reference)")
    ap.add_argument("--n", type=int, default=256, help="held-out prompts (make_t2i_prompts(n, seed=1))")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for name in args.planners:
        if name not in TINY_MODELS and not os.path.isfile(os.path.join(name, "config.json")):
            ap.error(f"planner {name!r}: neither a tiny model name ({', '.join(TINY_MODELS)}) nor a model folder")
    torch.set_num_threads(args.threads)
    rows = heldout_rows(args.n)
    first = None
    for name in args.planners:
        model, processor = load_planner(name)
        plans = planner_plans(model, processor, rows)
        s = plan_stats(plans, rows)
        changed = "" if first is None else f"; plans changed vs the first: {sum(a != b for a, b in zip(first, plans))}"
        first = plans if first is None else first
        cols = " / ".join(f"{s['columns'][c]:.2f}" for c in COLS_3)
        print(f"{name}\n  shape reading {shape_reading(model, processor):.3f} (chance 0.333), colour reading "
              f"{colour_reading(model, processor):.3f} (chance 0.200)\n  {len(rows)} held-out plans: right "
              f"{s['right']:.3f}, objects {s['objects']:.2f} (asked {s['asked']:.2f}), coloured prompts with every "
              f"colour named {s['coloured_named']:.3f} (of {s['coloured_rows']}), first colour "
              f"'{s['first_colour'][0]}' on {s['first_colour'][1]:.2f}, columns left / centre / right {cols}"
              f"{changed}", flush=True)


if __name__ == "__main__":
    main()
