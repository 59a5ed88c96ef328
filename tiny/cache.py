"""The tiny built-in recipe: a from-scratch tiny VLM and the synthetic shapes data, built on first
use and cached under outputs/tiny-cache/ (docs/tiny.md says what such a model can learn).

`--model_name_or_path tiny` and `--dataset_name synthetic:shapes` resolve here; anything else is
passed through untouched.
"""

import hashlib
import json
import os
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = "tiny"
TINY_SFT_MODEL = "tiny-sft"  # the tiny VLM after train_sft.py's tiny recipe: the warm start of tiny GRPO
TINY_DATASET = "synthetic:shapes"
TINY_RECIPE = os.path.join(REPO, "recipes", "tiny_grpo.yaml")
TINY_SFT_RECIPE = os.path.join(REPO, "recipes", "tiny_sft.yaml")
CACHE_DIR = os.environ.get("MMGRPO_TINY_CACHE", os.path.join("outputs", "tiny-cache"))

# Train and held-out splits come from different seeds, so no held-out image is seen in training.
# Counting questions (all shapes, or one colour) with objects in their own 28 px cells: what a model
# this small learns by SFT, and improves on with RL (docs/tiny.md).
SHAPES_KINDS = ["count", "count_color"]
SHAPES_SPLITS = {"train": dict(n=4000, seed=0, kinds=SHAPES_KINDS), "test": dict(n=256, seed=1, kinds=SHAPES_KINDS)}
TINY_VLM = dict(family="qwen2_5_vl", hidden_size=128, num_hidden_layers=2, vision_depth=2, image_size=84, seed=0)


def _cached(name, spec, build):
    """Build `name` once per spec into CACHE_DIR/name-<hash>, atomically (tmp folder then rename)."""
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    path = os.path.join(CACHE_DIR, f"{name}-{key}")
    if os.path.isdir(path):
        return path
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    build(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_vlm_path():
    from tiny.models import make_tiny_vlm

    return _cached("tiny-vlm", TINY_VLM, lambda out: make_tiny_vlm(out, **TINY_VLM))


def shapes_dataset_path():
    from datasets import DatasetDict

    from tiny.shapes import make_shapes_vqa

    def build(out):
        DatasetDict({split: make_shapes_vqa(**spec) for split, spec in SHAPES_SPLITS.items()}).save_to_disk(out)

    return _cached("shapes", SHAPES_SPLITS, build)


def tiny_sft_path():
    """The warm start: train_sft.py's tiny recipe, run once (in its own process) and reused while the
    recipe, the tiny model and the data stay the same."""
    import subprocess
    import sys

    with open(TINY_SFT_RECIPE) as f:
        spec = {"recipe": f.read(), "model": TINY_VLM, "data": SHAPES_SPLITS}
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    marker = os.path.join(CACHE_DIR, f"tiny-sft-{key}.json")
    if os.path.exists(marker):
        with open(marker) as f:
            path = json.load(f)["checkpoint"]
        if os.path.isdir(path):
            return path
    out = os.path.join(CACHE_DIR, f"tiny-sft-{key}")
    print(f"warm start: training the tiny VLM with train_sft.py into {out} (once; cached afterwards)", flush=True)
    subprocess.run([sys.executable, os.path.join(REPO, "train_sft.py"), "--config", TINY_SFT_RECIPE,
                    "--output_dir", out], check=True, env={**os.environ, "ACCELERATE_USE_CPU": "false"})
    from utils.checkpoint import latest_checkpoint

    path = latest_checkpoint(out)
    with open(os.path.join(out, "train_summary.json")) as f:
        summary = json.load(f)
    with open(marker, "w") as f:
        json.dump({"checkpoint": path, "heldout_accuracy": summary.get("heldout_accuracy")}, f)
    return path


def resolve_tiny(cfg, accelerator):
    """(model path, dataset path) for a config, building the tiny pieces on the main process first."""
    with accelerator.main_process_first():
        model = {TINY_MODEL: tiny_vlm_path, TINY_SFT_MODEL: tiny_sft_path}.get(
            cfg.model_name_or_path, lambda: cfg.model_name_or_path)()
        data = shapes_dataset_path() if cfg.dataset_name == TINY_DATASET else cfg.dataset_name
    return model, data
