"""Mix-GRPO image side: a rollout with one SDE step and the training recompute of that step, against the diffusers
pipeline's own ODE sampling of the same batch (Qwen-Image, true CFG).

    python bench/bench_flow.py                                   # tiny config on the CPU
    python bench/bench_flow.py --device cuda --dtype bf16 --config small --batch 8 --steps 20
    python bench/bench_flow.py --config small --size 64 --batch 1 --steps 3 --repeats 1   # CPU smoke of small

Phases (timed interleaved in one process, best of --repeats; text encoding included, the VAE decode with --decode):
  pipeline  QwenImagePipeline.__call__ (ODE, true CFG with the norm rescale), output_type "latent" ("pt")
  rollout   encode_condition + sample(sde_steps=[k]): the same work plus one SDE step and its record
  recompute step_logprob of the recorded step + backward (LoRA on the transformer), CFG branches included
  fwd+bwd   one plain transformer forward + backward on the batch (the unit the recompute is counted in)
Memory: each phase in a fresh process; CUDA torch.cuda.max_memory_allocated above what was allocated before the
phase, CPU peak RSS above the RSS before it (VmHWM, reset through /proc/self/clear_refs).
Targets: rollout <= 1.1x pipeline; recompute ~ CFG branches x fwd+bwd.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from utils.t2i.adapters import QwenImageGenerator  # noqa: E402
from utils.t2i.generators import Guidance, sample, step_logprob  # noqa: E402

MIB = 2**20
PROMPT = "a photo of two red circles and a blue square"


def build(config, out_dir):
    """tiny: the tests' tiny pipeline (32 px). small: Qwen-Image's architecture (real VAE, 16 latent channels,
    head dim 128) with few layers and a small VLM, 512 px, for a GPU run."""
    from tiny.pipelines import make_tiny_qwenimage

    if config == "tiny":
        return make_tiny_qwenimage(out_dir), 32
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from tiny.models import make_tiny_vlm

    vlm_dir = make_tiny_vlm(os.path.join(out_dir, "_vlm"), hidden_size=512, num_hidden_layers=4,
                            num_attention_heads=8, vision_hidden_size=128, vision_heads=4)
    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    processor = AutoProcessor.from_pretrained(vlm_dir)
    transformer = QwenImageTransformer2DModel(num_layers=8, attention_head_dim=128, num_attention_heads=8,
                                              joint_attention_dim=512)  # real: 60 layers, 24 heads, 3584
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift=1.0,
                                                time_shift_type="exponential")  # Qwen-Image's scheduler config
    QwenImageEditPipeline(scheduler=scheduler, vae=AutoencoderKLQwenImage(), text_encoder=vlm,
                          tokenizer=processor.tokenizer, processor=processor,
                          transformer=transformer).save_pretrained(out_dir)
    return out_dir, 512


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_mib(fn, device):
    """Peak memory of one fn() call above what was in use before it (after two warm-ups)."""
    fn()
    fn()
    _sync(device)
    if device.startswith("cuda"):
        base = torch.cuda.memory_allocated() / MIB
        torch.cuda.reset_peak_memory_stats()
    else:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the warm-ups' freed heap back, or the phase reuses it unseen
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak-RSS counter to the current RSS
    fn()
    _sync(device)
    top = torch.cuda.max_memory_allocated() / MIB if device.startswith("cuda") else _status("VmHWM")
    return max(0.0, top - base)


PHASES = ("pipeline", "rollout", "recompute", "fwd+bwd")


def setup(args, path, phases):
    """phase -> a no-argument function running it once (what it needs is built here, untimed)."""
    from diffusers import QwenImagePipeline

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    size, prompts, guidance = args.size, [PROMPT] * args.batch, Guidance(scale=args.cfg)
    seed = torch.Generator().manual_seed(0)
    fns = {}
    if "pipeline" in phases:
        pipe = QwenImagePipeline.from_pretrained(path, dtype=dtype).to(args.device)
        pipe.set_progress_bar_config(disable=True)

        @torch.no_grad()
        def pipeline():
            return pipe(prompts, negative_prompt=" ", true_cfg_scale=args.cfg, height=size, width=size,
                        num_inference_steps=args.steps, generator=seed,
                        output_type="pt" if args.decode else "latent").images

        fns["pipeline"] = pipeline

    def rollout_with(gen):
        cond = gen.encode_condition(prompts, height=size, width=size, negative_prompt=" ")
        return cond, sample(gen, cond, num_steps=args.steps, sde_steps=[args.sde_step], guidance=guidance,
                            generator=seed, output_type="pt" if args.decode else None)

    if "rollout" in phases:
        gen = QwenImageGenerator.from_pretrained(path, dtype=dtype, device=args.device)
        fns["rollout"] = lambda: rollout_with(gen)
    if {"recompute", "fwd+bwd"} & set(phases):
        trainer = QwenImageGenerator.from_pretrained(path, dtype=dtype, device=args.device)
        cond, out = rollout_with(trainer)
        step = out.steps[0]
        params = trainer.add_lora(r=16)
        x, t = step.latents.to(trainer.dtype), step.timestep

        def recompute():
            for q in params:
                q.grad = None
            step_logprob(trainer, cond, step)[0].sum().backward()

        def fwd_bwd():  # one transformer forward + backward of the conditional branch
            for q in params:
                q.grad = None
            trainer.forward(x, t, cond, cond.pos, guidance).float().sum().backward()

        def max_dev():
            with torch.no_grad():
                return (torch.exp(step_logprob(trainer, cond, step)[0] - step.log_prob) - 1).abs().max().item()

        fns.update({"recompute": recompute, "fwd+bwd": fwd_bwd, "max_dev": max_dev})
    return fns


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--config", default="tiny", choices=["tiny", "small"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sde_step", type=int, default=2)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", type=int, default=None, help="image size (default: 32 tiny, 512 small)")
    p.add_argument("--decode", action="store_true", help="include the VAE decode (the same code in both)")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # memory of one phase, in a fresh process
    p.add_argument("--path", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.phase:
        print(json.dumps({"mib": peak_mib(setup(args, args.path, [args.phase])[args.phase], args.device)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path, size = build(args.config, tmp)
        args.size = args.size or size
        mib = {}
        for phase in PHASES:  # a fresh process per phase: its peak memory is that phase's alone
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--size", str(args.size), "--phase", phase,
                   "--path", path]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if done.returncode:
                raise SystemExit(f"phase {phase} failed:\n{done.stderr[-3000:]}")
            mib[phase] = json.loads(done.stdout.strip().splitlines()[-1])["mib"]
        fns = setup(args, path, PHASES)
    # Time the phases interleaved, best of --repeats after two warm-up rounds: a busy machine slows all alike.
    best = dict.fromkeys(PHASES, float("inf"))
    for r in range(args.repeats + 2):
        for phase in PHASES:
            _sync(args.device)
            t0 = time.perf_counter()
            fns[phase]()
            _sync(args.device)
            if r >= 2:
                best[phase] = min(best[phase], time.perf_counter() - t0)
    branches = 2 if args.cfg > 1 else 1
    print(f"config={args.config} device={args.device} dtype={args.dtype} batch={args.batch} steps={args.steps} "
          f"size={args.size} cfg={args.cfg} threads={args.threads} decode={args.decode}")
    print(f"{'phase':<12}{'seconds':>10}{'peak MiB':>10}")
    for name in PHASES:
        print(f"{name:<12}{best[name]:>10.4f}{mib[name]:>10.1f}")
    print(f"rollout / pipeline time   {best['rollout'] / best['pipeline']:.3f}  (target <= 1.1)")
    print(f"rollout / pipeline memory {mib['rollout'] / max(mib['pipeline'], 1e-9):.3f}")
    print(f"recompute / ({branches} x fwd+bwd) time {best['recompute'] / (branches * best['fwd+bwd']):.3f}"
          "  (target ~1)")
    print(f"recompute / fwd+bwd memory {mib['recompute'] / max(mib['fwd+bwd'], 1e-9):.3f}")
    print(f"max |ratio - 1| with unchanged weights (LoRA B = 0): {fns['max_dev']():.2e}")


if __name__ == "__main__":
    main()
