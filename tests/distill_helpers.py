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
    import train_sft
    from tiny.models import make_tiny_llm
    from utils.checkpoint import latest_checkpoint
    from utils.config import parse_config

    data = os.path.join(out, "chains.jsonl")
    os.makedirs(out, exist_ok=True)
    with open(data, "w") as f:
        for r in reasoner_rows(rows, reflect_share=0.5):
            f.write(json.dumps(r) + "\n")
    llm = make_tiny_llm(os.path.join(out, "llm"))
    cfg = parse_config(train_sft.SFTConfig, [
        "--model_name_or_path", llm, "--dataset_name", data, "--dataset_format", "sharegpt", "--max_steps", str(steps),
        "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--per_device_train_batch_size", str(len(rows)),
        "--output_dir", os.path.join(out, "train"), "--save_steps", str(steps), "--report_to", "none",
        "--logging_steps", "50", "--cpu_threads", "1"])
    train_sft.main(cfg)
    return latest_checkpoint(os.path.join(out, "train"))


def train_memorized_captioner(rows, out, steps=80):
    """The tiny VLM after `steps` SFT steps on these rows' scene captions (tiny.cycle.caption_rows)."""
    import datasets

    import train_sft
    from tiny.cycle import caption_rows
    from tiny.models import make_tiny_vlm
    from utils.checkpoint import latest_checkpoint
    from utils.config import parse_config

    data = os.path.join(out, "captions")
    message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    features = datasets.Features({"id": datasets.Value("string"), "messages": datasets.List(message),
                                  "images": datasets.List(datasets.Image())})
    datasets.Dataset.from_list(caption_rows(rows), features=features).save_to_disk(data)
    vlm = make_tiny_vlm(os.path.join(out, "vlm"))
    cfg = parse_config(train_sft.SFTConfig, [
        "--model_name_or_path", vlm, "--dataset_name", data, "--dataset_format", "sharegpt", "--max_steps", str(steps),
        "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--per_device_train_batch_size", str(len(rows)),
        "--output_dir", os.path.join(out, "train"), "--save_steps", str(steps), "--report_to", "none",
        "--logging_steps", "40", "--cpu_threads", "1"])
    train_sft.main(cfg)
    return latest_checkpoint(os.path.join(out, "train"))
