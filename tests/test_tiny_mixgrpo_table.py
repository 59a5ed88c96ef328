"""bench/experiments/tiny_mixgrpo_table.py: the results table of both-stage tiny Mix-GRPO runs and the issue's
targets."""

import json
import subprocess
import sys

from bench.experiments.tiny_mixgrpo_table import run_row, tables


def _summary(reason, refine, perfect_worse, detected, rounds):
    out = {}
    for when, i in (("before", 0), ("after", 1)):
        out.update({f"heldout_reward_{when}": reason[i], f"heldout_refine_reward_{when}": refine[i],
                    f"heldout_refine_perfect_worse_{when}": perfect_worse[i], f"heldout_refine_no_edit_{when}": 0.5,
                    f"heldout_detected_{when}": detected[i], f"heldout_refine_detected_{when}": detected[i],
                    f"heldout_requested_{when}": 1.8})
        out.update({f"heldout_round{n}_reward_{when}": v for n, v in enumerate(rounds[i], 1)})
    return out


def test_targets_are_means_over_runs_and_each_is_judged():
    a = run_row(_summary((0.40, 0.50), (0.40, 0.58), (0.10, 0.02), (2.0, 1.85), ([0.4, 0.4], [0.55, 0.58])))
    b = run_row(_summary((0.40, 0.44), (0.42, 0.47), (0.10, 0.06), (2.0, 2.3), ([0.41, 0.42], [0.46, 0.47])))
    assert round(a["refine_gain_after"], 6) == 0.08 and round(b["refine_gain_before"], 6) == 0.02
    text = tables([a, b], ["s0", "s1"])
    targets = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[-1] for line in text.splitlines()
               if line.endswith("yes |") or line.endswith("no |")}
    assert targets["reason + refine beats reason alone after training by >= 0.05"] == "yes"  # (0.08 + 0.03) / 2
    assert targets["refine makes a perfect first draft worse in < 5 % of cases (after)"] == "yes"  # 0.04
    assert targets["reason alone gains >= 0.05 over the warm start"] == "yes"  # (0.10 + 0.04) / 2 = 0.07
    assert targets["refine gain after training > refine gain before"] == "yes"  # 0.055 vs 0.01
    assert targets["objects per image within 0.1 of asked, or below the warm start's"] == "no"  # 2.075, asked 1.8
    assert "| s0 | 0.400 / 0.400 | 0.550 / 0.580 |" in text


def test_a_run_without_refine_scores_is_named(tmp_path):
    (tmp_path / "train_summary.json").write_text(json.dumps({"heldout_reward_after": 0.5}))
    out = subprocess.run([sys.executable, "bench/experiments/tiny_mixgrpo_table.py", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and f"{tmp_path}/train_summary.json: no held-out reason + refine" in out.stderr
