"""Test fixtures of distill.py and iterate.py: a small question file, and a tiny text reasoner that has learnt
those questions' chains by heart (so a real `transformers serve` of it gives known, gradeable chains)."""

import json
import os

from tiny.cycle import reasoner_rows, scene_caption
from tiny.shapes import shapes_vqa_rows


def write_questions(folder, n=16, seed=5):
    """n shapes counting questions as a jsonl of image paths, questions, answers and a `caption` column (the
    scene's description); returns (path, rows)."""
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    rows = shapes_vqa_rows(n, seed=seed, kinds=["count", "count_color"])
    path = os.path.join(folder, "questions.jsonl")
    with open(path, "w") as f:
        for r in rows:
            image = os.path.join("images", f"{r['id']}.png")
            r["image"].save(os.path.join(folder, image))
            f.write(json.dumps({"id": r["id"], "image": image, "question": r["question"], "answer": r["answer"],
                                "caption": scene_caption(r), "difficulty": r["difficulty"],
                                "objects": r["objects"]}) + "\n")
    return path, rows


def train_memorized_reasoner(rows, out, steps=150):
    """The tiny text LLM after `steps` SFT steps on these rows' reasoner chains (half with a reflection)."""
    from tiny.models import make_tiny_llm

    data = os.path.join(out, "chains.jsonl")
    os.makedirs(out, exist_ok=True)
    with open(data, "w") as f:
        for r in reasoner_rows(rows, reflect_share=0.5):
            f.write(json.dumps(r) + "\n")
    return _memorize(make_tiny_llm(os.path.join(out, "llm")), data, len(rows), out, steps, logging_steps=50)


def train_memorized_captioner(rows, out, steps=80):
    """The tiny VLM after `steps` SFT steps on these rows' scene captions (tiny.cycle.caption_rows)."""
    from tiny.cache import save_sharegpt
    from tiny.cycle import caption_rows
    from tiny.models import make_tiny_vlm

    data = save_sharegpt(caption_rows(rows), os.path.join(out, "captions"))
    return _memorize(make_tiny_vlm(os.path.join(out, "vlm")), data, len(rows), out, steps, logging_steps=40)


def _memorize(model, data, n_rows, out, steps, logging_steps):
    """train_sft.py on a sharegpt set, one full-set batch per step at a high constant lr; its last checkpoint."""
    import train_sft
    from utils.core.checkpoint import latest_checkpoint
    from utils.core.config import parse_config

    cfg = parse_config(train_sft.SFTConfig, [
        "--model_name_or_path", model, "--dataset_name", data, "--dataset_format", "sharegpt", "--max_steps",
        str(steps), "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--per_device_train_batch_size",
        str(n_rows), "--output_dir", os.path.join(out, "train"), "--save_steps", str(steps), "--report_to", "none",
        "--logging_steps", str(logging_steps), "--cpu_threads", "1"])
    train_sft.main(cfg)
    return latest_checkpoint(os.path.join(out, "train"))
