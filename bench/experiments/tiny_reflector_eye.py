"""Does the tiny reflector see better after a describe task? An experiment on the reflector warm start's eye.

    python bench/experiments/tiny_reflector_eye.py --out outputs/eye                        # as tiny-reflector is built
    python bench/experiments/tiny_reflector_eye.py --out outputs/eye0 --describe_steps 0      # the reflect SFT alone
    python bench/experiments/tiny_reflector_eye.py --probe tiny-reflector DIR ...   # is the colour in the image tokens?

Both arms start from tiny-planner with tiny-sft's vision tower and merger and end with the same reflect SFT
(recipes/stages/tiny_reflector.yaml on the reflector's rows, planner rows replayed). With --describe_steps > 0 a
describe SFT comes first, on other drafts of the same world (synthetic:reflect's rows of --describe_seed) under
tiny.reflector.DESCRIBE_PROMPT -> "I see <plan of the draft>", at the same recipe; 4000 steps at the recipe's
lr (1e-3) on 8192 drafts of seed 7 is tiny-describer, which tiny-reflector is trained from (tiny/cache.py). Printed
and written to OUT/scores.json, on the held-out reflector rows: what the description (after the describe SFT) and
the reflection's "I see ..." get right (count, colours, every object), and the reflection scores of
bench/experiments/tiny_reflector_report.py. --probe fits a linear probe (logistic regression) of an object's colour on
the merged image token of its cell, over one-object drafts (half to fit, half to test), and prints its test accuracy:
whether the eye passes the colour on, whatever the language model does with it.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiny import cache  # noqa: E402
from tiny.edits import reflector_rows  # noqa: E402
from tiny.reflector import (  # noqa: E402
    describe_rows,
    reflection_scores,
    reflections,
    reflector_sft_rows,
    seen_scores,
    with_eye,
)
from tiny.shapes import DEFAULT_COLORS
from utils.core.checkpoint import latest_checkpoint


def once(path, build):
    """`build(tmp)` into path + ".tmp", then renamed to `path`; skipped when `path` exists. Returns `path`."""
    if not os.path.isdir(path):
        build(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def sft(out, model, data, steps, threads, lr=None):
    if latest_checkpoint(out) is None or not os.path.exists(os.path.join(out, "train_summary.json")):
        subprocess.run([sys.executable, os.path.join(cache.REPO, "train_sft.py"), "--config",
                        cache.TINY_REFLECTOR_RECIPE, "--model_name_or_path", model, "--dataset_name", data,
                        "--output_dir", out, "--max_steps", str(steps), "--save_steps", str(steps),
                        "--cpu_threads", str(threads), *(["--learning_rate", str(lr)] if lr else [])],
                       check=True, env={**os.environ, "ACCELERATE_USE_CPU": "false"})
    return latest_checkpoint(out)


def score(model_dir, rows, describe):
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = reflections(model, AutoProcessor.from_pretrained(model_dir), rows, describe=describe)
    return texts, seen_scores(texts, rows)


def colour_probe(model_dir, n_rows=600, seed=5, epochs=300):
    """Test accuracy of a linear probe of the colour of a one-object draft's object on its cell's image token."""
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    path = cache.resolve_tiny_name(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    images = AutoProcessor.from_pretrained(path).image_processor
    feats, labels = [], []
    for row in reflector_rows(n_rows, seed=seed, image_size=32):
        objects = json.loads(row["draft"])
        if len(objects) != 1:
            continue
        # at 84 x 84 as the reflector recipe shows a draft (its min_pixels), whatever the folder's processor says
        inputs = images(images=[row["images"][0]], return_tensors="pt", size={"shortest_edge": 7056,
                                                                               "longest_edge": 28224})
        with torch.no_grad():
            tokens = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        tokens = getattr(tokens, "pooler_output", tokens)
        if tokens.shape[0] != 9:
            raise SystemExit(f"{model_dir}: {tokens.shape[0]} image tokens for a draft, expected 3 x 3")
        feats.append(tokens[objects[0]["cell"]])
        labels.append(DEFAULT_COLORS.index(objects[0]["color"]))
    x, y = torch.stack(feats), torch.tensor(labels)
    n = len(y) // 2
    x = (x - x[:n].mean(0)) / (x[:n].std(0) + 1e-6)
    weight = torch.zeros(x.shape[1], len(DEFAULT_COLORS), requires_grad=True)
    bias = torch.zeros(len(DEFAULT_COLORS), requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=0.05)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(x[:n] @ weight + bias, y[:n]).backward()
        opt.step()
    return ((x[n:] @ weight + bias).argmax(1) == y[n:]).float().mean().item(), n, len(y) - n


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--probe", nargs="+", help="models whose image tokens get the colour probe (then exit)")
    parser.add_argument("--describe_steps", type=int, default=4000)
    parser.add_argument("--describe_rows", type=int, default=8192)
    parser.add_argument("--describe_seed", type=int, default=7)
    parser.add_argument("--describe_lr", type=float, default=None, help="default: the reflect recipe's")
    parser.add_argument("--reflect_steps", type=int, default=4000)
    parser.add_argument("--reflect_lr", type=float, default=None, help="default: the reflect recipe's")
    parser.add_argument("--describe_from", default=None, help="continue the describe SFT from this checkpoint")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.probe:
        for name in args.probe:
            accuracy, fit, test = colour_probe(name)
            print(f"{name}: colour probe {accuracy:.3f} ({fit} drafts fitted, {test} tested)", flush=True)
        return
    if not args.out:
        parser.error("--out is required (or --probe)")
    os.makedirs(args.out, exist_ok=True)
    start = once(os.path.join(args.out, "planner-eye"),
                 lambda out: with_eye(cache.tiny_planner_path(), cache.tiny_sft_path(), out))
    held_out = reflector_rows(**cache.REFLECT_SPLITS["test"])
    result = {"args": vars(args)}
    if args.describe_steps > 0:
        data = once(os.path.join(args.out, "describe-rows"), lambda out: cache.save_sharegpt(describe_rows(
            reflector_rows(args.describe_rows, seed=args.describe_seed, image_size=32)), out))
        start = sft(os.path.join(args.out, "describe"), args.describe_from or start, data, args.describe_steps,
                    args.threads, args.describe_lr)
        _, result["describe"] = score(start, held_out, describe=True)
        print("after the describe SFT:", result["describe"], flush=True)
    if args.reflect_steps == 0:
        return
    data = once(os.path.join(args.out, "reflector-rows"), lambda out: cache.save_sharegpt(reflector_sft_rows(
        reflector_rows(**cache.REFLECT_SPLITS["train"]), cache._plan_rows(cache.REFLECTOR_PLAN_ROWS)), out))
    final = sft(os.path.join(args.out, "reflect"), start, data, args.reflect_steps, args.threads, args.reflect_lr)
    texts, result["reflection_seen"] = score(final, held_out, describe=False)
    result["reflection"] = reflection_scores(texts, held_out, image_size=32)
    result["model"] = final
    print(json.dumps(result, indent=2), flush=True)
    with open(os.path.join(args.out, "scores.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
