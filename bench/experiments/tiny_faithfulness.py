"""Right answer, wrong reasons, in miniature: the tiny GRPO recipe with CPR against the answer-only ablation.

    python bench/experiments/tiny_faithfulness.py       # both recipes, seeds 0 and 1 (about 7-8 min per run on 2 cores)
    python bench/experiments/tiny_faithfulness.py --seeds 0 1 2 --recipes tiny_grpo
    python bench/experiments/tiny_faithfulness.py --seeds 0 1 2 --recipes tiny_grpo --tag dynamic \
        --train_flags "--dynamic_sampling true" --skip_evaluate          # held-out accuracy only

For each recipe and seed it runs `train_grpo.py --config recipes/<recipe>.yaml --seed S` (skipped when
that run's train_summary.json exists), then `evaluate.py --metrics crystal` on the final checkpoint, and
prints held-out accuracy before and after GRPO with two faithfulness measures of the reasoning: Match F1
of the reasoning steps against the reference steps (crystal-metrics, offline MiniLM), and the share of
answered completions whose last reasoning step states the answer the completion gives. It also splits
accuracy by question kind ("How many circles?" = count, "How many red shapes?" = count_color) and gives the
share of count_color answers that equal the number of objects of any colour (a colour-blind count).
"""

import argparse
import json
import os
import subprocess
import sys

import datasets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tiny.cache import shapes_dataset_path, tiny_sft_path  # noqa: E402


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def evaluate(model, out_dir):
    """evaluate.py --metrics crystal on the held-out split into out_dir, unless it is already there."""
    if not os.path.exists(os.path.join(REPO, out_dir, "metrics.json")):
        run([sys.executable, "evaluate.py", "--model", model, "--dataset", "synthetic:shapes", "--split", "test",
             "--metrics", "crystal", "--max_new_tokens", "128", "--batch_size", "64", "--output_dir", out_dir])
    with open(os.path.join(REPO, out_dir, "metrics.json")) as f:
        return json.load(f)


def held_out_objects():
    """id -> (question kind, number of objects) of the held-out shapes questions."""
    test = datasets.load_from_disk(shapes_dataset_path())["test"].select_columns(["id", "kind", "objects"])
    return {r["id"]: (r["kind"], len(json.loads(r["objects"]))) for r in test}


def kind_breakdown(generations_path, meta):
    """{"count": acc, "count_color": acc, "colour_blind": share} of an evaluate.py generations.jsonl."""
    acc, blind = {}, []
    with open(generations_path) as f:
        for line in f:
            row = json.loads(line)
            kind, n_objects = meta[row["id"]]
            acc.setdefault(kind, []).append(bool(row["correct"]))
            if kind == "count_color":
                blind.append(row["predicted_answer"] == str(n_objects))
    out = {kind: sum(v) / len(v) for kind, v in acc.items()}
    out["colour_blind"] = sum(blind) / max(len(blind), 1)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["tiny_grpo", "tiny_answer_only"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--out", default="outputs/faithfulness")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--train_flags", default="", help="extra train_grpo.py flags for every run, e.g. "
                        "'--dynamic_sampling true'")
    parser.add_argument("--tag", default="", help="added to the run folders' names (runs with other flags)")
    parser.add_argument("--skip_evaluate", action="store_true",
                        help="no evaluate.py pass: held-out accuracy (train_grpo.py's own) only")
    args = parser.parse_args()
    os.chdir(REPO)  # the tiny cache and --out are relative to the repository
    meta = held_out_objects()
    if not args.skip_evaluate:
        warm = os.path.join(args.out, "warm-start-eval")
        warm_scores = evaluate(tiny_sft_path(), warm)
        warm_kinds = kind_breakdown(os.path.join(REPO, warm, "generations.jsonl"), meta)
        print(f"warm start: accuracy {warm_scores['accuracy']:.3f}, Match F1 {warm_scores['match_f1']:.3f}, "
              f"count {warm_kinds['count']:.3f}, count_color {warm_kinds['count_color']:.3f}, "
              f"colour-blind count_color answers {warm_kinds['colour_blind']:.3f}")
    rows = []
    for recipe in args.recipes:
        for seed in args.seeds:
            out = os.path.join(args.out, f"{recipe}{'-' + args.tag if args.tag else ''}-seed{seed}")
            summary_path = os.path.join(REPO, out, "train_summary.json")
            if not os.path.exists(summary_path):
                run([sys.executable, "train_grpo.py", "--config", f"recipes/{recipe}.yaml", "--seed", str(seed),
                     "--output_dir", out, "--report_to", "none", *args.train_flags.split()])
            with open(summary_path) as f:
                summary = json.load(f)
            row = dict(recipe=recipe + (f" ({args.tag})" if args.tag else ""), seed=seed,
                       accuracy_before=summary.get("heldout_accuracy_before"),
                       accuracy_after=summary.get("heldout_accuracy_after"),
                       reasoning_agrees_before=summary.get("heldout_reasoning_agrees_before"),
                       reasoning_agrees_after=summary.get("heldout_reasoning_agrees_after"),
                       train_runtime=summary.get("train_runtime"), match_f1=None, count=None, count_color=None,
                       colour_blind=None)
            if not args.skip_evaluate:
                checkpoint = os.path.join(out, f"checkpoint-{summary['global_step']}")
                eval_dir = os.path.join(out, "eval")
                scores = evaluate(checkpoint, eval_dir)
                row["match_f1"] = scores.get("crystal", scores).get("match_f1")
                row.update(kind_breakdown(os.path.join(REPO, eval_dir, "generations.jsonl"), meta))
            rows.append(row)
    print("\n| recipe | seed | held-out accuracy before -> after | reasoning states the answer before -> after "
          "| Match F1 after | count | count_color | colour-blind count_color answers | GRPO seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        print(f"| {r['recipe']} | {r['seed']} | {fmt(r['accuracy_before'])} -> {fmt(r['accuracy_after'])} | "
              f"{fmt(r['reasoning_agrees_before'])} -> {fmt(r['reasoning_agrees_after'])} | {fmt(r['match_f1'])} | "
              f"{fmt(r['count'])} | {fmt(r['count_color'])} | {fmt(r['colour_blind'])} | {fmt(r['train_runtime'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
