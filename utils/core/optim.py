"""The training scripts' optimizer and warmup by transformers' / TRL's names: --optim, --adam_beta1, --adam_beta2,
--adam_epsilon, --weight_decay, and --warmup_steps (a count, or under 1 a share of the steps, as transformers reads
it) beside our --warmup_ratio.

Torch's AdamW runs on the CPU and on CUDA in two forms: `adamw_torch` (one multi-tensor `foreach` update per step)
and `adamw_torch_fused` (one fused kernel per step; TRL's default). transformers' other names need a package or a
device this project does not install or wire in (bitsandbytes, torchao, GaLore, ...): each is refused naming it.
"""

import math
from dataclasses import dataclass, field

import torch

# --optim -> torch.optim.AdamW keyword arguments
TORCH_ADAMW = {"adamw_torch": {}, "adamw_torch_fused": {"fused": True}}
OPTIMIZERS = tuple(TORCH_ADAMW)

# transformers' other --optim names -> what they need
_NEEDS = {
    "adamw_torch_xla": "torch_xla (TPUs)",
    "adamw_torch_npu_fused": "torch_npu (Ascend NPUs)",
    "adamw_apex_fused": "NVIDIA apex",
    "adamw_anyprecision": "torchdistx",
    "adamw_torch_4bit": "torchao",
    "adamw_torch_8bit": "torchao",
    "galore_adamw": "galore-torch", "galore_adamw_8bit": "galore-torch", "galore_adafactor": "galore-torch",
    "galore_adamw_layerwise": "galore-torch", "galore_adamw_8bit_layerwise": "galore-torch",
    "galore_adafactor_layerwise": "galore-torch",
    "apollo_adamw": "apollo-torch", "apollo_adamw_layerwise": "apollo-torch",
    "lomo": "lomo-optim", "adalomo": "lomo-optim",
    "grokadamw": "grokadamw",
    "schedule_free_radam": "schedulefree", "schedule_free_adamw": "schedulefree", "schedule_free_sgd": "schedulefree",
    "stable_adamw": "torch-optimi",
}
_BNB = ("adamw_bnb_8bit", "adamw_8bit", "ademamix", "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit",
        "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit",
        "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")
_NEEDS.update(dict.fromkeys(_BNB, "bitsandbytes"))
_NOT_ADAM = ("adafactor", "sgd", "adagrad", "rmsprop")


@dataclass
class OptimizerFlags:
    """The optimizer flags the three training scripts share (a script redeclares a field to change its default)."""

    # training: optimizer (transformers' / TRL's names)
    optim: str = field(default="adamw_torch", metadata={"help": (
        "adamw_torch (torch's AdamW, one foreach update) or adamw_torch_fused (one fused kernel; TRL's default); "
        "transformers' other optimizers are refused naming what they need")})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2"})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    warmup_steps: float = field(default=0, metadata={"help": (
        "linear LR warmup: a count of optimizer steps, or under 1 a share of them (as transformers reads it)")})


def optimizer_error(cfg):
    """The one-line reason --optim and the Adam flags cannot run as given, or None."""
    name = cfg.optim
    if name in _NEEDS:
        return (f"--optim {name} needs {_NEEDS[name]}, which this project does not install or wire in; use "
                f"{' or '.join(OPTIMIZERS)} (torch's AdamW)")
    if name in _NOT_ADAM:
        return (f"--optim {name} is not an AdamW: the learning rates of the recipes and the bf16 update check "
                f"(utils/core/precision.py) assume Adam's steps; use {' or '.join(OPTIMIZERS)}")
    if name not in TORCH_ADAMW:
        return f"--optim {name!r} is not one of {', '.join(OPTIMIZERS)}"
    for flag in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg, flag) < 1.0:
            return f"--{flag} {getattr(cfg, flag)} must be in [0, 1)"
    if not cfg.adam_epsilon > 0:
        return f"--adam_epsilon {cfg.adam_epsilon} must be > 0"
    return None


def check_optimizer_flags(cfg):
    """Raise ConfigError naming the flag when --optim, the Adam flags or the warmup cannot run (a script's validate)."""
    from utils.core.config import ConfigError

    error = optimizer_error(cfg) or warmup_error(cfg)
    if error:
        raise ConfigError(error)


def build_optimizer(params, cfg, **extra):
    """AdamW over `params` (tensors or parameter groups) with --optim's form, --learning_rate, --adam_beta1/2,
    --adam_epsilon and --weight_decay (`extra` overrides, e.g. a script's own weight decay per group)."""
    flag = lambda name: getattr(cfg, name, getattr(OptimizerFlags, name))  # noqa: E731 (configs without the group)
    kwargs = dict(lr=cfg.learning_rate, betas=(flag("adam_beta1"), flag("adam_beta2")), eps=flag("adam_epsilon"),
                  weight_decay=cfg.weight_decay, **TORCH_ADAMW[flag("optim")])
    return torch.optim.AdamW(params, **{**kwargs, **extra})


def warmup_error(cfg):
    """--warmup_steps and --warmup_ratio (where the script has it): each valid, and not both given."""
    ratio = getattr(cfg, "warmup_ratio", 0.0)
    if not cfg.warmup_steps >= 0:
        return f"--warmup_steps {cfg.warmup_steps} must be >= 0 (a count, or under 1 a share of the steps)"
    if cfg.warmup_steps >= 1 and not float(cfg.warmup_steps).is_integer():
        return f"--warmup_steps {cfg.warmup_steps}: a count of steps must be whole (under 1 it is a share of them)"
    if not 0 <= ratio < 1:
        return f"--warmup_ratio {ratio} must be in [0, 1)"
    if cfg.warmup_steps and ratio:
        return "--warmup_steps and --warmup_ratio both set the warmup; give one"
    return None


def num_warmup_steps(cfg, max_steps):
    """Optimizer steps of linear warmup: --warmup_steps as a count (>= 1) or a share of `max_steps` (under 1, as
    transformers reads it), else --warmup_ratio's share (where the script has it)."""
    if cfg.warmup_steps >= 1:
        return int(cfg.warmup_steps)
    share = cfg.warmup_steps if cfg.warmup_steps > 0 else getattr(cfg, "warmup_ratio", 0.0)
    return math.ceil(share * max_steps)
