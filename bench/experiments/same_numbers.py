"""Do two runs of the same recipe give the same numbers? Compares two output folders of train_grpo.py,
train_mixgrpo.py or train_sft.py, e.g. one run at an older commit and one at the newest:

    python bench/experiments/same_numbers.py /tmp/before/grpo /tmp/after/grpo

metrics.jsonl value for value on every key except wall-clock and memory ones (TIMING_KEYS: they measure the
machine, not the run), every other JSON file value for value (completions.jsonl, train_summary.json minus its
timing keys, trainer states), safetensors tensor for tensor (weights, LoRA adapters) and the rest byte for byte
(optimizer and random states, held-out images). Prints the first difference of each file
(row and key), the keys and files only one side writes, and exits 1 if a file of numbers (NUMBER_FILES) differs;
the config file and the run's own log folders (tensorboard events, whose bytes hold wall-clock times) are left out.
"""

import argparse
import filecmp
import json
import os
import sys

import torch
from safetensors import safe_open

# Keys whose value is a wall-clock time, a speed or a memory size: they differ between any two runs.
TIMING_KEYS = ("step_time", "time/", "_time", "time_", "seconds", "throughput", "per_second", "tokens_per_s",
               "memory", "mem_", "peak_", "runtime", "elapsed", "wall")
# Files of numbers: metrics, completions, summaries and held-out results, weights, optimizer and random states, plots.
# Others (chat templates, a run's lock, files only one side writes) are listed but decide nothing.
NUMBER_FILES = (".json", ".jsonl", ".safetensors", ".bin", ".pkl", ".pt", ".png", ".npy")
LEFT_OUT = ("config.yaml", "mmgrpo", "runs", "logs", "tensorboard")  # written config (paths differ), log folders


def is_timing(key):
    return any(part in key for part in TIMING_KEYS)


def dumps(value):
    """A value's exact text (NaN equals NaN; floats in full)."""
    return json.dumps(value, sort_keys=True)


def first_difference(a_rows, b_rows):
    """(row index, key, a value, b value) of the first difference in a key both rows hold, or None; timing keys
    skipped. A key only one side writes is no difference here: new_keys lists them."""
    if len(a_rows) != len(b_rows):
        return (min(len(a_rows), len(b_rows)), "<rows>", len(a_rows), len(b_rows))
    for i, (a, b) in enumerate(zip(a_rows, b_rows)):
        if not (isinstance(a, dict) and isinstance(b, dict)):
            if dumps(a) != dumps(b):
                return (i, "<row>", a, b)
            continue
        for key in sorted(set(a) & set(b)):
            if not is_timing(key) and dumps(a[key]) != dumps(b[key]):
                return (i, key, a[key], b[key])
    return None


def new_keys(a_rows, b_rows):
    """The top-level keys only before's rows write and those only after's rows write."""
    a = {k for row in a_rows if isinstance(row, dict) for k in row}
    b = {k for row in b_rows if isinstance(row, dict) for k in row}
    return sorted(a - b), sorted(b - a)


def tensors_difference(a_path, b_path):
    """The first tensor (by name) whose dtype, shape or values differ, or None. The header's metadata is left to the
    caller: PEFT writes an adapter's target_modules from a set, so their order follows the process's string hash."""
    with safe_open(a_path, "pt") as a, safe_open(b_path, "pt") as b:
        if sorted(a.keys()) != sorted(b.keys()):
            return ("-", "<tensor names>", sorted(set(a.keys()) - set(b.keys())), sorted(set(b.keys()) - set(a.keys())))
        for key in sorted(a.keys()):
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return ("-", key, "", "")
    return None


def read_rows(path):
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return [json.load(f)]


def files(folder):
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in LEFT_OUT)
        out += [os.path.relpath(os.path.join(root, n), folder) for n in sorted(names) if n not in LEFT_OUT]
    return out


def compare(before, after):
    """(whether every file of numbers both runs wrote is the same, lines of the comparison)."""
    lines, same = [], True
    a_files, b_files = files(before), files(after)
    for missing in sorted(set(a_files) ^ set(b_files)):
        lines.append(f"only in {'before' if missing in a_files else 'after'}: {missing}")
    timing = set()
    for name in sorted(set(a_files) & set(b_files)):
        a, b = os.path.join(before, name), os.path.join(after, name)
        if name.endswith((".json", ".jsonl")):
            a_rows, b_rows = read_rows(a), read_rows(b)
            timing |= {k for row in a_rows + b_rows if isinstance(row, dict) for k in row if is_timing(k)}
            diff = first_difference(a_rows, b_rows)
            what = f"{len(a_rows)} rows" if name.endswith(".jsonl") else "values"
            only_before, only_after = new_keys(a_rows, b_rows)
            what += "".join(f"; keys only {side}: {', '.join(keys)}"
                            for side, keys in (("before", only_before), ("after", only_after)) if keys)
        elif name.endswith(".safetensors"):
            diff, what = tensors_difference(a, b), "tensors"
            if diff is None and not filecmp.cmp(a, b, shallow=False):
                what += " (the header's metadata differs)"
        else:
            diff = None if filecmp.cmp(a, b, shallow=False) else ("-", "<bytes>", "", "")
            what = "bytes"
        same &= diff is None or not name.endswith(NUMBER_FILES)
        lines.append(f"{name}: {'same ' + what if diff is None else 'DIFFERS at row %s key %s: %r vs %r' % diff}")
    lines.append(f"left out: {', '.join(LEFT_OUT)}; timing keys skipped: {', '.join(sorted(timing)) or 'none'}")
    return same, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    same, lines = compare(args.before, args.after)
    print("\n".join(lines))
    print("same numbers" if same else "DIFFERENT numbers")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
