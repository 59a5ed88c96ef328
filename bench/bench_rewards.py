"""Reward throughput at GRPO scale: completions/second for 64 prompts x 8 completions of realistic length.

    python bench/bench_rewards.py                       # cpr, format, math_accuracy and the other text rewards
    python bench/bench_rewards.py --spr                 # + SPR (loads the packaged MiniLM)
    python bench/bench_rewards.py --step_seconds 0.3    # + each reward's share of a GRPO step of that length
    python bench/bench_rewards.py --metrics out/metrics.jsonl   # + the measured reward share of a train_grpo run
    python bench/bench_rewards.py --image               # the image reward models: time and memory per image
    python bench/bench_rewards.py --overlap             # the tiny text-free job's step time with / without
                                                        # --overlap_rewards

--image times pickscore, clipscore, aesthetic, hpsv2, imagereward and ocr on --image_count images of --image_size px
(tiny models built from configs, unless --image_kwargs names real ones, e.g. '{"pickscore": {"model_name_or_path":
"yuvalkirstain/PickScore_v1", "device": "cuda"}}'): seconds per image (best of --repeats, after one warm-up call),
the load time, and the memory the model takes (CUDA: peak allocated; CPU: the process's peak RSS growth).
--overlap runs the tiny Flow-GRPO job (recipes/tiny_flow_grpo.yaml, python train_mixgrpo.py) for --overlap_steps
steps with --overlap_reward, with and without --overlap_rewards, and prints the mean step time (every step: with the
overlap a step also draws the next step's images, and the last draws none).

CRYSTAL completions are JSON (70%) or <think> steps (30%) with 4-9 reasoning steps of 12-25 words; math
completions are a <think> block of 12-20 sentences then an <answer> (integer, fraction, decimal, LaTeX);
each group's 8 answers are drawn from 6 candidates, so answers repeat within a group as they do in GRPO.
Each reward is timed on the whole batch, best of --repeats, with the reward caches cleared between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rewards import get_reward  # noqa: E402

WORDS = ("the red circle square triangle blue green left right above below row column object image count "
         "compare larger smaller next to each there are is of in on a two three four so therefore").split()


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize()


def crystal_batch(rng: random.Random, prompts: int, group: int) -> tuple[list[str], dict]:
    completions, answers, references, questions = [], [], [], []
    for _ in range(prompts):
        reference = [_sentence(rng, 10, 20) for _ in range(rng.randint(3, 6))]
        options = rng.sample(["red", "blue", "green", "yellow", "purple"], 4)
        answer = rng.choice([str(rng.randint(0, 9)), rng.choice("ABCD"), rng.choice(["Yes", "No"])])
        question = "Which one?\n\n" + "\n".join(f"{letter}) {o}" for letter, o in zip("ABCD", options))
        for _ in range(group):
            steps = [rng.choice([s, _sentence(rng, 12, 25)]) for s in reference]
            steps += [_sentence(rng, 12, 25) for _ in range(rng.randint(1, 3))]
            pred = rng.choice([answer, str(rng.randint(0, 9)), rng.choice("ABCD")])
            text = json.dumps({"reasoning_steps": steps, "answer": pred}, indent=2)
            if rng.random() < 0.3:  # some completions use the tag format
                text = "<think>" + " ".join(f"Step {i + 1}: {s}." for i, s in enumerate(steps)) + \
                       f"</think><answer>{pred}</answer>"
            completions.append(text)
            answers.append(answer)
            references.append(reference)
            questions.append(question)
    return completions, dict(answer=answers, reference_steps=references, question=questions)


def math_batch(rng: random.Random, prompts: int, group: int) -> tuple[list[str], dict]:
    completions, answers = [], []
    for _ in range(prompts):
        a, b = rng.randint(1, 40), rng.randint(2, 12)
        gold = rng.choice([str(a), f"\\frac{{{a}}}{{{b}}}", f"{a / b:.3f}", f"{a}\\sqrt{{2}}"])
        for _ in range(group):
            pred = rng.choice([gold, str(a), f"{a}/{b}", str(a + 1), f"\\frac{{{a}}}{{{b}}}", f"{a}\\sqrt{{2}}"])
            think = " ".join(_sentence(rng, 10, 20) + "." for _ in range(rng.randint(12, 20)))
            completions.append(f"<think>{think}</think>\n<answer>{pred}</answer>")
            answers.append(gold)
    return completions, dict(answer=answers)


def time_reward(fn, completions, columns, repeats: int, clear=None) -> float:
    times = []
    for _ in range(repeats):
        if clear:
            clear()
        start = time.perf_counter()
        fn(completions, **columns)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spr", action="store_true", help="also time SPR (sentence-embedding model)")
    parser.add_argument("--step_seconds", type=float, default=None,
                        help="length of one GRPO step at this batch size, to print each reward's share")
    parser.add_argument("--metrics", default=None,
                        help="a train_grpo.py metrics.jsonl: print the share of step time its rewards took")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", action="store_true", help="time the image reward models instead")
    parser.add_argument("--image_count", type=int, default=16)
    parser.add_argument("--image_size", type=int, default=512)
    parser.add_argument("--image_kwargs", type=json.loads, default={},
                        help="JSON {reward: options}: real checkpoints, device, batch_size")
    parser.add_argument("--overlap", action="store_true", help="the tiny text-free job with / without the overlap")
    parser.add_argument("--overlap_reward", default="ocr")
    parser.add_argument("--overlap_kwargs", default="{}",
                        help="JSON options of --overlap_reward (e.g. a model folder)")
    parser.add_argument("--overlap_steps", type=int, default=6)
    args = parser.parse_args(argv)
    if args.image:
        return bench_image_rewards(args)
    if args.overlap:
        return bench_overlap(args)

    import torch

    torch.set_num_threads(1)  # rewards run beside the trainer; one core is what they can count on
    from rewards.text import _math_equal, _parse

    def clear_math_caches():
        _parse.cache_clear()
        _math_equal.cache_clear()

    rng = random.Random(args.seed)
    crystal, crystal_cols = crystal_batch(rng, args.prompts, args.group)
    math, math_cols = math_batch(rng, args.prompts, args.group)
    n = len(crystal)
    chars = statistics.mean(len(c) for c in crystal), statistics.mean(len(c) for c in math)
    print(f"{args.prompts} prompts x {args.group} completions = {n}; mean length: CRYSTAL {chars[0]:.0f} chars, "
          f"math {chars[1]:.0f} chars")

    cases = [("format", crystal, crystal_cols, None), ("accuracy", crystal, crystal_cols, None),
             ("cpr", crystal, crystal_cols, None), ("reasoning", crystal, crystal_cols, None),
             ("think_format", math, {}, None), ("math_accuracy", math, math_cols, clear_math_caches)]
    rewards = {name: get_reward(name) for name, *_ in cases}
    rewards["overlong_penalty"] = get_reward("overlong_penalty", max_completion_length=2048, buffer_length=512,
                                            unit="chars")
    cases.append(("overlong_penalty", math, {}, None))
    if args.spr:
        rewards["spr"] = get_reward("spr")
        from rewards.crystal import _EMBEDDERS

        cases.append(("spr", crystal, crystal_cols, lambda: [e._cache.clear() for e in _EMBEDDERS.values()]))

    header = f"{'reward':<16}{'seconds':>10}{'completions/s':>16}"
    print(header + (f"{'share of step':>16}" if args.step_seconds else ""))
    for name, completions, columns, clear in cases:
        seconds = time_reward(rewards[name], completions, columns, args.repeats, clear)
        line = f"{name:<16}{seconds:>10.3f}{n / seconds:>16.0f}"
        if args.step_seconds:
            line += f"{100 * seconds / args.step_seconds:>15.1f}%"
        print(line)


    if args.metrics:
        print(run_share(args.metrics))


IMAGE_PROMPTS = ['a photo of a cat holding a sign that says "hello"', "a red dog on the table", 'a "blue" cat',
                 'a storefront with "open late" in neon']


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_image_rewards(args) -> None:
    import tempfile

    import numpy as np
    import torch
    from PIL import Image

    from tiny.reward_models import make_tiny_aesthetic, make_tiny_clip, make_tiny_hps, make_tiny_imagereward

    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="bench-image-rewards-")
    make_tiny_clip(os.path.join(folder, "clip"))
    clip_dir, mlp_dir, *_ = make_tiny_aesthetic(os.path.join(folder, "aesthetic"))
    hps_config, _ = make_tiny_hps(os.path.join(folder, "hps"))
    ir_dir, ir_tok, *_ = make_tiny_imagereward(os.path.join(folder, "imagereward"))
    tiny = {"pickscore": {"model_name_or_path": os.path.join(folder, "clip")},
            "clipscore": {"model_name_or_path": os.path.join(folder, "clip")},
            "aesthetic": {"clip_name_or_path": clip_dir, "mlp_name_or_path": mlp_dir},
            "hpsv2": {"model_name_or_path": os.path.join(folder, "hps"), "architecture": hps_config},
            "imagereward": {"model_name_or_path": ir_dir, "tokenizer_name_or_path": ir_tok},
            "ocr": {}}
    rng = np.random.default_rng(args.seed)
    images = [Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))
              for _ in range(args.image_count)]
    prompts = [IMAGE_PROMPTS[i % len(IMAGE_PROMPTS)] for i in range(args.image_count)]
    print(f"{args.image_count} images of {args.image_size} px; tiny models unless --image_kwargs names others")
    print(f"{'reward':<14}{'model':<12}{'load s':>8}{'ms/image':>10}{'images/s':>10}{'memory MB':>11}")
    for name, options in tiny.items():
        options = args.image_kwargs.get(name, options)
        cuda = torch.cuda.is_available() and str(options.get("device", "auto")) != "cpu"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rss = _peak_rss_mb()
        start = time.perf_counter()
        fn = get_reward(name, **options)
        load = time.perf_counter() - start
        fn(["x"] * 2, images=images[:2], prompt=prompts[:2])  # warm-up
        seconds = time_reward(fn, ["x"] * len(images), dict(images=images, prompt=prompts), args.repeats)
        memory = torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mb() - rss
        kind = "given" if name in args.image_kwargs else "shipped" if name == "ocr" else "tiny"
        print(f"{name:<14}{kind:<12}{load:>8.2f}{1000 * seconds / len(images):>10.2f}{len(images) / seconds:>10.1f}"
              f"{memory:>11.0f}")


def bench_overlap(args) -> None:
    import subprocess
    import tempfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix="bench-overlap-")
    prompts = os.path.join(folder, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("\n".join(IMAGE_PROMPTS) + "\n")
    times = {}
    for overlap in ("false", "true"):
        out = os.path.join(folder, f"overlap-{overlap}")
        subprocess.run([sys.executable, os.path.join(repo, "train_mixgrpo.py"), "--config",
                        os.path.join(repo, "recipes", "tiny_flow_grpo.yaml"), "--dataset_name", "prompts",
                        "--train_data_path", prompts, "--val_data_path", "none", "--reward_fn", args.overlap_reward,
                        "--reward_kwargs", args.overlap_kwargs, "--max_steps", str(args.overlap_steps),
                        "--save_steps", "1000",
                        "--overlap_rewards", overlap, "--output_dir", out, "--report_to", "none"],
                       check=True, cwd=repo, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [row["step_time"] for row in map(json.loads, f) if "step_time" in row]
        times[overlap] = statistics.mean(steps)  # all steps: with the overlap, a step draws the next step's images
    print(f"tiny text-free job, reward {args.overlap_reward}, {args.overlap_steps} steps (mean step time): without "
          f"overlap {times['false']:.3f} s, with --overlap_rewards {times['true']:.3f} s, "
          f"ratio {times['false'] / times['true']:.2f}x")


def run_share(metrics_path: str) -> str:
    """Reward time over step time, from the `time/rewards` and `step_time` that train_grpo.py logs."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "time/rewards" in r and r.get("step_time")]
    if not rows:
        raise ValueError(f"{metrics_path}: no rows with 'time/rewards' and 'step_time'")
    reward_s, step_s = sum(r["time/rewards"] for r in rows), sum(r["step_time"] for r in rows)
    return (f"{metrics_path}: {len(rows)} steps, rewards {reward_s / len(rows):.4f} s of {step_s / len(rows):.2f} s "
            f"per step = {100 * reward_s / step_s:.3f}% of step time")


if __name__ == "__main__":
    main()
