"""The tiny reflector: its SFT rows, what a reflector VLM writes for train_mixgrpo's reflect prompt, and whether
its edit fixes the draft.

A reflection is right when its instruction, read back (`tiny.edits.parse_instruction`) and carried out on the
draft (`apply_edit`), gives the prompt's render (same objects, colours and cells), or when it says "no further edit
needed" for a draft that already is the render. Used by bench/experiments/tiny_reflector_report.py and the reflector's
tests.
"""

import json
import re
from collections import Counter

import torch

from tiny.edits import FLAWS, apply_edit, cell_name, parse_instruction, scene_key
from utils.core.encoding import encode_prompts
from utils.core.rollout import generate_completions, stop_token_ids
from utils.t2i.r3_format import REFLECT_PROMPT, reflection_of, user_message

DESCRIBE_PROMPT = "Describe the image: every object, its colour and where it is."
SEEN = re.compile(r"(\w+) (circle|square|triangle) (top|middle|bottom) (left|center|right)")


def with_eye(model_dir: str, eye_dir: str, out_dir: str) -> str:
    """A copy of the VLM folder `model_dir` whose vision tower and merger (`visual.*`) are `eye_dir`'s: the tiny
    planner never saw an image, tiny-sft learnt to see the shapes (same vision config). Returns `out_dir`."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    model, eye = load_file(weights), load_file(os.path.join(eye_dir, "model.safetensors"))
    visual = [k for k in model if k.startswith("visual.")]
    if not visual or any(k not in eye or eye[k].shape != model[k].shape for k in visual):
        raise ValueError(f"{eye_dir}: its vision tower does not match {model_dir}'s (visual.* names and shapes)")
    save_file({**model, **{k: eye[k] for k in visual}}, weights, metadata={"format": "pt"})
    return out_dir


def reflector_sft_rows(reflect_rows, plan_rows) -> list[dict]:
    """The reflector's SFT rows (tiny/cache.py's tiny-reflector): each reflect row (tiny.edits.reflector_rows) followed
    in turn by one planner row (tiny.t2i.planner_rows, no image) while they last, then the planner rows left; id,
    messages and images only, so the two kinds make one table."""
    reflect = [dict(id=r["id"], messages=r["messages"], images=r["images"]) for r in reflect_rows]
    plans = [dict(id=r["id"], messages=r["messages"], images=[]) for r in plan_rows]
    mixed = []
    for i, row in enumerate(reflect):
        mixed += [row] + ([plans[i]] if i < len(plans) else [])
    return mixed + plans[len(reflect):]


def describe_rows(reflect_rows) -> list[dict]:
    """sharegpt rows that teach the eye what the reflector must see first: each reflector row's draft under
    DESCRIBE_PROMPT -> the first half of its reflection, "I see <plan of the draft>" (tiny.edits.reflection_text)."""
    return [dict(id=r["id"].replace("reflect", "describe", 1), images=r["images"],
                 messages=[{"role": "user", "content": "<image>" + DESCRIBE_PROMPT},
                           {"role": "assistant", "content": _seen_part(r["messages"][1]["content"])}])
            for r in reflect_rows]


def _seen_part(text: str) -> str:
    """The "I see ..." part of a reflection (or the whole of a description): up to the first ";"."""
    return text.split("</think>")[0].removeprefix("<think>").split(";")[0]


def seen_outcome(text: str, row: dict) -> dict:
    """What the "I see ..." part of a reflection (or a description) gets right about the draft it was shown: the
    number of objects, their colours as a multiset, and every object (colour, shape, cell)."""
    seen = [(c, s, f"{v} {h}") for c, s, v, h in SEEN.findall(_seen_part(text))]
    draft = [(o["color"], o["shape"], cell_name(o["cell"])) for o in json.loads(row["draft"])]
    return dict(count=len(seen) == len(draft), colors=Counter(c for c, _, _ in seen) == Counter(c for c, _, _ in draft),
                objects=Counter(seen) == Counter(draft))


def seen_scores(texts, rows) -> dict:
    """Shares over the rows of `seen_outcome`'s three checks."""
    outcomes = [seen_outcome(t, r) for t, r in zip(texts, rows)]
    return {f"seen_{k}": sum(o[k] for o in outcomes) / len(outcomes) for k in ("count", "colors", "objects")}


def reflection_outcome(text: str, row: dict, *, image_size: int) -> dict:
    """{format, kept, fixed} of one reflection on a reflector row (tiny.edits.reflector_rows): `format` as the
    reflect stage's reward reads it, `kept` when it asks for no edit, `fixed` when the draft ends as the target."""
    fmt, instruction, kept = reflection_of(text)
    draft, target = json.loads(row["draft"]), json.loads(row["target"])
    if kept:
        return dict(format=fmt, kept=True, fixed=scene_key(draft) == scene_key(target))
    try:
        edited = apply_edit(draft, parse_instruction(instruction), image_size=image_size)
    except ValueError:  # an instruction the world cannot carry out (unreadable, or naming what is not there)
        return dict(format=fmt, kept=False, fixed=False)
    return dict(format=fmt, kept=False, fixed=scene_key(edited) == scene_key(target))


@torch.no_grad()
def reflections(model, processor, rows, *, max_new_tokens=72, batch=32, describe=False) -> list[str]:
    """The reflection a VLM writes greedily for each reflector row: its draft image under train_mixgrpo's reflect
    prompt, as the reflect stage asks it (`describe`: under DESCRIBE_PROMPT instead)."""
    tok = processor.tokenizer
    stops, texts = stop_token_ids(model, tok), []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        prompts = [DESCRIBE_PROMPT if describe else REFLECT_PROMPT.format(prompt=r["prompt"]) for r in chunk]
        enc = encode_prompts(processor, [user_message(p, True) for p in prompts],
                             [[r["images"][0]] for r in chunk], sample_ids=[r["id"] for r in chunk])
        ids, mask = generate_completions(model, enc, row_seeds=torch.arange(len(chunk)), temperature=0.0,
                                         max_new_tokens=max_new_tokens, eos_token_id=stops,
                                         pad_token_id=tok.pad_token_id)
        texts += tok.batch_decode(ids.masked_fill(mask == 0, tok.pad_token_id), skip_special_tokens=True)
    return texts


def reflection_scores(texts, rows, *, image_size: int) -> dict:
    """Shares over the rows: format, fixed (overall and per flaw), no edit asked for a perfect draft (`kept_perfect`)
    and for a flawed one (`kept_flawed`)."""
    outcomes = [reflection_outcome(t, r, image_size=image_size) for t, r in zip(texts, rows)]

    def share(values):
        values = list(values)
        return sum(values) / len(values) if values else float("nan")

    perfect = [o for o, r in zip(outcomes, rows) if r["flaw"] == "none"]
    flawed = [o for o, r in zip(outcomes, rows) if r["flaw"] != "none"]
    return {"format": share(o["format"] for o in outcomes), "fixed": share(o["fixed"] for o in outcomes),
            **{f"fixed/{flaw}": share(o["fixed"] for o, r in zip(outcomes, rows) if r["flaw"] == flaw)
               for flaw in FLAWS},
            "kept_perfect": share(o["kept"] for o in perfect), "kept_flawed": share(o["kept"] for o in flawed)}
