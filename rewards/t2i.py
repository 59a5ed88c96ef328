"""``shapes_t2i``: the local GenEval-like scorer of the synthetic text-to-image set, as a reward.

No server needed: ``utils.synthetic.score_t2i(image, meta)`` detects the drawn shapes and grades them
against the row's ``include`` / ``exclude`` items, so the tiny Mix-GRPO recipe trains on CPU with the
same reward shape as the GenEval server.
"""

from __future__ import annotations

from rewards.common import GENEVAL_METADATA_KEYS, RewardFunction, check_length, metadata_rows


def _shapes_t2i(completions, images=None, *, key, **columns) -> list[float | None]:
    from utils.synthetic import score_t2i

    n = len(completions)
    if images is None:
        raise ValueError("reward 'shapes_t2i' scores images: call it with images=[one PIL image per completion]")
    images = check_length(images, "images", n, "shapes_t2i")
    rows = metadata_rows(columns, n, GENEVAL_METADATA_KEYS, reward="shapes_t2i")
    return [None if im is None else float(score_t2i(im, row)[key]) for im, row in zip(images, rows)]


def shapes_t2i_reward(key: str = "score"):
    """``fn(completions, images=[PIL, ...], include=[...], exclude=[...], tag=..., prompt=...)``.

    ``key="score"`` gives partial credit in [0, 1]; ``key="strict"`` gives 1.0 only when every item holds.
    Images that are None get None; a ``metadata`` column of dicts may replace the separate columns.
    """
    if key not in ("score", "strict"):
        raise ValueError(f"shapes_t2i: key must be 'score' or 'strict', got {key!r}")
    import utils.synthetic  # noqa: F401  (fail at configuration time if the scorer is missing)

    return RewardFunction("shapes_t2i", _shapes_t2i, key=key)
