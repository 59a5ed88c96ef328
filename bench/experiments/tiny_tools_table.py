"""The tiny tool task's table: GRPO with and without tools from the same warm start, over seeds, and the issue's
targets (with tools: held-out accuracy after GRPO >= the warm start's + 0.10 and >= GRPO without tools + 0.15).

    python bench/experiments/tiny_tools_table.py --with outputs/tools/s0 outputs/tools/s1 outputs/tools/s2 \\
        --without outputs/notools/s0 outputs/notools/s1 outputs/notools/s2

Each folder is a train_grpo.py run of recipes/tiny_tools.yaml (the --without runs with --tools ''); the numbers
are the held-out accuracies its train_summary.json holds (before: the warm start, with or without the tool).
"""

import argparse
import json
import os
import statistics


def accuracies(folder):
    with open(os.path.join(folder, "train_summary.json")) as f:
        summary = json.load(f)
    return summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]


def table(with_tools, without_tools, names=None):
    """Markdown: one row per seed, then the targets on the means over the seeds."""
    names = names or [f"seed {i}" for i in range(len(with_tools))]
    lines = ["| run | warm start, with the tool | after GRPO with tools | warm start, without | after GRPO without "
             "tools | with - warm start | with - without |", "|---|---|---|---|---|---|---|"]
    rows = []
    for name, (wb, wa), (nb, na) in zip(names, with_tools, without_tools):
        rows.append((wb, wa, nb, na))
        lines.append(f"| {name} | {wb:.3f} | {wa:.3f} | {nb:.3f} | {na:.3f} | {wa - wb:+.3f} | {wa - na:+.3f} |")
    mean = [statistics.mean(r[i] for r in rows) for i in range(4)]
    lines.append(f"| mean | {mean[0]:.3f} | {mean[1]:.3f} | {mean[2]:.3f} | {mean[3]:.3f} | {mean[1] - mean[0]:+.3f} "
                 f"| {mean[1] - mean[3]:+.3f} |")
    lines += ["", "| target | measured (mean over runs) | met |", "|---|---|---|",
              f"| with tools: after GRPO >= the warm start + 0.10 | {mean[1] - mean[0]:+.3f} | "
              f"{'yes' if mean[1] - mean[0] >= 0.10 else 'no'} |",
              f"| with tools >= GRPO without tools + 0.15 | {mean[1] - mean[3]:+.3f} | "
              f"{'yes' if mean[1] - mean[3] >= 0.15 else 'no'} |"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with", dest="with_tools", nargs="+", required=True)
    parser.add_argument("--without", nargs="+", required=True)
    args = parser.parse_args(argv)
    if len(args.with_tools) != len(args.without):
        parser.error("give one --without run per --with run (the same seeds, in order)")
    print(table([accuracies(f) for f in args.with_tools], [accuracies(f) for f in args.without]))


if __name__ == "__main__":
    main()
