"""Truncated importance sampling on the loss side: the weights pi_train / pi_sampler that correct for the rollout
engine's log-probs differing from the trainer's (vLLM's kernels, precision and batching), and the logged mismatch.

vLLM (`utils.core.vllm_rollout`) returns its log-prob of each sampled token; the trainer recomputes it. Token t's policy
loss is multiplied by min(pi_train(t) / pi_vllm(t), cap) (TRL's `vllm_importance_sampling_*`), the surrogate only,
not the KL term (`utils.core.losses.clipped_policy_loss`, `is_weights`).
"""

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(trainer_logps, sampler_logps, mask, *, mode="token_truncate", cap=3.0):
    """Truncated (or masked) importance weights pi_train / pi_vllm that multiply the per-token policy loss.

    token_*: one ratio per token [B, T]; sequence_*: exp of the summed log-ratio of the sequence [B, 1].
    *_truncate: min(ratio, cap); *_mask: 0 where ratio > cap. Tokens vLLM could not score (NaN) get 1.
    The same rule as TRL 1.16's `vllm_importance_sampling_correction`.
    """
    if mode not in IS_MODES:
        raise ValueError(f"--vllm_importance_sampling_mode {mode!r} is not one of {IS_MODES}")
    if not cap > 0:
        raise ValueError(f"--vllm_importance_sampling_cap must be > 0, got {cap}")
    diff = torch.nan_to_num((trainer_logps.detach().float() - sampler_logps.float()) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


def mismatch_stats(trainer_logps, sampler_logps, mask, weights=None):
    """Local sums for the logged divergence |logp_train - logp_vllm| over completion tokens vLLM scored,
    and for the importance weights: reduce `*_sum` / `count` with "sum" and `*_max` with "max"."""
    diff = (trainer_logps.detach().float() - sampler_logps.float()).abs()
    valid = mask.bool() & ~diff.isnan()
    d = diff[valid]
    stats = {"count": valid.sum().float(), "diff_sum": d.sum(), "diff_max": d.max() if d.numel() else d.new_zeros(())}
    if weights is not None:
        w = weights.expand_as(diff)[valid] if weights.shape[-1] == 1 else weights[valid]
        stats.update(weight_sum=w.sum(), weight_max=w.max() if w.numel() else w.new_zeros(()),
                     neg_weight_max=(-w).max() if w.numel() else w.new_zeros(()))
    return stats


def mismatch_metrics(stats, reduce):
    """Logged metrics from `mismatch_stats` after `reduce(tensor, op)` (e.g. accelerator.reduce)."""
    count = reduce(stats["count"], "sum").clamp(min=1)
    out = {"vllm/logp_diff_mean": (reduce(stats["diff_sum"], "sum") / count).item(),
           "vllm/logp_diff_max": reduce(stats["diff_max"], "max").item()}
    if "weight_sum" in stats:
        out.update({"vllm/is_weight_mean": (reduce(stats["weight_sum"], "sum") / count).item(),
                    "vllm/is_weight_max": reduce(stats["weight_max"], "max").item(),
                    "vllm/is_weight_min": -reduce(stats["neg_weight_max"], "max").item()})
    return out
