"""Rollouts, shared by the RL scripts and the held-out evaluation: one sampled completion per row (a group's prompt
prefilled once when the model allows it), the stop-token rule, the completion mask and truncation. The sampling noise
is `utils.core.seeds`, prompt batches are `utils.core.encoding`, ZeRO-3 gathering around generation is
`utils.core.zero3`, and the log-probs of the sampled completions are `utils.core.logprobs`.

HF `generate` prepares every input (positions, masks, images, the cache, the logits processors) and prefills; the
decoding that follows runs in `lean_decode`, our own loop over the same model calls and the same processors, with the
ids and the full-attention KV cache in buffers allocated once and the stop rule one tensor op. `generate`'s own loop
(`decoder="generate"`) stays the reference: both sample the same tokens (tests/test_lean_decode.py).
"""

import contextlib
import inspect
import os

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from utils.core.errors import InputError
from utils.core.seeds import GumbelSampler

# Chat templates end an assistant turn with one of these; generation must stop there too.
END_OF_TURN_TOKENS = ("<|im_end|>",)
DECODERS = ("lean", "generate")


@torch.no_grad()
def generate_completions(model, batch, *, row_seeds, max_new_tokens, temperature, top_k=None, top_p=None,
                         eos_token_id, pad_token_id, suppress_token_ids=(), prompt_index=None, decoder="lean"):
    """Sample one completion per row; returns (completion_ids [B, L], completion_mask [B, L]).

    The mask covers tokens up to and including the first EOS; rows are padded with pad_token_id.
    `suppress_token_ids` (image placeholders, role markers) are never sampled: an image token inside
    a completion would not match any image features when the completion is scored.

    With `prompt_index` ([B], the row of `batch` each completion continues), `batch` holds each distinct prompt
    once: its prefill (vision tower included) runs once and the KV cache is shared by its completions, as in the
    training pass (`utils.core.logprobs`). Only for models `can_share_prompts` accepts.

    `decoder`: "lean" (`lean_decode`, where the installed transformers has the generation hooks it needs) or
    "generate" (HF's own decoding loop, the reference).

    `model` must hold whole weights (under ZeRO-3: inside `unwrap_for_generation`), so no process waits on another:
    transformers would otherwise turn on `synced_gpus` under ZeRO-3, and processes that make different numbers of
    calls (an uneven share of held-out rows) would hang in its per-token all-reduce.
    """
    if decoder not in DECODERS:
        raise ValueError(f"decoder {decoder!r} is not one of {DECODERS}")
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
    lean = {"custom_generate": lean_decode} if decoder == "lean" and lean_decode_available(model) else {}
    out = model.generate(**batch, **shared, generation_config=config, logits_processor=LogitsProcessorList([sampler]),
                         synced_gpus=False, **lean)
    completion = out[:, prompt_length:]
    return completion, completion_mask(completion, eos_token_id)


def lean_decode_available(model):
    """Whether this transformers has what `lean_decode` calls (`generate`'s prefill and kwargs update)."""
    return all(hasattr(model, name) for name in ("_prefill", "prepare_inputs_for_generation",
                                                 "_update_model_kwargs_for_generation"))


def lean_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
    """`generate`'s greedy loop (`custom_generate`) over what `generate` prepared: the same prefill, model inputs,
    logits processors (our Gumbel sampler last, so greedy is a sample) and stop rule, without its per-token
    bookkeeping. The token ids fill a buffer of the final length; full-attention KV layers are moved into buffers
    of the final length after the prefill and filled in place (DynamicLayer copies its whole cache at every token);
    a row stops at its first EOS and the loop when every row has, or at max_new_tokens. Returns prompt + completion
    ids as `generate` does.

    Finished rows leave the model's batch (`Compaction`) once a quarter of it has finished: `generate` keeps
    decoding them, padded, until the last row ends. A row's logits do not depend on the other rows of its batch
    except through the GEMM kernel a batch size picks; the batch never shrinks below MIN_ROWS rows, under which
    the CPU's kernels round differently (tests/test_lean_decode.py compares the tokens with `generate`'s)."""
    unknown = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
    if synced_gpus or streamer is not None or generation_config.return_dict_in_generate or unknown:
        raise ValueError("lean_decode: synced_gpus, streamers, dict outputs and stopping criteria other than the "
                         f"length and EOS ({', '.join(unknown) or 'none here'}) are generate's (decoder='generate')")
    batch, prompt_length = input_ids.shape
    total = generation_config.max_length
    eos = torch.as_tensor(generation_config.eos_token_id or [], device=input_ids.device).reshape(-1)
    pad = generation_config._pad_token_tensor.to(input_ids.device)
    ids = input_ids.new_full((batch, total), int(pad))
    ids[:, :prompt_length] = input_ids
    compaction = Compaction.for_decoding(model, logits_processor, model_kwargs, batch)
    processors = decode_processors(logits_processor, prompt_length, input_ids.device)
    running = torch.ones(batch, dtype=torch.bool, device=input_ids.device)  # rows of the model's batch
    optimized = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    length = prompt_length
    with optimized():
        while True:
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
            if length == prompt_length:
                preallocate_cache(kv_cache(model_kwargs), total)
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
            del outputs
            rows = compaction.rows
            held = ids[:, :length] if rows is None else ids[rows, :length]
            for processor in processors:  # (the list's own call inspects each signature at every token)
                logits = processor(held, logits)
            token = torch.where(running, logits.argmax(-1), pad)
            if rows is None:
                ids[:, length] = token
            else:
                ids[rows, length] = token
            running &= ~torch.isin(token, eos)
            length += 1
            left = int(running.sum())
            if length == total or left == 0:
                return ids[:, :length]
            if compaction.due(left, running.numel()):
                running, model_kwargs = compaction.keep(model, running, model_kwargs, logits_processor)
            held = ids[:, :length] if compaction.rows is None else ids[compaction.rows, :length]
            inputs = model.prepare_inputs_for_generation(held, next_sequence_length=1, **model_kwargs)
            outputs = model(**inputs, return_dict=True)


def decode_processors(logits_processor, prompt_length, device):
    """`generate`'s logits processors as the decoding loop applies them, each with the same result at every token:
    a minimum length the prompt already reaches left out (it would only copy the scores: no EOS is ever masked),
    token suppression with its vocabulary mask built once rather than at every token."""
    kept = []
    for processor in logits_processor:
        if type(processor) is lp.MinLengthLogitsProcessor and processor.min_length <= prompt_length:
            continue
        if type(processor) is lp.SuppressTokensLogitsProcessor:
            processor = SuppressedTokens(processor.suppress_tokens.to(device))
        kept.append(processor)
    return kept


class SuppressedTokens:
    """SuppressTokensLogitsProcessor with its mask over the vocabulary built at the first token: -inf at the
    suppressed ids, the scores elsewhere (the same numbers as its `torch.where`)."""

    def __init__(self, token_ids):
        self.token_ids, self.mask = token_ids, None

    def __call__(self, input_ids, scores):
        if self.mask is None or self.mask.shape[-1] != scores.shape[-1]:
            self.mask = torch.isin(torch.arange(scores.shape[-1], device=scores.device), self.token_ids)
        return scores.masked_fill(self.mask, -float("inf"))


# The model inputs `generate` carries from step to step with one row per sequence (batch dimension first; position
# ids may carry a leading rope-section dimension), and the inputs it only forwards in the prefill.
PER_ROW_INPUTS = ("attention_mask", "position_ids", "token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")
PREFILL_ONLY_INPUTS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "image_sizes", "image_position_ids",
                       "video_position_ids")


class Compaction:
    """Which rows of the decoding batch the model still runs, and the selection of every per-row state when
    finished rows leave: the model inputs `generate` carries (PER_ROW_INPUTS), the KV cache, Qwen-VL's rope
    offsets on the model, and the Gumbel sampler's noise. Off (`rows` None throughout) where a processor, an input
    or a cache layer is not one it knows how to select."""

    MIN_ROWS = 4

    def __init__(self, enabled):
        self.enabled, self.rows = enabled, None

    @classmethod
    def for_decoding(cls, model, logits_processor, model_kwargs, batch):
        from transformers.generation import logits_process as lp
        from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL

        row_free = (lp.SuppressTokensLogitsProcessor, lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor)
        known = all(isinstance(p, (*row_free, GumbelSampler)) for p in logits_processor)
        unknown_inputs = [k for k, v in model_kwargs.items() if torch.is_tensor(v) and k not in PER_ROW_INPUTS
                          and k not in PREFILL_ONLY_INPUTS and k not in MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL]
        cache = kv_cache(model_kwargs)
        selectable = cache is None or (isinstance(cache, DynamicCache) and all(
            hasattr(type(layer), "batch_select_indices") for layer in cache.layers))
        return cls(known and not unknown_inputs and selectable and batch > cls.MIN_ROWS)

    def due(self, left, held):
        return self.enabled and left <= 0.75 * held and held > self.MIN_ROWS

    def keep(self, model, running, model_kwargs, logits_processor):
        """Drop the finished rows (keeping MIN_ROWS rows at least); returns (running, model_kwargs) of the rows
        kept."""
        keep = running.nonzero().squeeze(1)
        if keep.numel() < self.MIN_ROWS:  # fill up with finished rows, which decode padding as in `generate`
            keep = torch.cat([keep, (~running).nonzero().squeeze(1)[: self.MIN_ROWS - keep.numel()]]).sort().values
        cache, held = kv_cache(model_kwargs), running.numel()
        for name in PER_ROW_INPUTS:
            value = model_kwargs.get(name)
            if torch.is_tensor(value):
                model_kwargs[name] = value.index_select(value.dim() - 2, keep)  # [.., rows, positions]
        for name in PREFILL_ONLY_INPUTS:
            model_kwargs.pop(name, None)
        if cache is not None:
            cache.batch_select_indices(keep)
        for module in _rope_holders(model):
            if module.rope_deltas.shape[0] == held:
                module.rope_deltas = module.rope_deltas[keep]
        for processor in logits_processor:
            if isinstance(processor, GumbelSampler):
                processor.select_rows(keep)
        self.rows = keep if self.rows is None else self.rows[keep]
        return running[keep], model_kwargs


def _rope_holders(model):
    """The modules holding Qwen-VL's per-row rope offsets (however deep PEFT or a wrapper has put the core)."""
    return [m for m in model.modules() if torch.is_tensor(getattr(m, "rope_deltas", None))]


class PreallocatedLayer(DynamicLayer):
    """A full-attention layer's keys and values in buffers of the rollout's final length: `update` writes the new
    positions in place and returns views of the filled part, where DynamicLayer concatenates (a copy of the whole
    layer cache per token). The views hold the same numbers the concatenation would."""

    def __init__(self, layer, capacity):
        super().__init__()
        keys, values = layer.keys, layer.values
        filled = keys.shape[-2]
        self._keys = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
        self._values = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
        self._keys[..., :filled, :] = keys
        self._values[..., :filled, :] = values
        self.keys, self.values = self._keys[..., :filled, :], self._values[..., :filled, :]
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices):
        filled = self.keys.shape[-2]
        self._keys, self._values = self._keys[indices], self._values[indices]
        self.keys, self.values = self._keys[..., :filled, :], self._values[..., :filled, :]


def preallocate_cache(cache, capacity):
    """Move each filled full-attention layer of a DynamicCache into a `PreallocatedLayer` of `capacity` positions
    (sliding-window, linear-attention and shared layers keep their own classes)."""
    for k, layer in enumerate(getattr(cache, "layers", ())):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[k] = PreallocatedLayer(layer, capacity)


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
    for module in _rope_holders(model):
        module.rope_deltas = module.rope_deltas[idx]
    return {"input_ids": ids[idx], "attention_mask": prompts["attention_mask"][idx]}, cache


def kv_cache(model_kwargs):
    """The KV cache among `generate`'s model kwargs, under either of its names (`cache_kwargs`)."""
    return model_kwargs.get("cache", model_kwargs.get("past_key_values"))


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
