"""SFT batches: chat-formatted conversations with labels on the assistant tokens only.

A conversation is a list of chat messages in the HF multimodal format (content items
`{"type": "image"}` / `{"type": "text"}`) plus its images. `encode_sft_batch` renders it with the
model's own chat template, tokenizes it with the processor (which expands image placeholders into
image tokens) and sets labels to the input ids on assistant text, -100 everywhere else: system,
user, image and padding tokens never contribute to the loss.

Where the assistant text is: the conversation is rendered up to each assistant turn with the
generation prompt (`before`) and up to the end of that turn (`upto`); the turn is the characters
between the two, trailing whitespace excluded (so the end-of-turn token such as `<|im_end|>` is
learned but the newline the template adds after it is not). This needs only a template whose
renderings are prefixes of one another, which holds for Qwen, InternVL, GLM, LLaVA and Llama
templates and does not need `{% generation %}` markers (most released templates have none).
Character spans become token labels through the tokenizer's offset mapping, shifted past the
image placeholders the processor expanded.
"""

from __future__ import annotations

import bisect
import json
import re

import torch

from utils.core.data import IMAGE_MARKER, images_of
from utils.core.encoding import check_image_tokens, raise_for_sample
from utils.core.prompts import RESPONSE_TEMPLATES, build_messages
from utils.core.video import VIDEO_MARKER, check_video_tokens, load_clips, processor_video_kwargs, videos_of

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------------
# Rows -> conversations


def vqa_conversation(row, *, response_template="crystal_json", prompt_template=None, system_prompt=None):
    """(messages, images) for a CRYSTAL VQA row: the prompt as at RL/eval time, the target built from
    reference_steps + answer in `response_template` format (utils.core.prompts.RESPONSE_TEMPLATES)."""
    if response_template not in RESPONSE_TEMPLATES:
        raise ValueError(f"--response_template {response_template!r} is not one of {list(RESPONSE_TEMPLATES)}")
    images = images_of(row)
    messages = build_messages(row["question"], num_images=len(images), choices=row.get("choices"),
                              template=prompt_template or response_template, system_prompt=system_prompt,
                              num_videos=len(videos_of(row)))
    target = RESPONSE_TEMPLATES[response_template](row.get("reference_steps") or [], row["answer"])
    messages.append({"role": "assistant", "content": [{"type": "text", "text": target}]})
    return messages, images


def sharegpt_tools(row):
    """A sharegpt row's tool schemas (column 'tools', JSON text), None without."""
    return json.loads(row["tools"]) if row.get("tools") else None


def sharegpt_conversation(row, *, system_prompt=None):
    """(messages, images) for a sharegpt row (utils.core.data.load_sharegpt): each `<image>` (`<video>`) marker becomes
    an image (video) item in place; `system_prompt` is prepended when the row has no system turn. The row's
    videos are `utils.core.video.videos_of(row)`."""
    messages = []
    items = {IMAGE_MARKER: {"type": "image"}, VIDEO_MARKER: {"type": "video"}}
    for message in row["messages"]:
        pieces = re.split(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})", message["content"])
        content = [dict(items[piece]) if piece in items else {"type": "text", "text": piece}
                   for piece in pieces if piece]
        messages.append({"role": message["role"], "content": content})
        if message.get("tool_calls"):  # a tool-calling turn (utils.core.data.load_sharegpt)
            messages[-1]["tool_calls"] = json.loads(message["tool_calls"])
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    return messages, list(row.get("images") or [])


# --------------------------------------------------------------------------------------------------
# Conversations -> token labels


def assistant_char_spans(processor, messages, *, sample_id="?", tools=None):
    """(rendered text, [(start, end) character spans of assistant turns]) under the model's chat template, with
    `tools` (JSON schemas) shown as the template shows them; an assistant turn's tool calls are its text too."""

    if getattr(processor, "tokenizer", processor) is processor:  # text-only templates expect string content
        messages = [{**m, "content": _text_of(m["content"])} for m in messages]
    extra = {"tools": tools} if tools else {}

    def render(msgs, generation_prompt):
        return processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt, **extra)

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError(f"sample {sample_id!r}: the conversation starts with an assistant turn; "
                             "an assistant turn must answer a user turn")
        before, upto = render(messages[:i], True), render(messages[: i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError(f"sample {sample_id!r}: the chat template does not render conversations as prefixes of "
                             "each other (it rewrites earlier turns), so assistant tokens cannot be located")
        end = len(upto.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    if not spans:
        raise ValueError(f"sample {sample_id!r}: no assistant text to train on")
    return text, spans


def _text_of(content):
    if isinstance(content, str):
        return content
    return "".join(item.get("text", "") for item in content if item.get("type") == "text")


def _shift_past_expansions(span, replacements):
    """Map a character span of the rendered text into the text after image placeholders were expanded."""
    ends = [r["span"][1] for r in replacements]
    gained = [0] + [r["new_span"][1] - r["span"][1] for r in replacements]
    return tuple(c + gained[bisect.bisect_right(ends, c)] for c in span)


def encode_sft_batch(processor, conversations, images, *, sample_ids, max_length=None, videos=None,
                     video_budget=None, tools=None):
    """Tokenize a batch of (messages, images) for SFT (right padding); `videos` (per sample, its videos as
    `utils.core.video.videos_of` gives them) are sampled and sized under `video_budget` (utils.core.video);
    `tools` (per sample, its tool schemas or None) go to the chat template. A tool-use conversation trains on its
    assistant turns (tool calls included) only: tool results, like prompts and images, are masked.

    Returns the processor's model inputs (input_ids, attention_mask, pixel values ...) plus `labels`:
    input ids on assistant tokens, IGNORE_INDEX elsewhere. A row longer than `max_length` is cut at the
    end only if the cut falls inside its last assistant turn (images and prompts are never cut); anything
    else is an error naming the sample and the flag.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    tools = tools or [None] * len(conversations)
    rendered = [assistant_char_spans(processor, m, sample_id=sid, tools=t)
                for m, sid, t in zip(conversations, sample_ids, tools)]
    texts = [text for text, _ in rendered]
    kwargs = dict(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False,
                  return_offsets_mapping=True)
    has_images = any(len(imgs) for imgs in images)
    if has_images:
        if tokenizer is processor:
            raise ValueError(f"sample {sample_ids[0]!r} has images but the model has no image processor")
        kwargs.update(images=[list(imgs) for imgs in images], return_text_replacement_offsets=True)
    clips = load_clips(videos, video_budget) if videos and any(videos) else None
    if clips:
        kwargs.update(processor_video_kwargs([c for row in clips for c in row]), return_text_replacement_offsets=True)
    try:
        batch = processor(**kwargs)
    except (ValueError, IndexError, RuntimeError) as err:
        raise_for_sample(processor, sample_ids, texts, images, err, videos=clips)

    offsets = batch.pop("offset_mapping")
    replacements = batch.pop("text_replacement_offsets", None)
    if clips:
        check_video_tokens(processor, batch["input_ids"], batch.get("video_grid_thw"), clips, sample_ids)
    if (has_images or clips) and replacements is None:
        raise ValueError(f"the processor {type(processor).__name__} does not report where it expanded image "
                         "placeholders (return_text_replacement_offsets), so assistant tokens cannot be located")
    offsets = offsets.tolist() if torch.is_tensor(offsets) else offsets
    input_ids = batch["input_ids"]
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    first_assistant_of_last_turn = []
    for row, (_, spans) in enumerate(rendered):
        row_replacements = replacements[row] if replacements is not None else []
        token_spans = [_shift_past_expansions(s, row_replacements) for s in spans]
        keep = torch.zeros(input_ids.shape[1], dtype=torch.bool)
        first_of_last = None
        for index, (start, end) in enumerate(token_spans):
            for pos, (tok_start, tok_end) in enumerate(offsets[row]):
                # Every token overlapping the span; zero-width tokens (padding) never overlap.
                if tok_start < end and tok_end > start:
                    keep[pos] = True
                    if index == len(token_spans) - 1 and first_of_last is None:
                        first_of_last = pos
        keep &= batch["attention_mask"][row].bool()
        labels[row, keep] = input_ids[row, keep]
        first_assistant_of_last_turn.append(first_of_last)
    batch["labels"] = labels

    if max_length and input_ids.shape[1] > max_length:
        lengths = batch["attention_mask"].sum(-1).tolist()
        for sid, length, first in zip(sample_ids, lengths, first_assistant_of_last_turn):
            if length > max_length and (first is None or first >= max_length):
                raise ValueError(f"sample {sid!r}: its prompt (images included) is {first} tokens and the whole "
                                 f"conversation {length}, over --max_length {max_length}; raise the flag or lower "
                                 "--max_pixels")
        for key, value in list(batch.items()):
            # per-token tensors only (pixel tensors never are: they are cut by image, not by token)
            if torch.is_tensor(value) and value.shape[:2] == input_ids.shape and not key.startswith(("pixel", "image")):
                batch[key] = value[:, :max_length]
    if has_images:  # an image inside a cut assistant turn would leave its features without tokens
        check_image_tokens(processor, batch["input_ids"], images, sample_ids)
    return batch
