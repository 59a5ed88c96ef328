#!/usr/bin/env bash
# GPU checks for one bare CUDA machine with no network, in under 8 minutes:
#   bash bench/gpu_check.sh
# Nothing is installed: what is missing is listed in missing.txt and the checks that need it are skipped.
# Python: $GPU_CHECK_PYTHON, else .venv/bin/python, else python3.
# Results (logs, JSON, the benchmark tables, summary.txt) go to $OUT when set, else bench/results/.
# Each check has its own time limit; a check that would start past the overall budget is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
BUDGET=${GPU_CHECK_BUDGET:-470}  # seconds for everything
START=$SECONDS
STATUS=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1 TOKENIZERS_PARALLELISM=false
export MMGRPO_TINY_CACHE="${MMGRPO_TINY_CACHE:-$RESULTS/tiny-cache}"
: > "$RESULTS/summary.txt"

log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$RESULTS/summary.txt"; }

# check <name> <seconds> <command...>: run under a time limit (capped by what is left of the budget), log to
# $RESULTS/<name>.log, record PASS / FAIL / SKIP in summary.txt
check() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then log "SKIP $name: the ${BUDGET}s budget is spent"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "run  $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$RESULTS/$name.log"
    if [ $rc -eq 0 ]; then log "PASS $name ($((SECONDS - t0))s)"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then log "FAIL $name: timed out after ${limit}s"; STATUS=1
    else log "FAIL $name: exit $rc (see $name.log)"; STATUS=1; fi
}

# ---- environment: the project venv if present, else the system python; nothing is installed
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
PY=${GPU_CHECK_PYTHON:-$PY}
"$PY" - > "$RESULTS/missing.txt" 2>/dev/null <<'EOF' || echo python > "$RESULTS/missing.txt"
import importlib.util
for name in ("torch", "triton", "pytest", "transformers", "accelerate", "deepspeed", "peft", "trl", "vllm"):
    if importlib.util.find_spec(name) is None:
        print(name)
EOF
has() { ! grep -qx "$1" "$RESULTS/missing.txt"; }
if [ -s "$RESULTS/missing.txt" ]; then
    log "missing (not installed, not waited for): $(tr '\n' ' ' < "$RESULTS/missing.txt")"
fi
if ! has torch || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    log "FAIL no CUDA device visible to torch: nothing to check"
    exit 1
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    "$PY" - <<'EOF'
import importlib, torch
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
      f"shared memory per block (opt-in) {getattr(p, 'shared_memory_per_block_optin', '?')} bytes")
for name in ("torch", "triton", "transformers", "accelerate", "deepspeed", "peft", "trl", "vllm"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "missing")
print("cuda", torch.version.cuda)
EOF
} 2>&1 | tee "$RESULTS/gpu_env.txt"

# ---- 1. kernels: every test with compiled Triton (launch configurations chosen for this card's shared memory)
if has pytest && has triton; then
    check kernel_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_precision.py
else
    log "SKIP kernel_tests: pytest or triton missing"
fi

# ---- 2. fused log-prob benchmark, V = 151936: bf16 weights, and fp32 weights under bf16 autocast; against TRL's
#         kernel (when installed) and bare cuBLAS GEMMs (achieved TFLOP/s)
check bench_logprob 70 "$PY" bench/bench_logprob.py --device cuda --dtype bf16 --tokens 4096 16384 32768 \
    --roofline --out "$RESULTS"
check bench_logprob_autocast 40 "$PY" bench/bench_logprob.py --device cuda --dtype autocast --tokens 16384 \
    --methods naive ours --roofline --out "$RESULTS"

# ---- 3. accelerate launch with DeepSpeed ZeRO-3 on 1 GPU: two GRPO and two SFT steps, with a checkpoint
check tiny_cache 40 "$PY" -c \
    "from tiny.cache import shapes_dataset_path, tiny_vlm_path; tiny_vlm_path(); shapes_dataset_path()"
TINY_GRPO=(--model_name_or_path tiny --dataset_name synthetic:shapes --max_steps 2 --save_steps 2
           --per_device_train_batch_size 8 --num_generations 8 --max_completion_length 24 --learning_rate 1e-5
           --report_to none --bf16)
if has deepspeed && has accelerate; then
    check zero3_grpo 60 "$PY" -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml \
        --num_processes 1 train_grpo.py "${TINY_GRPO[@]}" --output_dir "$RESULTS/zero3_grpo"
    check zero3_sft 45 "$PY" -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml \
        --num_processes 1 train_sft.py --model_name_or_path tiny --dataset_name synthetic:shapes --max_steps 2 \
        --save_steps 2 --per_device_train_batch_size 4 --report_to none --bf16 --output_dir "$RESULTS/zero3_sft"
else
    log "SKIP zero3_grpo, zero3_sft: deepspeed or accelerate missing"
fi

# ---- 4. vLLM colocate: a tiny Qwen2.5-VL, a tiny text LLM, the LLM with LoRA (bench/vllm_smoke.py); then server
#         mode: vllm_serve.py on the GPU, two train_grpo.py --vllm_mode server steps on the CPU (gloo weight pushes);
#         then vLLM's `vllm serve` as `trl vllm-serve` starts it (two GPUs: GRPO steps with NCCL pushes; one: the
#         client's requests and replies)
if has vllm; then
    check vllm_smoke 150 "$PY" bench/vllm_smoke.py --timeout 70 --out "$RESULTS"
    check vllm_server_smoke 120 "$PY" bench/vllm_server_smoke.py --timeout 90 --out "$RESULTS"
    check vllm_serve_smoke 120 "$PY" bench/vllm_server_smoke.py --server vllm --timeout 90 --out "$RESULTS"
else
    log "SKIP vllm_smoke, vllm_server_smoke, vllm_serve_smoke: no vLLM (pip install -r requirements-vllm.txt)"
fi

# ---- 5. train_grpo.py on one GPU without DeepSpeed, then the same with --use_vllm (engine asleep while training;
#         the sampler/trainer gap and the importance weights must be logged)
check grpo_cuda 40 "$PY" train_grpo.py "${TINY_GRPO[@]}" --output_dir "$RESULTS/grpo_cuda"
if has vllm; then
    check grpo_vllm 60 "$PY" train_grpo.py "${TINY_GRPO[@]}" --use_vllm --vllm_enforce_eager --vllm_enable_sleep_mode \
        --output_dir "$RESULTS/grpo_vllm"
    check grpo_vllm_metrics 10 grep -q '"vllm/is_weight_mean"' "$RESULTS/grpo_vllm/metrics.jsonl"
fi

# ---- 6. padding-free packing: the training log-prob pass padded vs packed on the long-tailed workload (256 image
#         tokens a prompt, completions log-normal in [16, 1024]): tokens/s and peak memory of each
check bench_packing 60 "$PY" bench/bench_packing.py --device cuda --full --hidden_size 512 --num_hidden_layers 8 \
    --prompts 4 --num_generations 8 --workdir "$RESULTS/bench_packing" --json "$RESULTS/bench_packing.json"
if "$PY" -c "import flash_attn" 2>/dev/null; then  # the packed pass's varlen path (one kernel call per layer)
    check bench_packing_fa2 60 "$PY" bench/bench_packing.py --device cuda --full --hidden_size 512 \
        --num_hidden_layers 8 --prompts 4 --num_generations 8 --attn_implementation flash_attention_2 \
        --workdir "$RESULTS/bench_packing_fa2" --json "$RESULTS/bench_packing_fa2.json"
else
    log "SKIP bench_packing_fa2: flash_attn is not installed"
fi

# ---- 7. the HF rollout eager vs compiled (--cache_implementation static: static KV cache, CUDA graphs), tokens/s
#         and compile time, tiny and larger tiny Qwen2.5-VL, B = 8 and 40 (bench/bench_compiled_rollout.py)
check bench_compiled_rollout 150 "$PY" bench/bench_compiled_rollout.py --device cuda --max_new_tokens 128 \
    --repeats 3 --workdir "$RESULTS/bench_compiled_rollout" --json "$RESULTS/bench_compiled_rollout.json"

log "done in $((SECONDS - START))s, status $STATUS; results in $RESULTS"
exit $STATUS
