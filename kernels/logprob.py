"""Token log-probabilities without the full [N, V] logits.

    log p(label) = z[label] - logsumexp(z),   z = (hidden @ weight.T + bias) / T

`fused_token_logprobs` takes the hidden states and the LM-head weight: the vocabulary is processed in
tiles of VOCAB_TILE columns and rows in chunks, with an online logsumexp, so memory stays
O(rows x tile). Positions whose label is ignore_index never go through the head.

Gradients. With a trainable head the backward recomputes every tile once and accumulates the
hidden, weight and bias gradients tile by tile. With a frozen head (LoRA, frozen lm_head) the
gradient w.r.t. hidden is  g / T * (W[label] - sum_v p_v W_v)  and the expected head row
sum_v p_v W_v is accumulated during the forward pass, so the backward never sees the vocabulary.

Backends: "torch" loops over tiles with in-place torch ops (the CPU path, and the reference);
"triton" fuses the head matmul with the online logsumexp in one kernel (no logits are written at
all) and folds the recomputed tiles of the backward in single-pass kernels, with the gradient
matmuls left to cuBLAS. "auto" picks Triton for CUDA tensors.

Precision. The GEMMs run in the compute dtype: the autocast dtype when autocast is on for the tensors'
device (fp32 weights are cast tile by tile, or inside the Triton kernel; no bf16 copy of the whole head
is made), else the inputs' promoted dtype. Softmax statistics and gradient sums are always fp32. A
bf16/fp16 GEMM whose result is summed uses cuBLAS's fp32-output GEMM on CUDA; where torch has none
(probed once per device type) CUDA falls back to fp32 GEMMs with a warning, once, and the CPU rounds
each tile's product to the compute dtype and sums the tiles in fp32.

Over 400 lines on purpose: the Triton kernels sit beside the torch path they must equal, tile for tile,
so that one file shows both and the tests compare them.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with torch on Linux; elsewhere only the torch path exists
    triton = None

__all__ = ["fused_token_logprobs", "token_logprobs", "naive_token_logprobs"]

# Columns of the vocabulary processed at once, and the size of one logits tile (rows x columns).
# CPU: 2^24 fp32 elements = 64 MiB, 2048 rows of an 8192-column tile, big enough for full-speed GEMMs.
# CUDA: 4096 rows x 16384 columns (256 MiB fp32 + a 128 MiB bf16 copy) keep cuBLAS near its peak;
# TRL's chunked kernel holds a tile of that size too, plus an fp32 copy of the whole weight gradient.
VOCAB_TILE = 8192
TILE_ELEMENTS = 1 << 24
CUDA_VOCAB_TILE = 16384
CUDA_TILE_ELEMENTS = 1 << 26

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str = "auto",
):
    """log p(label | hidden) under logits = (hidden @ weight.T + bias) / temperature.

    hidden [..., H], weight [V, H], labels [...] (int). Returns fp32 of labels' shape, 0.0 where
    labels == ignore_index; with return_entropy=True returns (logp, entropy). Under autocast the GEMMs
    run in the autocast dtype (statistics in fp32); gradients come back in the inputs' dtypes.
    """
    _check_head_inputs(hidden, weight, labels, bias, temperature)
    use_triton = _use_triton(backend, hidden)
    cdtype = compute_dtype(hidden, weight)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    keep = (flat_labels != ignore_index).nonzero().squeeze(1)
    kept_labels = flat_labels.index_select(0, keep)
    _check_label_range(kept_labels, weight.shape[0], ignore_index)
    logp, entropy = _FusedLogProb.apply(
        flat_hidden.index_select(0, keep), weight, bias, kept_labels, 1.0 / temperature, return_entropy, use_triton,
        torch.is_grad_enabled(), cdtype,
    )
    # index_copy keeps the result connected to the graph even when no label is kept
    zeros = torch.zeros(flat_labels.shape, device=hidden.device, dtype=torch.float32)
    logp = zeros.index_copy(0, keep, logp).view(labels.shape)
    if not return_entropy:
        return logp
    return logp, zeros.index_copy(0, keep, entropy).view(labels.shape)


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
    _check_labels_and_temperature(labels, temperature, "token_logprobs")
    use_triton = _use_triton(backend, logits)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if use_triton and flat_logits.stride(1) != 1:
        flat_logits = flat_logits.contiguous()
    flat_labels = labels.reshape(-1)
    keep = (flat_labels != ignore_index).nonzero().squeeze(1)
    kept_labels = flat_labels.index_select(0, keep)
    _check_label_range(kept_labels, logits.shape[-1], ignore_index)
    logp = _TokenLogProb.apply(flat_logits, keep, kept_labels, 1.0 / temperature, use_triton)
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
# Validation and backend choice
# ----------------------------------------------------------------------------------------------


def _check_labels_and_temperature(labels, temperature, where):
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"{where}: labels must be an integer tensor, got {labels.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{where}: temperature must be a positive number, got {temperature!r}")


def _check_head_inputs(hidden, weight, labels, bias, temperature):
    where = "fused_token_logprobs"
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{where}: weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"{where}: hidden {tuple(hidden.shape)} needs labels of shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{where}: bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    _check_labels_and_temperature(labels, temperature, where)


def _check_label_range(kept_labels, vocab, ignore_index):
    if kept_labels.numel() and (kept_labels.min() < 0 or kept_labels.max() >= vocab):
        bad = kept_labels[(kept_labels < 0) | (kept_labels >= vocab)][0].item()
        raise ValueError(f"label {bad} is outside the vocabulary [0, {vocab}) and is not ignore_index={ignore_index}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_triton(backend: str, tensor: torch.Tensor) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return triton is not None and tensor.is_cuda
    if triton is None:
        raise RuntimeError("backend='triton' but triton is not installed")
    if not tensor.is_cuda and not _interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to interpret on the CPU)")
    return True


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head GEMMs run in: autocast's when it is on for hidden's device (as a plain
    `hidden @ weight.T` would), else the promoted dtype of the inputs."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def _plan(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int]:
    """(rows per chunk, columns per tile) for a tile of at most TILE_ELEMENTS."""
    cuda = device.type == "cuda"
    tile = max(1, min(CUDA_VOCAB_TILE if cuda else VOCAB_TILE, n_cols))
    return max(1, min(n_rows, (CUDA_TILE_ELEMENTS if cuda else TILE_ELEMENTS) // tile)), tile


class _Scratch:
    """Flat buffers reused by every tile; each view is contiguous whatever the tile's width."""

    def __init__(self, numel, device):
        self.numel, self.device, self.buffers = numel, device, {}

    def get(self, name, rows, cols, dtype):
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(self.numel, device=self.device, dtype=dtype)
        return buf[: rows * cols].view(rows, cols)


def _logits_tile(h, w, b, inv_t, out):
    """out = (h @ w.T + b) * inv_t in h's dtype; the temperature rides on the GEMM's alpha/beta."""
    if b is None:
        return torch.addmm(out, h, w.t(), beta=0, alpha=inv_t, out=out)
    return torch.addmm(b, h, w.t(), beta=inv_t, alpha=inv_t, out=out)


# device type -> (has a bf16/fp16 GEMM with fp32 output, why not), probed once
_FP32_OUT_GEMM: dict = {}
_WARNED: set = set()


def _warn_once(key, message):
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fp32_out_gemm(device) -> tuple[bool, str]:
    """Whether torch has a bf16/fp16 GEMM writing fp32 (`torch.mm(..., out_dtype=torch.float32)`) here."""
    if device.type not in _FP32_OUT_GEMM:
        a = torch.zeros(2, 2, device=device, dtype=torch.bfloat16)
        try:
            torch.mm(a, a, out_dtype=torch.float32)
            _FP32_OUT_GEMM[device.type] = (True, "")
        except (TypeError, RuntimeError) as err:  # NotImplementedError is a RuntimeError
            _FP32_OUT_GEMM[device.type] = (False, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
    return _FP32_OUT_GEMM[device.type]


def _low_precision_gemm_mode(device) -> str:
    """How a bf16/fp16 GEMM whose result must be fp32 runs on `device`.

    "fp32_out": one GEMM on tensor cores writing fp32. "round" (CPU without it): the GEMM in the low
    precision, its product rounded once and summed in fp32. "fp32" (CUDA without it): operands upcast,
    no tensor cores; warned once.
    """
    ok, why = _fp32_out_gemm(device)
    if ok:
        return "fp32_out"
    if device.type == "cpu":
        return "round"
    _warn_once(("fp32-gemm", device.type),
               f"fused_token_logprobs: torch {torch.__version__} has no bf16/fp16 GEMM with fp32 output on "
               f"{device.type} ({why}); its head GEMMs fall back to fp32 (no tensor cores, several times slower)")
    return "fp32"


def _raw_logits_fp32(h, w, out):
    """out = h @ w.T in fp32 even for bf16/fp16 inputs (the Triton folds add bias and 1/T).

    Forward statistics come from fp32 logits, so the recomputed tiles must be fp32 too: probabilities
    from bf16-rounded logits would not sum to one under the forward's logsumexp.
    """
    if h.dtype not in _LOW_PRECISION:
        return torch.mm(h, w.t(), out=out)
    if _low_precision_gemm_mode(h.device) == "fp32_out":
        return torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
    # rounding the product is not an option here; on the CPU this is the interpreter's path only
    return torch.mm(h.float(), w.float().t(), out=out)


def _addmm_fp32(acc, a, b, alpha=1.0, beta=1.0):
    """acc = beta * acc + alpha * a @ b in fp32 with a @ b in b's dtype (a is cast to it).

    beta = 0 ignores acc's content (it may be uninitialised).
    """
    if b.dtype not in _LOW_PRECISION:
        acc.addmm_(a.to(b.dtype), b, alpha=alpha, beta=beta)
        return
    mode = _low_precision_gemm_mode(acc.device)
    if mode == "fp32_out":
        torch.addmm(acc, a.to(b.dtype), b, alpha=alpha, beta=beta, out_dtype=torch.float32, out=acc)
    elif mode == "round":
        product = torch.mm(a.to(b.dtype), b)
        if beta == 0:
            acc.copy_(product).mul_(alpha)
        else:
            acc.mul_(beta).add_(product, alpha=alpha)
    else:  # the same product of rounded operands as "fp32_out", without tensor cores
        acc.addmm_(a.to(b.dtype).float(), b.float(), alpha=alpha, beta=beta)


def _new_stats(n, device, with_entropy):
    f32 = {"device": device, "dtype": torch.float32}
    return {
        "max": torch.full((n,), -math.inf, **f32),
        "sumexp": torch.zeros(n, **f32),
        # sum_j e_j (z_j - max): the entropy is log(sumexp) - this / sumexp
        "zexp": torch.zeros(n, **f32) if with_entropy else None,
        "target": torch.zeros(n, **f32),
    }


def _finish_stats(stats):
    log_sum = stats["sumexp"].log()
    lse = stats["max"] + log_sum
    entropy = None if stats["zexp"] is None else log_sum - stats["zexp"] / stats["sumexp"]
    return lse, stats["target"], entropy


# ----------------------------------------------------------------------------------------------
# Torch tile folds (the reference; what runs on the CPU)
# ----------------------------------------------------------------------------------------------


def _fold_forward_torch(z, labels, col0, stats, scratch):
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


def _tile_grad_torch(z, labels, col0, lse, entropy, g, g_ent, scratch):
    """Minus the logits gradient of one fp32 tile, up to a per-row factor c (z is overwritten).

    d loss / dz_ij = -c_i q_ij. Without an entropy gradient c = g and q = p - onehot; with one,
    c = 1 and q = p * (g + g_ent * (log p + entropy)) - g * onehot.
    """
    z.sub_(lse.unsqueeze(1))  # log p
    if g_ent is None:
        q, onehot = z.exp_(), torch.ones_like(g)
    else:
        p = torch.exp(z, out=scratch.get("exp", *z.shape, torch.float32))
        q, onehot = z.add_(entropy.unsqueeze(1)).mul_(g_ent.unsqueeze(1)).add_(g.unsqueeze(1)).mul_(p), g
    local = labels - col0
    hit = ((local >= 0) & (local < z.shape[1])).nonzero().squeeze(1)
    q.index_put_((hit, local.index_select(0, hit)), -onehot.index_select(0, hit), accumulate=True)
    return q


# ----------------------------------------------------------------------------------------------
# Fused head: autograd Function
# ----------------------------------------------------------------------------------------------


class _FusedLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, return_entropy, use_triton, grad_enabled, cdtype):
        # entropy often serves logging only: its gradient then arrives as None and costs nothing
        ctx.set_materialize_grads(False)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # the expected head row costs a GEMM: only when hidden alone will get a gradient
        expected_row = grad_enabled and need_h and not need_w and not need_b and hidden.shape[0] > 0
        # every dtype is chosen here (cdtype for the GEMMs, fp32 for the rest): autocast must not recast
        with torch.autocast(hidden.device.type, enabled=False):
            if use_triton and not expected_row:
                lse, target, entropy = _head_stats_triton(hidden, weight, bias, labels, inv_t, return_entropy, cdtype)
                delta = None
            else:
                lse, target, entropy, delta = _head_forward_tiles(
                    hidden, weight, bias, labels, inv_t, return_entropy, expected_row, use_triton, cdtype
                )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy, delta)
        ctx.inv_t, ctx.use_triton, ctx.cdtype = inv_t, use_triton, cdtype
        logp = target - lse
        if entropy is None:
            entropy = torch.zeros_like(logp)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, labels, lse, entropy, delta = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_logp is None and g_ent is None) or hidden.shape[0] == 0:
            return (torch.zeros_like(hidden) if need_h else None, torch.zeros_like(weight) if need_w else None,
                    torch.zeros_like(bias) if need_b else None, None, None, None, None, None, None)
        g = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        if delta is not None and g_ent is None:
            # frozen head: d logp / d hidden = (W[label] - E_p[W]) / T, E_p[W] summed in the forward
            grad_h = (g * ctx.inv_t).unsqueeze(1) * delta.float()
            return grad_h.to(hidden.dtype), None, None, None, None, None, None, None, None
        g_ent = None if g_ent is None else g_ent.float()
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _head_backward_tiles(hidden, weight, bias, labels, lse, entropy, g, g_ent, ctx.inv_t, need_h,
                                         need_w, need_b, ctx.use_triton, ctx.cdtype)
        return (*grads, None, None, None, None, None, None)


def _head_forward_tiles(hidden, weight, bias, labels, inv_t, with_entropy, expected_row, use_triton, cdtype):
    """Forward over (row chunk, vocab tile) pairs in cdtype; with expected_row also sums E_p[W] per row."""
    n, vocab = hidden.shape[0], weight.shape[0]
    rows, tile = _plan(n, vocab, hidden.device)
    scratch = _Scratch(rows * tile, hidden.device)
    lse = torch.empty(n, device=hidden.device, dtype=torch.float32)
    target, entropy = torch.empty_like(lse), torch.empty_like(lse) if with_entropy else None
    delta = torch.empty_like(hidden) if expected_row else None
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        h, lab = hidden[r0:r1].to(cdtype), labels[r0:r1]
        stats = _new_stats(r1 - r0, hidden.device, with_entropy)
        expect = torch.zeros(r1 - r0, hidden.shape[1], device=hidden.device) if expected_row else None
        for v0 in range(0, vocab, tile):
            v1 = min(v0 + tile, vocab)
            w = weight[v0:v1].to(cdtype)
            b = None if bias is None else bias[v0:v1].to(cdtype)
            if use_triton:
                x = _raw_logits_fp32(h, w, scratch.get("z32", r1 - r0, v1 - v0, torch.float32))
                e_out = scratch.get("e", r1 - r0, v1 - v0, cdtype) if expected_row else None
                e, rescale = _fold_forward_triton(x, lab, v0, stats, inv_t, bias=bias, e_out=e_out)
            else:
                z = _logits_tile(h, w, b, inv_t, scratch.get("z", r1 - r0, v1 - v0, cdtype))
                if z.dtype != torch.float32:
                    z = scratch.get("z32", r1 - r0, v1 - v0, torch.float32).copy_(z)
                e, rescale = _fold_forward_torch(z, lab, v0, stats, scratch)
            if expected_row:
                _addmm_fp32(expect.mul_(rescale.unsqueeze(1)), e, w)
        lse[r0:r1], target[r0:r1], ent = _finish_stats(stats)
        if with_entropy:
            entropy[r0:r1] = ent
        if expected_row:
            expect.div_(stats["sumexp"].unsqueeze(1))
            delta[r0:r1] = weight.index_select(0, lab).float().sub_(expect).to(hidden.dtype)
    return lse, target, entropy, delta


def _head_backward_tiles(hidden, weight, bias, labels, lse, entropy, g, g_ent, inv_t, need_h, need_w, need_b,
                         use_triton, cdtype):
    """Recompute each tile once (vocabulary outer, rows inner) and accumulate the gradients.

    With d loss / dz_ij = -c_i q_ij (see _tile_grad_torch) and z = (h W^T + b) / T:
    grad_h_i = -c_i / T sum_j q_ij W_j,  grad_W_j = -sum_i q_ij c_i h_i / T,  grad_b_j = -sum_i q_ij c_i / T.
    """
    n, hdim = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    rows, tile = _plan(n, vocab, device)
    scratch = _Scratch(rows * tile, device)
    row_scale = (g if g_ent is None else torch.ones_like(g)) * inv_t  # c_i / T
    soft_sum = torch.empty(n, hdim, device=device) if need_h else None  # sum_j q_ij W_j
    # rows of hidden pre-scaled by c_i / T, in the compute dtype (the weight-gradient GEMM's operand)
    h_w = (hidden.float() * row_scale.unsqueeze(1)).to(cdtype) if need_w else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.empty(vocab, device=device, dtype=torch.float32) if need_b else None
    direct_w = need_w and weight.dtype == torch.float32  # accumulate straight into the returned gradient
    gw_acc = None if direct_w or not need_w else torch.empty(tile, hdim, device=device)

    for v0 in range(0, vocab, tile):
        v1 = min(v0 + tile, vocab)
        w = weight[v0:v1].to(cdtype)
        b = None if bias is None else bias[v0:v1].to(cdtype)
        gw = (grad_w[v0:v1] if direct_w else gw_acc[: v1 - v0]) if need_w else None
        gb = grad_b[v0:v1] if need_b else None
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            h = hidden[r0:r1].to(cdtype)
            ent = None if g_ent is None else entropy[r0:r1]
            ge = None if g_ent is None else g_ent[r0:r1]
            if use_triton:
                x = _raw_logits_fp32(h, w, scratch.get("z32", r1 - r0, v1 - v0, torch.float32))
                q = _tile_grad_triton(x, scratch.get("q", r1 - r0, v1 - v0, cdtype), labels[r0:r1], v0, lse[r0:r1],
                                      ent, g[r0:r1], ge, inv_t, bias)
            else:
                z = _logits_tile(h, w, b, inv_t, scratch.get("z", r1 - r0, v1 - v0, cdtype))
                if z.dtype != torch.float32:
                    z = scratch.get("z32", r1 - r0, v1 - v0, torch.float32).copy_(z)
                q = _tile_grad_torch(z, labels[r0:r1], v0, lse[r0:r1], ent, g[r0:r1], ge, scratch)
            first = r0 == 0  # beta = 0 on the first chunk: no zero-fill pass over the accumulators
            if need_h:
                _addmm_fp32(soft_sum[r0:r1], q, w, beta=0.0 if v0 == 0 else 1.0)
            if need_w:
                _addmm_fp32(gw, q.t(), h_w[r0:r1], alpha=-1.0, beta=0.0 if first else 1.0)
            if need_b:
                gb_tile = torch.mv(q.t().float(), row_scale[r0:r1])
                if first:
                    gb.copy_(gb_tile).neg_()
                else:
                    gb.sub_(gb_tile)
        if need_w and not direct_w:
            grad_w[v0:v1] = gw

    grad_h = None
    if need_h:
        grad_h = soft_sum.mul_(-row_scale.unsqueeze(1)).to(hidden.dtype)
    return grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype)


# ----------------------------------------------------------------------------------------------
# Logits given: autograd Function
# ----------------------------------------------------------------------------------------------


class _TokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, keep, labels, inv_t, use_triton):
        n, vocab = keep.shape[0], logits.shape[1]
        stats = _new_stats(n, logits.device, with_entropy=False)
        if use_triton and n:
            _fold_forward_triton(logits, labels, 0, stats, inv_t, row_index=keep)
        elif n:
            rows, tile = _plan(n, vocab, logits.device)
            scratch = _Scratch(rows * tile, logits.device)
            for r0 in range(0, n, rows):
                idx = keep[r0 : r0 + rows]
                chunk = {k: None if v is None else v[r0 : r0 + rows] for k, v in stats.items()}
                for v0 in range(0, vocab, tile):
                    z = _gather_tile(logits, idx, v0, min(v0 + tile, vocab), inv_t, scratch)
                    _fold_forward_torch(z, labels[r0 : r0 + rows], v0, chunk, scratch)
        lse, target, _ = _finish_stats(stats)
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
        rows, tile = _plan(n, vocab, logits.device)
        scratch = _Scratch(rows * tile, logits.device)
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
# Triton kernels and their launchers
# ----------------------------------------------------------------------------------------------


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def _round_by_hand(dtype) -> bool:
    """The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: round by hand there."""
    return _interpreting() and dtype == torch.bfloat16


@_jit
def _round_to_bf16(x):
    # fp32 -> the nearest bf16 value (ties to even), still in fp32; a later cast to bf16 is then exact
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@_jit
def _head_stats_kernel(
    h_ptr, w_ptr, b_ptr, labels_ptr, max_ptr, sum_ptr, zexp_ptr, target_ptr,
    n_rows, vocab, hdim, cols_per_split, n_splits, inv_t, stride_h, stride_w,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    CAST_W: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program: BLOCK_N rows x one vocabulary split. The head GEMM and the online logsumexp are
    # fused, so the logits only ever live in registers.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, vocab)
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_N,), tl.float32)
    run_zexp = tl.zeros((BLOCK_N,), tl.float32)
    target = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for k0 in range(0, hdim, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < hdim
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if CAST_W:  # autocast over fp32 weights: the tile is cast here, no bf16 copy of the head exists
                if ROUND_BY_HAND:
                    w = _round_to_bf16(w)
                else:
                    w = w.to(h.dtype)
            if UPCAST:  # the Triton interpreter multiplies bf16 operands as raw bits
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
        z = acc * inv_t
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] * inv_t
        z = tl.where(col_ok[None, :], z, float("-inf"))
        target += tl.sum(tl.where((cols[None, :] == labels[:, None]) & col_ok[None, :], z, 0.0), axis=1)
        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        rescale = tl.exp(run_max - new_max)
        e = tl.exp(z - new_max[:, None])
        if WITH_ENTROPY:
            shift = tl.where(run_sum > 0, run_max - new_max, 0.0) * run_sum
            centred = tl.where(col_ok[None, :], z - new_max[:, None], 0.0)
            run_zexp = (run_zexp + shift) * rescale + tl.sum(e * centred, axis=1)
        run_sum = run_sum * rescale + tl.sum(e, axis=1)
        run_max = new_max
    out = rows * n_splits + pid_s
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_ptr + out, run_sum, mask=row_ok)
    tl.store(target_ptr + out, target, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(zexp_ptr + out, run_zexp, mask=row_ok)


@_jit
def _fold_forward_kernel(
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
                e = _round_to_bf16(e)
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


@_jit
def _fold_backward_kernel(
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
        grad = _round_to_bf16(grad)
    tl.store(out_ptr + src * stride_out + cols, grad.to(out_ptr.dtype.element_ty), mask=ok)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


# Launch configurations of the fused head kernel, best first: (BLOCK_N, BLOCK_V, BLOCK_H, num_warps,
# num_stages). Each pipeline stage holds a BLOCK_N x BLOCK_H hidden tile and a BLOCK_V x BLOCK_H weight
# tile in shared memory; the first that fits the card's per-block limit is used (128 x 128 x 64 in 3
# stages needs 96 KiB in bf16: H100 / A100, not A10 / L4 / L40S / RTX 4090 with 99 KiB).
HEAD_CONFIGS_LOW_PRECISION = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 2),
    (128, 64, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (64, 64, 32, 4, 2),
]
HEAD_CONFIGS_FP32 = [
    (64, 64, 32, 4, 3),
    (64, 64, 32, 4, 2),
    (32, 64, 32, 4, 2),
    (32, 32, 32, 4, 1),
]
INTERPRETER_HEAD_CONFIG = (16, 32, 16, 1, 1)
SMEM_RESERVE = 8 * 1024  # reductions and layout conversions of the epilogue
SMEM_FALLBACK = 99 * 1024  # when the device does not report its opt-in limit: the smallest recent card's
_HEAD_CONFIG_CACHE: dict = {}


def head_smem_bytes(config, h_bytes, w_bytes) -> int:
    """Shared memory the pipelined operand tiles of a head-kernel config need."""
    block_n, block_v, block_h, _, stages = config
    return max(1, stages) * block_h * (block_n * h_bytes + block_v * w_bytes)


def head_configs(cdtype, w_dtype, smem_limit) -> list:
    """The launch configurations that fit `smem_limit` bytes per block, best first (never empty)."""
    candidates = HEAD_CONFIGS_LOW_PRECISION if cdtype in _LOW_PRECISION else HEAD_CONFIGS_FP32
    h_bytes, w_bytes = torch.empty((), dtype=cdtype).element_size(), torch.empty((), dtype=w_dtype).element_size()
    fitting = [c for c in candidates if head_smem_bytes(c, h_bytes, w_bytes) + SMEM_RESERVE <= smem_limit]
    return fitting or [min(candidates, key=lambda c: head_smem_bytes(c, h_bytes, w_bytes))]


def _smem_limit(device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or SMEM_FALLBACK


def _fold_block(n_cols):
    return 32 if _interpreting() else min(1024, triton.next_power_of_2(max(n_cols, 16)))


def _head_stats_triton(hidden, weight, bias, labels, inv_t, with_entropy, cdtype):
    """Forward statistics from one fused kernel; vocabulary splits keep every SM busy for small N."""
    n = hidden.shape[0]
    if n == 0:
        empty = torch.zeros(0, device=hidden.device, dtype=torch.float32)
        return empty, empty, (empty if with_entropy else None)
    hidden = hidden.to(cdtype).contiguous()
    weight = weight.contiguous()
    if _interpreting():  # the interpreter has no shared memory limit; tests set the config to run
        return _launch_head_stats(hidden, weight, bias, labels, inv_t, with_entropy, INTERPRETER_HEAD_CONFIG)
    key = (hidden.device.index, cdtype, weight.dtype)
    return _with_fitting_config(key, lambda: head_configs(cdtype, weight.dtype, _smem_limit(hidden.device)),
                                lambda config: _launch_head_stats(hidden, weight, bias, labels, inv_t, with_entropy,
                                                                  config))


def _with_fitting_config(key, candidates, launch):
    """launch(config) with the best cached configuration for `key` (candidates() the first time). One the GPU
    rejects (Triton's OutOfResources: the estimate was short) is dropped for good, with a warning, once."""
    if key not in _HEAD_CONFIG_CACHE:
        _HEAD_CONFIG_CACHE[key] = list(candidates())
    configs = _HEAD_CONFIG_CACHE[key]
    while True:
        try:
            return launch(configs[0])
        except triton.runtime.errors.OutOfResources as err:
            if len(configs) == 1:
                raise
            _warn_once(("head-config", key, configs[0]), f"fused_token_logprobs: launch configuration {configs[0]} "
                       f"does not fit this GPU ({err}); using {configs[1]}")
            configs.pop(0)


def _launch_head_stats(hidden, weight, bias, labels, inv_t, with_entropy, config):
    n, hdim = hidden.shape
    vocab = weight.shape[0]
    f32 = {"device": hidden.device, "dtype": torch.float32}
    block_n, block_v, block_h, warps, stages = config
    row_blocks = triton.cdiv(n, block_n)
    vocab_blocks = triton.cdiv(vocab, block_v)
    wanted = 2 if _interpreting() else triton.cdiv(4 * _num_sms(hidden.device), row_blocks)
    cols_per_split = triton.cdiv(vocab_blocks, max(1, min(wanted, vocab_blocks))) * block_v
    n_splits = triton.cdiv(vocab, cols_per_split)
    parts = {name: torch.empty(n, n_splits, **f32) for name in ("max", "sumexp", "zexp", "target")}
    low = hidden.dtype in _LOW_PRECISION
    _head_stats_kernel[(row_blocks, n_splits)](
        hidden, weight, hidden if bias is None else bias, labels, parts["max"], parts["sumexp"], parts["zexp"],
        parts["target"], n, vocab, hdim, cols_per_split, n_splits, inv_t, hidden.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, DOT_PRECISION="tf32" if low else "ieee",
        UPCAST=_interpreting() and low, CAST_W=weight.dtype != hidden.dtype, ROUND_BY_HAND=_round_by_hand(hidden.dtype),
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, num_warps=warps, num_stages=stages,
    )
    # merge the splits' online statistics
    run_max = parts["max"].amax(1, keepdim=True)
    weight_k = torch.exp(parts["max"] - run_max)
    sumexp = (parts["sumexp"] * weight_k).sum(1)
    lse = run_max.squeeze(1) + sumexp.log()
    entropy = None
    if with_entropy:
        zexp = (weight_k * (parts["zexp"] + (parts["max"] - run_max) * parts["sumexp"])).sum(1)
        entropy = sumexp.log() - zexp / sumexp
    return lse, parts["target"].sum(1), entropy


def _fold_forward_triton(x, labels, col0, stats, scale, *, bias=None, e_out=None, row_index=None):
    """Fold rows of x (a tile, or whole logits rows picked by row_index) into stats, in place.

    With e_out, also writes exp(z - new max) there and returns (e_out, rescale per row).
    """
    n_rows = labels.shape[0]
    write_exp = e_out is not None
    rescale = torch.empty(n_rows, device=x.device, dtype=torch.float32) if write_exp else stats["max"]
    zexp = stats["zexp"] if stats["zexp"] is not None else stats["sumexp"]
    e_out = x if e_out is None else e_out
    _fold_forward_kernel[(n_rows,)](
        x, x.stride(0), labels if row_index is None else row_index, labels, x if bias is None else bias,
        e_out, e_out.stride(0), stats["max"], stats["sumexp"], zexp, stats["target"], rescale, x.shape[1], col0, scale,
        HAS_ROW_INDEX=row_index is not None, HAS_BIAS=bias is not None, WITH_ENTROPY=stats["zexp"] is not None,
        WRITE_EXP=write_exp, ROUND_BY_HAND=_round_by_hand(e_out.dtype), BLOCK=_fold_block(x.shape[1]),
    )
    return (e_out, rescale) if write_exp else (None, None)


def _tile_grad_triton(x, out, labels, col0, lse, entropy, g, g_ent, inv_t, bias):
    """Minus the tile's logits gradient up to the row factor c (as _tile_grad_torch), from raw
    fp32 logits x into out (in the GEMM dtype)."""
    rows, cols = x.shape
    block = _fold_block(cols)
    _fold_backward_kernel[(rows, triton.cdiv(cols, block))](
        x, x.stride(0), out, out.stride(0), lse, labels, x if bias is None else bias, lse,
        lse if entropy is None else entropy, g, g if g_ent is None else g_ent, cols, col0, inv_t, -1.0,
        HAS_ROW_INDEX=False, HAS_BIAS=bias is not None, SCALE_BY_G=g_ent is not None,
        HAS_ENTROPY_GRAD=g_ent is not None, ROUND_BY_HAND=_round_by_hand(out.dtype), BLOCK=block,
    )
    return out


def _logits_grad_triton(logits, keep, labels, lse, g, inv_t, grad):
    vocab = logits.shape[1]
    block = _fold_block(vocab)
    _fold_backward_kernel[(keep.shape[0], triton.cdiv(vocab, block))](
        logits, logits.stride(0), grad, grad.stride(0), keep, labels, lse, lse, lse, g, g, vocab, 0, inv_t, inv_t,
        HAS_ROW_INDEX=True, HAS_BIAS=False, SCALE_BY_G=True, HAS_ENTROPY_GRAD=False,
        ROUND_BY_HAND=_round_by_hand(grad.dtype), BLOCK=block,
    )
