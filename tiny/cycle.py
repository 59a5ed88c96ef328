"""The tiny world of the OpenVLThinker cycle (iterate.py with no arguments): scene captions, the text
reasoner's prompts and chains, and the training rows of the two small models the cycle needs.

- **The base VLM** (`tiny-base`): the tiny VLM pre-trained by train_sft.py to describe a scene
  ("a red circle in the top left and a blue square in the center"). It can see but not reason, the part
  a real base VLM plays. It is also the tiny captioner: distill.py captions with it as a local HF model.
- **The text reasoner** (`tiny-reasoner`): the tiny text LLM trained by train_sft.py to answer a counting
  question from a scene description, in `<think>...</think><answer>...</answer>` form. A share of its
  training chains carry an R1-style reflection ("... Wait, let me count again. ...") so that distill.py's
  reflection cut has something to cut. distill.py asks it through `transformers serve`, the
  OpenAI-compatible path a vLLM-served reasoner takes.

Both are built once and cached by `tiny.cache` (`tiny-base`, `tiny-reasoner`); docs/openvlthinker.md says
why the tiny world uses them.
"""

from __future__ import annotations

import json
import random

from tiny.shapes import _grid_region, _join

# distill.py's default prompts: the tiny models are trained on exactly what distill.py sends.
from utils.prompts import CAPTION_PROMPT, REASONER_PROMPT

REFLECTIONS = ("Wait, let me count again.", "But wait, let me check the description.")


def _objects(row) -> list[dict]:
    objects = json.loads(row["objects"]) if isinstance(row["objects"], str) else row["objects"]
    for obj in objects:
        obj.setdefault("region", _grid_region(obj["cell"], 3) if obj.get("cell") is not None else "image")
    # reading order: by grid cell (row-major), by position where objects have no cell
    return sorted(objects, key=lambda o: (o["cell"], 0, 0) if o.get("cell") is not None else (0, o["y"], o["x"]))


def scene_caption(row) -> str:
    """What the scene shows, in reading order: 'a red circle in the top left and a blue square in the center.'"""
    return _join([f"a {o['color']} {o['shape']} in the {o['region']}" for o in _objects(row)]) + "."


def caption_rows(rows) -> list[dict]:
    """sharegpt rows that teach the base VLM to describe a scene: `<image>Describe the image.` -> its caption."""
    return [{"id": r["id"], "messages": [{"role": "user", "content": "<image>" + CAPTION_PROMPT},
                                         {"role": "assistant", "content": scene_caption(r)}],
             "images": [r["image"]]} for r in rows]


def _counted(row) -> tuple[list[dict], str]:
    """The objects a counting question asks about and the noun it counts ('circle', 'green shape')."""
    question = row["question"]
    words = question.rstrip("?").split()
    noun = words[2]  # "How many circles are there" / "How many green shapes are there"
    objects = _objects(row)
    if noun.endswith("s") and noun[:-1] in ("circle", "square", "triangle"):
        return [o for o in objects if o["shape"] == noun[:-1]], noun[:-1]
    return [o for o in objects if o["color"] == noun], f"{noun} shape"


def reasoner_chain(row, *, reflect: bool = False, reflection: str = REFLECTIONS[0]) -> str:
    """The reasoner's answer to a counting row: the objects asked about (colour and shape), their count,
    then the answer.

    With `reflect` the chain checks itself once ("... Wait, let me count again. There are 2 circles.")."""
    found, noun = _counted(row)
    count = len(found)
    named = [f"a {o['color']} {o['shape']}" for o in found]
    seen = f"I see {_join(named)}." if found else f"I see no {noun}."
    total = f"There {'is' if count == 1 else 'are'} {count} {noun if count == 1 else noun + 's'}."
    think = f"{seen} {total}" + (f" {reflection} {total}" if reflect else "")
    return f"<think>{think}</think><answer>{count}</answer>"


def reasoner_rows(rows, *, reflect_share: float = 0.3, seed: int = 0) -> list[dict]:
    """Text-only sharegpt rows that train the tiny reasoner: REASONER_PROMPT (scene caption + question) ->
    reasoner_chain; `reflect_share` of them with a reflection."""
    rng = random.Random(f"reasoner-{seed}")
    out = []
    for r in rows:
        reflect = rng.random() < reflect_share
        prompt = REASONER_PROMPT.format(caption=scene_caption(r), question=r["question"])
        chain = reasoner_chain(r, reflect=reflect, reflection=rng.choice(REFLECTIONS))
        out.append({"id": r["id"], "messages": [{"role": "user", "content": prompt},
                                                {"role": "assistant", "content": chain}]})
    return out
