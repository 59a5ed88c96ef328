"""Held-out edit success of the tiny edit generator against the identity edit and its untrained (warm-start)
transformer, per edit kind, and a grid of its edits.

    python bench/experiments/tiny_edit_generator_report.py      # the cached default edit generator (built on first use)
    python bench/experiments/tiny_edit_generator_report.py --path DIR --n 256 --grid grid.png --json out.json

It edits the held-out triples (tiny.edits.edit_triples(n, seed=1): the synthetic:edits test split) with ODE steps
under the tiny Mix-GRPO recipe's refine guidance (tiny.edit_generator.EVAL_GUIDANCE), and counts an edit a success
when the detector finds exactly the edited scene's objects: the cells the instruction names hold what the target
holds there (`carried`) and every other cell holds what it held (`kept`). The grid shows, per row, the input, the
instruction, the trained and untrained edits and the target.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiny.cache import tiny_edit_generator_path
from tiny.edit_generator import EVAL_GUIDANCE, OUTCOMES, evaluate_edit_generator, grid_png, to_tensor  # noqa: E402


def table_markdown(tables) -> str:
    labels = list(tables)
    lines = ["| kind | n | " + " | ".join(f"{label} success" for label in labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for kind, first in tables[labels[0]].items():
        lines.append(f"| {kind} | {first['n']} | " + " | ".join(f"{tables[lab][kind]['success']:.2f}"
                                                               for lab in labels) + " |")
    for outcome in OUTCOMES[1:]:
        lines.append(f"| all: {outcome} | {tables[labels[0]]['all']['n']} | "
                     + " | ".join(f"{tables[lab]['all'][outcome]:.2f}" for lab in labels) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=None, help="an edit generator folder (default: the cached default build)")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--guidance_scale", type=float, default=EVAL_GUIDANCE["guidance_scale"])
    parser.add_argument("--image_scale", type=float, default=EVAL_GUIDANCE["image_scale"])
    parser.add_argument("--num_steps", type=int, default=EVAL_GUIDANCE["num_steps"])
    parser.add_argument("--untrained", action=argparse.BooleanOptionalAction, default=True,
                        help="also edit with the transformer the build started from (--no-untrained: skip it)")
    parser.add_argument("--grid", default=None, help="write a grid PNG of the first --grid_rows rows here")
    parser.add_argument("--grid_rows", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the tables here")
    args = parser.parse_args(argv)
    if args.path is None:
        args.path = tiny_edit_generator_path()
    out = evaluate_edit_generator(args.path, n=args.n, seed=args.seed, image_scale=args.image_scale,
                                  guidance_scale=args.guidance_scale, num_steps=args.num_steps,
                                  untrained=args.untrained)
    print(table_markdown(out["tables"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "args": vars(args), "tables": out["tables"]}, f, indent=2)
    if args.grid:
        k, ims = args.grid_rows, out["images"]
        columns = [("input", ims["identity"][:k]), ("edited", ims["trained"][:k])]
        columns += [("untrained", ims["untrained"][:k])] if "untrained" in ims else []
        columns += [("target", to_tensor([r["image_after"] for r in out["rows"][:k]]))]
        print("grid:", grid_png(args.grid, out["rows"][:k], columns))


if __name__ == "__main__":
    main()
