"""Refuse a training set-up whose optimizer steps would round away: pure bf16/fp16 weights under a plain
Adam-style optimizer at a learning rate below the weights' rounding step.

An Adam step moves a weight by about the learning rate (its update m / sqrt(v) is about 1 in size). A bf16
number has 8 significant bits, so a step smaller than half the gap between w and its neighbour (|w| / 2^8
to |w| / 2^9) rounds back to w: at lr 1e-6 every bf16 weight above ~5e-4 in size never moves. Mixed
precision (fp32 weights, `--bf16` autocast) or DeepSpeed (fp32 master weights) keeps those updates.
"""

import torch

from utils.core.errors import InputError

# significant bits after the leading one
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
SAMPLE_PER_TENSOR = 1 << 16  # weights looked at per tensor (evenly strided), enough for a fraction
MAX_LOST_FRACTION = 0.5


def lost_step_fraction(params, lr):
    """Fraction of the low-precision elements of `params` that a step of size `lr` cannot change (it is under
    half their rounding gap), estimated on an even sample of each tensor; (fraction, low-precision count)."""
    lost, total = 0.0, 0
    for p in params:
        bits = MANTISSA_BITS.get(p.dtype)
        if bits is None or p.numel() == 0:
            continue
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLE_PER_TENSOR)].float()
        _, exponent = torch.frexp(sample)  # |w| = m 2^e with m in [0.5, 1): gap = 2^(e - 1 - bits)
        half_gap = torch.ldexp(torch.ones_like(sample), exponent - 2 - bits)
        frozen = (half_gap > lr) & (sample != 0)
        lost += frozen.float().mean().item() * p.numel()
        total += p.numel()
    return (lost / total if total else 0.0), total


def check_update_precision(optimizer, *, master_weights=False):
    """Raise before training when most trainable bf16/fp16 weights could never move under `optimizer`.

    `master_weights`: the optimizer updates fp32 copies (DeepSpeed's bf16/fp16 optimizers), so nothing is
    lost. Only Adam-family optimizers are checked: their steps are about lr in size whatever the gradient.
    """
    if master_weights or "adam" not in type(optimizer).__name__.lower():
        return
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        fraction, count = lost_step_fraction(params, group["lr"])
        if count and fraction > MAX_LOST_FRACTION:
            dtype = next(p.dtype for p in params if p.dtype in MANTISSA_BITS)
            name = str(dtype).removeprefix("torch.")
            raise InputError(  # a script ends with this one line (utils.core.errors), no traceback
                f"--dtype {name} trains {count:,} {name} weights with {type(optimizer).__name__} at learning rate "
                f"{group['lr']:g}: a step that small rounds away for {fraction:.0%} of them, so they would never "
                f"change. Load fp32 weights and train in mixed precision (--dtype float32 --bf16), use DeepSpeed "
                "(fp32 master weights), or raise --learning_rate")


def deepspeed_master_weights(accelerator):
    """Whether DeepSpeed will step fp32 copies of the weights (`master_weights` above): under every ZeRO stage
    (its partitioned optimizer keeps fp32 partitions), and under its bf16 / fp16 optimizers at stage 0."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return False
    return plugin.zero_stage > 0 or accelerator.mixed_precision in ("bf16", "fp16")
