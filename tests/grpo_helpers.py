"""Reward functions with known values, for testing how train_grpo.py combines rewards.

Loaded by name through the registry (`--reward_funcs tests.grpo_helpers:always_one`), as a user's
own reward module would be.
"""


def always_one(completions, **columns):
    return [1.0 for _ in completions]


def half_missing(completions, **columns):
    """3.0 on even rows, not applicable (None) on odd rows."""
    return [3.0 if i % 2 == 0 else None for i in range(len(completions))]


def completion_length(completions, **columns):
    """A reward that varies within a group, so advantages are non-zero."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) / 10.0 for c in completions]


def negative_length(completions, **columns):
    """The opposite objective of completion_length: conflicting gradients for PCGrad."""
    return [-r for r in completion_length(completions)]
