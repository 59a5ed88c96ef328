"""Prompts as chat conversations: TRL's data formats for GRPO and evaluation (docs/data.md).

A data set gives its prompts in one of three ways, chosen by its columns:

- **conversational** (TRL's VLM GRPO format): a `prompt` column (`--prompt_column`) of chat messages, each
  `{"role": ..., "content": ...}` with content a string or a list of parts `{"type": "text", "text": ...}`,
  `{"type": "image"}`, `{"type": "video"}` in any order and in any turn; the media in an `images` column (else
  `image`, one per row) and a `videos` column, in the order their placeholders appear. As in TRL, a row whose user
  turns are plain strings gets its images placed before the text of its first user turn.
- **plain text**: a `prompt` column of strings, fed to the model as they are (no chat template), as TRL feeds a
  standard-format prompt; no media.
- **columns** (the VQA path): `question` / `image` / `choices` ... through a prompt template
  (`utils.core.prompts.build_messages`), which builds the same kind of conversation.

Every other column stays and reaches the reward functions by name, as TRL passes them (the prompt column itself
is the rewards' `prompts`). Every row is checked before any compute, and a bad one is an error naming the file,
the row and the column: a prompt that is not a list of messages, an unknown role or content type, roles out of
order (a system turn only first; the first other turn a user's; a tool message only after an assistant turn or
another tool message), an assistant turn at the end (a prompt ends before the answer), and media counts that
differ from the placeholders.
"""

from __future__ import annotations

import datasets

from utils.core.config import ConfigError
from utils.core.data import images_of, load_vqa, render_question
from utils.core.data_checks import VIDEOS_FEATURE, image_cells, replace_columns, require_columns, video_column_cells
from utils.core.data_sources import Source, open_source
from utils.core.prompts import build_messages

ROLES = ("system", "user", "assistant", "tool")
CONTENT_TYPES = ("text", "image", "video")
# message keys kept besides role and content (an assistant's tool calls, a tool message's name and call id)
EXTRA_KEYS = ("tool_calls", "name", "tool_call_id")


def prompt_kind(column_names, prompt_column) -> str:
    """'conversation' or 'text' when `prompt_column` is one of the columns (the values decide which; this returns
    'prompt' before the values are read), else 'columns'."""
    return "prompt" if prompt_column and prompt_column in column_names else "columns"


def _strip_none(value):
    """Arrow gives every struct all keys seen in the column: drop the ones that are None, at any depth."""
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def canonical_messages(value, n_images: int = 0, fail=None) -> list[dict]:
    """A prompt's messages with every content a list of parts ({"type": "text", "text"}, {"type": "image"},
    {"type": "video"}), as TRL's `prepare_multimodal_messages` makes them: while no user turn has taken the images,
    a user turn whose content is a string gets `n_images` image parts before its text. Keys Arrow filled with None
    are dropped. `fail(message)` raises for a malformed prompt (default: ValueError)."""

    def default_fail(message):
        raise ValueError(message)

    fail = fail or default_fail
    if not isinstance(value, (list, tuple)) or not value:
        fail(f"expected a non-empty list of chat messages, got {value!r:.200}")
    messages, images_placed = [], False
    for turn, message in enumerate(value):
        if not isinstance(message, dict):
            fail(f"message {turn} is not a dict with 'role' and 'content': {message!r:.200}")
        message = _strip_none(dict(message))
        role = message.get("role")
        if role not in ROLES:
            fail(f"message {turn} has role {role!r}; expected one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None:
            if role != "assistant" or not message.get("tool_calls"):
                fail(f"message {turn} ({role}) has no content")
            content = []
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not images_placed:
                parts = [{"type": "image"} for _ in range(n_images)] + parts
                images_placed = True
        elif isinstance(content, (list, tuple)):
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in CONTENT_TYPES:
                    fail(f"message {turn}, part {k} has type {kind!r}; expected one of {', '.join(CONTENT_TYPES)}")
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        fail(f"message {turn}, part {k}: a text part needs a 'text' string, got {part!r:.200}")
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    if part.get(kind) is not None:
                        fail(f"message {turn}, part {k}: an {kind} given inside the message; put the media in the "
                             f"'{kind}s' column, in the order of their placeholders")
                    parts.append({"type": kind})
        else:
            fail(f"message {turn} content must be a string or a list of parts, got {content!r:.200}")
        out = {"role": role, "content": parts}
        out.update({k: message[k] for k in EXTRA_KEYS if k in message})
        messages.append(out)
    return messages


def check_roles(messages, fail) -> None:
    """Roles in order: a system turn only first, then a user turn first; a tool message only after an assistant
    turn or another tool message; no assistant turn at the end (a prompt stops where the answer starts)."""
    for turn, message in enumerate(messages):
        role = message["role"]
        previous = messages[turn - 1]["role"] if turn else None
        if role == "system" and turn:
            fail(f"message {turn} is a system turn; only the first message may be one")
        if role in ("assistant", "tool") and previous in (None, "system"):
            fail(f"message {turn} ({role}) comes before any user turn")
        if role == "tool" and previous not in ("assistant", "tool"):
            fail(f"message {turn} is a tool message after a {previous} turn; tool results follow the assistant "
                 "turn that called the tool")
    last = messages[-1]["role"]
    if last == "assistant":
        fail(f"the last message (message {len(messages) - 1}) is an assistant turn: a prompt ends before the "
             "answer; drop it (or keep the answer in another column for the rewards)")
    if last == "system":
        fail("the prompt has only a system turn; it needs a user turn")


def count_parts(messages, kind: str) -> int:
    return sum(part["type"] == kind for m in messages for part in m["content"])


def _images_column(columns, image_column):
    """TRL's choice: 'images' (a list per row), else the single-image column."""
    if "images" in columns:
        return "images", True
    if image_column and image_column in columns:
        return image_column, False
    return None, True


def load_prompt_set(name_or_path, *, split="train", prompt_column="prompt", image_column="image",
                    video_column="video", check_images=True, **vqa_columns) -> datasets.Dataset:
    """The rows of a GRPO / evaluation data set: with a `prompt_column`, TRL's conversational or plain-text
    prompts (checked here, module doc); without one, `utils.core.data.load_vqa` with `image_column`,
    `video_column` and `vqa_columns` (question_column=..., answer_column=..., steps_column=..., ...)."""
    table, source = open_source(name_or_path, split)
    if prompt_kind(table.column_names, prompt_column) == "columns":
        return load_vqa(name_or_path, split=split, image_column=image_column, video_column=video_column,
                        check_images=check_images, **vqa_columns)
    return _load_prompts(table, source, prompt_column, image_column, video_column, check_images)


def _load_prompts(table, source: Source, prompt_column, image_column, video_column, check_images):
    require_columns(table, source, {prompt_column: "--prompt_column"})
    columns = table.column_names
    images_column, many = _images_column(columns, image_column)
    if images_column is not None:
        cells, counts = image_cells(table, source, images_column, check_images, many=many)
    else:
        cells, counts = None, [0] * len(table)
    videos_column = "videos" if "videos" in columns else video_column
    videos = video_column_cells(table, source, videos_column, "videos" if videos_column == "videos" else "video",
                                check_images, "--video_column")
    kinds = set()
    for row, value in enumerate(table[prompt_column]):
        def fail(message, row=row):
            source.fail(row, prompt_column, message)

        n_videos = len(videos[row]) if videos is not None else 0
        if isinstance(value, str):
            kinds.add("text")
            if not value.strip():
                fail("empty prompt")
            if counts[row] or n_videos:
                source.fail(row, images_column if counts[row] else videos_column,
                            "a plain-text prompt cannot carry images or videos (TRL's rule): give the prompt as "
                            "chat messages with image/video parts")
            continue
        kinds.add("conversation")
        messages = canonical_messages(value, counts[row], fail)
        check_roles(messages, fail)
        for kind, have, column in (("image", counts[row], images_column), ("video", n_videos, videos_column)):
            placeholders = count_parts(messages, kind)
            if placeholders != have:
                where = f"column '{column}'" if column else f"no '{kind}s' column"
                fail(f"{placeholders} {kind} placeholder(s) but {have} {kind}(s) ({where})")
    if len(kinds) > 1:
        source.fail(0, prompt_column, "mixes plain-text prompts and chat messages; use one form")
    new, features, drop = {}, {}, []
    if cells is not None:  # paths became absolute (or a single image a one-image list): rewrite the column
        new[images_column] = cells
        features[images_column] = datasets.List(datasets.Image()) if many else datasets.Image()
        drop.append(images_column)
    if videos is not None:
        new["videos"], features["videos"] = videos, VIDEOS_FEATURE
        drop.append(videos_column)
    if new:
        table = replace_columns(table, new, features, drop)
    return table


def prompt_messages(row, *, prompt_column="prompt", prompt_template="crystal_json", system_prompt=None):
    """The prompt of one row, as the model sees it before the chat template: chat messages (parts as in
    `canonical_messages`), or a string for a plain-text prompt. A conversational row gets `system_prompt` as its
    first turn when it has no system turn; a column row is built by `prompt_template` (`build_messages`)."""
    if not (prompt_column and prompt_column in row):
        return build_messages(row["question"], num_images=len(images_of(row)), choices=row.get("choices"),
                              template=prompt_template, system_prompt=system_prompt,
                              num_videos=len(row.get("videos") or []))
    value = row[prompt_column]
    if isinstance(value, str):
        return value
    messages = canonical_messages(value, len(prompt_images(row, prompt_column)))
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    return messages


def prompt_images(row, prompt_column="prompt"):
    """A row's images in placeholder order: TRL's `images` (else `image`) for a prompt row, `image` otherwise."""
    if prompt_column and prompt_column in row and row.get("images") is not None:
        return list(row["images"])
    return images_of(row)


def prompt_question(row, *, prompt_column="prompt"):
    """The question text a grader compares answers against: the question with its rendered choices, or the text
    of the last user turn of a conversational prompt (a plain-text prompt as it is)."""
    if not (prompt_column and prompt_column in row):
        return render_question(row["question"], row.get("choices"))
    messages = prompt_messages(row, prompt_column=prompt_column)
    if isinstance(messages, str):
        return messages
    users = [m for m in messages if m["role"] == "user"]
    return "".join(p["text"] for p in users[-1]["content"] if p["type"] == "text") if users else ""


def reward_columns(column_names, prompt_column="prompt"):
    """The columns that reach the reward functions by name: all but the prompt (TRL passes it as `prompts`)."""
    return [c for c in column_names if c != prompt_column]


def set_chat_template(processor, path):
    """Replace the processor's (and its tokenizer's) chat template with the one at `path` (TRL's
    `chat_template_path`): a .jinja file, or a folder whose chat_template.jinja / tokenizer_config.json holds one.
    Checkpoints then save it with the model. None leaves the model's own."""
    import json
    import os

    if not path:
        return processor
    template = None
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            template = f.read()
    elif os.path.isdir(path):
        jinja, config = os.path.join(path, "chat_template.jinja"), os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        elif os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"--chat_template_path {path}: no chat template there (a .jinja file, or a folder with "
                          "chat_template.jinja or a tokenizer_config.json that has one)")
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.chat_template = template
    if tokenizer is not processor:
        processor.chat_template = template
    return processor
