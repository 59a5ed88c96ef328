"""The training log-prob pass (policy forward + backward), padded against packed (--padding_free), on a
long-tailed length workload.

    python bench/bench_packing.py                 # CPU scale: completions 4..256 tokens, tiny Qwen2.5-VL
    python bench/bench_packing.py --full          # the issue's scale: completions 16..1024 tokens
    python bench/bench_packing.py --device cuda --full --hidden_size 1024 --num_hidden_layers 8 --json out.json

Workload: P prompts, each a 448 px image (256 image tokens) and a question, G completions per prompt whose
lengths are drawn log-normal (median max_len / 8, sigma 1) and clipped to [max_len / 64, max_len]: most are
short, a few reach the maximum, as reasoning models' completions do. The padded pass is the scripts' padded
path (a group's completions share one prompt pass through its KV cache, completions padded to the longest);
the packed pass lays the prompts and completions end to end (utils/core/packing.py).

Each variant runs in its own fresh process, one after the other, so the peak memory is its own: on the CPU the
peak RSS over the RSS before the first pass, on CUDA torch's peak allocated bytes over those before it. Times
are medians over the timed repeats. tokens/s counts real tokens only (prompt and completion, no padding).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("padded", "packed")


def longtail_lengths(n, max_len, seed):
    """n completion lengths, log-normal (median max_len / 8, sigma 1), clipped to [max_len / 64, max_len]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(math.log(max_len / 8) + torch.randn(n, generator=gen))
    return raw.round().clamp(max(1, max_len // 64), max_len).long().tolist()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="completions up to 1024 tokens (default: 256, CPU scale)")
    p.add_argument("--max_len", type=int, default=None, help="longest completion (default 256; --full 1024)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per variant (after one warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attn_implementation", default="sdpa", choices=("sdpa", "flash_attention_2", "eager"),
                   help="both variants' attention (flash_attention_2: CUDA with flash-attn installed)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="print each variant's top operators (one extra pass)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_len is None:
        args.max_len = 1024 if args.full else 256
    return args


def rss_mb(peak=False):
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def model_path(args):
    return os.path.join(args.workdir, f"tiny-vlm-h{args.hidden_size}-l{args.num_hidden_layers}-px448")


def build_inputs(args, processor, device, vocab):
    """The unique prompts, prompt_index, and long-tailed completions (random token ids)."""
    import torch

    from tiny.shapes import make_shapes_vqa
    from utils.core.encoding import encode_prompts
    from utils.core.prompts import build_messages

    rows = [make_shapes_vqa(args.prompts, seed=args.seed, image_size=448)[i] for i in range(args.prompts)]
    messages = [build_messages(r["question"], num_images=1) for r in rows]
    prompts = encode_prompts(processor, messages, [[r["image"]] for r in rows],
                             sample_ids=[str(i) for i in range(args.prompts)]).to(device)
    n = args.prompts * args.num_generations
    lengths = longtail_lengths(n, args.max_len, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    width = max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(10, vocab, (n, width), generator=gen)
    special = torch.tensor(sorted(getattr(processor, "tokenizer", processor).added_tokens_decoder))
    ids = ids.masked_fill(torch.isin(ids, special), 10).masked_fill(mask == 0, 0)  # no image or role tokens
    prompt_index = torch.arange(args.prompts).repeat_interleave(args.num_generations)
    return prompts, prompt_index.to(device), ids.to(device), mask.to(device), lengths


def worker(args):
    import torch

    sys.path.insert(0, REPO)
    from utils.core.logprobs import CompletionLogProbs
    from utils.core.models import load_model_and_processor

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, processor = load_model_and_processor(model_path(args), dtype="bfloat16" if device.type == "cuda"
                                                else "float32", attn_implementation=args.attn_implementation)
    model.to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy = CompletionLogProbs(model, padding_free=args.worker == "packed")
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts, prompt_index, ids, mask, lengths = build_inputs(args, processor, device, vocab)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    cpu_times = []

    def one_pass():
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        logps = policy(prompts, ids, mask, 1.0, prompt_index=prompt_index)
        logps.sum().backward()
        sync()
        model.zero_grad(set_to_none=True)
        cpu_times.append(time.process_time() - c0)
        return time.perf_counter() - t0

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = rss_mb()
    times = [one_pass() for _ in range(args.repeats + 1)][1:]
    peak = ((torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda"
            else rss_mb(peak=True) - base_rss)
    profile = ""
    if args.profile:  # where one pass's time goes, by operator (self CPU time)
        from torch.profiler import profile as profiler

        with profiler() as prof:
            one_pass()
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40)
    tokens = int(prompts["attention_mask"].sum()) + sum(lengths)
    result = dict(variant=args.worker, sec=statistics.median(times), times=times, peak_mb=peak, tokens=tokens,
                  cpu_sec=statistics.median(cpu_times[1:args.repeats + 1]), profile=profile,
                  tokens_per_sec=tokens / statistics.median(times), completions=len(lengths),
                  completion_tokens=sum(lengths), padded_completion_tokens=len(lengths) * max(lengths))
    with open(args.result, "w") as f:
        json.dump(result, f)


def run_variant(args, variant):
    result_path = os.path.join(args.workdir, f"result-{variant}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--result", result_path,
           "--workdir", args.workdir, "--max_len", str(args.max_len), "--prompts", str(args.prompts),
           "--num_generations", str(args.num_generations), "--hidden_size", str(args.hidden_size),
           "--num_hidden_layers", str(args.num_hidden_layers), "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--device", args.device, "--seed", str(args.seed),
           "--attn_implementation", args.attn_implementation]
    cmd += ["--gradient_checkpointing"] * args.gradient_checkpointing + ["--profile"] * args.profile
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} worker failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-4000:]}")
    with open(result_path) as f:
        return json.load(f)


def main(args):
    sys.path.insert(0, REPO)
    from tiny.models import make_tiny_vlm

    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench_packing-")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.isdir(model_path(args)):
        make_tiny_vlm(model_path(args), hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                      seed=args.seed, image_size=448)
    rows = [run_variant(args, v) for v in VARIANTS]
    r0 = rows[0]
    print(f"training log-prob pass (forward + backward), {args.device}, tiny Qwen2.5-VL hidden {args.hidden_size} x "
          f"{args.num_hidden_layers} layers, {args.prompts} prompts x {args.num_generations} completions, 256 image "
          f"tokens a prompt, completion lengths log-normal in [{max(1, args.max_len // 64)}, {args.max_len}] "
          f"({r0['completion_tokens']} tokens, {r0['padded_completion_tokens']} padded), {args.threads} threads, "
          f"median of {args.repeats}")
    print(f"{'variant':<8} {'s/pass':>8} {'CPU s':>8} {'tokens/s':>10} {'peak MB':>9}")
    for r in rows:
        print(f"{r['variant']:<8} {r['sec']:>8.3f} {r['cpu_sec']:>8.3f} {r['tokens_per_sec']:>10.0f} "
              f"{r['peak_mb']:>9.0f}")
    for r in rows:
        if r["profile"]:
            print(f"\n{r['variant']}: one pass by operator\n{r['profile']}")
    padded, packed = rows
    ratios = dict(time_ratio=packed["sec"] / padded["sec"], cpu_time_ratio=packed["cpu_sec"] / padded["cpu_sec"],
                  memory_ratio=packed["peak_mb"] / max(padded["peak_mb"], 1e-9))
    print(f"packed / padded: time {ratios['time_ratio']:.2f}x (CPU time {ratios['cpu_time_ratio']:.2f}x; "
          f"target <= 0.6), peak memory "
          f"{ratios['memory_ratio']:.2f}x (target <= 0.7)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), rows=rows, **ratios), f, indent=2)
    return rows, ratios


if __name__ == "__main__":
    cli = parse_args()
    if cli.worker:
        worker(cli)
    else:
        main(cli)
