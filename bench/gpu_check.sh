#!/usr/bin/env bash
# GPU checks for one CUDA machine (sized for a single H200, under 8 minutes in all).
#   bash bench/gpu_check.sh
# Results go to $OUT when set, else bench/results/. Each check is one section below, with its own
# time limit; later checks append a section at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
START=$SECONDS
STATUS=0

log() { echo "[gpu_check +$((SECONDS - START))s] $*"; }

# ---- environment: the project venv if present, else the system python; install what is missing
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
need() {  # need <import name> <pip requirement>
    "$PY" -c "import $1" 2>/dev/null && return 0
    log "installing $2"
    timeout 120 "$PY" -m pip install -q "$2" || log "could not install $2 (offline?); continuing without it"
}
need torch "torch==2.14.1"
need triton "triton==3.8.0"
need pytest "pytest==9.2.0"
need trl "trl==1.16.0"   # the benchmark's peer; its column is skipped when absent
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$RESULTS/gpu_env.txt"

# ---- kernels: tests with compiled Triton on CUDA (the torch cases run too)
log "kernel tests on CUDA"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$RESULTS/test_kernels_cuda.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "kernel tests FAILED"; STATUS=1; }

# ---- kernels: fused log-prob benchmark, bf16, V = 151936, up to 32k tokens, against cuBLAS
log "bench_logprob on CUDA"
timeout 200 "$PY" bench/bench_logprob.py --device cuda --dtype bf16 --tokens 4096 16384 32768 --roofline \
    --out "$RESULTS" 2>&1 | tee "$RESULTS/bench_logprob_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "bench_logprob FAILED"; STATUS=1; }

# ---- train_grpo.py: a tiny GRPO run on CUDA (bf16 autocast), then the same with --use_vllm when vLLM is there
log "train_grpo smoke run on CUDA"
timeout 150 "$PY" train_grpo.py --model_name_or_path tiny --dataset_name synthetic:shapes --max_steps 3 \
    --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 32 --learning_rate 1e-5 \
    --bf16 --report_to none --output_dir "$RESULTS/grpo_cuda" 2>&1 | tail -5 | tee "$RESULTS/grpo_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "train_grpo CUDA smoke FAILED"; STATUS=1; }
if "$PY" -c "import vllm" 2>/dev/null; then
    log "train_grpo --use_vllm smoke run"
    timeout 200 "$PY" train_grpo.py --model_name_or_path tiny --dataset_name synthetic:shapes --max_steps 3 \
        --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 32 --learning_rate 1e-5 \
        --use_vllm --report_to none --output_dir "$RESULTS/grpo_vllm" 2>&1 | tail -5 | tee "$RESULTS/grpo_vllm.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { log "train_grpo --use_vllm smoke FAILED"; STATUS=1; }
else
    log "vLLM not installed here: --use_vllm smoke run skipped (pip install -r requirements-vllm.txt)"
fi

# ---- (later checks append here)

log "done, status $STATUS; results in $RESULTS"
exit $STATUS
