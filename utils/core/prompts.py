"""Prompt templates shared by train_grpo.py, train_sft.py and evaluate.py.

A template turns one dataset row (question, choices, images) into chat messages in the
standard HF multimodal format: content items `{"type": "image"}` and `{"type": "text"}`.
"""

from utils.core.data import render_question

# CRYSTAL asks for reasoning steps and the answer as one JSON object; crystal-metrics parses it.
CRYSTAL_JSON_SYSTEM = (
    "Look at the image and answer the question. "
    'Reply with JSON: {"reasoning_steps": ["step", ...], "answer": "..."}'
)

# OpenVLThinker / R1-style: reasoning in <think>, final answer in <answer>.
THINK_ANSWER_SYSTEM = (
    "Look at the image and answer the question. "
    "Think first inside <think> </think>, then give the final answer inside <answer> </answer>."
)

# distill.py (OpenVLThinker's distillation): what the captioner is asked, and the text reasoner's user turn.
CAPTION_PROMPT = "Describe the image in detail."
REASONER_PROMPT = (
    "Image description: {caption}\n"
    "Question: {question}\n"
    "Think inside <think> </think>, then give the final answer inside <answer> </answer>."
)

SYSTEM_PROMPTS = {"crystal_json": CRYSTAL_JSON_SYSTEM, "think_answer": THINK_ANSWER_SYSTEM, "plain": None}
PROMPT_TEMPLATES = tuple(SYSTEM_PROMPTS)


def build_messages(question, *, num_images=1, choices=None, template="crystal_json", system_prompt=None,
                   num_videos=0):
    """Chat messages for one sample: optional system turn, then videos and images followed by the question.

    `system_prompt` overrides the template's own; `plain` has none (question and images only).
    """
    if template not in SYSTEM_PROMPTS:
        raise ValueError(f"--prompt_template {template!r} is not one of {list(SYSTEM_PROMPTS)}")
    system = system_prompt if system_prompt is not None else SYSTEM_PROMPTS[template]
    content = [{"type": "video"} for _ in range(num_videos)] + [{"type": "image"} for _ in range(num_images)]
    content.append({"type": "text", "text": render_question(question, choices)})
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    messages.append({"role": "user", "content": content})
    return messages


def crystal_json_target(reference_steps, answer):
    """The assistant text a CRYSTAL-format SFT target trains on (the same schema the reward parses)."""
    import json

    return json.dumps({"reasoning_steps": list(reference_steps), "answer": str(answer)})


def think_answer_target(reference_steps, answer):
    """The assistant text for the `<think>..</think><answer>..</answer>` format."""
    steps = " ".join(s.strip() for s in reference_steps)
    return f"<think>{steps}</think><answer>{answer}</answer>"


RESPONSE_TEMPLATES = {"crystal_json": crystal_json_target, "think_answer": think_answer_target}
