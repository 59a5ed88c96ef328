"""Reward functions, one registry.

Every reward is ``f(completions, **columns) -> list[float | None]`` (TRL's signature): ``completions`` are
strings or chat messages, each dataset column arrives as a keyword list, and None marks a sample the
reward does not apply to. Image rewards also take ``images=[PIL image per completion]``.

    from rewards import get_reward, list_rewards
    cpr = get_reward("cpr", answer_weight=0.6, step_weight=0.4)
    cpr(completions, answer=answers, reference_steps=steps)
    mine = get_reward("my_pkg.my_module:my_fn", scale=2.0)   # any TRL-style function; kwargs are bound
    rm = get_reward("path/or/hub-id", device="cuda:1")       # a sequence-classification reward model (TRL's)

Built-in names map to factories ``(**options) -> reward function``; ``register`` adds more: the tiny world
(tiny/) registers ``shapes_t2i`` when it is imported, as every script does.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from rewards.common import RewardFunction
from rewards.reward_model import TextRewardModel, is_reward_model_name

__all__ = ["get_reward", "list_rewards", "register"]

# name -> "module:factory"; imported on first use so `import rewards` stays light (no sympy, torch, HTTP).
_BUILTIN = {
    "format": "rewards.crystal:format_reward",
    "strict_format": "rewards.crystal:strict_format_reward",
    "accuracy": "rewards.crystal:accuracy_reward",
    "cpr": "rewards.crystal:cpr_reward",
    "spr": "rewards.crystal:spr_reward",
    "reasoning": "rewards.crystal:reasoning_reward",
    "think_format": "rewards.text:think_format_reward",
    "math_accuracy": "rewards.text:math_accuracy_reward",
    "overlong_penalty": "rewards.text:overlong_penalty_reward",
    "geneval": "rewards.geneval:geneval_reward",
    "judge_geneval_plus": "rewards.judge:judge_geneval_plus_reward",
    "judge_tiif": "rewards.judge:judge_tiif_reward",
    "tool_format": "rewards.tools:tool_format_reward",
    "tool_budget": "rewards.tools:tool_budget_reward",
    "pickscore": "rewards.clip:pickscore_reward",
    "clipscore": "rewards.clip:clipscore_reward",
    "aesthetic": "rewards.clip:aesthetic_reward",
    "hpsv2": "rewards.hps:hpsv2_reward",
    "imagereward": "rewards.imagereward:imagereward_reward",
    "ocr": "rewards.ocr:ocr_reward",
    "unifiedreward": "rewards.unifiedreward:unifiedreward_reward",
    "weighted": "rewards.weighted:weighted_reward",
}
_REGISTERED: dict[str, Callable] = {}


def list_rewards() -> list[str]:
    """Registered reward names, sorted."""
    return sorted({*_BUILTIN, *_REGISTERED})


def register(name: str, factory: Callable | None = None, *, overwrite: bool = False):
    """Register ``factory(**options) -> reward function`` under ``name``; works as a decorator too."""

    def add(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"register({name!r}): the factory must be callable, got {type(f).__name__}")
        if ":" in name:
            raise ValueError(f"register({name!r}): ':' is reserved for 'module:function' paths")
        if not overwrite and (name in _BUILTIN or name in _REGISTERED):
            raise ValueError(f"reward {name!r} is already registered; pass overwrite=True to replace it")
        _REGISTERED[name] = f
        return f

    return add if factory is None else add(factory)


def get_reward(name: str | Callable, **options) -> Callable:
    """The reward called ``name``, configured with ``options``.

    ``name`` is a registered name (see ``list_rewards()``), a ``"package.module:function"`` path to a
    TRL-style reward function (``options`` are bound as keyword arguments), a reward model (a local folder or
    ``owner/name`` hub id of an ``AutoModelForSequenceClassification`` checkpoint: ``rewards.reward_model``), or a
    callable (returned with ``options`` bound). Unknown names raise ValueError listing the valid ones.
    """
    if callable(name):
        return _bind(name, options, getattr(name, "__name__", "reward"))
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward is a registered name, 'module:function' or a callable; got {name!r}")
    if ":" in name:
        return _bind(_import(name), options, name.rsplit(":", 1)[1])
    if name in _REGISTERED:
        factory = _REGISTERED[name]
    elif name in _BUILTIN:
        factory = _import(_BUILTIN[name])
    else:
        if not is_reward_model_name(name):
            raise ValueError(f"unknown reward {name!r}; valid names: {', '.join(list_rewards())} "
                             f"(or 'package.module:function' for your own, or a reward model's folder or hub id)")
        factory = lambda **kw: TextRewardModel(name, **kw)  # noqa: E731
        _check_options(name, TextRewardModel.__init__, options)
    _check_options(name, factory, options)
    return factory(**options)


def _import(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward path {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward {path!r}: cannot import module {module_name!r}: {e}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {path!r} is a {type(fn).__name__}, not a function")
    return fn


def _check_options(name: str, factory: Callable, options: dict) -> None:
    """Unknown options are an error naming the valid ones, not a TypeError deep inside a factory."""
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"reward {name!r} has no option(s) {unknown}; its options are: "
                         f"{', '.join(params) or '(none)'}")


def _bind(fn: Callable, options: dict, name: str) -> Callable:
    if not options:
        return fn

    return RewardFunction(name, fn, **options)
