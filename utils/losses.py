"""The clipped policy-gradient loss of GRPO and its variants (docs/grpo.md).

Shared by train_grpo.py (text tokens) and train_mixgrpo.py (text tokens and SDE image steps).
"""

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")


def k3_kl(logps, ref_logps):
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def clipped_policy_loss(logps, old_logps, advantages, mask, *, epsilon_low=0.2, epsilon_high=None, beta=0.0,
                        ref_logps=None, loss_type="grpo", importance_sampling_level="token",
                        max_completion_length=None, num_items_in_batch=None, num_processes=1, is_weights=None):
    """GRPO surrogate on per-token log-probs [B, T] with advantages [B] and a completion mask [B, T].

    per-token loss = -w * min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * k3
    with rho = exp(logp - logp_old) per token, or per sequence (GSPO: exp of the mean log-ratio), and w the
    sampler-correction weights `is_weights` ([B, T] or [B, 1], no gradient; 1 when none): they scale the
    surrogate only, not the KL term (TRL's placement).
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
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)
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
    return loss, stats
