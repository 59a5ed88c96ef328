"""Text rewards for think-then-answer training (OpenVLThinker / R1 style) and DAPO's over-long shaping."""

from __future__ import annotations

import re
import threading
from decimal import Decimal
from functools import lru_cache
from typing import Any

from rewards.common import RewardFunction, completion_texts, optional_column, require_column

# One <think> block, then one <answer> block, nothing else but whitespace; neither block may contain a
# tag of either kind, so repeated "</answer>" tails or nested blocks fail.
_NO_TAG = r"(?:(?!</?think>|</?answer>).)*"
THINK_ANSWER_RE = re.compile(rf"^\s*<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>\s*$", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _think_format(completions, **columns) -> list[float]:
    return [1.0 if THINK_ANSWER_RE.match(t) else 0.0 for t in completion_texts(completions)]


def think_format_reward():
    """1.0 for exactly ``<think>...</think>`` followed by ``<answer>...</answer>``, else 0.0."""
    return RewardFunction("think_format", _think_format)


def extract_answer(text: str) -> str | None:
    """Content of the last ``<answer>`` block (models that restart keep their final word), or None."""
    matches = ANSWER_RE.findall(text)
    return matches[-1].strip() if matches else None


# --- math_accuracy ----------------------------------------------------------------------------------------

_MATHY = re.compile(r"[0-9\\^_+\-*/=()\[\]{}<>%.]")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")
_OPTION = re.compile(r"^\(?([A-Za-z])(?:[).:]|\s*$)")


def _normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"^\\boxed\{(.*)\}$", r"\1", text)
    return re.sub(r"\s+", " ", text).rstrip(".").strip().casefold()


@lru_cache(maxsize=8192)
def _parse(text: str, timeout: int | None):
    """math-verify parse of a final answer; wrapped in $..$ so bare LaTeX ("x+1", "\\sqrt{2}") parses.

    Cached: the G completions of one prompt share its gold answer, and short answers repeat.
    """
    from math_verify import parse

    return tuple(parse(f"${text}$", parsing_timeout=timeout))


@lru_cache(maxsize=65536)
def _math_equal(gold: str, pred: str, timeout: int | None) -> bool:
    """math-verify equivalence; cached because the completions of a group often repeat an answer and
    verify's sympy simplification costs ~20 ms per pair."""
    # Plain words and option letters go by string equality: as symbols, "red" and "der" would be equal products.
    if not (_MATHY.search(gold) and _MATHY.search(pred)):
        return False
    if _PLAIN_NUMBER.match(gold) and _PLAIN_NUMBER.match(pred):  # the common case, without sympy (~10 ms)
        return Decimal(gold.replace(",", "")) == Decimal(pred.replace(",", ""))
    from math_verify import verify

    gold_parsed, pred_parsed = _parse(gold, timeout), _parse(pred, timeout)
    if not gold_parsed or not pred_parsed:
        return False
    # Skip verify's sympy simplify (~30 ms) on clear numeric misses; percentages keep verify's own rules.
    if "%" not in gold + pred and _numbers_differ(gold_parsed[0], pred_parsed[0]):
        return False
    return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=timeout))


def _numbers_differ(gold, pred) -> bool:
    """True only when both are constant numbers whose values differ by more than 1e-6 (relative)."""
    try:
        if not (getattr(gold, "is_number", False) and getattr(pred, "is_number", False)):
            return False
        g, p = complex(gold.evalf()), complex(pred.evalf())
    except (TypeError, ValueError, AttributeError):
        return False
    return abs(g - p) > 1e-6 * max(1.0, abs(g))


def answers_match(gold: str, pred: str, timeout: int | None = 5) -> bool:
    """OpenVLThinker-style check: normalised string equality, option letters, then math-verify equivalence."""
    g, p = _normalise(gold), _normalise(pred)
    if not g or not p:
        return False
    if g == p:
        return True
    g_opt, p_opt = _OPTION.match(gold.strip()), _OPTION.match(pred.strip())
    if g_opt and p_opt and len(g) == 1:  # gold "B" vs prediction "B) blue" / "(B)"
        return g_opt.group(1).casefold() == p_opt.group(1).casefold()
    return _math_equal(gold.strip(), pred.strip(), timeout)


def _math_accuracy(completions, *, timeout_seconds, **columns) -> list[float | None]:
    golds = require_column(columns, "answer", len(completions), "math_accuracy")
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for text, gold in zip(completion_texts(completions), golds):
        if gold is None:
            out.append(None)
            continue
        gold = str(gold)
        gold = extract_answer(gold) or gold
        pred = extract_answer(text)
        out.append(1.0 if pred is not None and answers_match(gold, pred, timeout) else 0.0)
    return out


def math_accuracy_reward(timeout_seconds: int | None = 5):
    """1.0 when the ``<answer>`` content equals the ``answer`` column under math-verify, else 0.0.

    No ``<answer>`` block scores 0.0; a row whose answer is None gets None. A gold answer written as
    ``<answer>x</answer>`` is unwrapped first. math-verify's timeout uses SIGALRM, which exists only in the
    main thread, so in other threads the timeout is off (the answers are short).
    """
    return RewardFunction("math_accuracy", _math_accuracy, timeout_seconds=timeout_seconds)


# --- overlong_penalty -------------------------------------------------------------------------------------


def soft_overlong_penalty(length: int, max_length: int, buffer_length: int) -> float:
    """DAPO's soft over-long punishment (its Eq. 13): 0 up to max - buffer, linear down to -1 at max, -1 beyond."""
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length >= max_length:
        return -1.0
    return (start - length) / buffer_length


def overlong_penalty_reward(max_completion_length: int | None = None, buffer_length: int | None = None,
                            unit: str = "tokens", tokenizer: Any = None):
    """DAPO's soft over-long punishment: 0 up to ``max_completion_length - buffer_length`` tokens, linear down
    to -1 at ``max_completion_length``, -1 beyond (TRL: ``get_soft_overlong_punishment``).

    train_grpo.py fills ``max_completion_length`` from its own flag when it is not given; ``buffer_length``
    (DAPO's L_cache: 4096 of 20480) defaults to a quarter of it. ``unit="tokens"`` counts the
    ``completion_ids`` the trainer passes (TRL does), else tokens from ``tokenizer`` (an object or a
    name/path for AutoTokenizer); ``unit="chars"`` counts characters.
    """
    if max_completion_length is None:
        raise ValueError("overlong_penalty needs max_completion_length (train_grpo.py passes its own "
                         "--max_completion_length)")
    if unit not in ("tokens", "chars"):
        raise ValueError(f"overlong_penalty: unit must be 'tokens' or 'chars', got {unit!r}")
    max_completion_length = int(max_completion_length)
    buffer_length = max(1, max_completion_length // 4) if buffer_length is None else int(buffer_length)
    if not 0 < buffer_length <= max_completion_length:
        raise ValueError(f"overlong_penalty: need 0 < buffer_length <= max_completion_length, got buffer_length="
                         f"{buffer_length}, max_completion_length={max_completion_length}")
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return RewardFunction("overlong_penalty", _overlong_penalty, max_completion_length=max_completion_length,
                          buffer_length=buffer_length, unit=unit, tokenizer=tokenizer)


def _lengths(completions, unit, tokenizer, columns) -> list[int]:
    if unit == "chars":
        return [len(t) for t in completion_texts(completions)]
    ids = optional_column(columns, "completion_ids", len(completions), "overlong_penalty")
    if ids is not None:
        return [len(x) for x in ids]
    if tokenizer is None:
        raise ValueError("overlong_penalty with unit='tokens' needs the trainer to pass completion_ids, or "
                         "tokenizer=<tokenizer or name>; or use unit='chars'")
    return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in completion_texts(completions)]


def _overlong_penalty(completions, *, max_completion_length, buffer_length, unit, tokenizer, **columns) -> list[float]:
    return [soft_overlong_penalty(n, max_completion_length, buffer_length)
            for n in _lengths(completions, unit, tokenizer, columns)]
