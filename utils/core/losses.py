"""The clipped policy-gradient loss of GRPO and its variants (docs/grpo.md).

Shared by train_grpo.py (text tokens) and train_mixgrpo.py (text tokens and SDE image steps).
"""

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")
# Logged share of completion tokens whose entropy exceeds this (nats): the 80th-percentile token entropy that
# "Beyond the 80/20 Rule" (Wang et al., 2025) measured on Qwen3-8B chains of thought.
ENTROPY_THRESHOLD = 0.672


def high_entropy_mask(entropy, mask, quantile, gather=None):
    """Completion tokens in the top `quantile` fraction by entropy (TRL's `top_entropy_quantile`): entropy >= the
    (1 - quantile) quantile of the entropies of the masked tokens, over all processes when `gather` (a callable
    returning the concatenated 1-D tensors of every process, -1 padding allowed) is given. 1.0 keeps every token,
    0.0 only the highest. Returns a bool [B, T] mask, inside `mask`."""
    mask = mask.bool()
    local = entropy.detach()[mask].float()
    values = local if gather is None else gather(local)
    values = values[values >= 0]  # entropies are >= 0; -1 marks padding between processes
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach() >= threshold) & mask


def accumulation_divisor(loss_type, gradient_accumulation_steps):
    """What a micro-batch's loss is divided by for its share of the optimizer step's loss: 1 under dapo, whose
    normaliser already counts the tokens of the whole step (its micro-batch losses add up), the number of
    micro-batches for the other loss types (their micro-batch losses are averaged)."""
    return 1 if loss_type == "dapo" else gradient_accumulation_steps


def k3_kl(logps, ref_logps):
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def clipped_policy_loss(logps, old_logps, advantages, mask, *, epsilon_low=0.2, epsilon_high=None, beta=0.0,
                        ref_logps=None, loss_type="grpo", importance_sampling_level="token",
                        max_completion_length=None, num_items_in_batch=None, num_processes=1, is_weights=None,
                        entropy=None, entropy_coef=0.0, entropy_mask=None, entropy_threshold=ENTROPY_THRESHOLD,
                        gradient_accumulation_steps=1, kl_bias_correction=False):
    """GRPO surrogate on per-token log-probs [B, T] with advantages [B] and a completion mask [B, T].

    per-token loss = -w * min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * k3
    with rho = exp(logp - logp_old) per token, or per sequence (GSPO: exp of the mean log-ratio), and w the
    sampler-correction weights `is_weights` ([B, T] or [B, 1], no gradient; 1 when none): they scale the
    surrogate only, not the KL term (TRL's placement).
    `kl_bias_correction` (TRL's use_bias_correction_kl, DeepSeek-V3.2): the k3 term is multiplied by rho (with its
    gradient), which makes the KL gradient the unbiased reverse-KL gradient; on-policy rho is 1 in value, so the
    loss is unchanged and only the gradient moves (by beta * k3 * grad logp).
    Entropy (TRL's semantics): `entropy_mask` ([B, T] bool, `high_entropy_mask`) keeps the surrogate on those
    tokens only (the KL term and the normaliser still span `mask`); `entropy_coef` subtracts coef * H, H the
    mean per-token `entropy` over the tokens the surrogate trains on, whatever the loss type. dapo's loss spans
    the optimizer step (its micro-batch losses are summed), so there H is divided by `gradient_accumulation_steps`
    as the other loss types' losses are; `entropy` alone only adds the `entropy` and `entropy_high_frac` stats
    (share of tokens above `entropy_threshold`).
    Normalisation (`loss_type`):
      grpo    mean over a sequence's tokens, then mean over sequences
      bnpo    mean over all tokens of the local batch
      dr_grpo sum over tokens / (batch * max_completion_length)
      dapo    sum over tokens / tokens in the global batch (`num_items_in_batch`; scaled by the number
              of processes because DDP averages gradients over them)
    Returns (loss, stats) where stats holds detached tensors for logging.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"--loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    if importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"--importance_sampling_level {importance_sampling_level!r} is not one of {IMPORTANCE_LEVELS}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    tokens_per_seq = mask.sum(-1).clamp(min=1.0)
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / tokens_per_seq).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logps.dtype).unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
    per_token = -torch.min(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(logps.dtype)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(logps.dtype)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)
        if kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    per_token = per_token.expand_as(logps)

    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / tokens_per_seq).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type dr_grpo needs max_completion_length")
        loss = (per_token * mask).sum() / (logps.shape[0] * max_completion_length)
    else:  # dapo
        total = num_items_in_batch if num_items_in_batch is not None else mask.sum()
        loss = (per_token * mask).sum() / (torch.as_tensor(total, dtype=logps.dtype).clamp(min=1.0) / num_processes)
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy")
        trained = mask if entropy_mask is None else mask * entropy_mask.to(mask.dtype)
        bonus = (entropy * trained).sum() / trained.sum().clamp(min=1.0)
        loss = loss - entropy_coef * bonus / (gradient_accumulation_steps if loss_type == "dapo" else 1)

    with torch.no_grad():
        ratio_t = ratio.expand_as(logps)
        low = (ratio_t < 1 - epsilon_low) & (adv < 0)
        high = (ratio_t > 1 + epsilon_high) & (adv > 0)
        n = mask.sum().clamp(min=1.0)
        stats = {
            "clip_ratio": ((low | high).to(mask.dtype) * mask).sum() / n,
            "kl": (kl * mask).sum() / n if kl is not None else torch.zeros((), device=logps.device),
            "tokens": mask.sum(),
            # the largest |rho - 1| over completion tokens: exactly 0 on the first pass over fresh samples
            "ratio_max_dev": (((ratio_t - 1).abs() * mask).max() if mask.numel()
                              else torch.zeros((), device=logps.device)),
        }
        if entropy is not None:
            ent = entropy.detach().float()
            stats["entropy"] = (ent * mask).sum() / n
            stats["entropy_high_frac"] = ((ent > entropy_threshold).to(mask.dtype) * mask).sum() / n
    return loss, stats
