"""Held-out scores of the tiny reflector (the warm start of the tiny job's reflect stage) against the planner it
starts from.

    python bench/experiments/tiny_reflector_report.py              # tiny-reflector vs tiny-planner (built on first use)
    python bench/experiments/tiny_reflector_report.py --models tiny-reflector DIR --n 256

Each model reflects greedily on the held-out reflector rows (synthetic:reflect's test split: prompts and flawed
drafts of another seed) under train_mixgrpo's reflect prompt. A reflection is right when its instruction, carried
out on the draft, gives the prompt's render, or when it keeps a draft that already is it (tiny.reflector). As a
reference, "always no edit" is right on the flawless fifth of the rows. Each model also plans the held-out
text-to-image prompts under the reason prompt: the share of plans naming exactly the requested objects shows
whether learning to reflect cost the reason step.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiny.cache import (  # noqa: E402
    REFLECT_SPLITS,
    TINY_PLANNER_MODEL,
    TINY_REFLECT_DATASET,
    TINY_REFLECTOR_MODEL,
    resolve_dataset,
)
from tiny.planner import load_planner, planner_plans  # noqa: E402
from tiny.reflector import reflection_scores, reflections  # noqa: E402
from tiny.t2i import make_t2i_prompts, plan_matches_request  # noqa: E402
from utils.core.data import load_sharegpt  # noqa: E402

COLUMNS = ("format", "fixed", "fixed/missing", "fixed/extra", "fixed/wrong_color", "fixed/wrong_position",
           "fixed/none", "kept_flawed", "plans_match")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[TINY_REFLECTOR_MODEL, TINY_PLANNER_MODEL])
    parser.add_argument("--n", type=int, default=256, help="held-out rows of each kind (at most 256)")
    args = parser.parse_args()
    table = load_sharegpt(resolve_dataset(TINY_REFLECT_DATASET), split="test")
    rows = [table[i] for i in range(min(args.n, len(table)))]
    prompts = make_t2i_prompts(args.n, seed=1)
    size = REFLECT_SPLITS["test"]["image_size"]
    results = {"always no edit": reflection_scores(["<think></think> no further edit needed"] * len(rows), rows,
                                                   image_size=size)}
    for name in args.models:
        start = time.time()
        model, processor = load_planner(name)
        results[name] = reflection_scores(reflections(model, processor, rows), rows, image_size=size)
        plans = planner_plans(model, processor, prompts)
        results[name]["plans_match"] = sum(map(plan_matches_request, plans, prompts)) / len(prompts)
        print(f"{name}: {time.time() - start:.0f} s", flush=True)
    print(f"\n{len(rows)} held-out reflect rows, {len(prompts)} held-out prompts\n")
    print("| model | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, scores in results.items():
        print(f"| {name} | " + " | ".join(f"{scores[c]:.3f}" if c in scores else "" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
