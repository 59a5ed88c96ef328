"""What the tiled kernels share: the backend choice, input checks, the tile plan and its scratch buffers, the
online-logsumexp statistics, bf16 rounding under the Triton interpreter, and the launch-configuration choice.

The ops themselves live one per file beside their torch paths: `logprob.py` (log-prob from the LM head),
`logits_logprob.py` (log-prob from existing logits), `advantages.py` (group advantages).
"""

from __future__ import annotations

import math
import os
import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with torch on Linux; elsewhere only the torch paths exist
    triton = tl = None

LOW_PRECISION = (torch.float16, torch.bfloat16)
SMEM_RESERVE = 8 * 1024  # reductions and layout conversions of a kernel's epilogue
SMEM_FALLBACK = 99 * 1024  # when the device does not report its opt-in limit: the smallest recent card's


# ----------------------------------------------------------------------------------------------
# Backend choice and input checks
# ----------------------------------------------------------------------------------------------


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(backend: str, tensor: torch.Tensor) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return triton is not None and tensor.is_cuda
    if triton is None:
        raise RuntimeError("backend='triton' but triton is not installed")
    if not tensor.is_cuda and not interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to interpret on the CPU)")
    return True


def check_labels_and_temperature(labels, temperature, where):
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"{where}: labels must be an integer tensor, got {labels.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{where}: temperature must be a positive number, got {temperature!r}")


def check_label_range(kept_labels, vocab, ignore_index):
    if kept_labels.numel() and (kept_labels.min() < 0 or kept_labels.max() >= vocab):
        bad = kept_labels[(kept_labels < 0) | (kept_labels >= vocab)][0].item()
        raise ValueError(f"label {bad} is outside the vocabulary [0, {vocab}) and is not ignore_index={ignore_index}")


def warn_once(warned: set, key, message):
    """warnings.warn(message) the first time `key` is seen in `warned` (the caller's set)."""
    if key not in warned:
        warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------
# Tiles and the online logsumexp
# ----------------------------------------------------------------------------------------------


def plan(n_rows: int, n_cols: int, max_cols: int, max_elements: int) -> tuple[int, int]:
    """(rows per chunk, columns per tile) for tiles of at most max_cols columns and max_elements elements."""
    tile = max(1, min(max_cols, n_cols))
    return max(1, min(n_rows, max_elements // tile)), tile


class Scratch:
    """Flat buffers reused by every tile; each view is contiguous whatever the tile's width. A buffer is as
    large as the largest view asked of it (the first tile is the largest, so it is allocated once)."""

    def __init__(self, device):
        self.device, self.buffers = device, {}

    def get(self, name, rows, cols, dtype):
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < rows * cols:
            buf = self.buffers[name] = torch.empty(rows * cols, device=self.device, dtype=dtype)
        return buf[: rows * cols].view(rows, cols)

    def cast(self, name, tensor, dtype):
        """The 2-D `tensor` in `dtype`: itself when it has it, else a copy in buffer `name`. On the CPU a fresh
        tile-sized tensor (what .to() returns) costs a page fault per 4 KiB on every tile; a reused buffer does not."""
        if tensor.dtype == dtype:
            return tensor
        return self.get(name, *tensor.shape, dtype).copy_(tensor)


def new_stats(n, device, with_entropy):
    """Running statistics of n rows before any tile: max, sum of exp(z - max), target logit."""
    f32 = {"device": device, "dtype": torch.float32}
    return {
        "max": torch.full((n,), -math.inf, **f32),
        "sumexp": torch.zeros(n, **f32),
        # sum_j e_j (z_j - max): the entropy is log(sumexp) - this / sumexp
        "zexp": torch.zeros(n, **f32) if with_entropy else None,
        "target": torch.zeros(n, **f32),
    }


def finish_stats(stats):
    """(logsumexp, target logit, entropy or None) from the statistics of every tile."""
    log_sum = stats["sumexp"].log()
    lse = stats["max"] + log_sum
    entropy = None if stats["zexp"] is None else log_sum - stats["zexp"] / stats["sumexp"]
    return lse, stats["target"], entropy


# ----------------------------------------------------------------------------------------------
# Triton helpers and launch configurations
# ----------------------------------------------------------------------------------------------


def jit(fn):
    return triton.jit(fn) if triton is not None else fn


def round_by_hand(dtype) -> bool:
    """The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: round by hand there."""
    return interpreting() and dtype == torch.bfloat16


@jit
def round_to_bf16(x):
    # fp32 -> the nearest bf16 value (ties to even), still in fp32; a later cast to bf16 is then exact
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def fold_block(n_cols):
    """Columns one program of a row-fold kernel loads at once."""
    return 32 if interpreting() else min(1024, triton.next_power_of_2(max(n_cols, 16)))


def num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def smem_limit(device) -> int:
    """Shared memory one block may use on `device` (the opt-in limit)."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or SMEM_FALLBACK


def fitting_configs(candidates, smem_bytes, limit) -> list:
    """The candidates whose smem_bytes(config) + SMEM_RESERVE fit `limit`, best first (never empty: the
    smallest one when none fits, so that Triton says what is missing)."""
    fitting = [c for c in candidates if smem_bytes(c) + SMEM_RESERVE <= limit]
    return fitting or [min(candidates, key=smem_bytes)]


def with_fitting_config(cache: dict, key, candidates, launch, warned: set, what: str):
    """launch(config) with the best configuration cached for `key` (candidates() the first time). One the GPU
    rejects (Triton's OutOfResources: the estimate was short) is dropped for good, with a warning, once."""
    if key not in cache:
        cache[key] = list(candidates())
    configs = cache[key]
    while True:
        try:
            return launch(configs[0])
        except triton.runtime.errors.OutOfResources as err:
            if len(configs) == 1:
                raise
            warn_once(warned, ("config", what, key, configs[0]), f"{what}: launch configuration {configs[0]} "
                      f"does not fit this GPU ({err}); using {configs[1]}")
            configs.pop(0)
