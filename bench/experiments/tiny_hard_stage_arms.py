"""Rerun cycle 1's hard GRPO stage of a tiny `iterate.py` run under named arms, to find why it lowers held-out
accuracy (docs/results/2026-12-01-tiny-cycles.md: 0.705 -> 0.550 over three seeds).

    python iterate.py --num_cycles 1 --seed S --output_dir RUN   # stopped once cycle-1/grpo-hard starts
    python bench/experiments/tiny_hard_stage_arms.py --run_dir RUN --arms unfrozen-hard frozen-hard unfrozen-random \\
        frozen-random unfrozen-hard-lr1e-05
    python bench/experiments/tiny_hard_stage_arms.py --run_dir RUN0 RUN1 RUN2                # the table of every arm

Each arm starts from the model iterate.py hands to the hard stage (the medium stage's pick) with the hard stage's
recipe exactly as iterate.py builds it, changed only by the arm:

    frozen / unfrozen   --freeze_vision_tower true / false (the recipe's hard stage: unfrozen)
    hard / random       the hard third of the cycle's difficulty estimate, or as many questions drawn uniformly
                        (seeded) from all 960, whatever their bucket
    -lrX                --learning_rate X (default: the recipe's)

It scores the stage's last checkpoint greedily on the held-out rows iterate.py uses (so the drop is seen, not
hidden by a validation pick), records what the validation pick would have chosen (the start's score is the
medium pick's own), and per answer: accuracy by the data set's difficulty label, the signed count error, and
whether the objects the model lists ("I see a red circle and ...") are the ones asked about. One JSON row per arm
is appended to RUN/cycle-1/arms/arms.jsonl; a finished arm (its row there) is skipped. Without --arms it prints
the rows of every --run_dir as one markdown table, with the mean over seeds of each arm.
"""

import argparse
import json
import os
import random
import re
import shutil
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import iterate  # noqa: E402
from tiny.cache import resolve_dataset
from tiny.cycle import _counted
from utils.core.config import parse_config  # noqa: E402

LEVEL_COLUMN = iterate.ESTIMATED_DIFFICULTY
LISTED = re.compile(r"\ban? (\w+) (circle|square|triangle)\b")


def parse_arm(name):
    """'unfrozen-hard-lr1e-05' -> {"freeze_vision_tower": False, "data": "hard", "learning_rate": 1e-05}."""
    parts = name.split("-", 2)
    if len(parts) < 2 or parts[0] not in ("frozen", "unfrozen") or parts[1] not in ("hard", "random") or (
            len(parts) == 3 and not parts[2].startswith("lr")):
        raise SystemExit(f"--arms: {name!r} is not (frozen|unfrozen)-(hard|random)[-lrX], e.g. unfrozen-hard-lr1e-05")
    arm = {"freeze_vision_tower": parts[0] == "frozen", "data": parts[1], "learning_rate": None}
    if len(parts) == 3:
        try:
            arm["learning_rate"] = float(parts[2][2:])
        except ValueError:
            raise SystemExit(f"--arms: {name!r}: {parts[2][2:]!r} is not a learning rate") from None
    return arm


def random_levels(levels, seed):
    """As many 'hard' labels as `levels` has, on questions drawn uniformly (seeded) from all of them; the rest
    'easy', so `--curriculum hard` trains on the draw."""
    n = sum(level == "hard" for level in levels)
    chosen = set(random.Random(seed).sample(range(len(levels)), n))
    return ["hard" if i in chosen else "easy" for i in range(len(levels))]


def _count(text):
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return None


def answer_stats(records, rows):
    """Held-out answers (evaluate.py's generations.jsonl records, in row order) against the rows: accuracy per
    difficulty label, signed count error, and whether the listed objects are the ones the question asks about."""
    by_level, errors, listed_ok, listed_agree, counting = {}, Counter(), 0, 0, 0
    for record, row in zip(records, rows, strict=True):
        by_level.setdefault(row["difficulty"], []).append(bool(record["correct"]))
        said, gold = _count(record["predicted_answer"]), _count(row["answer"])
        if row.get("kind") != "count" or gold is None:
            continue
        counting += 1
        errors["none" if said is None else said - gold] += 1
        truth, _ = _counted(row)
        think = record["completion"].split("</think>")[0]
        listed = Counter(LISTED.findall(think))
        listed_ok += listed == Counter((o["color"], o["shape"]) for o in truth)
        listed_agree += said is not None and sum(listed.values()) == said
    wrong = {k: v for k, v in errors.items() if k != 0}
    return {"accuracy": sum(r["correct"] for r in records) / len(records),
            "accuracy_by_difficulty": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_level.items())},
            "count_error": {str(k): v for k, v in sorted(wrong.items(), key=lambda kv: str(kv[0]))},
            "over_by_one": errors[1], "under_by_one": errors[-1],
            "signed_error_mean": (sum(k * v for k, v in wrong.items() if k != "none") /
                                  max(sum(v for k, v in wrong.items() if k != "none"), 1)),
            "listed_objects_correct": listed_ok / max(counting, 1),
            "answer_matches_listed": listed_agree / max(counting, 1)}


def heldout_rows(cfg):
    """The held-out rows evaluate.py scores (the first --eval_samples), without their images."""
    import datasets

    rows = datasets.load_from_disk(resolve_dataset(cfg.eval_dataset))[cfg.eval_split]
    rows = rows.select(range(min(cfg.eval_samples or len(rows), len(rows)))).remove_columns("image")
    return list(rows)


def main(args):
    run = args.run_dir
    cfg = parse_config(iterate.IterateConfig, ["--config", os.path.join(run, "config.yaml")])
    configs = iterate.script_configs()
    runner = iterate.Runner(cfg)
    cycle = os.path.join(run, "cycle-1")
    medium_pick = iterate.Runner.done(os.path.join(cycle, "grpo-medium-pick"))
    medium = medium_pick["best_checkpoint"] if medium_pick else iterate.Runner.done(
        os.path.join(cycle, "grpo-medium"))["checkpoint"]
    hard_rows = os.path.join(cycle, "grpo-hard-data")
    if not os.path.isdir(hard_rows) or iterate.Runner.done(os.path.join(cycle, "eval-grpo-medium")) is None:
        raise SystemExit(f"{run}: cycle 1 has no grpo-hard-data or eval-grpo-medium yet; run iterate.py first")
    arms_dir = os.path.join(cycle, "arms")
    runner.hold(arms_dir)  # a second runner on this run would train the same arm twice at once
    runner.forward_signals()
    table = os.path.join(arms_dir, "arms.jsonl")
    done = {json.loads(line)["arm"] for line in open(table)} if os.path.exists(table) else set()
    template = {"prompt_template": cfg.prompt_template}
    rows = heldout_rows(cfg)

    def read_records(folder):
        return iterate.read_rows(os.path.join(folder, "generations.jsonl"))

    medium_eval = os.path.join(cycle, "eval-grpo-medium")
    start = {"accuracy": iterate.eval_metrics(medium_eval)["accuracy"], **answer_stats(read_records(medium_eval), rows)}
    for name in args.arms:
        arm = parse_arm(name)
        if name in done:
            print(f"[arms] {name}: done earlier, skipped", flush=True)
            continue
        folder = os.path.join(arms_dir, name)
        data = hard_rows
        if arm["data"] == "random":
            data = os.path.join(arms_dir, "random-data")
            if not os.path.isdir(data):
                import datasets

                hard = datasets.load_from_disk(hard_rows)
                levels = random_levels(hard[LEVEL_COLUMN], seed=cfg.seed)
                tmp = f"{data}.tmp-{os.getpid()}"  # two drivers on one run may both write it: the first rename wins
                hard.remove_columns([LEVEL_COLUMN]).add_column(LEVEL_COLUMN, levels).save_to_disk(tmp)
                try:
                    os.rename(tmp, data)
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)
        overrides = {**cfg.grpo_hard, "freeze_vision_tower": arm["freeze_vision_tower"]}
        if arm["learning_rate"] is not None:
            overrides["learning_rate"] = arm["learning_rate"]
        forced = {"model_name_or_path": medium, "curriculum": ["hard"], "dataset_name": data, "dataset_split": "train",
                  "image_column": "image", "question_column": "question", "answer_column": "answer",
                  "difficulty_samples": 0, "difficulty_column": LEVEL_COLUMN, **template,
                  "output_dir": os.path.join(folder, "grpo"), "resume_from_checkpoint": "latest"}
        if cfg.rl_eval_steps:
            forced.update(save_steps=cfg.rl_eval_steps, save_total_limit=None)
        values = iterate.stage_recipe(cfg.grpo_hard_recipe, overrides, forced,
                                      defaults={"eval_dataset_name": None}, cycle={"seed": cfg.seed})
        grpo_dir = forced["output_dir"]
        recipe = os.path.join(grpo_dir, "recipe.yaml")
        if not runner.done(grpo_dir):
            iterate.start_stage(f"{name} grpo", grpo_dir, values, configs["grpo"])
        last = runner.run(f"{name} grpo", grpo_dir, runner.launch("train_grpo.py", recipe),
                          result=lambda: {"checkpoint": iterate.final_checkpoint(grpo_dir)})["checkpoint"]
        eval_dir = os.path.join(folder, "eval-last")
        ev = iterate.stage_recipe(None, dict(cfg.evaluate), {
            "model": last, "dataset": cfg.eval_dataset, "split": cfg.eval_split, "max_samples": cfg.eval_samples,
            "output_dir": eval_dir, **template})
        ev_recipe = os.path.join(eval_dir, "recipe.yaml")
        if not runner.done(eval_dir):
            iterate.start_stage(f"{name} eval", eval_dir, ev, configs["evaluate"])
        runner.run(f"{name} eval", eval_dir, runner.python("evaluate.py", ev_recipe))
        row = {"arm": name, "seed": cfg.seed, **arm, "medium_model": medium, "last_checkpoint": last,
               "start": start, "last": {"accuracy": iterate.eval_metrics(eval_dir)["accuracy"],
                                        **answer_stats(read_records(eval_dir), rows)}}
        if cfg.rl_eval_steps and medium_pick:
            pick_dir = os.path.join(folder, "pick")
            pv = iterate.stage_recipe(None, dict(cfg.evaluate), {
                "select_best": grpo_dir, "select_metric": cfg.val_metric, "dataset": os.path.join(run, "val-data"),
                "split": "train", "max_samples": None, "output_dir": pick_dir, **template})
            if not runner.done(pick_dir):
                iterate.start_stage(f"{name} pick", pick_dir, pv, configs["evaluate"])
            pick = runner.run(f"{name} pick", pick_dir, runner.python("evaluate.py", os.path.join(pick_dir,
                                                                                                  "recipe.yaml")),
                              result=lambda: iterate.picked(pick_dir))
            # the stage's start is the medium pick: its validation score is that pick's own
            steps = {"0": medium_pick["value"], **pick["steps"]}
            best = max(steps, key=lambda s: (steps[s], -int(s)))
            row["validation"] = {"steps": steps, "picked_step": int(best)}
        os.makedirs(arms_dir, exist_ok=True)
        with open(table, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[arms] {name}: held-out {row['start']['accuracy']:.3f} -> {row['last']['accuracy']:.3f}"
              + (f"; validation picks step {row['validation']['picked_step']}" if "validation" in row else ""),
              flush=True)


def _buckets(stats):
    return " / ".join(f"{v:.2f}" for _, v in sorted(stats["accuracy_by_difficulty"].items(),
                                                       key=lambda kv: ("easy", "medium", "hard").index(kv[0])))


def table(run_dirs):
    """Markdown: one line per (seed, arm), then each arm's mean over the seeds that ran it."""
    rows = []
    for run in run_dirs:
        path = os.path.join(run, "cycle-1", "arms", "arms.jsonl")
        rows += [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    lines = ["| seed | arm | medium | last | change | validation (step: score) -> pick | over by one | mean signed "
             "error of wrong counts | listed objects right | accuracy easy / medium / hard |", "|" + "---|" * 10]
    for r in rows:
        a, b = r["start"], r["last"]
        val = r.get("validation")
        picked = (", ".join(f"{k}: {v:.3f}" for k, v in val["steps"].items()) + f" -> {val['picked_step']}"
                  if val else "")
        lines.append(f"| {r['seed']} | {r['arm']} | {a['accuracy']:.3f} | {b['accuracy']:.3f} | "
                     f"{b['accuracy'] - a['accuracy']:+.3f} | {picked} | {a['over_by_one']} -> {b['over_by_one']} | "
                     f"{a['signed_error_mean']:+.2f} -> {b['signed_error_mean']:+.2f} | "
                     f"{a['listed_objects_correct']:.2f} -> {b['listed_objects_correct']:.2f} | "
                     f"{_buckets(a)} -> {_buckets(b)} |")
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        mean = lambda f: sum(f(r) for r in mine) / len(mine)  # noqa: E731
        lines.append(f"| mean of {len(mine)} | {arm} | {mean(lambda r: r['start']['accuracy']):.3f} | "
                     f"{mean(lambda r: r['last']['accuracy']):.3f} | "
                     f"{mean(lambda r: r['last']['accuracy'] - r['start']['accuracy']):+.3f} | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run_dir", nargs="+", required=True,
                        help="iterate.py --output_dir(s) whose cycle 1 reached grpo-hard (one with --arms)")
    parser.add_argument("--arms", nargs="+", help="(frozen|unfrozen)-(hard|random)[-lrX]; none: print the table")
    args = parser.parse_args()
    if not args.arms:
        print(table(args.run_dir))
    elif len(args.run_dir) > 1:
        parser.error("--arms runs on one --run_dir")
    else:
        main(argparse.Namespace(run_dir=args.run_dir[0], arms=args.arms))
