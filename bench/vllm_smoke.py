"""vLLM colocate smoke run on one CUDA GPU: a tiny Qwen2.5-VL and a tiny text LLM, built on the spot (no network).

    python bench/vllm_smoke.py [--out DIR]           # bench/gpu_check.sh runs it; needs vLLM and a GPU

For each model, through utils.core.vllm_rollout.VLLMRollout (sleep mode on, eager):
  1. generate with the trainer's own prompt ids; check the echoed ids, that no suppressed token was sampled and
     that every completion ends at a stop id or at --max_tokens;
  2. compare vLLM's sampled-token log-probs with the trainer's (bf16 autocast) on the same tokens: mean / max
     |diff| and the truncated importance weights;
  3. perturb the policy's weights: generating at the same step (no sync) must now disagree with the trainer,
     the next step (synced parameter by parameter) must agree again; the text model repeats it with LoRA
     adapters (merged layer by layer);
  4. sleep: the engine's GPU memory is released and comes back at the next round.
Writes vllm_smoke.json; exits 1 if a check fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from accelerate import Accelerator  # noqa: E402

from tiny.models import make_tiny_llm, make_tiny_vlm  # noqa: E402
from tiny.shapes import make_shapes_vqa  # noqa: E402
from utils.core.encoding import encode_prompts  # noqa: E402
from utils.core.importance import importance_weights, mismatch_metrics, mismatch_stats  # noqa: E402
from utils.core.logprobs import CompletionLogProbs  # noqa: E402
from utils.core.models import load_model_and_processor  # noqa: E402
from utils.core.prompts import build_messages  # noqa: E402
from utils.core.rollout import special_token_ids_to_suppress, stop_token_ids  # noqa: E402
from utils.core.seeds import completion_seeds  # noqa: E402
from utils.core.vllm_rollout import VLLMRollout  # noqa: E402

# |logp_train - logp_vllm| of sampled tokens, mean: bf16 on both sides of a tiny model agree within AGREE_MEAN;
# an engine left with the old weights must be STALE_FACTOR times further off than the synced one
AGREE_MEAN, STALE_FACTOR = 0.05, 5.0


def trainer_logps(policy, batch, ids, mask, temperature):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return policy(batch, ids, mask, temperature)


def perturb(model, scale=0.5, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and p.dim() == 2:
                spread = p.std().item() or 0.05  # LoRA's B starts at zero
                p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * scale * spread)


def run_model(kind, path, accelerator, out):
    model, processor = load_model_and_processor(path, dtype="float32")
    model.to("cuda")
    if kind == "llm+lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]))
    policy = CompletionLogProbs(model)
    tok = getattr(processor, "tokenizer", processor)
    cfg = SimpleNamespace(seed=0, temperature=1.0, top_p=1.0, top_k=None, max_completion_length=24,
                          max_prompt_length=256, bf16=True, dtype="float32", vllm_gpu_memory_utilization=0.2,
                          vllm_enable_sleep_mode=True, vllm_enforce_eager=True, vllm_max_num_seqs=64)
    t0 = time.perf_counter()
    rollout = VLLMRollout(path, accelerator, cfg, processor=processor, model_config=model.config)
    timing = {"engine_start_s": time.perf_counter() - t0}
    rows = make_shapes_vqa(8, seed=3)
    vision = kind == "vlm"
    images = [[r["image"]] if vision else [] for r in rows]
    messages = [build_messages(r["question"], num_images=len(im)) for r, im in zip(rows, images)]
    batch = encode_prompts(processor, messages, images, sample_ids=[str(i) for i in range(8)]).to("cuda")
    stop = stop_token_ids(model, tok)
    suppress = special_token_ids_to_suppress(tok, stop)
    checks, metrics = {}, {}

    def round_(step, seeds_round):
        seeds = completion_seeds(0, seeds_round, range(8))
        t = time.perf_counter()
        ids, mask, vlogp = rollout.generate(policy, processor, messages, images, seeds, step=step, stop_ids=stop,
                                            suppress_ids=suppress, prompt_batch=batch, return_logprobs=True)
        timing[f"generate_step{step}_round{seeds_round}_s"] = time.perf_counter() - t
        tlogp = trainer_logps(policy, batch, ids, mask, cfg.temperature)
        w = importance_weights(tlogp, vlogp, mask, cap=3.0)
        return ids, mask, mismatch_metrics(mismatch_stats(tlogp, vlogp, mask, w), lambda x, op: x)

    ids, mask, m0 = round_(0, 0)
    sampled = ids[mask.bool()]
    checks["no_suppressed_token"] = not torch.isin(sampled, torch.tensor(suppress, device=ids.device)).any().item()
    ends = [(row[m.bool()][-1].item() in stop) or int(m.sum()) == cfg.max_completion_length
            for row, m in zip(ids, mask)]
    checks["every_completion_ends_at_stop_or_max"] = all(ends)
    checks["fresh_weights_agree"] = m0["vllm/logp_diff_mean"] < AGREE_MEAN
    metrics["step0"] = m0
    perturb(model)
    _, _, stale = round_(0, 1)  # same step: no sync
    _, _, synced = round_(1, 2)
    metrics["stale"], metrics["synced"] = stale, synced
    checks["stale_weights_disagree"] = stale["vllm/logp_diff_mean"] > STALE_FACTOR * synced["vllm/logp_diff_mean"]
    checks["synced_weights_agree"] = synced["vllm/logp_diff_mean"] < AGREE_MEAN
    free_awake = torch.cuda.mem_get_info()[0]
    rollout.sleep()
    torch.cuda.empty_cache()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    checks["sleep_frees_memory"] = freed > 0
    _, _, woken = round_(2, 3)
    checks["wakes_and_agrees"] = woken["vllm/logp_diff_mean"] < AGREE_MEAN
    metrics["after_sleep"] = woken
    out.append({"kind": kind, "checks": checks, "metrics": metrics, "timing": timing,
                "sleep_freed_mib": freed / 2**20})
    return all(checks.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench", "results"))
    parser.add_argument("--models", nargs="+", default=["vlm", "llm", "llm+lora"],
                        choices=["vlm", "llm", "llm+lora"])
    parser.add_argument("--timeout", type=int, default=150, help="seconds per model (each in its own process)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # kind, model path
    args = parser.parse_args()
    if args.worker:  # one engine per process: vLLM's distributed state is process-wide
        results = []
        try:
            ok = run_model(args.worker[0], args.worker[1], Accelerator(), results)
        except Exception as err:  # noqa: BLE001 - reported as this model's verdict
            results.append({"kind": args.worker[0], "error": f"{type(err).__name__}: {err}"})
            ok = False
        print("RESULT " + json.dumps(results[-1], default=str), flush=True)
        sys.exit(0 if ok else 1)
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="vllm-smoke-")
    paths = {"vlm": make_tiny_vlm(os.path.join(root, "vlm"), seed=0),
             "llm": make_tiny_llm(os.path.join(root, "llm"), seed=0)}
    results, ok = [], True
    for kind in args.models:
        path = paths["vlm" if kind == "vlm" else "llm"]
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", kind, path], capture_output=True, text=True,
                                  timeout=args.timeout)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"kind": kind, "error": proc.stderr[-3000:]}
            ok &= proc.returncode == 0
        except subprocess.TimeoutExpired:
            result, ok = {"kind": kind, "error": f"timed out after {args.timeout} s"}, False
        results.append(result)
        print(json.dumps(result, indent=1), flush=True)
    with open(os.path.join(args.out, "vllm_smoke.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("vllm smoke:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
