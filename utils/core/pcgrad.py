"""PCGrad (Yu et al., 2020): combine per-objective gradients after projecting away their conflicts.

For each objective i, and each other objective j in a random order, if g_i . g_j < 0 then
g_i <- g_i - (g_i . g_j / |g_j|^2) g_j. The combined gradient is the sum of the projected g_i.
For two objectives this leaves each projected gradient orthogonal to the other's original one, so
no objective's update direction works against another's.

In training, the per-objective gradients are those of the whole optimizer step: `PCGradAccumulator` sums
them over the step's micro-batches, averages them over the processes (as DDP averages a plain gradient),
and only then projects, so the update does not depend on how the step is split into micro-batches or
processes. It keeps one float32 copy of the trainable parameters per objective.

Used by train_grpo.py alone (--use_pcgrad).
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


def _flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().float() for g, p in zip(grads, params)])


class PCGradAccumulator:
    """Per-objective gradients summed over one optimizer step, projected once at its end.

        acc = PCGradAccumulator(params, num_objectives=K)
        for micro_batch in step:                       # forward through the unwrapped model (no DDP hooks)
            acc.add([loss_1, ..., loss_K], extra_loss=kl_loss)
        acc.write_gradients(reduce=lambda t: accelerator.reduce(t, "mean"), generator=g)   # then clip, step
    """

    def __init__(self, params, num_objectives):
        self.params = [p for p in params if p.requires_grad]
        self.num_objectives = num_objectives
        self.reset()

    def reset(self):
        self.objectives = None
        self.extra = None

    def add(self, losses, *, extra_loss=None):
        if len(losses) != self.num_objectives:
            raise ValueError(f"PCGradAccumulator: {len(losses)} losses for {self.num_objectives} objectives")
        flat = torch.stack([_flat_grad(loss, self.params) for loss in losses])
        self.objectives = flat if self.objectives is None else self.objectives + flat
        if extra_loss is not None:
            g = _flat_grad(extra_loss, self.params)
            self.extra = g if self.extra is None else self.extra + g

    def write_gradients(self, *, reduce=None, generator=None):
        """Reduce (e.g. mean over processes), project, add the extra gradient, write `p.grad`; returns the cosine
        similarities of the objectives' step gradients. The accumulator is empty afterwards."""
        if self.objectives is None:
            raise RuntimeError("PCGradAccumulator.write_gradients before any add()")
        objectives, extra = self.objectives, self.extra
        if reduce is not None:
            objectives = reduce(objectives)
            extra = reduce(extra) if extra is not None else None
        combined = pcgrad_combine(objectives, generator=generator)
        if extra is not None:
            combined = combined + extra
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = combined[offset: offset + n].view_as(p).to(p.dtype)
            offset += n
        norms = objectives.norm(dim=1).clamp(min=1e-20)
        self.reset()
        return (objectives @ objectives.T) / (norms[:, None] * norms[None, :])
