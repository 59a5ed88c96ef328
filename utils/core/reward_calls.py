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

A value that is not finite (inf, -inf, NaN) counts as None, unscorable: an advantage of inf would make every
advantage of its group NaN and the step's loss with them.

`check_reward_call` reads a reward's signature against those keywords and the data set's columns, so a
reward that needs a column the data lacks, or cannot take TRL's keywords, fails before any model loads.

Mix-GRPO calls its one image reward as `reward(texts, images=..., **columns)` (`build_image_reward`,
`score_images`): an image it gives no score is NaN, never 0.
"""

from __future__ import annotations

import inspect
import math
import sys

import torch

from rewards import get_reward
from rewards.common import TRAINER_KEYWORDS, process_rank
from rewards.geneval import server_endpoints
from utils.core.config import ConfigError


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


def reward_values(values, n, name, what="completions") -> tuple[torch.Tensor, int]:
    """A reward's return for `n` `what` as float32 [n]: NaN where it returned None or a non-finite number (unscorable:
    left out of its group and counted, never trained on). Returns (values, how many were +-inf or NaN). Refused,
    naming the reward: anything but one number or None per item."""
    values = list(values) if values is not None and not isinstance(values, (str, bytes)) else None
    if values is None or len(values) != n:
        got = "None" if values is None else f"{len(values)} rewards"
        raise ValueError(f"reward {name!r} returned {got} for {n} {what}; it must return one float or None per "
                         f"{what.rstrip('s')}")
    out, bad = torch.full((n,), float("nan")), 0
    for k, value in enumerate(values):
        if value is None:
            continue
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"reward {name!r} returned {value!r} for {what.rstrip('s')} {k}; expected a number or "
                             "None") from None
        if math.isfinite(value):
            out[k] = value
        else:
            bad += 1
    if bad and name not in _WARNED:
        _WARNED.add(name)
        print(f"reward {name!r} returned {bad} non-finite value(s) (inf or NaN): treated as unscorable, left out of "
              "their groups and counted (this notice once per reward)", file=sys.stderr, flush=True)
    return out, bad


_WARNED: set = set()


def call_rewards(reward_fns, names, *, prompts, completions, completion_ids, columns, trainer_state=None,
                 log=None):
    """Rewards [completions, reward functions] (float32), NaN where a function returned None, inf or NaN (each
    function's count of +-inf goes to the step's metrics as `rewards/<name>/non_finite` when there is one)."""
    n = len(completions)
    log = log if log is not None else RewardLog()
    rewards = torch.full((n, len(reward_fns)), float("nan"))
    for j, (fn, name) in enumerate(zip(reward_fns, names)):
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                    trainer_state=trainer_state, log_extra=log.log_extra, log_metric=log.log_metric)
        rewards[:, j], bad = reward_values(values, n, name)
        if bad:
            log.log_metric(f"rewards/{name}/non_finite", bad)
    return rewards


# ---- Mix-GRPO's image reward: one reward, called on (texts, images) with the rows' columns ----


def build_image_reward(cfg):
    """Mix-GRPO's image reward: --reward_fn with --reward_kwargs; server rewards get the endpoint lists (rank r:
    endpoint r mod n)."""
    options = dict(cfg.reward_kwargs)
    if cfg.reward_fn == "geneval":
        options.setdefault("reward_server_urls", cfg.reward_server_urls)
        options.setdefault("reward_server_port", cfg.reward_server_port)
    elif cfg.reward_fn in ("judge_geneval_plus", "judge_tiif"):
        # An OpenAI-compatible judge serves /v1 (unlike the GenEval server, which serves "/").
        endpoint = server_endpoints(cfg.reward_server_urls, cfg.reward_server_port)
        endpoint = endpoint[process_rank() % len(endpoint)].rstrip("/")
        options.setdefault("base_url", endpoint if endpoint.endswith("/v1") else endpoint + "/v1")
    if cfg.allow_insecure_api_key:  # a judge's (train_mixgrpo.py refuses it for any other reward)
        options.setdefault("allow_insecure_api_key", True)
    try:
        return get_reward(cfg.reward_fn, **options)
    except ValueError as error:  # a bad option, or an API key that would travel in clear: before any model loads
        raise ConfigError(f"--reward_fn {cfg.reward_fn}: {error}") from None


def score_images(cfg, reward_fn, texts, images, rows):
    """The image reward per image, every metadata column of the rows passed through: held to GRPO's rules
    (`reward_values`). An image the reward gives no score (None: e.g. a judge reply with no verdict; or inf / NaN)
    is NaN: left out of its group's mean and advantage (0) and counted (`unscored`), never scored 0; a reward that
    fails, or returns another number of scores than images, raises naming it."""
    columns = {key: [r.get(key) for r in rows] for key in sorted({k for r in rows for k in r})}
    return reward_values(reward_fn(texts, images=images, **columns), len(images), cfg.reward_fn, "images")[0]
