"""The HF rollout, eager (--cache_implementation dynamic) against compiled (static), side by side in one run.

    python bench/bench_compiled_rollout.py                       # CPU: tiny and larger tiny Qwen2.5-VL, B = 8, 40
    python bench/bench_compiled_rollout.py --device cuda --max_new_tokens 256 --json out.json

Workload: GRPO's rollout as train_grpo.py runs it: prompts with an 84 px image, G = 8 completions per prompt
sharing its prefill (B / 8 prompts), counter-based Gumbel sampling at temperature 1, every completion generated to
--max_new_tokens (the stop tokens are suppressed, so both sides decode the same number of steps). For each model and
batch size: the first compiled call (compile time included), then --repeats timed calls of each side, alternating,
each with fresh seeds; tokens/s counts completion tokens. `same` is the share of completion tokens the compiled
rollout sampled exactly as the eager one (a compiled kernel that rounds a logit differently can change a draw).
`compile s` is the first compiled call's time over a warm call's, with a fresh on-disk compile cache (a first
run's; --warm_compile_cache keeps torch's, as a second run of the same shapes would).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = {"tiny": dict(hidden_size=128, num_hidden_layers=2), "larger": dict(hidden_size=256, num_hidden_layers=6)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[8, 40], help="completions per call (x 8)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the decode step")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--warm_compile_cache", action="store_true",
                   help="keep torch's on-disk compile cache (default: a fresh one, so compile s is a first run's)")
    args = p.parse_args(argv)
    if any(b % 8 for b in args.batch_sizes):
        p.error(f"--batch_sizes {args.batch_sizes}: each must be a multiple of 8 (G = 8 completions per prompt)")
    return args


def workload(processor, batch_size, device):
    """B / 8 image prompts (encoded once each) and the index of each completion's prompt."""
    import torch

    from tiny.shapes import make_shapes_vqa
    from utils.core.encoding import encode_prompts
    from utils.core.prompts import build_messages

    rows = make_shapes_vqa(batch_size // 8, seed=1)
    messages = [build_messages(r["question"], num_images=1) for r in rows]
    prompts = encode_prompts(processor, messages, [[r["image"]] for r in rows], sample_ids=list(range(len(rows))))
    return prompts.to(device), torch.arange(len(rows), device=device).repeat_interleave(8)


def measure(model, processor, batch_size, args):
    import torch

    from utils.core.compiled_generation import CompiledRollout
    from utils.core.rollout import generate_completions, stop_token_ids
    from utils.core.seeds import completion_seeds

    tok = processor.tokenizer
    stops = stop_token_ids(model, tok)
    prompts, index = workload(processor, batch_size, args.device)

    def kwargs(call):
        return dict(row_seeds=completion_seeds(0, call, range(batch_size)), max_new_tokens=args.max_new_tokens,
                    temperature=1.0, eos_token_id=stops, pad_token_id=tok.pad_token_id, suppress_token_ids=stops,
                    prompt_index=index)

    def timed(fn, call):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids, _ = fn(model, prompts, **kwargs(call))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, ids

    compiled = CompiledRollout(backend=args.backend)
    timed(generate_completions, 0)  # warm-up
    first, _ = timed(compiled.generate, 0)
    eager_s, compiled_s, same, total = [], [], 0, 0
    for call in range(1, args.repeats + 1):
        te, eager_ids = timed(generate_completions, call)
        tc, compiled_ids = timed(compiled.generate, call)
        eager_s.append(te)
        compiled_s.append(tc)
        same += int((eager_ids == compiled_ids).sum())
        total += eager_ids.numel()
    tokens = batch_size * args.max_new_tokens
    e, c = statistics.median(eager_s), statistics.median(compiled_s)
    return dict(batch_size=batch_size, new_tokens=args.max_new_tokens, eager_tok_s=tokens / e,
                compiled_tok_s=tokens / c, speedup=e / c, first_compiled_call_s=first,
                compile_s=max(0.0, first - c), same_tokens=same / total, eager_s=eager_s, compiled_s=compiled_s)


def main(argv=None):
    args = parse_args(argv)
    if not args.warm_compile_cache:  # read when inductor first compiles
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-cache-")
    import torch

    from tiny.models import make_tiny_vlm
    from utils.core.models import load_model_and_processor

    torch.set_num_threads(args.threads)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-compiled-rollout-")
    results = []
    for name in args.models:
        path = os.path.join(workdir, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_vlm(path, seed=0, **MODELS[name])
        model, processor = load_model_and_processor(path)
        model.to(args.device).eval()
        for batch_size in args.batch_sizes:
            row = dict(model=name, **MODELS[name], **measure(model, processor, batch_size, args))
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
    print(f"\n{args.device}, {args.threads} thread(s), backend {args.backend}, {args.max_new_tokens} new tokens, "
          f"median of {args.repeats} calls\n")
    print("| model | B | eager tok/s | compiled tok/s | compiled / eager | compile s | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} (hidden {r['hidden_size']}, {r['num_hidden_layers']} layers) | {r['batch_size']} | "
              f"{r['eager_tok_s']:.0f} | {r['compiled_tok_s']:.0f} | {r['speedup']:.2f}x | {r['compile_s']:.1f} | "
              f"{100 * r['same_tokens']:.1f} % |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
