"""Token log-probabilities from existing logits [..., V], and the row folds both log-prob ops share.

    log p(label) = z[label] - logsumexp(z),   z = logits / T

`token_logprobs` works tile by tile (memory O(rows x tile)); no log_softmax copy of the logits is made.
`naive_token_logprobs` is the plain path (full log_softmax + gather), the reference of tests and benchmarks.

The folds: a tile of tempered logits is folded into running per-row statistics (max, sum of exponentials,
the target logit, and for the entropy sum_j e_j (z_j - max)), an online logsumexp. `fold_forward_torch` (the
CPU path and the reference) and `fold_forward_triton` do the same fold; `fold_backward_kernel` writes a tile's
logits gradient. The LM-head op (`kernels/logprob.py`) folds its head-GEMM tiles with these same functions.
"""

from __future__ import annotations

import torch

from .tiling import (
    Scratch,
    check_label_range,
    check_labels_and_temperature,
    finish_stats,
    fold_block,
    jit,
    new_stats,
    plan,
    round_by_hand,
    round_to_bf16,
    tl,
    triton,
    use_triton,
)

__all__ = ["token_logprobs", "naive_token_logprobs"]

# Columns per tile and the elements of one tile's fp32 copy (rows x columns: 64 MiB) on the torch path. No GEMM
# runs here, so unlike the LM-head op's (kernels/logprob.py) they need not grow on CUDA, where Triton runs anyway.
VOCAB_TILE = 8192
TILE_ELEMENTS = 1 << 24


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    backend: str = "auto",
):
    """log p(label) from existing logits [..., V]: fp32 of labels' shape, 0.0 at ignore_index.

    Works tile by tile (memory O(rows x tile)); no log_softmax copy of the logits is made.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    check_labels_and_temperature(labels, temperature, "token_logprobs")
    triton_path = use_triton(backend, logits)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if triton_path and flat_logits.stride(1) != 1:
        flat_logits = flat_logits.contiguous()
    flat_labels = labels.reshape(-1)
    keep = (flat_labels != ignore_index).nonzero().squeeze(1)
    kept_labels = flat_labels.index_select(0, keep)
    check_label_range(kept_labels, logits.shape[-1], ignore_index)
    logp = _TokenLogProb.apply(flat_logits, keep, kept_labels, 1.0 / temperature, triton_path)
    zeros = torch.zeros(flat_labels.shape, device=logits.device, dtype=torch.float32)
    return zeros.index_copy(0, keep, logp).view(labels.shape)


def naive_token_logprobs(logits, labels, *, temperature=1.0, ignore_index=-100, return_entropy=False):
    """The plain path (full log_softmax + gather), used as the reference in tests and benchmarks."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    mask = labels != ignore_index
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# The torch fold (the reference; what runs on the CPU)
# ----------------------------------------------------------------------------------------------


def fold_forward_torch(z, labels, col0, stats, scratch):
    """Fold one fp32 tile of tempered logits into the running statistics (z is overwritten).

    Returns (e, rescale): e = exp(z - new max), rescale = exp(old max - new max) per row.
    """
    rows, cols = z.shape
    local = labels - col0
    hit = (local >= 0) & (local < cols)
    picked = z.gather(1, local.clamp(0, cols - 1).unsqueeze(1)).squeeze(1)
    stats["target"].add_(torch.where(hit, picked, 0.0))

    old_max, old_sum = stats["max"], stats["sumexp"]
    new_max = torch.maximum(old_max, z.amax(1))
    # rows masked to -inf so far (logits given with -inf) keep max -inf; centre them on 0 instead
    centre = torch.where(torch.isinf(new_max), 0.0, new_max)
    rescale = torch.exp(old_max - centre)
    z.sub_(centre.unsqueeze(1))
    if stats["zexp"] is not None:
        e = torch.exp(z, out=scratch.get("exp", rows, cols, torch.float32))
        tile_zexp = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(rows)  # row-wise dot, no temporary
        # re-centre the old sum on the new max; (-inf) * 0 on the first tile is masked out
        shift = torch.where(old_sum > 0, old_max - centre, 0.0) * old_sum
        stats["zexp"].add_(shift).mul_(rescale).add_(tile_zexp)
    else:
        e = z.exp_()
    old_sum.mul_(rescale).add_(e.sum(1))
    old_max.copy_(new_max)
    return e, rescale


# ----------------------------------------------------------------------------------------------
# The autograd Function
# ----------------------------------------------------------------------------------------------


class _TokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, keep, labels, inv_t, use_triton):
        n, vocab = keep.shape[0], logits.shape[1]
        stats = new_stats(n, logits.device, with_entropy=False)
        if use_triton and n:
            fold_forward_triton(logits, labels, 0, stats, inv_t, row_index=keep)
        elif n:
            rows, tile = plan(n, vocab, VOCAB_TILE, TILE_ELEMENTS)
            scratch = Scratch(logits.device)
            for r0 in range(0, n, rows):
                idx = keep[r0 : r0 + rows]
                chunk = {k: None if v is None else v[r0 : r0 + rows] for k, v in stats.items()}
                for v0 in range(0, vocab, tile):
                    z = _gather_tile(logits, idx, v0, min(v0 + tile, vocab), inv_t, scratch)
                    fold_forward_torch(z, labels[r0 : r0 + rows], v0, chunk, scratch)
        lse, target, _ = finish_stats(stats)
        ctx.save_for_backward(logits, keep, labels, lse)
        ctx.inv_t, ctx.use_triton = inv_t, use_triton
        return target - lse

    @staticmethod
    def backward(ctx, g):
        logits, keep, labels, lse = ctx.saved_tensors
        inv_t, n, vocab = ctx.inv_t, keep.shape[0], logits.shape[1]
        grad = torch.zeros_like(logits)
        if n == 0:
            return grad, None, None, None, None
        g = g.float().contiguous()
        if ctx.use_triton:
            _logits_grad_triton(logits, keep, labels, lse, g, inv_t, grad)
            return grad, None, None, None, None
        rows, tile = plan(n, vocab, VOCAB_TILE, TILE_ELEMENTS)
        scratch = Scratch(logits.device)
        for r0 in range(0, n, rows):
            idx, g_rows = keep[r0 : r0 + rows], g[r0 : r0 + rows]
            for v0 in range(0, vocab, tile):
                v1 = min(v0 + tile, vocab)
                z = _gather_tile(logits, idx, v0, v1, inv_t, scratch)
                p = z.sub_(lse[r0 : r0 + rows].unsqueeze(1)).exp_()
                grad[:, v0:v1].index_copy_(0, idx, p.mul_((-inv_t * g_rows).unsqueeze(1)).to(grad.dtype))
        # the one-hot part of d logp / dz
        grad.index_put_((keep, labels), (g * inv_t).to(grad.dtype), accumulate=True)
        return grad, None, None, None, None


def _gather_tile(logits, idx, v0, v1, inv_t, scratch):
    """fp32 copy of logits[idx, v0:v1] / T, in a reused buffer."""
    out = scratch.get("z32", idx.shape[0], v1 - v0, torch.float32)
    if logits.dtype == torch.float32:
        torch.index_select(logits[:, v0:v1], 0, idx, out=out)
    else:
        out.copy_(logits[:, v0:v1].index_select(0, idx))
    return out.mul_(inv_t) if inv_t != 1.0 else out


# ----------------------------------------------------------------------------------------------
# Triton fold kernels and their launchers
# ----------------------------------------------------------------------------------------------


@jit
def fold_forward_kernel(
    x_ptr, stride_x, row_index_ptr, labels_ptr, b_ptr, e_ptr, stride_e, max_ptr, sum_ptr, zexp_ptr, target_ptr,
    rescale_ptr, n_cols, col0, scale,
    HAS_ROW_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, WRITE_EXP: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row: fold z = (x + b) * scale into the running statistics. With WRITE_EXP,
    # exp(z - new max) goes to e for the expected-head-row GEMM that follows.
    row = tl.program_id(0)
    if HAS_ROW_INDEX:
        src = tl.load(row_index_ptr + row).to(tl.int64)
    else:
        src = row.to(tl.int64)
    x_row = x_ptr + src * stride_x
    label = tl.load(labels_ptr + row) - col0
    tile_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        z = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + col0 + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tile_max = tl.maximum(tile_max, z * scale)
    old_max = tl.load(max_ptr + row)
    new_max = tl.maximum(old_max, tl.max(tile_max, axis=0))
    centre = tl.where(new_max == float("-inf"), 0.0, new_max)
    sum_vec = tl.zeros((BLOCK,), tl.float32)
    zexp_vec = tl.zeros((BLOCK,), tl.float32)
    target_vec = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < n_cols
        z = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + col0 + cols, mask=ok, other=0.0).to(tl.float32)
        z = z * scale
        e = tl.where(ok, tl.exp(z - centre), 0.0)
        sum_vec += e
        if WITH_ENTROPY:
            zexp_vec += e * tl.where(ok, z - centre, 0.0)
        target_vec += tl.where(ok & (cols == label), z, 0.0)
        if WRITE_EXP:
            if ROUND_BY_HAND:
                e = round_to_bf16(e)
            tl.store(e_ptr + row.to(tl.int64) * stride_e + cols, e.to(e_ptr.dtype.element_ty), mask=ok)
    old_sum = tl.load(sum_ptr + row)
    rescale = tl.exp(old_max - centre)
    if WITH_ENTROPY:
        shift = tl.where(old_sum > 0, old_max - centre, 0.0) * old_sum
        tl.store(zexp_ptr + row, (tl.load(zexp_ptr + row) + shift) * rescale + tl.sum(zexp_vec, axis=0))
    tl.store(sum_ptr + row, old_sum * rescale + tl.sum(sum_vec, axis=0))
    tl.store(max_ptr + row, new_max)
    tl.store(target_ptr + row, tl.load(target_ptr + row) + tl.sum(target_vec, axis=0))
    if WRITE_EXP:
        tl.store(rescale_ptr + row, rescale)


@jit
def fold_backward_kernel(
    x_ptr, stride_x, out_ptr, stride_out, row_index_ptr, labels_ptr, b_ptr, lse_ptr, entropy_ptr, g_ptr, g_ent_ptr,
    n_cols, col0, scale, out_scale,
    HAS_ROW_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BY_G: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr, BLOCK: tl.constexpr,
):
    # out = out_scale * (a [j = label] - p_j * c) with a = (g or 1) and c = a + g_ent * (log p_j + entropy)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    if HAS_ROW_INDEX:
        src = tl.load(row_index_ptr + row).to(tl.int64)
    else:
        src = row.to(tl.int64)
    z = tl.load(x_ptr + src * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + col0 + cols, mask=ok, other=0.0).to(tl.float32)
    z = z * scale
    logp = z - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    if SCALE_BY_G:
        c = tl.load(g_ptr + row) + tl.zeros((BLOCK,), tl.float32)
    else:
        c = tl.full((BLOCK,), 1.0, tl.float32)
    if HAS_ENTROPY_GRAD:
        c += tl.load(g_ent_ptr + row) * (logp + tl.load(entropy_ptr + row))
    grad = -p * c
    if SCALE_BY_G:
        onehot = tl.load(g_ptr + row)
    else:
        onehot = 1.0
    grad += tl.where(cols == tl.load(labels_ptr + row) - col0, onehot, 0.0)
    grad = grad * out_scale
    if ROUND_BY_HAND:
        grad = round_to_bf16(grad)
    tl.store(out_ptr + src * stride_out + cols, grad.to(out_ptr.dtype.element_ty), mask=ok)


def fold_forward_triton(x, labels, col0, stats, scale, *, bias=None, e_out=None, row_index=None):
    """Fold rows of x (a tile, or whole logits rows picked by row_index) into stats, in place.

    With e_out, also writes exp(z - new max) there and returns (e_out, rescale per row).
    """
    n_rows = labels.shape[0]
    write_exp = e_out is not None
    rescale = torch.empty(n_rows, device=x.device, dtype=torch.float32) if write_exp else stats["max"]
    zexp = stats["zexp"] if stats["zexp"] is not None else stats["sumexp"]
    e_out = x if e_out is None else e_out
    fold_forward_kernel[(n_rows,)](
        x, x.stride(0), labels if row_index is None else row_index, labels, x if bias is None else bias,
        e_out, e_out.stride(0), stats["max"], stats["sumexp"], zexp, stats["target"], rescale, x.shape[1], col0, scale,
        HAS_ROW_INDEX=row_index is not None, HAS_BIAS=bias is not None, WITH_ENTROPY=stats["zexp"] is not None,
        WRITE_EXP=write_exp, ROUND_BY_HAND=round_by_hand(e_out.dtype), BLOCK=fold_block(x.shape[1]),
    )
    return (e_out, rescale) if write_exp else (None, None)


def _logits_grad_triton(logits, keep, labels, lse, g, inv_t, grad):
    vocab = logits.shape[1]
    block = fold_block(vocab)
    fold_backward_kernel[(keep.shape[0], triton.cdiv(vocab, block))](
        logits, logits.stride(0), grad, grad.stride(0), keep, labels, lse, lse, lse, g, g, vocab, 0, inv_t, inv_t,
        HAS_ROW_INDEX=True, HAS_BIAS=False, SCALE_BY_G=True, HAS_ENTROPY_GRAD=False,
        ROUND_BY_HAND=round_by_hand(grad.dtype), BLOCK=block,
    )
