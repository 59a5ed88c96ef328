"""FSDP2 (`accelerate_configs/fsdp2.yaml`, torch's `fully_shard`) for the three train scripts: which layers become
units, and whole weights for generation.

- **Units.** accelerate's TRANSFORMER_BASED_WRAP with no class list takes the prepared module's `_no_split_modules`.
  The prepared modules are our wrappers (the log-prob wrapper, Mix-GRPO's module), and the models' own lists name
  classes a given checkpoint may not hold (Gemma 3's SiglipTextEmbeddings, Gemma 4's audio layers), which accelerate
  refuses. `fsdp_layer_classes` is the union of the lists of every model inside, kept to the classes present;
  `prepare_training` sets it on the module it prepares under FSDP.
- **Optimizer state.** torch.distributed.checkpoint saves the AdamW state parameters have, and on resume expects one
  for every parameter (the fresh optimizer is initialised whole before loading): a parameter no step has reached yet
  (Mix-GRPO's vision tower before its first reflect step) made the resume fail. `init_adamw_state` gives every
  parameter AdamW's initial state (step 0, zero moments) right after `prepare`: what AdamW would create at its first
  gradient, so the updates are the same and every checkpoint is complete.
- **Generation.** FSDP2 all-gathers a unit's weights in its forward and frees them after: every decoding step would
  be a collective, and processes whose completions end at different lengths would wait on each other forever.
  `fsdp2_unsharded` gathers every unit once (one full copy, as ZeRO-3's generation does) and keeps the weights
  whole until it exits; nothing inside it communicates.
"""

from __future__ import annotations

import contextlib

import torch


def fsdp_layer_classes(module) -> list[str]:
    """Names of the layer classes to shard as units: the `_no_split_modules` of every model inside `module` that
    `module` actually holds, sorted."""
    present = {type(m).__name__ for m in module.modules()}
    wanted = set()
    for m in module.modules():
        wanted |= set(getattr(m, "_no_split_modules", None) or ())
    return sorted(wanted & present)


def fsdp2_units(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fsdp2(model) -> bool:
    return bool(fsdp2_units(model))


@contextlib.contextmanager
def fsdp2_unsharded(model):
    """Every FSDP2 unit of `model` gathered once (a collective: every process enters together) and kept whole until
    exit; a no-op without FSDP2. Inside, forwards run with no communication."""
    units = fsdp2_units(model)
    if not units:
        yield model
        return
    units[0]._get_fsdp_state()._lazy_init()  # the root's first-forward set-up, so what is restored below is final
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                      [(group, group.post_forward_mesh_info) for group in state._fsdp_param_groups]))
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        with torch.no_grad():
            yield model
    finally:
        for unit in units:
            unit.reshard()
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, info in groups:
                group.post_forward_mesh_info = info


def init_adamw_state(optimizer):
    """AdamW's own first-step state (step 0, zero moments) for every parameter that has none yet; for AdamW this is
    the same as the lazy one it creates at a parameter's first gradient."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if not isinstance(inner, torch.optim.AdamW):
        raise ValueError(f"init_adamw_state: {type(inner).__name__} is not AdamW")
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state[param]
            if state:
                continue
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
