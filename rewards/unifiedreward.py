"""``unifiedreward``: pointwise image scoring by a UnifiedReward-style judge behind an OpenAI-compatible endpoint.

The judge (e.g. ``vllm serve CodeGoat24/UnifiedReward-7b-v1.5``) sees the image and the prompt, rates the image's
alignment with the caption and its quality, and ends with "Final Score: s" for s in [1, 5]; the reward is s / 5, as
Flow-GRPO trains on it. A reply with no final score gets None (no score, never a 0). Requests go through
``rewards.judge.JudgeClient`` (bounded concurrency, timeouts, retries).
"""

from __future__ import annotations

import re

from rewards.common import RewardFunction, images_column, prompt_texts
from rewards.judge import DEFAULT_JUDGE_URL, JudgeClient

UNIFIEDREWARD_MODEL = "CodeGoat24/UnifiedReward-7b-v1.5"
# UnifiedReward's pointwise image-generation prompt (the wording its judge was trained on)
UNIFIEDREWARD_PROMPT = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from 1 "
    "to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")
_FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")


def final_score(reply: str, max_score: float = 5.0) -> float | None:
    """The reply's last "Final Score: s" (s in [1, 5]) divided by ``max_score``; None when there is none."""
    found = _FINAL_SCORE.findall(reply or "")
    return float(found[-1]) / max_score if found else None


def unifiedreward_reward(base_url: str = DEFAULT_JUDGE_URL, model: str = UNIFIEDREWARD_MODEL,
                         api_key: str | None = None, timeout: float = 60.0, max_retries: int = 3,
                         max_concurrency: int = 8, max_tokens: int = 512, backoff: float = 0.5,
                         prompt_template: str = UNIFIEDREWARD_PROMPT, image_size: int | None = 512,
                         prompt_column: str = "prompt", deadline: float | None = None,
                         allow_insecure_api_key: bool = False):
    """``fn(completions, images=[PIL, ...], prompt=[...]) -> [s / 5 or None]``; images are resized to
    ``image_size`` squared before they are sent (Flow-GRPO: 512; none: as drawn). The request options as the
    judges' (`rewards.judge.JudgeClient`)."""
    client = JudgeClient(base_url, model, api_key=api_key, timeout=timeout, max_retries=max_retries,
                         max_concurrency=max_concurrency, max_tokens=max_tokens, backoff=backoff, deadline=deadline,
                         allow_insecure_api_key=allow_insecure_api_key)
    return RewardFunction("unifiedreward", _unifiedreward, client=client, prompt_template=prompt_template,
                          image_size=image_size, prompt_column=prompt_column)


def _unifiedreward(completions, images=None, *, client, prompt_template, image_size, prompt_column, **columns):
    n = len(completions)
    images = images_column(images, n, "unifiedreward")
    prompts = prompt_texts(columns, n, "unifiedreward", prompt_column)
    keep = [i for i in range(n) if images[i] is not None]
    sized = [images[i].resize((image_size, image_size)) if image_size else images[i] for i in keep]
    replies = client.chat_many([(prompt_template.format(prompt=prompts[i]), image) for i, image in zip(keep, sized)])
    out: list[float | None] = [None] * n
    for i, reply in zip(keep, replies):
        out[i] = final_score(reply)
    return out
