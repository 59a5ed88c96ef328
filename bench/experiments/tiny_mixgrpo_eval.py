"""Held-out score of Mix-GRPO runs, before and after, over more prompts and noise seeds than a run's own evaluation.

    python bench/experiments/tiny_mixgrpo_eval.py outputs/tiny-mixgrpo [RUN ...] --noise_seeds 100 101 102 \\
        --eval_samples 256

A run evaluates its held-out prompts once, each from one noise seed, so its before -> after moves with the draw of
that noise as much as with training. This re-evaluates a run's warm start (its config's VLM and generator, as
loaded) and its last checkpoint (the VLM and the generator's trained part, from the checkpoint's training state)
with utils.t2i.mixgrpo_eval.evaluate_reason (greedy reasoning, ODE images) once per noise seed, and prints before,
after and
their paired difference with the spread over seeds. The warm start is evaluated once per config.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from types import SimpleNamespace

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiny.cache import resolve_tiny_t2i  # noqa: E402
from utils.core.checkpoint import latest_checkpoint  # noqa: E402
from utils.core.reward_calls import build_image_reward  # noqa: E402
from utils.core.rollout import special_token_ids_to_suppress, stop_token_ids  # noqa: E402
from utils.t2i.data import load_prompts  # noqa: E402
from utils.t2i.mixgrpo_eval import evaluate_reason  # noqa: E402
from utils.t2i.mixgrpo_model import MixGRPOModel, build_policy  # noqa: E402


def run_config(run, **overrides):
    """A run's flags as it ran with them (its config.yaml holds every flag), with `overrides`."""
    with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
        return SimpleNamespace(**{**yaml.safe_load(f), **overrides})


def evaluate_seeds(cfg, rows, vlm_path, gen_path, seeds, checkpoint=None):
    """{seed: evaluate_reason's result} for the warm start, or with `checkpoint`'s trained weights loaded."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    accelerator = Accelerator(cpu=True)
    model, processor, policy, gen, _ = build_policy(cfg, vlm_path, gen_path, accelerator.device)
    mix = MixGRPOModel(policy, gen)
    if checkpoint is not None:
        state = load_file(os.path.join(checkpoint, "training_state", "model.safetensors"))
        missing, unexpected = mix.load_state_dict(state, strict=False)
        trained = [k for k, p in mix.named_parameters() if p.requires_grad]
        if unexpected or [k for k in trained if k in missing]:
            raise ValueError(f"{checkpoint}: its training state does not fit this model "
                             f"(unexpected {unexpected[:3]}, missing {[k for k in trained if k in missing][:3]})")
    mix.eval()
    stop_ids = stop_token_ids(model, processor.tokenizer)
    suppress_ids = special_token_ids_to_suppress(processor.tokenizer, stop_ids)
    reward_fn, out = build_image_reward(cfg), {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for seed in seeds:
            cfg.seed = seed  # evaluate_reason seeds row i's noise with cfg.seed + i
            out[seed] = evaluate_reason(cfg, rows, policy=policy, processor=processor, gen=gen,
                                        accelerator=accelerator, stop_ids=stop_ids, suppress_ids=suppress_ids,
                                        reward_fn=reward_fn, grid_path=os.path.join(tmp, "grid.png"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="train_mixgrpo output folders (config.yaml and checkpoints)")
    ap.add_argument("--noise_seeds", type=int, nargs="+", default=[100, 101, 102])
    ap.add_argument("--eval_samples", type=int, default=256, help="held-out prompts (the tiny set has 256)")
    ap.add_argument("--model_name_or_path", default=None, help="the runs' warm-start VLM, when their config's name "
                                                               "now resolves to another (tiny: the current planner)")
    ap.add_argument("--reward_kwargs", type=json.loads, default=None,
                    help="JSON: score with these --reward_fn options instead of each run's own (a run trained on "
                         "another price of extra objects, scored on the default one: '{}')")
    ap.add_argument("--cpu_threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.cpu_threads)
    before_cache = {}
    print("| run | before | after | after - before (mean over seeds, min .. max) | strict | objects |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        cfg = run_config(run, eval_samples=args.eval_samples, report_to="none",
                         **({"model_name_or_path": args.model_name_or_path} if args.model_name_or_path else {}),
                         **({"reward_kwargs": args.reward_kwargs} if args.reward_kwargs is not None else {}))
        from accelerate import Accelerator

        vlm_path, gen_path, _, _, val_path = resolve_tiny_t2i(cfg, Accelerator(cpu=True))
        rows = load_prompts(cfg, val_path)[: args.eval_samples]
        key = (vlm_path, gen_path, cfg.generator_lora_r, val_path, json.dumps(cfg.reward_kwargs, sort_keys=True))
        if key not in before_cache:
            before_cache[key] = evaluate_seeds(cfg, rows, vlm_path, gen_path, args.noise_seeds)
        before = before_cache[key]
        after = evaluate_seeds(cfg, rows, vlm_path, gen_path, args.noise_seeds, checkpoint=latest_checkpoint(run))
        diffs = [after[s]["reward"] - before[s]["reward"] for s in args.noise_seeds]

        def mean(res, k):
            return statistics.mean(res[s].get(k, float("nan")) for s in args.noise_seeds)

        print(f"| {run} | {mean(before, 'reward'):.3f} | {mean(after, 'reward'):.3f} | {statistics.mean(diffs):+.3f} "
              f"({min(diffs):+.3f} .. {max(diffs):+.3f}) | {mean(before, 'strict'):.3f} -> {mean(after, 'strict'):.3f}"
              f" | {mean(before, 'detected'):.2f} -> {mean(after, 'detected'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
