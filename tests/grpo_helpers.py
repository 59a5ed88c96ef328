"""Reward functions with known values, for testing how train_grpo.py combines rewards, and the shared assets
(shapes rows + the tiny Qwen VLM) that the GRPO test modules train on.

The rewards are loaded by name through the registry (`--reward_funcs tests.grpo_helpers:always_one`), as a user's
own reward module would be.
"""

from pathlib import Path

from tests.launch_helpers import failing_fixture
from tiny.models import make_tiny_vlm
from tiny.shapes import make_shapes_vqa


def shapes_assets(tmp_path_factory, test_file, rows, kinds=("color", "count")):
    """A test module's shared assets: `rows` shapes questions of `kinds` (seed 0) and the tiny Qwen VLM (seed 0),
    built in a fresh folder: {"qwen": the model's folder, "data": the data set's folder, "root": that folder}.
    A failed build names `test_file`, so `pytest -x` says which module's assets broke."""
    root = tmp_path_factory.mktemp(Path(test_file).stem)
    data = str(root / "shapes")
    with failing_fixture(f"{test_file}'s assets ({rows} shapes rows, the tiny Qwen VLM)"):
        make_shapes_vqa(rows, seed=0, kinds=kinds).save_to_disk(data)
        return {"qwen": make_tiny_vlm(str(root / "qwen"), seed=0), "data": data, "root": root}


def always_one(completions, **columns):
    return [1.0 for _ in completions]


def half_missing(completions, **columns):
    """3.0 on even rows, not applicable (None) on odd rows."""
    return [3.0 if i % 2 == 0 else None for i in range(len(completions))]


def completion_length(completions, **columns):
    """A reward that varies within a group, so advantages are non-zero."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) / 10.0 for c in completions]


def negative_length(completions, **columns):
    """The opposite objective of completion_length: conflicting gradients for PCGrad."""
    return [-r for r in completion_length(completions)]


def none_on_odd(completions, **columns):
    """Scores even rows by length; odd rows are unscorable (every reward None)."""
    return [completion_length([c])[0] if i % 2 == 0 else None for i, c in enumerate(completions)]


def constant_on_even_prompts(completions, id, **columns):
    """1.0 for every completion of an even-numbered prompt (a group without spread), length on odd ones."""
    return [1.0 if int(i.rsplit("-", 1)[1]) % 2 == 0 else completion_length([c])[0] for i, c in zip(id, completions)]


def inf_once(completions, trainer_state=None, **columns):
    """Length, except +inf for the first completion of the first step: a user's reward that overflows once."""
    values = completion_length(completions)
    if trainer_state is not None and trainer_state.global_step == 0:
        values[0] = float("inf")
    return values
