"""Rollouts shared by the RL scripts: prompt encoding, reproducible sampling with HF `generate`, the stop-token
rule and the completion mask. (Log-probs of the sampled completions are `utils.logprobs`.)

Sampling is done with the Gumbel-max trick on counter-based noise: the noise for completion `k`
at position `t` depends only on (seed, k, t, token), so a completion is the same whether it was
generated alone, in a batch of 64, on one process or on eight. That makes runs reproducible
across world sizes and makes resume exact without restoring any generator state.
"""

import contextlib
import inspect

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from utils.errors import ImageTokenError, InputError
from utils.video import check_video_tokens, processor_video_kwargs

# Chat templates end an assistant turn with one of these; generation must stop there too.
END_OF_TURN_TOKENS = ("<|im_end|>",)

_MASK63 = (1 << 63) - 1
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB as int64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64


def _splitmix64(x):
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic, logical shifts)."""
    x = x ^ ((x & _MASK63) >> 30) ^ ((x < 0).long() << 33)
    x = x * _MIX1
    x = x ^ ((x & _MASK63) >> 27) ^ ((x < 0).long() << 36)
    x = x * _MIX2
    x = x ^ ((x & _MASK63) >> 31) ^ ((x < 0).long() << 32)
    return x


def counter_uniform(row_seeds, step, vocab_size):
    """Uniform(0, 1) noise that depends only on (row seed, step, token id).

    `step` is an int (returns [B, V]) or a 1-D tensor of steps (returns [B, S, V]).
    """
    device = row_seeds.device
    steps = torch.as_tensor(step, dtype=torch.long, device=device)
    base = _splitmix64(row_seeds.long().view(-1, *([1] * steps.dim())) * _GOLDEN + steps)
    tokens = torch.arange(vocab_size, device=device, dtype=torch.long)
    bits = _splitmix64(base.unsqueeze(-1) + tokens * _GOLDEN)
    mantissa = (bits & _MASK63) >> 10  # 53 random bits
    return (mantissa.double() + 0.5) / float(1 << 53)


def completion_seeds(seed, round_index, global_indices):
    """One int64 seed per completion, from the run seed, the generation round and its global index."""
    idx = torch.as_tensor(global_indices, dtype=torch.long)
    # Stay in int64 tensors throughout: Python ints would not wrap around like the hash needs.
    round_term = torch.full_like(idx, int(round_index)) * _GOLDEN
    return _splitmix64(_splitmix64(torch.full_like(idx, int(seed)) + round_term) + idx)


class GumbelSampler(LogitsProcessor):
    """Turns greedy decoding into sampling from softmax(logits / T) (after optional top-k/top-p).

    argmax(log p + Gumbel noise) is an exact sample from p; the noise comes from `counter_uniform`.
    """

    # Noise for several decoding steps is drawn at once (one batch of hash ops instead of one per token)
    # as long as the block stays under this many elements; large vocabularies draw a step at a time.
    block_elements = 1 << 22

    def __init__(self, row_seeds, prompt_length, temperature=1.0, top_k=None, top_p=None, max_new_tokens=None):
        self.row_seeds = row_seeds
        self.prompt_length = prompt_length
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self._block, self._block_start = None, None
        self.warpers = []
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=int(top_k)))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=float(top_p)))

    def gumbel(self, step, vocab_size, device):
        """Gumbel noise [B, V] for one decoding step, served from a cached block of steps."""
        block = self._block
        if (block is None or not (self._block_start <= step < self._block_start + block.shape[1])
                or block.shape[-1] != vocab_size):
            remaining = (self.max_new_tokens - step) if self.max_new_tokens else 1
            n = max(1, min(remaining, self.block_elements // max(1, len(self.row_seeds) * vocab_size)))
            u = counter_uniform(self.row_seeds.to(device), torch.arange(step, step + n, device=device), vocab_size)
            self._block, self._block_start = (-torch.log(-torch.log(u))).float(), step
        return self._block[:, step - self._block_start]

    def __call__(self, input_ids, scores):
        scores = scores.float()
        if self.temperature <= 0:  # greedy
            return scores
        scores = scores / self.temperature
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        step = input_ids.shape[1] - self.prompt_length
        return scores + self.gumbel(step, scores.shape[-1], scores.device)


def encode_prompts(processor, messages, images, *, sample_ids, max_prompt_length=None, videos=None):
    """Chat-template and tokenize a batch of prompts (left padding), images included.

    `images` is a list (one per sample) of lists of PIL images, possibly empty; `videos` likewise of
    `utils.video.Clip`s (already sampled and sized). Errors name the sample id: a prompt over
    `max_prompt_length` tokens, or images (videos) that do not match the image (video) placeholders,
    is never silently truncated or dropped.
    """

    tokenizer = getattr(processor, "tokenizer", processor)
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
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
    from utils.models import image_token_id

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
    from utils.models import image_token_id

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
    produce (utils.models.vision_feature_count), e.g. after prompts were repeated per completion."""
    from utils.models import image_token_id, vision_feature_count

    token = image_token_id(config)
    need = vision_feature_count(config, inputs) if token is not None else None
    if need is None:
        return
    ids = inputs["input_ids"] if input_ids is None else input_ids
    have = int((ids == token).sum())
    if have != need:
        raise ImageTokenError(f"the batch holds {have} image tokens for {need} image features: a prompt's image "
                              "tokens were cut or repeated without its pixels")


@contextlib.contextmanager
def zero3_gathered(engine):
    """Gather every ZeRO-3 shard of a DeepSpeed engine once, with the per-module hooks off.

    Under ZeRO-3 each forward would otherwise all-gather every layer again for every new token;
    gathering once makes generation as fast as on an unsharded model (at the memory of one full copy).
    """
    import deepspeed

    opt = engine.optimizer
    offload = opt.parameter_offload if hasattr(opt, "parameter_offload") else opt
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield engine.module
        finally:
            offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def unwrap_for_generation(model, accelerator):
    """The plain module behind DDP/DeepSpeed wrappers, with ZeRO-3 shards gathered while it is used."""
    if accelerator.distributed_type.name == "DEEPSPEED" and model.zero_optimization_stage() == 3:
        with zero3_gathered(model) as module:
            yield module
    else:
        yield accelerator.unwrap_model(model)


@torch.no_grad()
def generate_completions(model, batch, *, row_seeds, max_new_tokens, temperature, top_k=None, top_p=None,
                         eos_token_id, pad_token_id, suppress_token_ids=(), prompt_index=None):
    """Sample one completion per row; returns (completion_ids [B, L], completion_mask [B, L]).

    The mask covers tokens up to and including the first EOS; rows are padded with pad_token_id.
    `suppress_token_ids` (image placeholders, role markers) are never sampled: an image token inside
    a completion would not match any image features when the completion is scored.

    With `prompt_index` ([B], the row of `batch` each completion continues), `batch` holds each distinct prompt
    once: its prefill (vision tower included) runs once and the KV cache is shared by its completions, as in the
    training pass (`utils.logprobs`). Only for models `can_share_prompts` accepts.

    `model` must hold whole weights (under ZeRO-3: inside `unwrap_for_generation`), so no process waits on another:
    transformers would otherwise turn on `synced_gpus` under ZeRO-3, and processes that make different numbers of
    calls (an uneven share of held-out rows) would hang in its per-token all-reduce.
    """
    cache = None
    if prompt_index is not None:
        batch, cache = _shared_prefill(model, batch, prompt_index)
    prompt_length = batch["input_ids"].shape[1]
    sampler = GumbelSampler(row_seeds, prompt_length, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=max_new_tokens)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, temperature=None, top_k=None, top_p=None,
        suppress_tokens=list(suppress_token_ids) or None,
    )
    shared = cache_kwargs(model, cache) if cache is not None else {}
    out = model.generate(**batch, **shared, generation_config=config, logits_processor=LogitsProcessorList([sampler]),
                         synced_gpus=False)
    completion = out[:, prompt_length:]
    return completion, completion_mask(completion, eos_token_id)


def _shared_prefill(model, prompts, prompt_index):
    """Each distinct prompt's prefill once, all but its last token (left padding: the last column is every row's
    last token); the KV cache is then index-selected to the completions, which `generate` continues from their
    full prompt ids (it runs only the uncached last token). Qwen-VL's rope offsets follow the selection."""
    from transformers import DynamicCache

    ids = prompts["input_ids"]
    idx = torch.as_tensor(prompt_index, device=ids.device)
    per_token = {k for k, v in prompts.items() if torch.is_tensor(v) and v.dim() == 2 and v.shape == ids.shape}
    inputs = {k: (v[:, :-1] if k in per_token else v) for k, v in prompts.items()}
    if not any(hasattr(m, "get_rope_index") for m in model.modules()):
        # generate places the continuation after each row's own tokens (left padding skipped): the prefill must too
        mask = prompts["attention_mask"][:, :-1].long()
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    model(**inputs, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    cache.batch_select_indices(idx)
    for module in model.modules():  # the Qwen-VL core, however deep PEFT or a wrapper has put it
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = module.rope_deltas[idx]
    return {"input_ids": ids[idx], "attention_mask": prompts["attention_mask"][idx]}, cache


def cache_kwargs(model, cache):
    """`{name: cache}` for a forward or generate call: transformers renamed `past_key_values` to `cache` (5.2x);
    the vLLM set pins a release from before the rename, where an unknown `cache=` would be silently dropped."""
    forward = getattr(model, "get_base_model", lambda: model)().forward
    return {"cache" if "cache" in inspect.signature(forward).parameters else "past_key_values": cache}


def stop_token_ids(model, tokenizer):
    """The one stop-token rule of training, evaluation and vLLM: the model's generation_config EOS ids, the
    tokenizer's EOS, and the chat template's end-of-turn token when the vocabulary has one."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids.append(tokenizer.eos_token_id)
    for token in END_OF_TURN_TOKENS:
        if token in tokenizer.get_vocab():
            ids.append(tokenizer.convert_tokens_to_ids(token))
    return sorted({int(i) for i in ids if i is not None})


def special_token_ids_to_suppress(tokenizer, eos_ids):
    """Every special/added control token except EOS: placeholders and role markers a policy must not emit."""
    keep = set(eos_ids) | {tokenizer.pad_token_id}
    specials = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if added.special:
            specials.add(token_id)
    return sorted(specials - keep)


def completion_mask(completion_ids, eos_token_id):
    """1 for tokens up to and including the first EOS of each row, 0 after it."""
    eos_ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completion_ids == e
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).long()


def truncated_completions(completion_ids, completion_mask, stop_ids):
    """[B] True for completions that end without a stop token (cut at --max_completion_length)."""
    last = completion_ids.gather(1, (completion_mask.sum(-1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
    return ~torch.isin(last, torch.tensor(stop_ids, device=completion_ids.device))
