"""GRPO group advantages: weighted reward sum, then per-group normalisation, in one pass.

    r_i = sum_k w_k r_ik           (NaN = reward k missing for sample i: left out of the sum)
    A_i = (r_i - mean_group(r)) / (std + eps)

std is the unbiased sample std of the group ("group"), of the whole batch ("batch", the mean is
still the group's), or no division at all ("none"). Defined edge cases (TRL 1.16's rules):
- a sample whose every reward is NaN is unscorable: it is left out of its group's mean and std (and of
  the batch std) and its advantage is 0;
- a group with fewer than two scorable samples (groups of one included) has no spread: its advantages
  are 0 under every scale;
- a constant group has std 0, so its advantages are 0 / eps = 0.
"""

from __future__ import annotations

import torch

from .tiling import jit, tl, triton, use_triton

__all__ = ["group_advantages"]

SCALES = ("group", "batch", "none")


def group_advantages(rewards, group_size, *, weights=None, scale="group", eps=1e-4, backend="auto"):
    """rewards [B] or [B, R] (NaN = missing), groups are contiguous blocks of group_size. fp32 [B]."""
    rewards, weights = _check(rewards, group_size, weights, scale, eps)
    if group_size == 1:
        return torch.zeros(rewards.shape[0], device=rewards.device, dtype=torch.float32)
    if use_triton(backend, rewards):
        total, adv = _group_advantages_triton(rewards, weights, group_size, eps, normalise=scale == "group")
    else:
        scorable = ~rewards.isnan().all(dim=1)
        total = torch.nansum(rewards * weights, dim=1).masked_fill(~scorable, 0.0)
        valid = scorable.view(-1, group_size).float()
        count = valid.sum(1, keepdim=True)
        grouped = total.view(-1, group_size)
        mean = (grouped * valid).sum(1, keepdim=True) / count.clamp(min=1.0)
        adv = (grouped - mean) * valid
        if scale == "group":
            std = (adv.pow(2).sum(1, keepdim=True) / (count - 1).clamp(min=1.0)).sqrt()
            adv = adv / (std + eps)
        adv = (adv * (count > 1)).reshape(-1)
        total = total.masked_fill(~scorable, float("nan"))
    if scale == "batch":
        scored = total[~total.isnan()]
        adv = adv / (scored.std() + eps) if scored.numel() > 1 else torch.zeros_like(adv)
    return adv


def _check(rewards, group_size, weights, scale, eps):
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages: rewards must be [B] or [B, R], got shape {tuple(rewards.shape)}")
    batch, n_rewards = rewards.shape
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_advantages: group_size must be a positive int, got {group_size!r}")
    if batch % group_size:
        raise ValueError(f"group_advantages: {batch} rewards do not split into groups of group_size={group_size}")
    if scale not in SCALES:
        raise ValueError(f"group_advantages: scale must be one of {SCALES}, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps!r}")
    if weights is None:
        weights = torch.ones(n_rewards)
    weights = torch.as_tensor(weights, dtype=torch.float32).to(rewards.device)
    if weights.shape != (n_rewards,):
        raise ValueError(f"group_advantages: weights must have one entry per reward function ({n_rewards}), "
                         f"got shape {tuple(weights.shape)}")
    return rewards.float(), weights


@jit
def _group_advantages_kernel(
    rewards_ptr, weights_ptr, total_ptr, adv_ptr, n_rewards, group_size, eps,
    NORMALISE: tl.constexpr, BLOCK_G: tl.constexpr,
):
    # One program per group: weighted NaN-skipping sum over reward functions, then the mean and unbiased std
    # of the scorable samples (at least one reward not NaN); unscorable samples get NaN totals and 0 advantages.
    offs = tl.arange(0, BLOCK_G)
    ok = offs < group_size
    rows = tl.program_id(0) * group_size + offs
    total = tl.zeros((BLOCK_G,), tl.float32)
    present = tl.zeros((BLOCK_G,), tl.float32)
    for k in range(0, n_rewards):
        x = tl.load(rewards_ptr + rows * n_rewards + k, mask=ok, other=float("nan"))
        total += tl.where(x == x, x * tl.load(weights_ptr + k), 0.0)  # x != x only for NaN
        present += tl.where(x == x, 1.0, 0.0)
    valid = present > 0
    count = tl.sum(tl.where(valid, 1.0, 0.0), axis=0)
    mean = tl.sum(tl.where(valid, total, 0.0), axis=0) / tl.maximum(count, 1.0)
    adv = tl.where(valid, total - mean, 0.0)
    if NORMALISE:
        std = tl.sqrt(tl.sum(adv * adv, axis=0) / tl.maximum(count - 1.0, 1.0))
        adv = adv / (std + eps)
    adv = tl.where(count > 1, adv, 0.0)
    tl.store(total_ptr + rows, tl.where(valid, total, float("nan")), mask=ok)
    tl.store(adv_ptr + rows, adv, mask=ok)


def _group_advantages_triton(rewards, weights, group_size, eps, *, normalise):
    rewards = rewards.contiguous()
    total = torch.empty(rewards.shape[0], device=rewards.device, dtype=torch.float32)
    adv = torch.empty_like(total)
    _group_advantages_kernel[(rewards.shape[0] // group_size,)](
        rewards, weights.contiguous(), total, adv, rewards.shape[1], group_size, eps,
        NORMALISE=normalise, BLOCK_G=triton.next_power_of_2(group_size),
    )
    return total, adv
