"""Does a tiny VLM's vision tower see what the video questions ask? A linear probe on its video features.

    python bench/experiments/tiny_video_probe.py                       # the cached tiny-video-sft warm start
    python bench/experiments/tiny_video_probe.py --model outputs/tiny-video-seed0/checkpoint-100 --train_rows 3000

For each kind of the tiny video task (tiny/video_shapes.py: direction, frames, last) it fits a linear softmax
classifier on the model's merged video features (all tokens of a clip, flattened and standardised) of the first
`--train_rows` training clips, and prints its accuracy on the held-out clips beside the majority answer's share and
the model's own greedy accuracy (evaluate.py). A probe far above the model means the features carry the answer and
the language model does not read it; a probe at the majority share means the features do not carry it.
"""

import argparse
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tiny.cache import TINY_VIDEO_DATASET, TINY_VIDEO_SFT_MODEL, resolve_dataset, resolve_tiny_name  # noqa: E402
from utils.core.data import load_vqa  # noqa: E402
from utils.core.video import budget_for, load_clips, videos_of  # noqa: E402

# the frames recipes/tiny_video.yaml reads: every one of the 8 frames at 84 x 84
FRAMES = dict(fps=4.0, max_frames=8, min_pixels=84 * 84, max_pixels=84 * 84)


@torch.no_grad()
def video_features(model, processor, rows, budget, batch_size=32):
    """[rows, tokens * width]: each clip's merged video tokens, flattened."""
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        clips = load_clips([videos_of(r) for r in chunk], budget)
        # the clips are already sampled and resized to the budget, as the scripts feed them
        enc = processor.video_processor(videos=[c[0].frames for c in clips], return_tensors="pt",
                                        do_sample_frames=False, do_resize=False, cap_pixels_per_frame=False)
        feats = model.model.get_video_features(enc["pixel_values_videos"], enc["video_grid_thw"])
        feats = getattr(feats, "pooler_output", feats)
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        out.append(feats.reshape(len(chunk), -1).float())
    return torch.cat(out)


def probe_accuracy(x_train, y_train, x_test, y_test, classes, steps=300, weight_decay=1e-3):
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    weight = torch.zeros(x_train.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x_train @ weight + bias, y_train) + weight_decay * weight.pow(2).sum()
        loss.backward()
        optimizer.step()
    return ((x_test @ weight + bias).argmax(1) == y_test).float().mean().item()


def model_accuracy_by_kind(model_path, data, output_dir):
    """The model's own greedy held-out accuracy per kind, through evaluate.py."""
    import json

    subprocess.run([sys.executable, "evaluate.py", "--model", model_path, "--dataset", data, "--split", "test",
                    "--fps", str(FRAMES["fps"]), "--max_frames", str(FRAMES["max_frames"]),
                    "--video_min_pixels", str(FRAMES["min_pixels"]), "--video_max_pixels", str(FRAMES["max_pixels"]),
                    "--group_by", "kind", "--max_new_tokens", "128", "--output_dir", output_dir],
                   check=True, capture_output=True, cwd=REPO)
    with open(os.path.join(output_dir, "metrics.json")) as f:
        metrics = json.load(f)
    return {key.split("=", 1)[1]: value for key, value in metrics.items() if key.startswith("accuracy/kind=")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_VIDEO_SFT_MODEL)
    parser.add_argument("--dataset", default=TINY_VIDEO_DATASET)
    parser.add_argument("--train_rows", type=int, default=1500, help="training clips read (all kinds together)")
    parser.add_argument("--output_dir", default="outputs/tiny-video-probe")
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path, data = resolve_tiny_name(args.model), resolve_dataset(args.dataset)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    budget = budget_for(processor, **FRAMES)
    train = load_vqa(data, split="train").select(range(args.train_rows))
    test = load_vqa(data, split="test")
    own = model_accuracy_by_kind(path, data, args.output_dir)
    print(f"{'kind':<10} {'probe':>6} {'model':>6} {'majority':>8}  (train rows, feature width)")
    for kind in sorted({r["kind"] for r in test}):
        rows_train = [r for r in train if r["kind"] == kind]
        rows_test = [r for r in test if r["kind"] == kind]
        answers = sorted({r["answer"] for r in rows_train})
        y_train = torch.tensor([answers.index(r["answer"]) for r in rows_train])
        y_test = torch.tensor([answers.index(r["answer"]) if r["answer"] in answers else -1 for r in rows_test])
        x_train = video_features(model, processor, rows_train, budget)
        x_test = video_features(model, processor, rows_test, budget)
        accuracy = probe_accuracy(x_train, y_train, x_test, y_test, len(answers))
        majority = max((y_test == i).float().mean().item() for i in range(len(answers)))
        print(f"{kind:<10} {accuracy:6.3f} {own.get(kind, float('nan')):6.3f} {majority:8.3f}  "
              f"({len(rows_train)}, {x_train.shape[1]})")


if __name__ == "__main__":
    main()
