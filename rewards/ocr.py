"""``ocr``: Flow-GRPO's OCR reward, 1 - normalised edit distance between the text read in the image and the text
quoted in the prompt.

    target     the prompt's first double-quoted span ('a sign that says "Open Late"' -> "Open Late")
    read       every text line the OCR finds (confidence > 0), joined
    both lower-cased with spaces removed; d = 0 when the target occurs in what was read, else the Levenshtein
    distance, capped at len(target); reward = 1 - d / len(target), in [0, 1]

The OCR is RapidOCR (PaddleOCR's PP-OCR detection and recognition models in ONNX, run by onnxruntime): its wheel
ships its models, so it runs offline; Flow-GRPO reads with PaddleOCR itself. A prompt with no quoted text gets None
(the reward does not apply to it); an OCR failure raises (never a silent 0).
"""

from __future__ import annotations

from rewards.common import RewardFunction, images_column, prompt_texts
from rewards.models import load_once, require, rgb


def quoted_text(prompt: str) -> str | None:
    """The prompt's first double-quoted span, as Flow-GRPO's ``prompt.split('"')[1]``; None without one."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 and parts[1].strip() else None


def ocr_score(read: str, target: str) -> float:
    """1 - (Levenshtein distance, 0 when the target is contained, capped at its length) / its length, on lower-cased
    text without spaces."""
    from Levenshtein import distance

    read, target = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        raise ValueError("ocr: the quoted text is empty")
    d = 0 if target in read else min(distance(read, target), len(target))
    return 1.0 - d / len(target)


class OCRReader:
    """RapidOCR on its shipped models: the text of all lines it finds in an image, joined."""

    def __init__(self, params: dict | None):
        from rapidocr import RapidOCR

        # RapidOCR keeps lines read with confidence >= 0.5 (Global.text_score), as PaddleOCR's drop_score
        self.engine = RapidOCR(params={"Global.log_level": "warning", **(params or {})})

    def __call__(self, image) -> str:
        import numpy as np

        out = self.engine(np.asarray(rgb([image])[0]))
        texts, scores = out.txts or (), out.scores or ()
        return "".join(t for t, s in zip(texts, scores) if s > 0)


def ocr_reward(params: dict | None = None, prompt_column: str = "prompt"):
    """Flow-GRPO's OCR reward on RapidOCR. ``params``: RapidOCR's configuration overrides (e.g.
    ``{"EngineConfig.onnxruntime.use_cuda": true}``)."""
    require("ocr", "rapidocr", "onnxruntime", "Levenshtein")
    reader = load_once(("ocr", repr(sorted((params or {}).items()))), lambda: OCRReader(params))
    return RewardFunction("ocr", _ocr, reader=reader, prompt_column=prompt_column)


def _ocr(completions, images=None, *, reader, prompt_column, **columns):
    n = len(completions)
    images = images_column(images, n, "ocr")
    targets = [quoted_text(p) for p in prompt_texts(columns, n, "ocr", prompt_column)]
    return [None if image is None or target is None else ocr_score(reader(image), target)
            for image, target in zip(images, targets)]
