"""How the train scripts call reward functions: exactly as TRL's GRPOTrainer does, checked before a model loads.

TRL 1.16 calls every reward function as

    reward_func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                **columns, trainer_state=state, log_extra=log_extra, log_metric=log_metric)

with one entry per completion in each list: `prompts` the chat messages of the prompt, `completions`
the completion as assistant messages (`[{"role": "assistant", "content": text}]`, chat data), and
`completion_ids` its token ids. Every data set column (images included) is a keyword list.
`trainer_state` is a `transformers.TrainerState` (global_step, max_steps); `log_extra(column, values)`
adds a column to the logged completions and `log_metric(name, value)` a number to the step's metrics.
A reward returns one float or None ("does not apply") per completion.

`check_reward_call` reads a reward's signature against those keywords and the data set's columns, so a
reward that needs a column the data lacks, or cannot take TRL's keywords, fails before any model loads.
"""

from __future__ import annotations

import inspect
import math

import torch

from rewards.common import TRAINER_KEYWORDS
from utils.config import ConfigError


def _signature_of(fn):
    """(the callable whose parameters matter, keywords already bound) for plain functions and bound rewards."""
    bound = {}
    while hasattr(fn, "fn") and hasattr(fn, "options"):  # rewards.common.RewardFunction
        bound.update(fn.options)
        fn = fn.fn
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
    try:
        return inspect.signature(target), bound
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return None, bound


def check_reward_call(fn, name, columns):
    """Fail now, naming the reward, when calling it the way TRL does could not work on these columns."""
    signature, bound = _signature_of(fn)
    if signature is None:
        return
    params = {p.name: p for p in signature.parameters.values() if p.name not in bound}
    passed = set(TRAINER_KEYWORDS) | set(columns)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for p in params.values():
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty:
            raise ConfigError(f"reward {name!r}: parameter {p.name!r} is positional-only, but rewards are called "
                              f"with keywords only ({', '.join(TRAINER_KEYWORDS)} and the data set columns)")
        if (p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                and p.default is inspect.Parameter.empty and p.name not in passed):
            raise ConfigError(f"reward {name!r} needs {p.name!r}, which is neither a data set column (columns: "
                              f"{', '.join(sorted(columns))}) nor a keyword the trainer passes "
                              f"({', '.join(TRAINER_KEYWORDS)})")
    if not takes_any:
        refused = sorted(passed - set(params))
        if refused:
            raise ConfigError(f"reward {name!r} takes no **kwargs and would refuse {', '.join(refused)}, which the "
                              "trainer passes (TRL's call); add **kwargs to its signature")


def as_conversation(texts):
    """Completions in TRL's conversational form: one assistant message per completion."""
    return [[{"role": "assistant", "content": text}] for text in texts]


class RewardLog:
    """What rewards report through `log_extra` / `log_metric` during one step's calls."""

    def __init__(self):
        self.extra, self.metrics = {}, {}

    def log_extra(self, column, values):
        self.extra.setdefault(column, []).extend(list(values))

    def log_metric(self, name, value):
        self.metrics.setdefault(name, []).append(float(value))

    def metric_means(self):
        return {name: sum(v) / len(v) for name, v in self.metrics.items() if v}


def call_rewards(reward_fns, names, *, prompts, completions, completion_ids, columns, trainer_state=None,
                 log=None):
    """Rewards [completions, reward functions] (float32), NaN where a function returned None."""
    n = len(completions)
    log = log if log is not None else RewardLog()
    rewards = torch.full((n, len(reward_fns)), float("nan"))
    for j, (fn, name) in enumerate(zip(reward_fns, names)):
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                    trainer_state=trainer_state, log_extra=log.log_extra, log_metric=log.log_metric)
        values = list(values) if values is not None else None
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} rewards"
            raise ValueError(f"reward {name!r} returned {got} for {n} completions; it must return one float or "
                             "None per completion")
        for k, value in enumerate(values):
            if value is None:
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"reward {name!r} returned {value!r} for completion {k}; expected a number or "
                                 "None") from None
            if not math.isnan(value):
                rewards[k, j] = value
    return rewards
