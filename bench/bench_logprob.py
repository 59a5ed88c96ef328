"""Token log-prob from the LM head, forward + backward: naive vs TRL's chunked kernel vs ours.

    python bench/bench_logprob.py                  # CPU: N = 2048, 4096; H = 1024; V = 151936; fp32
    python bench/bench_logprob.py --quick          # small shapes, a few minutes
    python bench/bench_logprob.py --device cuda --dtype bf16 --tokens 4096 16384 32768 --roofline
    python bench/bench_logprob.py --device cuda --dtype autocast --tokens 16384 --roofline  # fp32 + bf16 autocast

Methods: naive = full logits -> log_softmax -> gather; trl = trl.kernels.ChunkedLogProbFunction
(TRL's GRPO settings: 32768-column chunks, log-probs only), skipped when trl is not installed;
ours = kernels.fused_token_logprobs. Every label is valid, so all three score the same N rows.
`--dtype autocast` keeps hidden states and weight in fp32 and runs every method under bf16 autocast (what
`--bf16` mixed precision gives the LM head); its cuBLAS roofline is the bf16 GEMMs.

Activation memory = peak memory during forward + backward minus what was allocated before (inputs,
weight) minus the gradients that must be returned (grad_hidden, and grad_weight with a trainable
head). CPU: peak RSS (VmHWM, reset through /proc/self/clear_refs) in a fresh subprocess per
configuration; CUDA: torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kernels import fused_token_logprobs  # noqa: E402

TRL_CHUNK_SIZE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16
MIB = 2**20


def trl_function():
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction


def logprobs(method, hidden, weight, labels):
    if method == "naive":
        logits = hidden @ weight.t()
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if method == "trl":
        return trl_function().apply(hidden, weight, None, labels, 1.0, TRL_CHUNK_SIZE, None, 1.0, ("log_probs",))[0]
    return fused_token_logprobs(hidden, weight, labels)


def make_inputs(n, hdim, vocab, dtype, device, trainable, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, hdim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    # std 0.05 gives logits of std ~1.6, the range real heads produce (no denormal exp tails)
    weight = torch.randn(vocab, hdim, generator=gen).mul_(0.05).to(device=device, dtype=dtype)
    weight.requires_grad_(trainable)
    labels = torch.randint(0, vocab, (n,), generator=gen).to(device)
    upstream = torch.randn(n, generator=gen).to(device)  # a per-token advantage
    return hidden, weight, labels, upstream


def step(method, hidden, weight, labels, upstream, autocast=False):
    hidden.grad = None
    weight.grad = None
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = (logprobs(method, hidden, weight, labels) * upstream).sum()
    loss.backward()


def returned_grad_bytes(hidden, weight):
    size = hidden.numel() * hidden.element_size()
    if weight.requires_grad:
        size += weight.numel() * weight.element_size()
    return size


# ---------------------------------------------------------------------------------------------
# one configuration (CPU: in its own process)
# ---------------------------------------------------------------------------------------------


def _peak_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_config(cfg):
    device, autocast = cfg["device"], cfg["dtype"] == "autocast"
    dtype = torch.float32 if autocast else getattr(torch, cfg["dtype"])
    hidden, weight, labels, upstream = make_inputs(cfg["n"], cfg["hidden"], cfg["vocab"], dtype, device,
                                                   cfg["trainable"])
    method = cfg["method"]
    # warm-up on a few rows: library initialisation, kernel compilation, imports
    step(method, hidden[:64].detach().requires_grad_(), weight, labels[:64], upstream[:64], autocast)
    hidden.grad = weight.grad = None
    grads = returned_grad_bytes(hidden, weight) / MIB
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / MIB
        for _ in range(cfg["repeats"]):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step(method, hidden, weight, labels, upstream, autocast)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        peak = torch.cuda.max_memory_allocated() / MIB
    else:
        base = _rss_mib()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak-RSS counter to the current RSS
        for _ in range(cfg["repeats"]):
            t0, c0 = time.perf_counter(), time.process_time()
            step(method, hidden, weight, labels, upstream, autocast)
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        peak = _peak_rss_mib()
        best = min(times, key=lambda t: t[1])
        return {**cfg, "wall_seconds": best[0], "cpu_seconds": best[1], "activation_mib": max(0.0, peak - base - grads)}
    return {**cfg, "wall_seconds": min(times), "activation_mib": max(0.0, peak - base - grads)}


def run_config_subprocess(cfg):
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"configuration {cfg} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# cuBLAS roofline: the bare GEMMs a fwd+bwd of the head needs
# ---------------------------------------------------------------------------------------------


def head_flops(n, hdim, vocab, trainable):
    return 2 * n * vocab * hdim * (3 if trainable else 2)


def cublas_seconds(n, hdim, vocab, dtype, trainable, repeats=3):
    hidden = torch.randn(n, hdim, device="cuda", dtype=dtype)
    weight = torch.randn(vocab, hdim, device="cuda", dtype=dtype)
    grad_logits = torch.randn(n, vocab, device="cuda", dtype=dtype)

    def gemms():  # the GEMMs of one forward + backward of the LM head, nothing else
        products = [hidden @ weight.t(), grad_logits @ weight]
        if trainable:
            products.append(grad_logits.t() @ hidden)
        return products

    gemms()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        gemms()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best  # the tensors are freed with this frame


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------


def format_table(rows, roofline, clock):
    head = (f"| N | head | method | {clock} time (s) | wall (s) | activation (MiB) | time / naive | time / trl | "
            "memory / naive | memory / trl |")
    if roofline:
        head += " TFLOP/s | cuBLAS TFLOP/s | of cuBLAS |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        key = (row["n"], row["trainable"])
        ref = {r["method"]: r for r in rows if (r["n"], r["trainable"]) == key}

        for r in ref.values():
            r["seconds"] = r[f"{clock}_seconds"]

        def ratio(field, other):
            return f"{row[field] / ref[other][field]:.2f}" if other in ref and ref[other][field] > 0 else "-"

        line = (f"| {row['n']} | {'trainable' if row['trainable'] else 'frozen'} | {row['method']} | "
                f"{row['seconds']:.2f} | {row['wall_seconds']:.2f} | {row['activation_mib']:.0f} | "
                f"{ratio('seconds', 'naive')} | {ratio('seconds', 'trl')} | {ratio('activation_mib', 'naive')} | "
                f"{ratio('activation_mib', 'trl')} |")
        if roofline:
            tflops = head_flops(row["n"], row["hidden"], row["vocab"], row["trainable"]) / row["wall_seconds"] / 1e12
            cublas = row.get("cublas_tflops")
            line += f" {tflops:.1f} | {cublas:.1f} | {tflops / cublas:.2f} |" if cublas else f" {tflops:.1f} | - | - |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "fp32", "bf16", "autocast"],
                        help="default: float32 on the CPU, bfloat16 on CUDA; autocast: fp32 tensors, bf16 autocast")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="N values (default 2048 4096)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--methods", nargs="+", default=["naive", "trl", "ours"], choices=["naive", "trl", "ours"])
    parser.add_argument("--heads", nargs="+", default=["trainable", "frozen"], choices=["trainable", "frozen"])
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per configuration (best kept)")
    parser.add_argument("--quick", action="store_true",
                        help="N = 256, 512 and V = 32768: a few minutes on 2 shared cores")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None,
                        help="time the ratios use; default cpu (process CPU seconds, all threads) on the CPU, since "
                             "other processes sharing the machine distort wall time, and wall on CUDA")
    parser.add_argument("--roofline", action="store_true", help="CUDA: compare with bare cuBLAS GEMMs")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench", "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(run_config(json.loads(args.worker))))
        return
    dtype = {"fp32": "float32", "bf16": "bfloat16", None: None}.get(args.dtype, args.dtype)
    dtype = dtype or ("bfloat16" if args.device == "cuda" else "float32")
    tokens = args.tokens or ([256, 512] if args.quick else [2048, 4096])
    vocab = 32768 if args.quick and args.vocab == 151936 else args.vocab
    repeats = args.repeats or (3 if args.device == "cuda" else 1)
    clock = "wall" if args.device == "cuda" else (args.clock or "cpu")
    methods = [m for m in args.methods if m != "trl" or trl_function() is not None]
    if "trl" in args.methods and "trl" not in methods:
        print("trl is not installed: the TRL column is skipped (pip install trl==1.16.0)")

    print(f"device={args.device} dtype={dtype} H={args.hidden} V={vocab} threads={torch.get_num_threads()} "
          f"repeats={repeats} clock={clock}; activation = peak {'RSS' if args.device == 'cpu' else 'allocated'} "
          "during fwd+bwd minus inputs, weight and the returned gradients")
    rows = []
    for n in tokens:
        for head in args.heads:
            cublas = None
            if args.roofline and args.device == "cuda":
                gemm_dtype = torch.bfloat16 if dtype == "autocast" else getattr(torch, dtype)
                secs = cublas_seconds(n, args.hidden, vocab, gemm_dtype, head == "trainable")
                cublas = head_flops(n, args.hidden, vocab, head == "trainable") / secs / 1e12
            for method in methods:
                cfg = {"device": args.device, "dtype": dtype, "n": n, "hidden": args.hidden, "vocab": vocab,
                       "trainable": head == "trainable", "method": method, "repeats": repeats}
                row = run_config_subprocess(cfg) if args.device == "cpu" else run_config(cfg)
                row["cublas_tflops"] = cublas
                rows.append(row)
                cpu = f"cpu {row['cpu_seconds']:8.2f} s  " if "cpu_seconds" in row else ""
                print(f"  N={n} {head:9s} {method:5s} wall {row['wall_seconds']:8.2f} s  {cpu}"
                      f"{row['activation_mib']:8.0f} MiB", flush=True)
    table = format_table(rows, args.roofline and args.device == "cuda", clock)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench_logprob_{args.device}_{dtype}")
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(f"written {stem}.md and .json")


if __name__ == "__main__":
    main()
