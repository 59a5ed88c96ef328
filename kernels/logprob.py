"""Token log-probabilities from the hidden states and the LM head, without the full [N, V] logits.

    log p(label) = z[label] - logsumexp(z),   z = (hidden @ weight.T + bias) / T

`fused_token_logprobs` takes the hidden states and the LM-head weight: the vocabulary is processed in
tiles of VOCAB_TILE columns and rows in chunks, with an online logsumexp, so memory stays
O(rows x tile). Positions whose label is ignore_index never go through the head. Each head-GEMM tile is
folded into the running statistics by the folds of `kernels/logits_logprob.py` (log-prob from logits).

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

Over 400 lines on purpose: the fused Triton kernel and its launch configurations sit beside the torch tile
loops they must equal, tile for tile, and the GEMM precision rules both follow, so that one file shows the
whole op and the tests compare its paths (they patch tile sizes and GEMMs here).
"""

from __future__ import annotations

import torch

from .logits_logprob import (
    fold_backward_kernel,
    fold_forward_torch,
    fold_forward_triton,
    naive_token_logprobs,
    token_logprobs,
)
from .tiling import (
    LOW_PRECISION,
    SMEM_RESERVE,  # noqa: F401 (the launch rules' reserve, read here beside HEAD_CONFIGS_*)
    Scratch,
    check_label_range,
    check_labels_and_temperature,
    finish_stats,
    fitting_configs,
    fold_block,
    interpreting,
    jit,
    new_stats,
    num_sms,
    plan,
    round_by_hand,
    round_to_bf16,
    smem_limit,
    tl,
    triton,
    use_triton,
    warn_once,
    with_fitting_config,
)

# token_logprobs and naive_token_logprobs stay importable from here, where they were before the split
__all__ = ["fused_token_logprobs", "token_logprobs", "naive_token_logprobs"]

# Columns of the vocabulary processed at once, and the size of one logits tile (rows x columns).
# CPU: 2^24 fp32 elements = 64 MiB, 2048 rows of an 8192-column tile, big enough for full-speed GEMMs.
# CUDA: 4096 rows x 16384 columns (256 MiB fp32 + a 128 MiB bf16 copy) keep cuBLAS near its peak;
# TRL's chunked kernel holds a tile of that size too, plus an fp32 copy of the whole weight gradient.
VOCAB_TILE = 8192
TILE_ELEMENTS = 1 << 24
CUDA_VOCAB_TILE = 16384
CUDA_TILE_ELEMENTS = 1 << 26


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
    triton_path = use_triton(backend, hidden)
    cdtype = compute_dtype(hidden, weight)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    keep = (flat_labels != ignore_index).nonzero().squeeze(1)
    kept_labels = flat_labels.index_select(0, keep)
    check_label_range(kept_labels, weight.shape[0], ignore_index)
    logp, entropy = _FusedLogProb.apply(
        flat_hidden.index_select(0, keep), weight, bias, kept_labels, 1.0 / temperature, return_entropy, triton_path,
        torch.is_grad_enabled(), cdtype,
    )
    # index_copy keeps the result connected to the graph even when no label is kept
    zeros = torch.zeros(flat_labels.shape, device=hidden.device, dtype=torch.float32)
    logp = zeros.index_copy(0, keep, logp).view(labels.shape)
    if not return_entropy:
        return logp
    return logp, zeros.index_copy(0, keep, entropy).view(labels.shape)


# ----------------------------------------------------------------------------------------------
# Validation, compute dtype, tiles
# ----------------------------------------------------------------------------------------------


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
    check_labels_and_temperature(labels, temperature, where)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head GEMMs run in: autocast's when it is on for hidden's device (as a plain
    `hidden @ weight.T` would), else the promoted dtype of the inputs."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _plan(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int]:
    """(rows per chunk, columns per tile) for a tile of at most TILE_ELEMENTS."""
    if device.type == "cuda":
        return plan(n_rows, n_cols, CUDA_VOCAB_TILE, CUDA_TILE_ELEMENTS)
    return plan(n_rows, n_cols, VOCAB_TILE, TILE_ELEMENTS)


def _logits_tile(h, w, b, inv_t, out):
    """out = (h @ w.T + b) * inv_t in h's dtype; the temperature rides on the GEMM's alpha/beta."""
    if b is None:
        return torch.addmm(out, h, w.t(), beta=0, alpha=inv_t, out=out)
    return torch.addmm(b, h, w.t(), beta=inv_t, alpha=inv_t, out=out)


# device type -> (has a bf16/fp16 GEMM with fp32 output, why not), probed once
_FP32_OUT_GEMM: dict = {}
_WARNED: set = set()


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
    warn_once(_WARNED, ("fp32-gemm", device.type),
              f"fused_token_logprobs: torch {torch.__version__} has no bf16/fp16 GEMM with fp32 output on "
              f"{device.type} ({why}); its head GEMMs fall back to fp32 (no tensor cores, several times slower)")
    return "fp32"


def _raw_logits_fp32(h, w, out):
    """out = h @ w.T in fp32 even for bf16/fp16 inputs (the Triton folds add bias and 1/T).

    Forward statistics come from fp32 logits, so the recomputed tiles must be fp32 too: probabilities
    from bf16-rounded logits would not sum to one under the forward's logsumexp.
    """
    if h.dtype not in LOW_PRECISION:
        return torch.mm(h, w.t(), out=out)
    if _low_precision_gemm_mode(h.device) == "fp32_out":
        return torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
    # rounding the product is not an option here; on the CPU this is the interpreter's path only
    return torch.mm(h.float(), w.float().t(), out=out)


def _addmm_fp32(acc, a, b, alpha=1.0, beta=1.0, scratch=None):
    """acc = beta * acc + alpha * a @ b in fp32 with a @ b in b's dtype (a is cast to it).

    beta = 0 ignores acc's content (it may be uninitialised). With `scratch` (a Scratch) the rounded product of
    the "round" mode goes to its buffer "product" instead of a fresh tensor.
    """
    if b.dtype not in LOW_PRECISION:
        acc.addmm_(a.to(b.dtype), b, alpha=alpha, beta=beta)
        return
    mode = _low_precision_gemm_mode(acc.device)
    if mode == "fp32_out":
        torch.addmm(acc, a.to(b.dtype), b, alpha=alpha, beta=beta, out_dtype=torch.float32, out=acc)
    elif mode == "round":
        out = None if scratch is None else scratch.get("product", a.shape[0], b.shape[1], b.dtype)
        product = torch.mm(a.to(b.dtype), b, out=out)
        if beta == 0:
            acc.copy_(product).mul_(alpha)
        else:
            acc.mul_(beta).add_(product, alpha=alpha)
    else:  # the same product of rounded operands as "fp32_out", without tensor cores
        acc.addmm_(a.to(b.dtype).float(), b.float(), alpha=alpha, beta=beta)


# ----------------------------------------------------------------------------------------------
# Torch tile gradient (the reference; what runs on the CPU)
# ----------------------------------------------------------------------------------------------


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
    scratch = Scratch(hidden.device)
    lse = torch.empty(n, device=hidden.device, dtype=torch.float32)
    target, entropy = torch.empty_like(lse), torch.empty_like(lse) if with_entropy else None
    delta = torch.empty_like(hidden) if expected_row else None
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        h, lab = hidden[r0:r1].to(cdtype), labels[r0:r1]
        stats = new_stats(r1 - r0, hidden.device, with_entropy)
        expect = torch.zeros(r1 - r0, hidden.shape[1], device=hidden.device) if expected_row else None
        for v0 in range(0, vocab, tile):
            v1 = min(v0 + tile, vocab)
            b = None if bias is None else bias[v0:v1].to(cdtype)
            if use_triton:
                w = weight[v0:v1].to(cdtype)
                x = _raw_logits_fp32(h, w, scratch.get("z32", r1 - r0, v1 - v0, torch.float32))
                e_out = scratch.get("e", r1 - r0, v1 - v0, cdtype) if expected_row else None
                e, rescale = fold_forward_triton(x, lab, v0, stats, inv_t, bias=bias, e_out=e_out)
            else:  # every tile-sized operand in a reused buffer (see Scratch.cast)
                w = scratch.cast("w", weight[v0:v1], cdtype)
                z = _logits_tile(h, w, b, inv_t, scratch.get("z", r1 - r0, v1 - v0, cdtype))
                z = scratch.cast("z32", z, torch.float32)
                e, rescale = fold_forward_torch(z, lab, v0, stats, scratch)
                e = scratch.cast("z", e, cdtype) if expected_row else e  # z's buffer is free once copied
            if expected_row:
                _addmm_fp32(expect.mul_(rescale.unsqueeze(1)), e, w, scratch=None if use_triton else scratch)
        lse[r0:r1], target[r0:r1], ent = finish_stats(stats)
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
    scratch = Scratch(device)
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
        # every tile-sized operand of the torch path in a reused buffer (see Scratch.cast)
        w = weight[v0:v1].to(cdtype) if use_triton else scratch.cast("w", weight[v0:v1], cdtype)
        b = None if bias is None else bias[v0:v1].to(cdtype)
        gw = (grad_w[v0:v1] if direct_w else gw_acc[: v1 - v0]) if need_w else None
        gb = grad_b[v0:v1] if need_b else None
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            h = hidden[r0:r1].to(cdtype) if use_triton else scratch.cast("h", hidden[r0:r1], cdtype)
            ent = None if g_ent is None else entropy[r0:r1]
            ge = None if g_ent is None else g_ent[r0:r1]
            if use_triton:
                x = _raw_logits_fp32(h, w, scratch.get("z32", r1 - r0, v1 - v0, torch.float32))
                q = _tile_grad_triton(x, scratch.get("q", r1 - r0, v1 - v0, cdtype), labels[r0:r1], v0, lse[r0:r1],
                                      ent, g[r0:r1], ge, inv_t, bias)
                q_gemm = q
            else:
                z = _logits_tile(h, w, b, inv_t, scratch.get("z", r1 - r0, v1 - v0, cdtype))
                z = scratch.cast("z32", z, torch.float32)
                q = _tile_grad_torch(z, labels[r0:r1], v0, lse[r0:r1], ent, g[r0:r1], ge, scratch)
                # the fp32 tile in the GEMM dtype once for both gradient GEMMs, in z's buffer (free once copied);
                # the bias gradient sums the fp32 one
                q_gemm = scratch.cast("z", q, cdtype) if need_h or need_w else q
            first = r0 == 0  # beta = 0 on the first chunk: no zero-fill pass over the accumulators
            prod = None if use_triton else scratch
            if need_h:
                _addmm_fp32(soft_sum[r0:r1], q_gemm, w, beta=0.0 if v0 == 0 else 1.0, scratch=prod)
            if need_w:
                _addmm_fp32(gw, q_gemm.t(), h_w[r0:r1], alpha=-1.0, beta=0.0 if first else 1.0, scratch=prod)
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
# The fused Triton kernel, its launch configurations and launchers
# ----------------------------------------------------------------------------------------------


@jit
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
                    w = round_to_bf16(w)
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
_HEAD_CONFIG_CACHE: dict = {}


def head_smem_bytes(config, h_bytes, w_bytes) -> int:
    """Shared memory the pipelined operand tiles of a head-kernel config need."""
    block_n, block_v, block_h, _, stages = config
    return max(1, stages) * block_h * (block_n * h_bytes + block_v * w_bytes)



def head_configs(cdtype, w_dtype, smem_limit) -> list:
    """The launch configurations that fit `smem_limit` bytes per block, best first (never empty)."""
    candidates = HEAD_CONFIGS_LOW_PRECISION if cdtype in LOW_PRECISION else HEAD_CONFIGS_FP32
    h_bytes, w_bytes = torch.empty((), dtype=cdtype).element_size(), torch.empty((), dtype=w_dtype).element_size()
    return fitting_configs(candidates, lambda c: head_smem_bytes(c, h_bytes, w_bytes), smem_limit)


def _head_stats_triton(hidden, weight, bias, labels, inv_t, with_entropy, cdtype):
    """Forward statistics from one fused kernel; vocabulary splits keep every SM busy for small N."""
    n = hidden.shape[0]
    if n == 0:
        empty = torch.zeros(0, device=hidden.device, dtype=torch.float32)
        return empty, empty, (empty if with_entropy else None)
    hidden = hidden.to(cdtype).contiguous()
    weight = weight.contiguous()
    if interpreting():  # the interpreter has no shared memory limit; tests set the config to run
        return _launch_head_stats(hidden, weight, bias, labels, inv_t, with_entropy, INTERPRETER_HEAD_CONFIG)
    key = (hidden.device.index, cdtype, weight.dtype)
    return _with_fitting_config(key, lambda: head_configs(cdtype, weight.dtype, smem_limit(hidden.device)),
                                lambda config: _launch_head_stats(hidden, weight, bias, labels, inv_t, with_entropy,
                                                                  config))

def _with_fitting_config(key, candidates, launch):
    """launch(config) with the head kernel's best configuration for `key` (see tiling.with_fitting_config)."""
    return with_fitting_config(_HEAD_CONFIG_CACHE, key, candidates, launch, _WARNED, "fused_token_logprobs")


def _launch_head_stats(hidden, weight, bias, labels, inv_t, with_entropy, config):
    n, hdim = hidden.shape
    vocab = weight.shape[0]
    f32 = {"device": hidden.device, "dtype": torch.float32}
    block_n, block_v, block_h, warps, stages = config
    row_blocks = triton.cdiv(n, block_n)
    vocab_blocks = triton.cdiv(vocab, block_v)
    wanted = 2 if interpreting() else triton.cdiv(4 * num_sms(hidden.device), row_blocks)
    cols_per_split = triton.cdiv(vocab_blocks, max(1, min(wanted, vocab_blocks))) * block_v
    n_splits = triton.cdiv(vocab, cols_per_split)
    parts = {name: torch.empty(n, n_splits, **f32) for name in ("max", "sumexp", "zexp", "target")}
    low = hidden.dtype in LOW_PRECISION
    _head_stats_kernel[(row_blocks, n_splits)](
        hidden, weight, hidden if bias is None else bias, labels, parts["max"], parts["sumexp"], parts["zexp"],
        parts["target"], n, vocab, hdim, cols_per_split, n_splits, inv_t, hidden.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, DOT_PRECISION="tf32" if low else "ieee",
        UPCAST=interpreting() and low, CAST_W=weight.dtype != hidden.dtype, ROUND_BY_HAND=round_by_hand(hidden.dtype),
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

def _tile_grad_triton(x, out, labels, col0, lse, entropy, g, g_ent, inv_t, bias):
    """Minus the tile's logits gradient up to the row factor c (as _tile_grad_torch), from raw
    fp32 logits x into out (in the GEMM dtype)."""
    rows, cols = x.shape
    block = fold_block(cols)
    fold_backward_kernel[(rows, triton.cdiv(cols, block))](
        x, x.stride(0), out, out.stride(0), lse, labels, x if bias is None else bias, lse,
        lse if entropy is None else entropy, g, g if g_ent is None else g_ent, cols, col0, inv_t, -1.0,
        HAS_ROW_INDEX=False, HAS_BIAS=bias is not None, SCALE_BY_G=g_ent is not None,
        HAS_ENTROPY_GRAD=g_ent is not None, ROUND_BY_HAND=round_by_hand(out.dtype), BLOCK=block,
    )
    return out
