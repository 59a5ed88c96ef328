"""PCGrad (Yu et al., 2020): combine per-objective gradients after projecting away their conflicts.

For each objective i, and each other objective j in a random order, if g_i . g_j < 0 then
g_i <- g_i - (g_i . g_j / |g_j|^2) g_j. The combined gradient is the sum of the projected g_i.
For two objectives this leaves each projected gradient orthogonal to the other's original one, so
no objective's update direction works against another's.
"""

import torch


def pcgrad_combine(grads, generator=None):
    """grads: [K, P] (one flattened gradient per objective) -> combined gradient [P]."""
    grads = grads.float()
    projected = grads.clone()
    k = grads.shape[0]
    for i in range(k):
        order = torch.randperm(k, generator=generator).tolist()
        for j in order:
            if j == i:
                continue
            dot = projected[i] @ grads[j]
            if dot < 0:
                projected[i] -= dot / grads[j].pow(2).sum().clamp(min=1e-20) * grads[j]
    return projected.sum(0)


def pcgrad_backward(losses, params, *, extra_loss=None, generator=None):
    """Write PCGrad's combined gradient of `losses` (plus the plain gradient of `extra_loss`, e.g. the KL
    term, which is not an objective to trade off) into `p.grad` (accumulating, like backward()).

    Returns the cosine similarities between the objectives' raw gradients (for logging conflicts).
    """
    params = [p for p in params if p.requires_grad]
    flat = []
    for loss in losses:
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        flat.append(torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)]))
    flat = torch.stack(flat)
    combined = pcgrad_combine(flat, generator=generator)
    if extra_loss is not None:
        grads = torch.autograd.grad(extra_loss, params, retain_graph=True, allow_unused=True)
        combined += torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])
    offset = 0
    for p in params:
        n = p.numel()
        g = combined[offset: offset + n].view_as(p).to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g
        offset += n
    norms = flat.norm(dim=1).clamp(min=1e-20)
    return (flat @ flat.T) / (norms[:, None] * norms[None, :])
