"""R3's text rules for Mix-GRPO: the reason and reflect prompts, their format checks and stage rewards.

The reasoning is the whole output, `<think>..</think>`; a reflection is `<think>..</think>` then a non-empty edit
instruction, or "no further edit"; the image is drawn from (or edited by) what these functions read out of the text.
Shared by train_mixgrpo.py and the tiny planner that warm-starts its policy.
"""

import re

import torch

# R3's format rules: the reasoning is the whole output, `<think>..</think>`; a reflection is `<think>..</think>` then
# a non-empty edit instruction; neither holds another think tag
_NO_TAG = r"(?:(?!<think>|</think>).)"
REASON_FORMAT = re.compile(rf"<think>({_NO_TAG}*?)</think>", re.S)
REFLECT_FORMAT = re.compile(rf"<think>{_NO_TAG}*?</think>{_NO_TAG}+", re.S)
LEADING_THINK = re.compile(r"<think>(.*?)</think>", re.S)
NO_EDIT = "no further edit needed"
NO_EDIT_MATCH = "no further edit"  # what R3 looks for in the instruction
REFLECT_PROMPT = ("This image was drawn for: {prompt}\nThink inside <think> </think> about whether it shows exactly "
                  f"that. Then write one edit instruction that fixes it, or write \"{NO_EDIT}\".")
REASON_PROMPT = ("Think about how to draw the image below inside <think> </think>: which objects, how many, "
                 "their colours and where they go. Then stop.\nImage: {prompt}")


def user_message(text, with_image=False):
    content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def reasoning_of(text):
    """(format 0/1, what the image is drawn from). Format 1 when the whole output is `<think>..</think>` (R3);
    the image reads the leading think block's reasoning, or the whole text when there is none."""
    text = text.strip()
    fmt = 1.0 if REASON_FORMAT.fullmatch(text) else 0.0
    match = LEADING_THINK.match(text)
    return fmt, (match.group(1).strip() if match else text)


def reason_rewards(scores, formats, format_weight):
    """Reason stage: text reward = score * fmt + w_fmt * fmt, image reward = score."""
    scores, formats = torch.as_tensor(scores, dtype=torch.float32), torch.as_tensor(formats, dtype=torch.float32)
    return scores * formats + format_weight * formats, scores.clone()


def reflection_of(text):
    """(format 0/1, the edit instruction, whether the image is kept). Format 1 for `<think>..</think>` then a
    non-empty instruction (R3). The instruction is the text after the last </think>; without one (no </think>, or
    nothing after it) or when it says "no further edit", there is no edit and the image is kept, as in R3."""
    text = text.strip()
    fmt = 1.0 if REFLECT_FORMAT.fullmatch(text) else 0.0
    _, closed, tail = text.rpartition("</think>")
    instruction = tail.strip()
    if not (closed and instruction):
        return fmt, NO_EDIT, True
    return fmt, instruction, NO_EDIT_MATCH in instruction.lower()


def reflect_rewards(scores_new, scores_prev, formats, no_edit, format_weight):
    """Reflect stage: improvement = score_new - score_prev, or 1 when score_prev = 1 and the edit says no further
    edit is needed; text reward = w_fmt * fmt + improvement * fmt; image reward = score_new."""
    new, prev = torch.as_tensor(scores_new, dtype=torch.float32), torch.as_tensor(scores_prev, dtype=torch.float32)
    fmt, keep = torch.as_tensor(formats, dtype=torch.float32), torch.as_tensor(no_edit, dtype=torch.bool)
    improvement = torch.where(keep & (prev >= 1.0), torch.ones_like(new), new - prev)
    return format_weight * fmt + improvement * fmt, new.clone()
