"""The tiny model families of tiny/models.py as the family tests use them (the `family_models` fixture of
tests/conftest.py builds each once per session), and the prompts, completions and plain-forward log-probs those
tests compare against."""

import torch
from PIL import Image

from tiny.tokenizer import ALL_FAMILIES

VLM_FAMILIES = list(ALL_FAMILIES)
TEXT_FAMILIES = ["qwen3"]


def build_family(out, family):
    """(model in eval mode, processor or tokenizer) of a tiny `family`, saved to `out` and loaded back as a user
    would load it."""
    from tiny.models import make_tiny_llm, make_tiny_vlm
    from utils.core.models import load_model_and_processor

    if family in TEXT_FAMILIES:
        make_tiny_llm(out, family=family, seed=0)
    else:
        make_tiny_vlm(out, family=family, seed=0)
    model, processor = load_model_and_processor(out, dtype="float32")
    return model.eval(), processor


def image(colour=(200, 30, 30), size=(84, 60)):
    return Image.new("RGB", size, colour)


def user(text, with_image):
    return {"role": "user", "content": ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": text}]}


def group_batches(processor, family):
    """Two prompts (with an image each, for a VLM) in a group of 4 completions: (the unique prompts, each
    completion's own copy of its prompt, the completions' prompt index)."""
    from utils.core.encoding import encode_prompts

    with_image = family not in TEXT_FAMILIES
    messages = [[user("What colour is the circle?", with_image)], [user("How many?", with_image)]]
    images = [[image()], [image((20, 200, 20), (60, 84))]] if with_image else [[], []]
    index = [0, 0, 1, 1]
    prompts = encode_prompts(processor, messages, images, sample_ids=["a", "b"])
    repeated = encode_prompts(processor, [messages[i] for i in index], [images[i] for i in index],
                              sample_ids=[str(i) for i in index])
    return prompts, repeated, index


def completions(tokenizer, n):
    """n completions of different lengths (padding after the first stop token is masked out)."""
    words = ["red", "blue", "two", "circle", "yes", "green"]
    ids = [tokenizer.encode(" ".join(words[: 2 + i % 3]), add_special_tokens=False) for i in range(n)]
    width = max(map(len, ids))
    completion = torch.full((n, width), tokenizer.pad_token_id)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, row in enumerate(ids):
        completion[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return completion, mask


def plain_logprobs(model, prompts, completion, mask):
    """Log-probs of the completions from one ordinary forward of the model over prompt + completion."""
    inputs = {}
    for key, value in prompts.items():
        if torch.is_tensor(value) and value.dim() == 2 and value.shape == prompts["input_ids"].shape:
            extra = completion if key == "input_ids" else mask if key == "attention_mask" else 0 * completion
            value = torch.cat([value, extra.to(value)], 1)
        inputs[key] = value
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    lp = prompts["input_ids"].shape[1]
    logp = torch.log_softmax(logits[:, lp - 1 : -1], -1).gather(-1, completion[..., None]).squeeze(-1)
    return logp * mask
