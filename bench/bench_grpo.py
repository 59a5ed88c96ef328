"""One GRPO step, ours (train_grpo.py) against TRL's GRPOTrainer, on the CPU, on three workloads.

    python bench/bench_grpo.py                      # the four workloads, tiny Qwen2.5-VL (hidden 256, 4 layers)
    python bench/bench_grpo.py --threads 1 --repeats 2 --json bench_grpo.json
    python bench/bench_grpo.py --workloads short --quick   # hidden 128, 2 layers, 16 new tokens, 1 + 2 steps

Workloads (`--workloads`, default all four, each with its target):
  short     an 84 px image (9 image tokens) and a one-line question with no system prompt (~38 prompt tokens),
            completions of natural length (up to 64 tokens): what a new user tries first. Target >= 1.3x TRL.
  short8x8  the short prompts, 8 prompts x 8 completions a step (64 completions), 12 timed steps: the
            independent check's workload, where the rollout's per-token overhead shows. Target >= 1.3x TRL.
  image448  the same question with a 448 px image: 256 image tokens, a real VLM prompt (~285 tokens), natural
            length. Target >= 2x TRL.
  forced    the CRYSTAL JSON system prompt with the 84 px image (126 prompt tokens), every completion forced to
            64 tokens (equal work on both sides: TRL through `generation_kwargs={"min_new_tokens": N}`, ours by
            adding the EOS ids to the tokens its sampler suppresses; train_grpo.py has no min-length flag).
            Target >= 1.3x TRL.
  longtail  the 448 px image (256 image tokens), completions forced to the maximum as in `forced`, then each cut
            to a length drawn log-normal (bench/bench_packing.py's `longtail_lengths`: median max / 8, a few
            at the maximum), the same draws on both sides, as if it had stopped there: the workload where
            padding costs most. Target >= 1.5x TRL. (Not in the default set: --workloads longtail.)
Frameworks (`--frameworks`): ours (train_grpo.py as configured by default, --padding_free on where supported),
ours_padded (the same with --padding_free false) and trl.
Targets hold at no more peak memory than TRL. Natural lengths differ between the two samplers (different
random streams), so the mean completion length of each side is printed next to its time.

Both sides get the same model folder, the same shapes-VQA rows, the same `format` + `accuracy` rewards, G = 8,
8 completions per step (64 in short8x8), beta = 0.04 (so both load a reference model), temperature 1, the same
learning rate, `loss_type` dapo, one optimisation pass per generation, fp32. TRL (a dev-only install,
requirements-dev.txt) is skipped with a message when it is not importable.

Each framework runs in its own fresh process (one after the other, never at once), with the same torch
and OpenMP thread count, so the peak RSS (ru_maxrss) is that framework's alone. On a machine other jobs
also load, use `--threads 1`: with more threads than free cores every parallel op waits for a descheduled
thread, and the timings count tensor ops rather than measure compute. Seconds per step leave out
the warm-up steps; ours come from metrics.jsonl (`step_time`, `time/*`), TRL's from a TrainerCallback
(`on_step_begin` .. `on_step_end`) with its generation, no-grad log-prob and reward calls timed by a
subclass. The shares split a step the same way on both sides:
  generation  sampling the completions (HF `generate`)
  logprob     no-grad log-probs of the reference model (and the old policy when mu > 1)
  rewards     reward functions (+ advantages)
  backward    policy forward with grad, loss, backward, clipping and the optimizer step
  other       the rest: dataset rows, chat template + image processor, decoding
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("generation", "logprob", "rewards", "backward")
FRAMEWORKS = ("ours", "ours_padded", "trl")
DEFAULT_FRAMEWORKS = ("ours", "trl")

FULL = dict(hidden_size=256, num_hidden_layers=4, max_completion_length=64, steps=5, batch_size=8)
QUICK = dict(hidden_size=128, num_hidden_layers=2, max_completion_length=16, steps=2, batch_size=8)
# A workload's own `steps` / `batch_size` replace the defaults unless the command line sets them (--quick too).
WORKLOADS = {
    "short": dict(image_size=84, template="plain", force_length=False, target=1.3),
    "short8x8": dict(image_size=84, template="plain", force_length=False, target=1.3, batch_size=64, steps=12),
    "image448": dict(image_size=448, template="plain", force_length=False, target=2.0),
    "forced": dict(image_size=84, template="crystal_json", force_length=True, target=1.3),
    "longtail": dict(image_size=448, template="plain", force_length=True, longtail=True, target=1.5),
}
DEFAULT_WORKLOADS = ("short", "short8x8", "image448", "forced")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller model, 16 tokens, 2 timed steps")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5, short8x8 12; --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (default 1)")
    p.add_argument("--hidden_size", type=int, default=None)
    p.add_argument("--num_hidden_layers", type=int, default=None)
    p.add_argument("--max_completion_length", type=int, default=None, help="new tokens (default 64; --quick 16)")
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=None,
                   help="completions per step (per_device_train_batch_size; default 8, short8x8 64)")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--learning_rate", type=float, default=1e-6)
    p.add_argument("--loss_type", default="dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    p.add_argument("--rows", type=int, default=64, help="shapes-VQA rows in the dataset")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads in each worker")
    p.add_argument("--gradient_checkpointing", action="store_true",
                   help="turn it on in both (TRL's default is on, ours off; both off by default here)")
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=list(WORKLOADS),
                   help="which workloads to run (default: short, short8x8, image448, forced)")
    p.add_argument("--frameworks", nargs="+", default=list(DEFAULT_FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--repeats", type=int, default=1, help="run every framework this many times (alternating)")
    p.add_argument("--workdir", default=None, help="where the model, data and run folders go (default: a temp dir)")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--seed", type=int, default=0)
    # internal: one framework in this process
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.fixed = {key for key in ("steps", "batch_size") if getattr(args, key) is not None}  # the command line's
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.fixed |= {"steps", "batch_size"}
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    for workload in args.workloads:
        steps, batch = workload_setting(args, workload, "steps"), workload_setting(args, workload, "batch_size")
        if steps < 1:
            p.error("--steps must be >= 1")
        if batch % args.num_generations:
            p.error(f"--batch_size {batch} ({workload}) must be a multiple of --num_generations {args.num_generations}")
    return args


def workload_setting(args, workload, key):
    """`key` (steps, batch_size) for `workload`: the command line's value, else the workload's own, else the default."""
    if key in args.fixed:
        return getattr(args, key)
    return WORKLOADS[workload].get(key, getattr(args, key))


# ---------------------------------------------------------------------------------------------
# worker side: one framework, in its own process
# ---------------------------------------------------------------------------------------------


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cut_to_longtail(spec):
    """f(completion lengths list) -> the same completions cut to this step's long-tailed lengths (the n-th call
    draws with seed (seed, n)): identical draws for every framework."""
    from bench.bench_packing import longtail_lengths

    calls = [0]

    def lengths(n):
        calls[0] += 1
        return longtail_lengths(n, spec["max_completion_length"], spec["seed"] * 1000 + calls[0])

    return lengths


def run_ours(spec):
    """train_grpo.main on the spec; timings from its metrics.jsonl."""
    import train_grpo

    if spec.get("longtail"):
        draw, generate = cut_to_longtail(spec), train_grpo.generate_completions

        def generate_longtail(*a, **kw):
            ids, mask = generate(*a, **kw)
            for k, n in enumerate(draw(ids.shape[0])):
                mask[k, n:] = 0
            return ids, mask

        train_grpo.generate_completions = generate_longtail

    if spec["force_length"]:
        # No min-length flag in train_grpo.py: suppressing EOS for the whole completion is what
        # min_new_tokens = max_completion_length does inside HF generate.
        suppress = train_grpo.special_token_ids_to_suppress
        train_grpo.special_token_ids_to_suppress = (
            lambda tok, eos_ids: sorted(set(suppress(tok, eos_ids)) | set(eos_ids)))
    import utils.core.checkpoint
    import utils.core.run

    marks = {}
    save = utils.core.checkpoint.save_checkpoint

    def save_checkpoint(*a, **kw):  # the final checkpoint comes after the last step; note the peak before it
        marks.setdefault("train_peak_rss_mb", peak_rss_mb())
        return save(*a, **kw)

    utils.core.checkpoint.save_checkpoint = save_checkpoint
    cpu_marks = []  # process CPU seconds at each metrics row: robust to other jobs on a shared machine

    class TimedLogger(utils.core.run.RunLogger):
        def log(self, step, metrics):
            cpu_marks.append(time.process_time())
            super().log(step, metrics)

    utils.core.run.RunLogger = TimedLogger  # start_logging builds the run's logger
    cfg = train_grpo.GRPOConfig(
        model_name_or_path=spec["model"], dataset_name=spec["data"], prompt_template=spec["template"],
        max_prompt_length=None,
        reward_funcs=["format", "accuracy"], num_generations=spec["G"], per_device_train_batch_size=spec["batch"],
        max_completion_length=spec["max_completion_length"], temperature=1.0, beta=spec["beta"],
        loss_type=spec["loss_type"], learning_rate=spec["learning_rate"], num_iterations=1,
        max_steps=spec["warmup"] + spec["steps"], logging_steps=1, save_steps=10**9, report_to="none",
        output_dir=spec["output_dir"], seed=spec["seed"], log_completions=False, dtype="float32",
        gradient_checkpointing=spec["gradient_checkpointing"], cpu_threads=spec["threads"],
        padding_free=False if spec["framework"] == "ours_padded" else None)
    train_grpo.main(cfg)
    with open(os.path.join(spec["output_dir"], "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cpu = [None] + [b - a for a, b in zip(cpu_marks, cpu_marks[1:])]  # step 1 has no mark before it
    steps = [dict(step_time=r["step_time"], cpu_time=c, completion_length=r["completion_length"],
                  **{k: r[f"time/{k}"] for k in PHASES}) for r, c in zip(rows, cpu)]
    return steps, marks


def run_trl(spec):
    """TRL's GRPOTrainer on the spec; a callback times whole steps, a subclass times the phases."""
    import torch
    from datasets import load_from_disk
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards import get_reward
    from utils.core.models import load_model_and_processor
    from utils.core.prompts import build_messages

    class TimedGRPOTrainer(GRPOTrainer):
        phase_times = dict.fromkeys(("generation", "logprob", "rewards", "prepare"), 0.0)

        def _timed(self, phase, fn, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.phase_times[phase] += time.perf_counter() - t0

        def _generate_single_turn(self, *a, **kw):
            completion_ids, logprobs = self._timed("generation", super()._generate_single_turn, *a, **kw)
            if spec.get("longtail"):
                completion_ids = [ids[:n] for ids, n in zip(completion_ids, draw(len(completion_ids)))]
            return completion_ids, logprobs

        def _calculate_rewards(self, *a, **kw):
            return self._timed("rewards", super()._calculate_rewards, *a, **kw)

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            if torch.is_grad_enabled():  # the policy forward of the loss: part of "backward"
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            return self._timed("logprob", super()._get_per_token_logps_and_entropies, *a, **kw)

        def _prepare_inputs(self, *a, **kw):
            return self._timed("prepare", super()._prepare_inputs, *a, **kw)

    steps, marks = [], {}
    draw = cut_to_longtail(spec)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            TimedGRPOTrainer.phase_times.update(dict.fromkeys(TimedGRPOTrainer.phase_times, 0.0))
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            elapsed = time.perf_counter() - self.t0
            t = dict(TimedGRPOTrainer.phase_times)
            # everything after the inputs are prepared: loss forward, backward, clipping, optimizer step
            steps.append(dict(step_time=elapsed, cpu_time=time.process_time() - self.cpu0,
                              backward=elapsed - t.pop("prepare"), **t))

        def on_train_end(self, args, state, control, **kw):
            marks["train_peak_rss_mb"] = peak_rss_mb()

    model, processor = load_model_and_processor(spec["model"], dtype="float32")
    from utils.core.samplers import SeededSampler

    data = load_from_disk(spec["data"])
    # The prompts ours draws, in its order (its seeded sampler, stage 0): TRL reads them unshuffled, so both sides
    # see the same prompt each step and natural completion lengths differ only by the sampling noise.
    order = SeededSampler(len(data), seed=spec["seed"]).take(len(data))
    data = data.select(order)
    # TRL's VLM format: conversational `prompt` with image placeholders, images in the `image` column.
    data = data.map(lambda row: {"prompt": build_messages(row["question"], num_images=1, template=spec["template"])})
    generation_kwargs = {"min_new_tokens": spec["max_completion_length"]} if spec["force_length"] else None
    args = GRPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch"], num_generations=spec["G"],
        max_completion_length=spec["max_completion_length"], temperature=1.0, beta=spec["beta"],
        loss_type=spec["loss_type"], learning_rate=spec["learning_rate"], lr_scheduler_type="constant",
        num_iterations=1, max_steps=spec["warmup"] + spec["steps"], logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, seed=spec["seed"], generation_kwargs=generation_kwargs,
        shuffle_dataset=False,
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=spec["gradient_checkpointing"])
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[get_reward("format"), get_reward("accuracy")], args=args,
                               train_dataset=data, processing_class=processor, callbacks=[StepTimer()])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    if len(lengths) != len(steps):
        raise RuntimeError(f"TRL logged {len(lengths)} completion lengths for {len(steps)} steps")
    for s, length in zip(steps, lengths):
        s["completion_length"] = length
    return steps, marks


def worker(args):
    with open(args.spec) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, REPO)
    baseline = current_rss_mb()
    steps, marks = (run_trl if args.worker == "trl" else run_ours)(dict(spec, framework=args.worker))
    result = dict(framework=args.worker, steps=steps, peak_rss_mb=peak_rss_mb(), start_rss_mb=baseline, **marks,
                  trl_imported="trl" in sys.modules)
    with open(args.result, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------


def prepare(args, workdir, image_size):
    """The tiny VLM folder and the shapes-VQA rows both frameworks train on (images of `image_size` px)."""
    sys.path.insert(0, REPO)
    from tiny.models import make_tiny_vlm
    from tiny.shapes import make_shapes_vqa

    model = os.path.join(workdir, f"tiny-vlm-h{args.hidden_size}-l{args.num_hidden_layers}-px{image_size}")
    data = os.path.join(workdir, f"shapes-{args.rows}-px{image_size}")
    if not os.path.isdir(model):
        make_tiny_vlm(model, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers, seed=args.seed,
                      image_size=image_size)
    if not os.path.isdir(data):
        make_shapes_vqa(args.rows, seed=args.seed, image_size=image_size).save_to_disk(data)
    return model, data


def run_worker(framework, spec, workdir, tag):
    spec_path = os.path.join(workdir, f"spec-{tag}.json")
    result_path = os.path.join(workdir, f"result-{tag}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--spec", spec_path,
           "--result", result_path]
    log_path = os.path.join(workdir, f"log-{tag}.txt")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{framework} worker failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    with open(result_path) as f:
        result = json.load(f)
    result["process_seconds"] = time.perf_counter() - t0
    return result


def summarize(result, warmup, batch):
    """Medians over the timed steps: one step slowed by another job on the machine does not move them."""
    timed = result["steps"][warmup:]
    sec = statistics.median(s["step_time"] for s in timed)
    total = sum(s["step_time"] for s in timed)
    shares = {k: sum(s[k] for s in timed) / total for k in PHASES}
    shares["other"] = 1.0 - sum(shares.values())
    cpu = [s["cpu_time"] for s in timed if s.get("cpu_time") is not None]
    return dict(framework=result["framework"], sec_per_step=sec, sec_per_step_mean=total / len(timed),
                sec_per_step_min=min(s["step_time"] for s in timed), completions_per_sec=batch / sec,
                cpu_sec_per_step=statistics.median(cpu) if cpu else float("nan"),
                peak_rss_mb=result["peak_rss_mb"], train_peak_rss_mb=result.get("train_peak_rss_mb"),
                mean_completion_length=statistics.mean(s["completion_length"] for s in timed), shares=shares,
                step_times=[s["step_time"] for s in timed])


def print_table(rows, title, target):
    print(f"\n{title}  (s/step: median over the timed steps; CPU: process CPU seconds per step)")
    print(f"{'framework':<10} {'s/step':>7} {'mean':>7} {'min':>7} {'CPU s':>7} {'compl/s':>8} {'peak RSS MB':>12} "
          f"{'mean len':>9}   " + " ".join(f"{k:>10}" for k in PHASES + ("other",)))
    for r in rows:
        shares = " ".join(f"{100 * r['shares'][k]:>9.1f}%" for k in PHASES + ("other",))
        print(f"{r['framework']:<10} {r['sec_per_step']:>7.3f} {r['sec_per_step_mean']:>7.3f} "
              f"{r['sec_per_step_min']:>7.3f} {r['cpu_sec_per_step']:>7.3f} {r['completions_per_sec']:>8.2f} "
              f"{r['peak_rss_mb']:>12.0f} {r['mean_completion_length']:>9.1f}   {shares}")
    by = {r["framework"]: r for r in rows}
    packing = {}
    if "ours" in by and "ours_padded" in by:
        packing = dict(packed_step_ratio=by["ours"]["sec_per_step"] / by["ours_padded"]["sec_per_step"],
                       packed_cpu_ratio=by["ours"]["cpu_sec_per_step"] / by["ours_padded"]["cpu_sec_per_step"],
                       packed_rss_ratio=by["ours"]["peak_rss_mb"] / by["ours_padded"]["peak_rss_mb"])
        print(f"step packed / padded = {packing['packed_step_ratio']:.2f}x time (median), "
              f"{packing['packed_cpu_ratio']:.2f}x CPU time, {packing['packed_rss_ratio']:.2f}x peak RSS")
    if "ours" not in by or "trl" not in by:
        return packing
    ours, trl = by["ours"], by["trl"]
    ratios = dict(throughput_ratio=trl["sec_per_step"] / ours["sec_per_step"],
                  throughput_ratio_min=trl["sec_per_step_min"] / ours["sec_per_step_min"],
                  throughput_ratio_cpu=trl["cpu_sec_per_step"] / ours["cpu_sec_per_step"],
                  # per generated token: natural lengths differ between the two samplers
                  token_throughput_ratio=(trl["sec_per_step"] / trl["mean_completion_length"])
                  / (ours["sec_per_step"] / ours["mean_completion_length"]),
                  rss_ratio=ours["peak_rss_mb"] / trl["peak_rss_mb"], **packing)
    speed, mem = ratios["throughput_ratio"], ratios["rss_ratio"]
    print(f"throughput ours / TRL = {speed:.2f}x median, {ratios['throughput_ratio_min']:.2f}x best step, "
          f"{ratios['throughput_ratio_cpu']:.2f}x CPU time, {ratios['token_throughput_ratio']:.2f}x per generated "
          f"token (target >= {target}x: {'met' if speed >= target else 'NOT met'}); "
          f"peak RSS ours / TRL = {mem:.2f} ({'no more' if mem <= 1.0 else 'MORE'} than TRL)")
    return ratios


def trl_available():
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def main(args):
    frameworks = list(args.frameworks)
    if "trl" in frameworks and not trl_available():
        print("trl is not installed (pip install -r requirements-dev.txt): benchmarking ours only")
        frameworks.remove("trl")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_grpo-")
    os.makedirs(workdir, exist_ok=True)
    results = {}
    for workload in args.workloads:
        load = WORKLOADS[workload]
        model, data = prepare(args, workdir, load["image_size"])
        batch, steps = workload_setting(args, workload, "batch_size"), workload_setting(args, workload, "steps")
        spec = dict(model=model, data=data, G=args.num_generations, batch=batch,
                    max_completion_length=args.max_completion_length, beta=args.beta, loss_type=args.loss_type,
                    learning_rate=args.learning_rate, warmup=args.warmup, steps=steps, threads=args.threads,
                    force_length=load["force_length"], template=load["template"], seed=args.seed,
                    longtail=load.get("longtail", False),
                    gradient_checkpointing=args.gradient_checkpointing)
        print(f"\n=== workload {workload}: {load['image_size']} px image, {load['template']} prompt, "
              f"{'forced' if load['force_length'] else 'natural'} length (max {args.max_completion_length} new "
              f"tokens); tiny Qwen2.5-VL hidden {args.hidden_size} x {args.num_hidden_layers} layers; "
              f"G {args.num_generations}, {batch} completions/step, beta {args.beta}, {args.warmup} warm-up "
              f"+ {steps} timed steps, {args.threads} threads; workdir {workdir}")
        runs = []
        for repeat in range(args.repeats):
            rows = []
            for framework in frameworks:
                tag = f"{workload}-{framework}-{repeat}"
                result = run_worker(framework, dict(spec, output_dir=os.path.join(workdir, f"run-{tag}")), workdir,
                                    tag)
                row = summarize(result, args.warmup, batch)
                row["process_seconds"] = result["process_seconds"]
                rows.append(row)
            ratios = print_table(rows, f"{workload}: run {repeat + 1} of {args.repeats}", load["target"])
            runs.append(dict(rows=rows, **ratios))
        results[workload] = dict(target=load["target"], runs=runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config={k: v for k, v in vars(args).items()
                                   if k not in ("worker", "spec", "result", "fixed")},
                           workloads=results), f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    cli = parse_args()
    if cli.worker:
        worker(cli)
    else:
        main(cli)
