"""Rollouts with HF `generate`, shared by the RL scripts and the held-out evaluation: one sampled completion per
row (a group's prompt prefilled once when the model allows it), the stop-token rule, the completion mask and
truncation. The sampling noise is `utils.core.seeds`, prompt batches are `utils.core.encoding`, ZeRO-3 gathering around
generation is `utils.core.zero3`, and the log-probs of the sampled completions are `utils.core.logprobs`.
"""

import inspect
import os

import torch
from transformers import GenerationConfig, LogitsProcessorList

from utils.core.errors import InputError
from utils.core.seeds import GumbelSampler

# Chat templates end an assistant turn with one of these; generation must stop there too.
END_OF_TURN_TOKENS = ("<|im_end|>",)


@torch.no_grad()
def generate_completions(model, batch, *, row_seeds, max_new_tokens, temperature, top_k=None, top_p=None,
                         eos_token_id, pad_token_id, suppress_token_ids=(), prompt_index=None):
    """Sample one completion per row; returns (completion_ids [B, L], completion_mask [B, L]).

    The mask covers tokens up to and including the first EOS; rows are padded with pad_token_id.
    `suppress_token_ids` (image placeholders, role markers) are never sampled: an image token inside
    a completion would not match any image features when the completion is scored.

    With `prompt_index` ([B], the row of `batch` each completion continues), `batch` holds each distinct prompt
    once: its prefill (vision tower included) runs once and the KV cache is shared by its completions, as in the
    training pass (`utils.core.logprobs`). Only for models `can_share_prompts` accepts.

    `model` must hold whole weights (under ZeRO-3: inside `unwrap_for_generation`), so no process waits on another:
    transformers would otherwise turn on `synced_gpus` under ZeRO-3, and processes that make different numbers of
    calls (an uneven share of held-out rows) would hang in its per-token all-reduce.
    """
    check_no_logits_shaping(model)
    cache = None
    if prompt_index is not None:
        batch, cache = _shared_prefill(model, batch, prompt_index)
    prompt_length = batch["input_ids"].shape[1]
    sampler = GumbelSampler(row_seeds, prompt_length, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=max_new_tokens)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, temperature=None, top_k=None, top_p=None,
        suppress_tokens=list(suppress_token_ids) or None, **NEUTRAL_PROCESSORS,
    )
    shared = cache_kwargs(model, cache) if cache is not None else {}
    out = model.generate(**batch, **shared, generation_config=config, logits_processor=LogitsProcessorList([sampler]),
                         synced_gpus=False)
    completion = out[:, prompt_length:]
    return completion, completion_mask(completion, eos_token_id)


# `generate` fills every field left at None from the checkpoint's generation_config.json (Qwen2.5-VL-Instruct ships
# repetition_penalty 1.05): the rollout would then sample from a reshaped distribution that the training log-probs
# never score. These values switch each such processor off explicitly. min_new_tokens=0 also overrides any min_length
# (setting both makes `generate` warn on every call).
NEUTRAL_PROCESSORS = dict(
    repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
    min_new_tokens=0, guidance_scale=1.0, remove_invalid_values=False, renormalize_logits=False,
)
# Processors that only a None turns off, so a checkpoint that sets one is refused rather than silently applied.
UNNEUTRAL_PROCESSORS = (
    "sequence_bias", "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
    "begin_suppress_tokens", "watermarking_config",
)


def check_no_logits_shaping(model):
    """Refuse a checkpoint whose generation_config.json asks `generate` for a logits processor the policy's log-probs
    do not apply (the rollout would be off-policy with no error)."""
    config = getattr(model, "generation_config", None)
    set_fields = [name for name in UNNEUTRAL_PROCESSORS if getattr(config, name, None) is not None]
    if set_fields:
        path = os.path.join(getattr(model, "name_or_path", "") or "<model>", "generation_config.json")
        raise InputError(
            f"{path} sets {', '.join(set_fields)}: a logits processor that the policy's log-probs do not apply, so "
            "the rollout would sample off-policy; remove it there"
        )


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
