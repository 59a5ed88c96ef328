"""Encoding chats into model inputs: a batch of prompts (chat template, left padding, images and videos), and the
image-token checks every encoded batch passes (prompts here, SFT batches in `utils.core.sft_data`, forward passes in
`utils.core.logprobs`): a prompt is never silently truncated, and its image tokens are exactly those of its images."""

import torch

from utils.core.errors import ImageTokenError, InputError
from utils.core.models import image_token_id, vision_feature_count
from utils.core.video import check_video_tokens, processor_video_kwargs


def encode_prompts(processor, messages, images, *, sample_ids, max_prompt_length=None, videos=None, tools=None):
    """Chat-template and tokenize a batch of prompts (left padding), images included.

    `messages` holds one prompt per sample: chat messages, or a string (a plain-text prompt, tokenized as it is,
    as TRL does). `images` is a list (one per sample) of lists of PIL images, possibly empty; `videos` likewise of
    `utils.core.video.Clip`s (already sampled and sized); `tools` (JSON schemas) go to the chat template. Errors
    name the sample id: a prompt over `max_prompt_length` tokens, or images (videos) that do not match the image
    (video) placeholders, is never silently truncated or dropped.
    """

    tokenizer = getattr(processor, "tokenizer", processor)
    texts = [m if isinstance(m, str) else processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True,
                                                                         **({"tools": tools} if tools else {}))
             for m in messages]
    has_images = any(len(imgs) for imgs in images)
    kwargs = dict(text=texts, return_tensors="pt", padding=True)
    if has_images:
        if tokenizer is processor:
            raise InputError(f"sample {sample_ids[0]!r} has images but the model has no image processor")
        kwargs["images"] = [list(imgs) for imgs in images]
    has_videos = bool(videos) and any(videos)
    if has_videos:
        kwargs.update(processor_video_kwargs([clip for clips in videos for clip in clips]))
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batch = processor(**kwargs)
    except (ValueError, IndexError, RuntimeError, StopIteration) as err:  # older processors: StopIteration
        raise_for_sample(processor, sample_ids, texts, images, err, videos=videos)
    finally:
        tokenizer.padding_side = previous_side
    if has_images:
        check_image_tokens(processor, batch["input_ids"], images, sample_ids)
    if has_videos:
        check_video_tokens(processor, batch["input_ids"], batch.get("video_grid_thw"), videos, sample_ids)
    if max_prompt_length:
        lengths = batch["attention_mask"].sum(-1)
        for sid, length in zip(sample_ids, lengths.tolist()):
            if length > max_prompt_length:
                raise InputError(
                    f"sample {sid!r}: prompt is {length} tokens (images included), over "
                    f"--max_prompt_length {max_prompt_length}; raise the flag or lower --max_pixels"
                )
    return batch


def raise_for_sample(processor, sample_ids, texts, images, err, videos=None):
    """A batch failed in the processor: re-run it sample by sample and raise an error naming the sample at
    fault (image or video placeholders that do not match the images or videos), or re-raise `err` if none
    fails alone."""
    for k, (sid, text, imgs) in enumerate(zip(sample_ids, texts, images)):
        try:
            single = processor(text=[text], **({"images": [list(imgs)]} if imgs else {}),
                               **processor_video_kwargs(videos[k] if videos else []))
            if videos is not None:  # some processors leave a placeholder without its video unexpanded
                grid = single.get("video_grid_thw")
                check_video_tokens(processor, torch.as_tensor(single["input_ids"]),
                                   None if grid is None else torch.as_tensor(grid), [videos[k]], [sid])
        except Exception as single_err:  # noqa: BLE001 - re-raised with the sample id
            raise InputError(f"sample {sid!r}: image tokens and images do not match: {single_err}") from err
    raise err


def image_tokens_per_image(processor, image):
    """How many image tokens the processor gives `image` on its own (its family's placeholder, rendered by the
    chat template, expanded): pan-and-scan crops, tiles and resizing included. Cached per image size."""
    cache = processor.__dict__.setdefault("_mmgrpo_tokens_per_size", {})
    key = (image.size, getattr(image, "mode", None))
    if key not in cache:
        placeholder = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}],
                                                    tokenize=False, add_generation_prompt=False)
        ids = processor(text=[placeholder], images=[[image]], return_tensors="pt")["input_ids"]
        cache[key] = int((ids == image_token_id(processor)).sum())
    return cache[key]


def check_image_tokens(processor, input_ids, images, sample_ids):
    """Refuse (ImageTokenError, naming the sample) a row whose image tokens are not exactly those of its images:
    a length limit that cut an image, a template or processor call that repeated or dropped one. The model would
    otherwise fail on the batch ("image features and image tokens do not match") or, worse, run on a
    misaligned prompt."""
    token = image_token_id(processor)
    if token is None:
        return
    counts = (input_ids == token).sum(-1).tolist()
    for sid, have, imgs in zip(sample_ids, counts, images):
        need = sum(image_tokens_per_image(processor, img) for img in imgs)
        if have != need:
            how = "cut (a length limit fell inside an image)" if have < need else "repeated"
            raise ImageTokenError(f"sample {sid!r}: {have} image tokens where its {len(imgs)} image(s) need {need}; "
                                  f"the image tokens were {how}")


def check_features_match_tokens(config, inputs, input_ids=None):
    """Before a forward: the image tokens of the batch must be exactly as many as the image features its pixels
    produce (utils.core.models.vision_feature_count), e.g. after prompts were repeated per completion."""
    token = image_token_id(config)
    need = vision_feature_count(config, inputs) if token is not None else None
    if need is None:
        return
    ids = inputs["input_ids"] if input_ids is None else input_ids
    have = int((ids == token).sum())
    if have != need:
        raise ImageTokenError(f"the batch holds {have} image tokens for {need} image features: a prompt's image "
                              "tokens were cut or repeated without its pixels")
