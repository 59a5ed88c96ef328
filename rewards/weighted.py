"""``weighted``: several rewards as one, r = sum_k w_k r_k, as GRPO weighs its reward functions.

    get_reward("weighted", weights={"pickscore": 1.0, "aesthetic": 0.1},
               reward_kwargs={"pickscore": {"divisor": 26}})

A reward that returns None for a sample is left out of that sample's sum (GRPO's NaN rule); a sample no reward
scores gets None. Each part is built once (its model loads once per process) and called with the same arguments.
"""

from __future__ import annotations

import math

from rewards import get_reward
from rewards.common import RewardFunction


def weighted_reward(weights: dict, reward_kwargs: dict | None = None):
    if not isinstance(weights, dict) or not weights:
        raise ValueError(f"weighted: weights must be a non-empty {{reward name: weight}} mapping, got {weights!r}")
    reward_kwargs = dict(reward_kwargs or {})
    unknown = sorted(set(reward_kwargs) - set(weights))
    if unknown:
        raise ValueError(f"weighted: reward_kwargs names {unknown}, which are not in weights ({sorted(weights)})")
    parts = []
    for name, weight in weights.items():
        if name == "weighted":
            raise ValueError("weighted: a weighted reward cannot hold another 'weighted'")
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"weighted: the weight of {name!r} must be a finite number, got {weight!r}")
        parts.append((name, float(weight), get_reward(name, **reward_kwargs.get(name, {}))))
    return RewardFunction("weighted", _weighted, parts=parts)


def _weighted(completions, *, parts, **columns):
    total: list[float | None] = [None] * len(completions)
    for name, weight, fn in parts:
        values = fn(completions, **columns)
        if values is None or len(values) != len(completions):
            raise ValueError(f"weighted: reward {name!r} returned {'None' if values is None else len(values)} "
                             f"values for {len(completions)} completions")
        for i, value in enumerate(values):
            if value is None or math.isnan(float(value)):
                continue
            total[i] = (total[i] or 0.0) + weight * float(value)
    return total
