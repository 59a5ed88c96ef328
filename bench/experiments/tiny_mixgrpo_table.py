"""The table of a results page from tiny Mix-GRPO runs with both stages: each run's held-out reason and reason +
refine scores before and after training (train_summary.json), and the issue's targets as means over the runs.

    python bench/experiments/tiny_mixgrpo_table.py outputs/mix/s0 outputs/mix/s1 outputs/mix/s2
"""

import argparse
import json
import os
import statistics


def run_row(summary):
    """One run's numbers from its train_summary.json entries (heldout_<key>_<before|after>)."""
    def get(key, when):
        return summary[f"heldout_{key}_{when}"]

    return dict(
        reason_before=get("reward", "before"), reason_after=get("reward", "after"),
        refine_before=get("refine_reward", "before"), refine_after=get("refine_reward", "after"),
        refine_gain_before=get("refine_reward", "before") - get("reward", "before"),
        refine_gain_after=get("refine_reward", "after") - get("reward", "after"),
        reason_gain=get("reward", "after") - get("reward", "before"),
        perfect_worse_before=get("refine_perfect_worse", "before"),
        perfect_worse_after=get("refine_perfect_worse", "after"),
        kept_before=get("refine_no_edit", "before"), kept_after=get("refine_no_edit", "after"),
        detected_before=get("detected", "before"), detected_after=get("detected", "after"),
        refine_detected_after=get("refine_detected", "after"), requested=get("requested", "after"),
        rounds_before=[summary[k] for k in sorted(summary) if k.startswith("heldout_round") and
                       k.endswith("_reward_before")],
        rounds_after=[summary[k] for k in sorted(summary) if k.startswith("heldout_round") and
                      k.endswith("_reward_after")])


def tables(rows, names):
    """Markdown: the per-run table, the targets (means over the runs) and the per-round scores."""
    lines = ["| run | reason: before -> after | reason + refine: before -> after | refine gain: before -> after "
             "| perfect drafts made worse: before -> after | kept as drawn | objects detected (asked) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in zip(names, rows):
        lines.append(
            f"| {name} | {r['reason_before']:.3f} -> {r['reason_after']:.3f} ({r['reason_gain']:+.3f}) "
            f"| {r['refine_before']:.3f} -> {r['refine_after']:.3f} "
            f"| {r['refine_gain_before']:+.3f} -> {r['refine_gain_after']:+.3f} "
            f"| {r['perfect_worse_before']:.3f} -> {r['perfect_worse_after']:.3f} "
            f"| {r['kept_before']:.2f} -> {r['kept_after']:.2f} "
            f"| {r['detected_before']:.2f} -> {r['detected_after']:.2f} "
            f"(refined {r['refine_detected_after']:.2f}; {r['requested']:.2f}) |")

    def mean(key):
        return statistics.mean(r[key] for r in rows)

    lines += ["", "| target | measured (mean over runs) | met |", "|---|---|---|"]
    checks = [
        ("reason + refine beats reason alone after training by >= 0.05", f"{mean('refine_gain_after'):+.3f}",
         mean("refine_gain_after") >= 0.05),
        ("refine makes a perfect first draft worse in < 5 % of cases (after)", f"{mean('perfect_worse_after'):.3f}",
         mean("perfect_worse_after") < 0.05),
        ("reason alone gains >= 0.05 over the warm start", f"{mean('reason_gain'):+.3f}", mean("reason_gain") >= 0.05),
        ("refine gain after training > refine gain before",
         f"{mean('refine_gain_after'):+.3f} vs {mean('refine_gain_before'):+.3f}",
         mean("refine_gain_after") > mean("refine_gain_before")),
        ("objects per image within 0.1 of asked, or below the warm start's",
         f"{mean('detected_after'):.2f} (asked {mean('requested'):.2f}, warm start {mean('detected_before'):.2f})",
         abs(mean("detected_after") - mean("requested")) <= 0.1 or mean("detected_after") <= mean("detected_before")),
    ]
    lines += [f"| {what} | {value} | {'yes' if ok else 'no'} |" for what, value, ok in checks]
    lines += ["", "| run | before: round 1 / 2 / 3 / 4 | after: round 1 / 2 / 3 / 4 |", "|---|---|---|"]
    for name, r in zip(names, rows):
        lines.append(f"| {name} | {' / '.join(f'{v:.3f}' for v in r['rounds_before'])} "
                     f"| {' / '.join(f'{v:.3f}' for v in r['rounds_after'])} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="output folders of train_mixgrpo.py runs with --reflect_refine")
    args = parser.parse_args()
    rows = []
    for run in args.runs:
        path = os.path.join(run, "train_summary.json")
        with open(path) as f:
            summary = json.load(f)
        if "heldout_refine_reward_after" not in summary:
            parser.error(f"{path}: no held-out reason + refine scores (a run without --reflect_refine?)")
        rows.append(run_row(summary))
    print(tables(rows, args.runs))


if __name__ == "__main__":
    main()
