"""Padding-free (packed) forward passes: a batch's sequences laid end to end, with no padding tokens.

Each packed row holds whole "units": a prompt's valid tokens, then the input tokens of each of its completions
(a group's completions share one prompt encoding, as in the shared-prompt pass of utils/core/logprobs.py); for SFT a
unit is one sequence. A block mask lets every token attend only to its own prompt and its own earlier tokens, and
position ids restart per sequence (Qwen-VL's 3-row multimodal rope: the positions `get_rope_index` gives the
padded batch, image tokens included). The hidden states that predict each completion token are gathered back to
the padded [B, T] layout, so the LM head, the losses and the tests see exactly what the padded pass returns.

Under sdpa the packed rows go to `segment_attention` (utils/core/packed_attention.py, registered as transformers'
"sdpa";
every call without packed segments is passed to transformers' own sdpa unchanged), which runs one SDPA per piece
over only the keys the piece sees: its unit's prefix and its own earlier tokens. No dense row mask is built, and a
unit's attention costs the sum of its pieces' pairs rather than the square of its length (the masked blocks are
skipped). Under flash_attention_2 (CUDA, flash-attn installed) the same pieces go to flash-attention's varlen kernel
in one call per layer (`packed_flash_attention`): each piece is a varlen sequence whose keys are its prefix's then
its own. Eager attention takes an explicit additive 4-D mask instead. Other kernels (flex, hub kernels), families
whose image tokens attend bidirectionally and sliding-window or linear-attention layers are refused with the reason
(`packing_unsupported_reason`).
Rows hold at most the longest unit's tokens (units are not split; shorter units share a row), and never more than
MAX_PACKED_TOKENS unless one unit is longer.
"""

from __future__ import annotations

import torch
from transformers.modeling_flash_attention_utils import flash_attn_supports_top_left_mask

from utils.core.config import ConfigError
from utils.core.packed_attention import Segments  # registers the packed attention functions
from utils.core.trajectories import full_side, has_media, packed_media, sequence_media, side_keys

# Tokens per packed row: eager's dense row mask grows as its square (256 MiB of fp32 at 8192).
MAX_PACKED_TOKENS = 8192
PACKED_ATTENTION = ("sdpa", "flash_attention_2", "eager")
# the implementations that read `packed_segments` (eager reads a dense mask)
SEGMENT_ATTENTION = ("sdpa", "flash_attention_2")
# Families whose image tokens attend to each other both ways (token_type_ids): a causal block mask is not theirs.
BIDIRECTIONAL_IMAGE_FAMILIES = ("gemma3", "gemma3n", "paligemma")


def _attn_implementation(config):
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


def packing_unsupported_reason(model_or_config):
    """None when this model's packed pass equals its padded one, else why it cannot be packed (one line)."""
    config = getattr(model_or_config, "config", model_or_config)
    impl = _attn_implementation(config)
    if impl not in PACKED_ATTENTION:
        return (f"attention {impl!r} has no packed path; packing needs one of {', '.join(PACKED_ATTENTION)} "
                "(--attn_implementation sdpa)")
    if impl == "flash_attention_2" and flash_attn_supports_top_left_mask():
        return ("this flash-attn aligns the causal mask top-left (before 2.1); a completion's queries need it "
                "bottom-right, after its prompt's keys: upgrade flash-attn or use --attn_implementation sdpa")
    if config.model_type in BIDIRECTIONAL_IMAGE_FAMILIES:
        return f"{config.model_type}'s image tokens attend bidirectionally; the packed mask is causal"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ()
    if "sliding_attention" in layer_types or getattr(text, "use_sliding_window", False):
        return f"{config.model_type} has sliding-window layers; the packed mask is a full causal one"
    if "linear_attention" in layer_types:
        return (f"{config.model_type} has linear-attention layers, whose recurrence along a packed row would carry one "
                "sequence's state into the next")
    return None


def resolve_padding_free(flag, model, notice=print):
    """--padding_free: None packs where the model allows it (a one-line notice says why not), True requires it
    (an error with the reason), False keeps the padded pass."""
    reason = packing_unsupported_reason(model)
    if flag and reason:
        raise ConfigError(f"--padding_free: {reason}")
    if flag is None and reason:
        notice(f"--padding_free off (padded log-prob pass): {reason}")
    return reason is None if flag is None else flag




def _is_prefix_mask(mask):
    lengths = mask.sum(-1, keepdim=True)
    return bool((mask.bool() == (torch.arange(mask.shape[1], device=mask.device) < lengths)).all())


def _rows(unit_lengths, max_tokens):
    """Units (in order, so image tokens keep the order of pixel_values) greedily into rows of <= max_tokens."""
    rows, current, size = [], [], 0
    for u, n in enumerate(unit_lengths):
        if current and size + n > max_tokens:
            rows.append(current)
            current, size = [], 0
        current.append(u)
        size += n
    if current:
        rows.append(current)
    return rows


class Packed:
    """One packed batch. `pieces`: per unit, a list of (kind, ids [k], positions [k] or [3, k], side {key: [k]}),
    kind -1 for the unit's prefix (prompt / whole SFT sequence) and c >= 0 for completion c. After construction
    `start[(unit, piece)]` is the flat index (row * width + column) of a piece's first token."""

    def __init__(self, pieces, *, max_tokens, device):
        lengths = [sum(p[1].shape[0] for p in unit) for unit in pieces]
        self.rows = _rows(lengths, min(max_tokens, max(lengths, default=1)))
        self.width = width = max(1, max(sum(lengths[u] for u in row) for row in self.rows))
        n_rows = len(self.rows)
        mrope = any(p[2].dim() == 2 for unit in pieces for p in unit)
        side_keys = sorted({k for unit in pieces for p in unit for k in p[3]})
        ids = torch.zeros(n_rows, width, dtype=torch.long, device=device)
        pos = torch.zeros((3, n_rows, width) if mrope else (n_rows, width), dtype=torch.long, device=device)
        side = {k: torch.zeros(n_rows, width, dtype=torch.long, device=device) for k in side_keys}
        # per token: its unit (-1: row padding) and its completion (-1: the prefix)
        owner = torch.full((n_rows, width), -1, dtype=torch.long, device=device)
        comp = torch.full((n_rows, width), -1, dtype=torch.long, device=device)
        self.start, segments = {}, []
        for r, row in enumerate(self.rows):
            col, segments_r = 0, []
            for u in row:
                prefix = len(segments_r)  # the unit's prefix comes first, and is never empty
                for j, (kind, p_ids, p_pos, p_side) in enumerate(pieces[u]):
                    k = p_ids.shape[0]
                    self.start[(u, j)] = r * width + col
                    if k:
                        segments_r.append((k, None if kind == -1 else prefix))
                    ids[r, col:col + k] = p_ids
                    if mrope:
                        pos[:, r, col:col + k] = p_pos if p_pos.dim() == 2 else p_pos.expand(3, -1)
                    else:
                        pos[r, col:col + k] = p_pos
                    for key, value in p_side.items():
                        side[key][r, col:col + k] = value
                    owner[r, col:col + k] = u
                    comp[r, col:col + k] = kind
                    col += k
            segments.append(segments_r)
        self.input_ids, self.position_ids, self.side = ids, pos, side
        self.owner, self.comp = owner, comp
        self.segments = Segments(segments, width)
        self.tokens = sum(lengths)

    def attention_mask(self):
        """eager's mask: additive fp32 (its scores are promoted to fp32), [rows, 1, width, width]. A key is
        visible if it is its unit's prefix or the query's own completion; row padding sees itself only."""
        owner, comp, width = self.owner, self.comp, self.width
        idx = torch.arange(width, device=owner.device)
        causal = idx[None, :] <= idx[:, None]
        same_unit = owner[:, :, None] == owner[:, None, :]
        visible = (comp[:, None, :] == -1) | (comp[:, None, :] == comp[:, :, None])
        allowed = (same_unit & causal & visible & (owner[:, :, None] >= 0)) | torch.eye(
            width, dtype=torch.bool, device=owner.device)
        blocked = torch.zeros((allowed.shape[0], 1, width, width), dtype=torch.float32, device=owner.device)
        return blocked.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)

    def forward(self, base, extra):
        """Hidden states [rows * width, H] of the packed rows through `base` (the HF model without its head)."""
        config = base.config
        inputs = dict(extra, **self.side)
        if _attn_implementation(config) in SEGMENT_ATTENTION:
            inputs["packed_segments"] = self.segments
        else:
            inputs["attention_mask"] = self.attention_mask()
        out = base(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False, **inputs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden.reshape(-1, hidden.shape[-1])


def _gather_rows(flat, index, valid):
    """flat[index] where valid, zeros elsewhere: the padded [B, T, H] view of packed hidden states. Only valid
    positions are read (padding would repeat one index, whose backward scatter-add is slow on the CPU)."""
    where = valid.reshape(-1).nonzero().squeeze(1)
    out = flat.new_zeros(valid.numel(), flat.shape[-1])
    out = out.index_copy(0, where, flat.index_select(0, index.reshape(-1).index_select(0, where)))
    return out.view(*valid.shape, flat.shape[-1])


def _side_inputs(batch):
    """Per-token side inputs of a batch (mm_token_type_ids, token_type_ids), and the rest."""
    shape = batch["input_ids"].shape
    per_token = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)
                 and v.dim() == 2 and v.shape == shape}
    rest = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask") and k not in per_token}
    return per_token, rest


def _grids_of_rows(grid_thw, tokens_per_prompt, rows, merge, per_grid=None):
    """The grid rows (of image_grid_thw or video_grid_thw) of each of `rows`' prompts, in order, and the same rows
    of `per_grid` (second_per_grid_ts, one value per video) when given. A prompt's grids are the next rows of
    grid_thw whose token counts (t * h * w / merge^2) add up to its count of that modality's tokens: family-agnostic
    (Qwen3-VL writes a video's frames as separate runs of tokens, Qwen2.5-VL as one)."""
    sizes = (grid_thw.prod(-1) // (merge * merge)).tolist()
    starts, k = [], 0
    for n in tokens_per_prompt.tolist():
        start, total = k, 0
        while total < n:
            total, k = total + sizes[k], k + 1
        if total != n:
            raise ValueError(f"padding_free: a prompt holds {n} vision tokens, which its grids do not add up to")
        starts.append((start, k))
    take = [j for r in rows.tolist() for j in range(*starts[r])]
    chosen = grid_thw[take]
    if per_grid is None:
        return chosen, None
    return chosen, torch.as_tensor(per_grid)[take]


def _mrope_positions(base, input_ids, mm_token_type_ids, attention_mask, rest):
    """The 3-row positions the model gives the padded batch (image and video tokens included): [3, B, L]."""
    grids = {k: rest[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if rest.get(k) is not None}
    pos, _ = base.get_rope_index(input_ids, mm_token_type_ids, attention_mask=attention_mask, **grids)
    return pos


def _prompt_grids(base, rest, mm_token_type_ids, idx):
    """Each completion's prompt's image and video grids (and video timings), in completion order."""
    merge = base.config.vision_config.spatial_merge_size
    grids = {}
    for kind, token_type, timing in (("image", 1, None), ("video", 2, "second_per_grid_ts")):
        if rest.get(f"{kind}_grid_thw") is None:
            continue
        counts = (mm_token_type_ids == token_type).sum(1)
        chosen, per_grid = _grids_of_rows(rest[f"{kind}_grid_thw"], counts, idx, merge,
                                          rest.get(timing) if timing else None)
        grids[f"{kind}_grid_thw"] = chosen
        if per_grid is not None:
            grids[timing] = per_grid
    return grids


def packed_completion_hidden(base, prompts, prompt_index, completion_ids, completion_mask, *,
                             max_tokens=None, completion_inputs=None):
    """Hidden states [B, T, H] predicting each completion token (position t predicts completion_ids[:, t]; zero
    where completion_mask is 0), from one packed pass over the unique prompts and the completions.

    prompts: left-padded unique prompts; prompt_index [B] maps completions to them (None: prompt i is
    completion i's). completion_mask must be a prefix mask (generation's: ones up to the stop token).
    completion_inputs: the side inputs and images of tool tokens inside the completions (utils/core/trajectories.py)."""
    if not _is_prefix_mask(completion_mask):
        raise ValueError("padding_free: completion_mask must be ones then zeros in every row")
    device = completion_ids.device
    n_comp = completion_ids.shape[0]
    idx = (torch.arange(n_comp, device=device) if prompt_index is None
           else torch.as_tensor(prompt_index, device=device))
    p_ids, p_mask = prompts["input_ids"], prompts["attention_mask"]
    lp = p_ids.shape[1]
    per_token, rest = _side_inputs(prompts)
    comp_side = side_keys(completion_inputs, completion_ids.shape)
    lengths = completion_mask.sum(-1).tolist()
    mrope = "mm_token_type_ids" in per_token and hasattr(base, "get_rope_index")
    members = [[] for _ in range(p_ids.shape[0])]
    for i, p in enumerate(idx.tolist()):
        members[p].append(i)
    if mrope:  # the padded batch's positions: each completion's prompt, then the completion
        full_mask = torch.cat([p_mask[idx], completion_mask.to(p_mask)], 1)
        mm = full_side(per_token["mm_token_type_ids"][idx], completion_ids, completion_inputs, "mm_token_type_ids")
        if has_media(completion_inputs):  # its prompt's images, then its tool images
            grids = {"image_grid_thw": sequence_media(base.config, prompts, idx, completion_ids, completion_mask,
                                                      completion_inputs)["image_grid_thw"]}
        else:
            grids = _prompt_grids(base, rest, per_token["mm_token_type_ids"], idx)  # a prompt may hold several
        full_pos = _mrope_positions(base, torch.cat([p_ids[idx], completion_ids], 1), mm, full_mask, grids)
    if has_media(completion_inputs):  # pixel rows in packed order: a prompt's images, then its completions'
        rest = dict(rest, **packed_media(base.config, prompts, members, completion_ids, completion_mask,
                                         completion_inputs, idx))
    pieces, unit_of = [], {}
    for p, comps in enumerate(members):
        if not comps:
            continue
        keep = p_mask[p].bool()
        n_p = int(keep.sum())
        pos = full_pos[:, comps[0], :lp][:, keep] if mrope else torch.arange(n_p, device=device)
        unit = [(-1, p_ids[p][keep], pos, {k: v[p][keep] for k, v in per_token.items()})]
        for i in comps:
            k = max(int(lengths[i]) - 1, 0)  # the last token predicts nothing
            c_pos = full_pos[:, i, lp:lp + k] if mrope else n_p + torch.arange(k, device=device)
            unit.append((i, completion_ids[i, :k], c_pos,
                         {key: comp_side[key][i, :k].long() if key in comp_side
                          else torch.zeros(k, dtype=torch.long, device=device) for key in per_token}))
        unit_of[p] = len(pieces)
        pieces.append(unit)
    packed = Packed(pieces, max_tokens=max_tokens or MAX_PACKED_TOKENS, device=device)
    flat = packed.forward(base, rest)
    # completion i, token t is predicted by its prompt's last token (t = 0) or by its own token t - 1
    width = completion_ids.shape[1]
    t = torch.arange(width, device=device)
    index = torch.zeros(n_comp, width, dtype=torch.long, device=device)
    for p, comps in enumerate(members):
        if not comps:
            continue
        u = unit_of[p]
        last = packed.start[(u, 0)] + pieces[u][0][1].shape[0] - 1
        for j, i in enumerate(comps, start=1):
            index[i] = torch.where(t == 0, last, packed.start[(u, j)] + t - 1)
    valid = completion_mask.bool()
    return _gather_rows(flat, index, valid), packed


def packed_sequence_hidden(base, batch, *, max_tokens=None):
    """Hidden states [B, L, H] of a right-padded batch (SFT) from one packed pass, zero at padding."""
    mask = batch["attention_mask"]
    if not _is_prefix_mask(mask):
        raise ValueError("padding_free: attention_mask must be ones then zeros in every row (right padding)")
    device = mask.device
    per_token, rest = _side_inputs(batch)
    mrope = "mm_token_type_ids" in per_token and hasattr(base, "get_rope_index")
    if mrope:
        full_pos = _mrope_positions(base, batch["input_ids"], per_token["mm_token_type_ids"], mask, rest)
    pieces = []
    for s, n in enumerate(mask.sum(-1).tolist()):
        pos = full_pos[:, s, :n] if mrope else torch.arange(n, device=device)
        pieces.append([(-1, batch["input_ids"][s, :n], pos, {k: v[s, :n] for k, v in per_token.items()})])
    packed = Packed(pieces, max_tokens=max_tokens or MAX_PACKED_TOKENS, device=device)
    flat = packed.forward(base, rest)
    t = torch.arange(mask.shape[1], device=device)
    index = torch.stack([packed.start[(s, 0)] + t for s in range(mask.shape[0])])
    valid = mask.bool()
    return _gather_rows(flat, index, valid), packed
