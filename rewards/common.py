"""Helpers shared by the reward functions: completion text, column access, images, process rank.

Every reward follows TRL's signature ``f(completions, **columns) -> list[float | None]``: ``completions``
holds strings or chat messages, and each dataset column arrives as a keyword list with one entry per
completion. Trainers also pass non-column keywords (TRL passes ``prompts``, ``completion_ids``,
``trainer_state``, ``log_extra``, ``log_metric``), so rewards take ``**columns`` and read only what they need.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any, Sequence

from utils.core.secrets import redact

GENEVAL_METADATA_KEYS = ("tag", "include", "exclude", "prompt")
# What a trainer passes besides the data set columns (TRL 1.16's GRPOTrainer passes all of these).
TRAINER_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def completion_text(completion: Any) -> str:
    """Text of one completion: a string, or chat messages ``[{"role": "assistant", "content": ...}]``.

    Message content may be a string or a list of parts (``{"type": "text", "text": ...}``); the text of
    all assistant messages is joined, so a single-message completion reads exactly as its content.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        texts = []
        for message in completion:
            if not isinstance(message, dict):
                raise TypeError(f"a chat completion must be a list of message dicts, got an item of type "
                                f"{type(message).__name__}")
            if message.get("role", "assistant") != "assistant":
                continue
            texts.append(content_text(message.get("content", "")))
        return "".join(texts)
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: keep the text ones
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type", "text") == "text")
    return str(content)


def completion_texts(completions: Sequence[Any]) -> list[str]:
    return [completion_text(c) for c in completions]


def require_column(columns: dict, name: str, n: int, reward: str) -> list:
    """The column ``name`` as a list of length ``n``; a clear error when it is absent or the wrong length."""
    if name not in columns or columns[name] is None:
        present = sorted(k for k in columns if k not in TRAINER_KEYWORDS)
        raise ValueError(f"reward {reward!r} needs the dataset column {name!r}; columns given: {present}")
    return check_length(columns[name], name, n, reward)


def optional_column(columns: dict, name: str, n: int, reward: str) -> list | None:
    if columns.get(name) is None:
        return None
    return check_length(columns[name], name, n, reward)


def check_length(values: Any, name: str, n: int, reward: str) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"reward {reward!r}: column {name!r} must be a list with one entry per completion, "
                         f"got {type(values).__name__}")
    values = list(values)
    if len(values) != n:
        raise ValueError(f"reward {reward!r}: column {name!r} has {len(values)} entries for {n} completions")
    return values


def image_bytes(image: Any, fmt: str = "JPEG", quality: int = 95) -> bytes:
    """Encode a PIL image or HWC uint8 array for the wire; encoded bytes pass through."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if type(image).__module__ == "numpy":  # an HWC uint8 array
        from PIL import Image

        image = Image.fromarray(image)
    if not hasattr(image, "save"):
        raise TypeError(f"expected a PIL image or encoded bytes, got {type(image).__name__}")
    if fmt == "JPEG" and image.mode != "RGB":
        image = image.convert("RGB")  # JPEG has no alpha / palette
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def process_rank() -> int:
    """This process's rank: accelerate's state if it was initialised, else $RANK, else 0."""
    state = sys.modules.get("accelerate.state")  # never imported -> never initialised; importing costs torch
    if state is not None and state.PartialState._shared_state != {}:
        return int(state.PartialState().process_index)  # reading only: constructing one first would init it
    return int(os.environ.get("RANK", "0"))


class RewardFunction:
    """A reward function bound to its options, under the name trainers log it by (TRL reads ``__name__``).

    ``fn(completions, **columns, **options)`` is a module-level function and the options are plain values,
    so the reward pickles: trainers that hand rewards to worker processes can use it.
    """

    def __init__(self, name: str, fn, **options):
        self.__name__ = name
        self.fn = fn
        self.options = options

    def __call__(self, completions, **columns):
        return self.fn(completions, **{**columns, **self.options})  # options win over same-named columns

    def __repr__(self) -> str:  # secrets redacted: a repr ends up in logs and error messages
        options = ", ".join(f"{k}={v!r}" for k, v in redact(self.options).items())
        return f"<reward {self.__name__}({options})>"


def metadata_rows(columns: dict, n: int, keys: Sequence[str] = GENEVAL_METADATA_KEYS,
                  reward: str = "geneval") -> list[dict]:
    """One GenEval metadata row per completion: a ``metadata`` column of dicts, else the schema's own columns
    (``tag``, ``include``, ``exclude``, ``prompt``; None entries are left out of the row)."""
    if columns.get("metadata") is not None:
        return [dict(m) for m in check_length(columns["metadata"], "metadata", n, reward)]
    present = [k for k in keys if columns.get(k) is not None]
    if not present or ("include" in keys and "include" not in present):
        raise ValueError(f"reward {reward!r} needs the GenEval metadata columns {list(keys)} (at least "
                         f"'include'), or a 'metadata' column of dicts; columns given: {sorted(columns)}")
    values = {k: check_length(columns[k], k, n, reward) for k in present}
    return [{k: values[k][i] for k in present if values[k][i] is not None} for i in range(n)]


def prompt_texts(columns: dict, n: int, reward: str, column: str = "prompt") -> list[str]:
    """The prompt text of each completion: the ``column`` column, else TRL's ``prompts`` (a string, or chat messages
    whose last user turn is read)."""
    values = optional_column(columns, column, n, reward)
    if values is None:
        values = optional_column(columns, "prompts", n, reward)
    if values is None:
        raise ValueError(f"reward {reward!r} needs the prompt text in column {column!r}; columns given: "
                         f"{sorted(columns)}")
    out = []
    for v in values:
        if isinstance(v, list):  # chat messages: the last user turn's text
            users = [m for m in v if isinstance(m, dict) and m.get("role") == "user"]
            v = content_text(users[-1].get("content")) if users else ""
        out.append(str(v))
    return out


def images_column(images, n: int, reward: str) -> list:
    """The ``images`` keyword as a list with one image (or None) per completion."""
    if images is None:
        raise ValueError(f"reward {reward!r} scores images: call it with images=[one PIL image per completion]")
    return check_length(images, "images", n, reward)
