"""The attention of a packed pass (utils/core/packing.py): which keys each packed sequence sees, and the attention
functions that compute only those pairs. Registered under transformers' own names ("sdpa", "flash_attention_2"),
so every model of those implementations takes them; a call without `packed_segments` (generation, the padded pass,
a vision tower) is transformers' own function, unchanged.

- `segment_attention` (sdpa): one SDPA per piece (a unit's prefix, or one completion over its prefix's keys then its
  own), so no dense row mask is built and no masked pair is computed.
- `packed_flash_attention` (flash_attention_2, CUDA): every piece of every row in one flash-attention varlen call;
  a piece's keys are its prefix's then its own, and the kernel's causal mask is aligned to the last key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward


class Segments:
    """The attention pattern of packed rows, for the functions below: per row, one (tokens, prefix) per piece, in
    column order from column 0; `prefix` is the index in the row of the piece's unit prefix (None for the prefix
    itself). A piece's queries see that prefix and, causally, its own tokens. Columns after a row's last piece are
    row padding: zeros."""

    def __init__(self, rows, width):
        self.rows, self.width = rows, width
        self._masks, self._varlen = {}, {}

    def check(self, query):
        """A causal layer's queries [rows, heads, width, d] must be these rows'."""
        if query.shape[0] != len(self.rows) or query.shape[2] != self.width:
            raise ValueError(f"padding_free: a causal layer got queries {tuple(query.shape)} for packed rows of "
                             f"{len(self.rows)} x {self.width} tokens")

    def mask(self, n, n_prefix, device):
        """[n, n_prefix + n] booleans (True: attend): the whole prefix, then causal over the piece's own tokens."""
        key = (n, n_prefix, device)
        if key not in self._masks:
            own = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            self._masks[key] = torch.cat([own.new_ones(n, n_prefix), own], 1)
        return self._masks[key]

    def varlen(self, device):
        """flash-attention's varlen layout of the rows: (query index, key index, cu_seqlens_q, cu_seqlens_k, max_q,
        max_k). Indices are flat (row * width + column); each piece is one varlen sequence, its queries its own
        tokens, its keys its prefix's tokens then its own (a prefix is read once per completion of its unit)."""
        if device not in self._varlen:
            q_index, k_index = [], []
            for r, pieces in enumerate(self.rows):
                starts = torch.tensor([0] + [n for n, _ in pieces]).cumsum(0) + r * self.width
                own = [torch.arange(starts[i], starts[i + 1]) for i in range(len(pieces))]
                for i, (_, j) in enumerate(pieces):
                    q_index.append(own[i])
                    k_index.append(own[i] if j is None else torch.cat([own[j], own[i]]))
            len_q = torch.tensor([len(t) for t in q_index])
            len_k = torch.tensor([len(t) for t in k_index])
            cu = [F.pad(n.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32) for n in (len_q, len_k)]
            self._varlen[device] = (torch.cat(q_index).to(device), torch.cat(k_index).to(device), *cu,
                                    int(len_q.max()), int(len_k.max()))
        return self._varlen[device]


def segment_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, packed_segments=None,
                      **kwargs):
    """transformers' sdpa attention, except for the causal layers of a packed pass (`packed_segments` given):
    there, one SDPA per piece over the keys it sees. query [rows, heads, width, d] -> ([rows, width, heads, d], None).
    Bidirectional layers (vision towers, which the same kwargs reach) take the plain path."""
    if packed_segments is None or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    seg = packed_segments
    seg.check(query)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    rows = []
    # split, not sliced: the backward of a split is one concatenation, a slice's writes into a zero tensor per piece;
    # pieces stay 4-D ([1, heads, n, d]), the shape SDPA's fused CPU and CUDA kernels take
    for pieces, q_row, k_row, v_row in zip(seg.rows, query.split(1), key.split(1), value.split(1)):
        sizes = [n for n, _ in pieces]
        tail = seg.width - sum(sizes)  # row padding
        qs, ks, vs = (t.split(sizes + [tail], dim=2) for t in (q_row, k_row, v_row))
        outs = []
        for i, (n, j) in enumerate(pieces):
            if j is None:  # a prefix: causal over itself
                out = F.scaled_dot_product_attention(qs[i], ks[i], vs[i], dropout_p=dropout, scale=scaling,
                                                     is_causal=True)
            else:  # a completion: its prefix (piece j), then itself
                mask = seg.mask(n, sizes[j], q_row.device)
                out = F.scaled_dot_product_attention(qs[i], torch.cat([ks[j], ks[i]], 2), torch.cat([vs[j], vs[i]], 2),
                                                     attn_mask=mask, dropout_p=dropout, scale=scaling)
            outs.append(out)
        if tail:
            outs.append(q_row.new_zeros(1, q_row.shape[1], tail, value.shape[-1]))
        rows.append(torch.cat(outs, 2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def packed_flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           packed_segments=None, **kwargs):
    """transformers' flash_attention_2, except for the causal layers of a packed pass: there, one varlen call over
    every piece of every row (flash-attention aligns a causal mask bottom-right when a sequence has more keys than
    queries: a completion's query t sees its prefix and its own tokens up to t). Row padding returns zeros."""
    if packed_segments is None or not getattr(module, "is_causal", True):
        return flash_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       **kwargs)
    seg = packed_segments
    seg.check(query)
    rows, heads, width, _ = query.shape
    q_index, k_index, cu_q, cu_k, max_q, max_k = seg.varlen(query.device)

    def tokens(t, index):  # [rows, h, width, d] -> [1, h, len(index), d]
        flat = t.transpose(1, 2).reshape(rows * width, t.shape[1], t.shape[3])
        return flat.index_select(0, index).transpose(0, 1)[None]

    for name in ("position_ids", "is_causal", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    out, _ = flash_attention_forward(module, tokens(query, q_index), tokens(key, k_index), tokens(value, k_index),
                                     None, dropout=dropout, scaling=scaling, is_causal=True, cu_seq_lens_q=cu_q,
                                     cu_seq_lens_k=cu_k, max_length_q=max_q, max_length_k=max_k, **kwargs)
    out = out.reshape(-1, heads, out.shape[-1])  # [tokens, heads, d]
    full = out.new_zeros(rows * width, heads, out.shape[-1]).index_copy(0, q_index, out)
    return full.view(rows, width, heads, -1), None


# Registered under transformers' own names, so every sdpa or flash_attention_2 model (policy, reference, under
# gradient checkpointing, whose recomputation re-reads the attention function) takes them; calls without packed
# segments are transformers' own.
AttentionInterface.register("sdpa", segment_attention)
AttentionInterface.register("flash_attention_2", packed_flash_attention)
