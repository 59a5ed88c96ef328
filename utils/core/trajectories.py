"""The images of multi-segment trajectories in the training passes (`utils.core.logprobs`, `utils.core.packing`).

A tool trajectory holds image tokens after its prompt: the images tools returned (utils/core/tool_rollout.py). Its
`completion_inputs` carry their per-token side inputs ([B, T], e.g. `mm_token_type_ids`) and their pixel inputs
(flattened patches and `image_grid_thw`, completion by completion, in order). A forward sees a sequence's images in
the order their tokens appear, so each pass orders them so: a completion's prompt's images, then its own
(`sequence_media`), or, in a packed row, each prompt's then those of each completion that shares it
(`packed_media`). Families whose pixel rows split by `image_grid_thw` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the tool
rollout refuses tool images elsewhere.
"""

from __future__ import annotations

import torch

PIXEL_KEYS = ("pixel_values", "image_grid_thw")


def has_media(completion_inputs):
    return bool(completion_inputs) and completion_inputs.get("pixel_values") is not None


def side_keys(completion_inputs, shape):
    """The per-token side inputs of the completions (same shape as completion_ids)."""
    return {k: v for k, v in (completion_inputs or {}).items() if torch.is_tensor(v) and v.shape == shape}


def _image_token_id(config):
    return getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)


def _chunks(pixel_values, grid_thw, token_counts, merge):
    """Per sequence, (its pixel rows, its grid rows): the next grids whose tokens add up to its image tokens."""
    if grid_thw is None or not len(grid_thw):
        empty_p = pixel_values[:0] if pixel_values is not None else None
        return [(empty_p, torch.zeros(0, 3, dtype=torch.long)) for _ in token_counts]
    sizes = grid_thw.prod(-1)
    tokens = (sizes // (merge * merge)).tolist()
    offsets = [0] + torch.cumsum(sizes, 0).tolist()
    out, g = [], 0
    for n in token_counts:
        start, total = g, 0
        while total < n:
            total, g = total + tokens[g], g + 1
        if total != n:
            raise ValueError(f"a sequence holds {n} image tokens, which its images' grids do not add up to")
        out.append((pixel_values[offsets[start]:offsets[g]], grid_thw[start:g]))
    return out


def _token_counts(ids, mask, token_id):
    return ((ids == token_id) & mask.bool()).sum(-1).tolist()


def split_media(config, prompts, prompt_index, completion_ids, completion_mask, completion_inputs):
    """(per prompt row, per completion) lists of (pixel rows, grid rows)."""
    token_id, merge = _image_token_id(config), config.vision_config.spatial_merge_size
    prompt_media = _chunks(prompts.get("pixel_values"), prompts.get("image_grid_thw"),
                           _token_counts(prompts["input_ids"], prompts["attention_mask"], token_id), merge)
    completion_media = _chunks(completion_inputs["pixel_values"], completion_inputs["image_grid_thw"],
                               _token_counts(completion_ids, completion_mask, token_id), merge)
    return prompt_media, completion_media


def _cat(parts, like):
    pixels = [p for p, _ in parts if p is not None and len(p)]
    grids = [g for _, g in parts if len(g)]
    return {"pixel_values": torch.cat(pixels) if pixels else like["pixel_values"][:0],
            "image_grid_thw": torch.cat(grids) if grids else like["image_grid_thw"][:0]}


def sequence_media(config, prompts, prompt_index, completion_ids, completion_mask, completion_inputs):
    """Pixel inputs of the full sequences (completion i's prompt's images, then its own), in completion order."""
    prompt_media, completion_media = split_media(config, prompts, prompt_index, completion_ids, completion_mask,
                                                 completion_inputs)
    idx = range(len(completion_media)) if prompt_index is None else torch.as_tensor(prompt_index).tolist()
    return _cat([part for i, p in enumerate(idx) for part in (prompt_media[p], completion_media[i])],
                completion_inputs)


def packed_media(config, prompts, members, completion_ids, completion_mask, completion_inputs, prompt_index):
    """Pixel inputs in packed order: each prompt that has completions (in order), then its completions'."""
    prompt_media, completion_media = split_media(config, prompts, prompt_index, completion_ids, completion_mask,
                                                 completion_inputs)
    parts = []
    for p, comps in enumerate(members):
        if comps:
            parts += [prompt_media[p]] + [completion_media[i] for i in comps]
    return _cat(parts, completion_inputs)


def full_side(prompt_value, completion_ids, completion_inputs, key):
    """A per-token side input of the full sequences: the prompt's, then the completion's (0 where none)."""
    completion = side_keys(completion_inputs, completion_ids.shape).get(key)
    if completion is None:
        completion = prompt_value.new_zeros(completion_ids.shape)
    return torch.cat([prompt_value, completion.to(prompt_value)], dim=1)
