"""``shapes_t2i``: the local GenEval-like scorer of the synthetic text-to-image set, as a reward.

No server needed: ``tiny.detector.score_t2i(image, meta)`` detects the drawn shapes and grades them
against the row's ``include`` / ``exclude`` items, so the tiny Mix-GRPO recipe trains on CPU with the
same reward shape as the GenEval server. Importing ``tiny`` registers it in the reward registry under
``shapes_t2i`` (rewards/ itself knows nothing of the tiny world).
"""

from __future__ import annotations

from rewards.common import GENEVAL_METADATA_KEYS, RewardFunction, check_length, metadata_rows
from tiny.detector import BEHAVIOURS, EXTRA_WEIGHT, score_t2i

# What score_t2i reports: the two rewards, then counts to log (e.g. as zero-weight rewards) so that a run
# shows whether the generator draws what was asked or just more.
KEYS = ("score", "strict", "detected", "requested", "extra")
# What Mix-GRPO's held-out evaluation logs beside the score of each image (ShapesT2IReward.details)
DETAILS = ("strict", "detected", "requested")


def _shapes_t2i(completions, images=None, *, key, behaviour, extra_weight, **columns) -> list[float | None]:
    n = len(completions)
    if images is None:
        raise ValueError("reward 'shapes_t2i' scores images: call it with images=[one PIL image per completion]")
    images = check_length(images, "images", n, "shapes_t2i")
    rows = metadata_rows(columns, n, GENEVAL_METADATA_KEYS, reward="shapes_t2i")
    return [None if im is None else float(score_t2i(im, row, behaviour=behaviour, extra_weight=extra_weight)[key])
            for im, row in zip(images, rows)]


class ShapesT2IReward(RewardFunction):
    """The reward, and what its scorer sees besides the score (`details`)."""

    def details(self, image, row) -> dict:
        """strict (every item holds), objects detected and requested for one image and its row, from one detection:
        a gain bought with extra objects or speckle shows (the reward itself is only its key)."""
        out = score_t2i(image, row, behaviour=self.options["behaviour"], extra_weight=self.options["extra_weight"])
        return {key: float(out[key]) for key in DETAILS}


def shapes_t2i_reward(key: str = "score", behaviour: str = "tiny", extra_weight: float | None = None):
    """``fn(completions, images=[PIL, ...], include=[...], exclude=[...], tag=..., prompt=...)``.

    ``key="score"`` gives partial credit in [0, 1]; ``key="strict"`` gives 1.0 only when every item holds
    (and, under ``tiny``, nothing extra is drawn); ``"detected"``, ``"requested"`` and ``"extra"`` are
    object counts for logging detected-vs-requested objects. ``behaviour="tiny"`` (default) also charges
    for unrequested objects and speckle, so noise, blank and confetti images cannot score;
    ``behaviour="geneval"`` keeps GenEval's rules (extra objects free unless an exclude item names them)
    for parity with the GenEval server. ``extra_weight`` (``tiny`` only; default
    ``tiny.detector.EXTRA_WEIGHT`` = 0.5) is what an extra object costs against a missing one: a reward that
    charges more for drawing what was not asked. See ``tiny.detector.score_t2i``.
    Images that are None get None; a ``metadata`` column of dicts may replace the separate columns.
    """
    if key not in KEYS:
        raise ValueError(f"shapes_t2i: key must be one of {KEYS}, got {key!r}")
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"shapes_t2i: behaviour must be one of {BEHAVIOURS}, got {behaviour!r}")
    if extra_weight is not None and behaviour != "tiny":
        raise ValueError(f"shapes_t2i: extra_weight prices extra objects under behaviour 'tiny' only; "
                         f"behaviour {behaviour!r} keeps GenEval's rules")
    if extra_weight is not None and not (isinstance(extra_weight, (int, float)) and extra_weight >= 0):
        raise ValueError(f"shapes_t2i: extra_weight must be a number >= 0, got {extra_weight!r}")
    extra_weight = EXTRA_WEIGHT if extra_weight is None else float(extra_weight)
    return ShapesT2IReward("shapes_t2i", _shapes_t2i, key=key, behaviour=behaviour, extra_weight=extra_weight)
