"""bench/experiments/same_numbers.py: two runs' folders compared, timing keys and a LoRA header's order aside."""

import json
import subprocess
import sys

import torch
from safetensors.torch import save_file

from bench.experiments.same_numbers import compare
from tests.launch_helpers import REPO


def run_folder(path, loss=0.5, step_time=1.0, extra=None, metadata=None, weight=1.0):
    (path / "checkpoint-1").mkdir(parents=True)
    rows = [{"step": 1, "loss": 0.25, "step_time": 2.0},
            {"step": 2, "loss": loss, "step_time": step_time, **(extra or {})}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "train_summary.json").write_text(json.dumps({"heldout_accuracy_after": 0.5, "train_runtime": step_time}))
    (path / "config.yaml").write_text(f"output_dir: {path}\n")
    save_file({"w": torch.full((2, 2), weight)}, str(path / "checkpoint-1" / "adapter.safetensors"), metadata)
    return str(path)


def test_the_same_numbers_pass_with_other_timings_new_keys_and_lora_header_order(tmp_path):
    before = run_folder(tmp_path / "before", metadata={"target_modules": '["to_q", "to_k"]'})
    after = run_folder(tmp_path / "after", step_time=9.0, extra={"skipped_steps": 0},
                       metadata={"target_modules": '["to_k", "to_q"]'})
    same, lines = compare(before, after)
    assert same, lines
    assert "metrics.jsonl: same 2 rows; keys only after: skipped_steps" in lines
    assert "checkpoint-1/adapter.safetensors: same tensors (the header's metadata differs)" in lines
    assert lines[-1].endswith("timing keys skipped: step_time, train_runtime")


def test_a_value_and_a_weight_that_differ_are_named_by_row_and_key(tmp_path):
    before = run_folder(tmp_path / "before")
    after = run_folder(tmp_path / "after", loss=0.5000001, weight=1.0 + 2**-20)
    same, lines = compare(before, after)
    assert not same
    assert "metrics.jsonl: DIFFERS at row 1 key loss: 0.5 vs 0.5000001" in lines
    assert "checkpoint-1/adapter.safetensors: DIFFERS at row - key w: '' vs ''" in lines
    out = subprocess.run([sys.executable, "bench/experiments/same_numbers.py", before, after], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout.rstrip().endswith("DIFFERENT numbers")
