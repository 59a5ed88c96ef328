"""Rewards for tool use (`--tools`, docs/tools.md). A tool trajectory's completion is TRL's list of messages: the
assistant turns (with `tool_calls`) and the tool messages between them; the trainer also passes `tool_calls`, the
number of calls each trajectory made.

- `tool_format`: 1.0 when every tool call of the trajectory was read and ran (no tool message is an error:
  unreadable call, unknown tool, bad arguments, an exception, a timeout), 0.0 when one failed; None for a
  trajectory without calls (the format does not apply).
- `tool_budget`: 0.0 within `max_calls` calls, minus `penalty` for each call past it.
"""

from __future__ import annotations

import json

from rewards.common import RewardFunction, check_length


def _failed(message) -> bool:
    """A tool message that reports an error ({"error": ...}, the trainer's and TRL's form)."""
    content = message.get("content")
    parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content or []
                                                          if isinstance(p, dict) and p.get("type") == "text"]
    for text in parts:
        try:
            value = json.loads(text)
        except (TypeError, ValueError):
            continue
        if isinstance(value, dict) and "error" in value:
            return True
    return False


def _tool_format(completions, **columns) -> list[float | None]:
    out = []
    for completion in completions:
        messages = completion if isinstance(completion, list) else []
        tools = [m for m in messages if isinstance(m, dict) and m.get("role") == "tool"]
        out.append(None if not tools else 0.0 if any(_failed(m) for m in tools) else 1.0)
    return out


def tool_format_reward():
    return RewardFunction("tool_format", _tool_format)


def _tool_budget(completions, *, tool_calls, max_calls, penalty, **columns) -> list[float]:
    calls = check_length(tool_calls, "tool_calls", len(completions), "tool_budget")
    return [-penalty * max(0, int(n) - max_calls) for n in calls]


def tool_budget_reward(max_calls: int = 1, penalty: float = 0.5):
    """0.0 for at most `max_calls` tool calls, minus `penalty` per call past them."""
    if max_calls < 0 or not penalty >= 0:
        raise ValueError(f"tool_budget: max_calls {max_calls} must be >= 0 and penalty {penalty} >= 0")
    return RewardFunction("tool_budget", _tool_budget, max_calls=max_calls, penalty=penalty)
