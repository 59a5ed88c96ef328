"""Difficulty curricula (OpenVLThinker): bucket training questions into easy / medium / hard and train
the chosen buckets in order (default medium then hard; easy questions teach little). The sampler that
walks the stages is `utils.core.samplers.CurriculumSampler`.

A question's difficulty is its `difficulty` column when the data set has one, or a score in [0, 1]:
the error rate of the current model over k sampled answers, optionally averaged with a quality rating
r in [0, 1] as (error_rate + (1 - r)) / 2. Scores split into tertiles or at fixed thresholds.

Used by train_grpo.py alone (--curriculum).
"""

import torch

LEVELS = ("easy", "medium", "hard")


def levels_from_scores(scores, *, split="tertiles", thresholds=(1 / 3, 2 / 3)):
    """Map difficulty scores (higher = harder) to easy/medium/hard.

    tertiles: the lowest third of questions (by rank, ties kept together) are easy, the highest third hard.
    thresholds: score < t1 easy, t1 <= score < t2 medium, score >= t2 hard.
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    if split == "thresholds":
        t1, t2 = thresholds
        if not t1 <= t2:
            raise ValueError(f"--difficulty_thresholds must be increasing, got {thresholds}")
        return ["easy" if s < t1 else "medium" if s < t2 else "hard" for s in scores.tolist()]
    if split != "tertiles":
        raise ValueError(f"--difficulty_split {split!r} is not one of ['tertiles', 'thresholds']")
    n = len(scores)
    if n == 0:
        return []
    q1, q2 = torch.quantile(scores, torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)).tolist()
    return ["easy" if s < q1 or (s == q1 and q1 < q2) else "medium" if s < q2 else "hard" for s in scores.tolist()]


def combine_with_rating(error_rates, ratings):
    """(error_rate + (1 - rating)) / 2; ratings must lie in [0, 1]."""
    out = []
    for i, (e, r) in enumerate(zip(error_rates, ratings)):
        if r is None or not 0.0 <= float(r) <= 1.0:
            raise ValueError(f"row {i}: the quality rating must be in [0, 1], got {r!r}")
        out.append((float(e) + (1.0 - float(r))) / 2.0)
    return out


def stage_indices(levels, curriculum):
    """{stage name: row indices} for the stages of `curriculum`, in order; errors on unknown or empty stages."""
    stages = {}
    for name in curriculum:
        if name not in LEVELS:
            raise ValueError(f"--curriculum stage {name!r} is not one of {LEVELS}")
        stages[name] = [i for i, level in enumerate(levels) if level == name]
        if not stages[name]:
            counts = {lv: sum(1 for x in levels if x == lv) for lv in LEVELS}
            raise ValueError(f"--curriculum stage {name!r} has no questions (difficulty counts: {counts})")
    return stages
