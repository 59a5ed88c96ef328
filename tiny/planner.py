"""What a planner VLM writes for train_mixgrpo's reason prompt, and whether it reads the prompt at all.

Used by bench/experiments/tiny_generator_report.py (`--planner`) and the tiny planner's build test.
"""

import torch
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from tiny.cache import resolve_tiny_name
from tiny.shapes import DEFAULT_COLORS, SHAPES
from utils.core.encoding import encode_prompts
from utils.core.rollout import generate_completions, stop_token_ids
from utils.t2i.r3_format import REASON_PROMPT, reasoning_of, user_message


def load_planner(name):
    """(model, processor) of a planner VLM: tiny-planner (the cached Mix-GRPO warm start) or a folder."""
    path = resolve_tiny_name(name)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


@torch.no_grad()
def planner_plans(model, processor, rows, max_new_tokens=64, batch=32):
    """The reasoning a planner VLM writes greedily for each row under train_mixgrpo's reason prompt."""
    tok = processor.tokenizer
    stops, plans = stop_token_ids(model, tok), []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        enc = encode_prompts(processor, [user_message(REASON_PROMPT.format(prompt=r["prompt"])) for r in chunk],
                             [[] for _ in chunk], sample_ids=[r["prompt"] for r in chunk])
        ids, mask = generate_completions(model, enc, row_seeds=torch.arange(len(chunk)), temperature=0.0,
                                         max_new_tokens=max_new_tokens, eos_token_id=stops,
                                         pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(ids.masked_fill(mask == 0, tok.pad_token_id), skip_special_tokens=True)
        plans += [reasoning_of(t)[1] for t in texts]
    return plans


def _reading(model, processor, cases, words):
    """Mean over cases (prompt, plan prefix, index of the right word) of P(the right word next), teacher-forced
    after the prefix and renormalised over `words` (token strings, one token each)."""
    tok = processor.tokenizer
    word_ids = [tok.encode(w, add_special_tokens=False)[0] for w in words]
    probs = []
    for prompt, prefix, right in cases:
        messages = [{"role": "user", "content": REASON_PROMPT.format(prompt=prompt)},
                    {"role": "assistant", "content": prefix + "\x00"}]
        text = processor.apply_chat_template(messages, tokenize=False)
        ids = tok(text[:text.rindex("\x00")], return_tensors="pt", add_special_tokens=False).input_ids
        probs.append(float(model(input_ids=ids).logits[0, -1, word_ids].softmax(-1)[right]))
    return sum(probs) / len(probs)


@torch.no_grad()
def shape_reading(model, processor, colors=("red", "blue", "green")):
    """P(the plan's first object is the shape the prompt names), teacher-forced after its colour, for
    "a photo of a {colour} {shape}" over `colors` x SHAPES and renormalised over the shape words.

    Exactly 1 / len(SHAPES) when the planner's next-token distribution does not depend on the prompt (the mean of
    one distribution's entries), 1 when it copies the shape."""
    cases = [(f"a photo of a {color} {shape}", f"<think>{color}", k) for color in colors
             for k, shape in enumerate(SHAPES)]
    return _reading(model, processor, cases, [f" {s}" for s in SHAPES])


@torch.no_grad()
def colour_reading(model, processor, colors=DEFAULT_COLORS):
    """P(the plan's first word is the colour the prompt names), teacher-forced right after `<think>`, for
    "a photo of a {colour} {shape}" over `colors` x SHAPES and renormalised over the colour words (the plan's first
    word has no leading space). Exactly 1 / len(colors) when nothing flows from the prompt to that position."""
    cases = [(f"a photo of a {color} {shape}", "<think>", k) for k, color in enumerate(colors) for shape in SHAPES]
    return _reading(model, processor, cases, list(colors))
