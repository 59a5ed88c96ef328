"""The HF rollout with a static KV cache and a compiled decode step (--cache_implementation static).

HF `generate` at small batch spends most of a decoding step in Python: the model's module calls, the cache's
bookkeeping, the mask and position updates. Here the prefill and the first token stay eager (they are
`utils.core.rollout.generate_completions` with one new token, so prompt sharing, images and videos work unchanged), its
KV cache is copied into a transformers `StaticCache`, and every later token is one call of a `torch.compile`d
decode step on fixed shapes (CUDA graphs on a GPU). The loop around it applies the logits processors
`generate` built for the first token (our counter-based Gumbel sampler included) with `generate`'s own position
and padding rules, so a completion can differ from the eager one only where the compiled kernels round a logit
differently (tests/test_compiled_generation.py measures how often).

The compiled step reads the module's parameters at each call: an optimizer step (in place) is seen by the next
rollout without recompiling. One compiled step serves the whole run; a new batch size or cache bucket compiles once
more. Caches are sized to the next power of two of prompt + completion tokens, so a run compiles a handful of times.

Used by train_grpo.py alone (and bench/bench_compiled_rollout.py, which times it).
"""

import contextlib

import torch
from transformers import DynamicCache, StaticCache

from utils.core.config import ConfigError
from utils.core.rollout import cache_kwargs, completion_mask, generate_completions
from utils.core.seeds import GumbelSampler

CACHE_IMPLEMENTATIONS = ("dynamic", "auto", "static")  # the first is the default
_MIN_CACHE_LEN = 64


def static_cache_unsupported_reason(model, *, use_vllm=False, zero3=False):
    """Why --cache_implementation static cannot run here, or None."""
    if use_vllm:
        return "--use_vllm generates with vLLM, which has its own cache and CUDA graphs"
    if zero3:
        return ("ZeRO-3 (and FSDP2) gather the sharded weights into new tensors for each generation, so the compiled "
                "step (its CUDA graphs) would be rebuilt at every rollout; use ZeRO-1/2 or DDP")
    text = model.config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return (f"{type(model).__name__} has {', '.join(sorted(kinds - {'full_attention'}))} layers; the compiled "
                "rollout copies a full-attention KV cache only")
    return None


def resolve_cache_implementation(flag, model, *, device, use_vllm=False, zero3=False, notice=print):
    """--cache_implementation: 'static' requires the compiled rollout (an error with the reason where it cannot
    run), 'dynamic' keeps HF generate's eager decoding, 'auto' is static on CUDA where it can run (a one-line notice
    says why not) and dynamic elsewhere (on a CPU it wins only at small batch, by less than its compile time costs a
    short run: docs/results). Returns True for the compiled rollout."""
    flag = flag or "dynamic"  # none: the model's own cache, as TRL reads it
    if flag not in CACHE_IMPLEMENTATIONS:
        raise ConfigError(f"--cache_implementation {flag!r} is not one of {', '.join(CACHE_IMPLEMENTATIONS)}")
    if flag == "dynamic" or (flag == "auto" and (torch.device(device).type != "cuda" or use_vllm)):
        return False  # (with vLLM the HF rollout does not run: nothing to say)
    reason = static_cache_unsupported_reason(model, use_vllm=use_vllm, zero3=zero3)
    if reason and flag == "static":
        raise ConfigError(f"--cache_implementation static: {reason}")
    if reason:
        notice(f"--cache_implementation auto: dynamic (eager decoding): {reason}")
    return reason is None


def _decode_step(model, cache, input_ids, position_ids, attention_mask):
    """One token per row through the model on the static cache; float logits [B, V]."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1,
                **cache_kwargs(model, cache), **kwargs)
    return out.logits[:, -1].float()


def cache_bucket(tokens):
    """The static cache length for `tokens` prompt + completion tokens: the next power of two (>= 64)."""
    return max(_MIN_CACHE_LEN, 1 << (int(tokens) - 1).bit_length())


class CompiledRollout:
    """`generate_completions` with a compiled decode step; one per policy, reused for the whole run.

    `backend` / `mode` go to `torch.compile` (default: inductor, with CUDA graphs on a GPU). `generate` takes
    `generate_completions`'s arguments and returns the same (completion_ids, completion_mask)."""

    def __init__(self, backend="inductor", mode=None):
        self.backend, self.mode = backend, mode
        self._caches = {}  # (batch, length, dtype, device) -> StaticCache, each filled in place by every call
        self._step = None
        self.compiles = 0  # distinct (batch, cache length) shapes compiled so far

    def _compiled_step(self, device):
        if self._step is None:
            mode = self.mode if self.mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
            self._step = torch.compile(_decode_step, backend=self.backend, mode=mode, fullgraph=False, dynamic=False)
        return self._step

    def _static_cache(self, model, prefix, length):
        """A StaticCache of `length` positions holding the eager prefill `prefix` (a DynamicCache)."""
        layer = prefix.layers[0]
        key = (layer.keys.shape[0], length, layer.keys.dtype, layer.keys.device)
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = StaticCache(config=model.config, max_cache_len=length)
            self.compiles += 1
        cache.reset()
        for static, dynamic in zip(cache.layers, prefix.layers, strict=True):
            static.update(dynamic.keys, dynamic.values)
        return cache

    @torch.no_grad()
    def generate(self, model, batch, *, row_seeds, max_new_tokens, temperature, top_k=None, top_p=None,
                 eos_token_id, pad_token_id, suppress_token_ids=(), prompt_index=None):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with _capture_generate(base) as seen:  # the eager prefill and first token, exactly as the eager rollout
            first, _ = generate_completions(model, batch, row_seeds=row_seeds, max_new_tokens=1,
                                            temperature=temperature, top_k=top_k, top_p=top_p,
                                            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                            suppress_token_ids=suppress_token_ids, prompt_index=prompt_index,
                                            decoder="generate")
        eos = torch.tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id],
                           device=first.device)
        unfinished = ~torch.isin(first[:, 0], eos)
        if max_new_tokens == 1 or not bool(unfinished.any()):
            return first, completion_mask(first, eos.tolist())
        prompt_ids, mask = seen["input_ids"], seen["attention_mask"]
        B, P = prompt_ids.shape
        length = cache_bucket(P + max_new_tokens)
        cache = self._static_cache(base, seen["cache"], length)
        # generate's rules: positions continue from the prompt's last one (+1 per token, every rope row);
        # the 2-D mask is the prompt's with ones after it
        positions = None if seen["position_ids"] is None else seen["position_ids"][..., -1:]
        attention = torch.cat([mask, mask.new_ones(B, length - P)], dim=1)
        ids = torch.cat([prompt_ids, torch.full((B, max_new_tokens), pad_token_id, dtype=prompt_ids.dtype,
                                                device=prompt_ids.device)], dim=1)
        ids[:, P] = first[:, 0]
        for sampler in seen["processors"]:  # the Gumbel sampler draws its noise in blocks of the whole budget
            if isinstance(sampler, GumbelSampler):
                sampler.max_new_tokens = max_new_tokens
        step_fn = self._compiled_step(prompt_ids.device)
        pad = torch.tensor(pad_token_id, device=ids.device)
        t = 1
        while t < max_new_tokens and bool(unfinished.any()):
            if prompt_ids.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            logits = step_fn(base, cache, ids[:, P + t - 1:P + t].contiguous(),
                             None if positions is None else positions + t, attention).clone()
            scores = seen["processors"](ids[:, :P + t], logits)
            token = torch.where(unfinished, scores.argmax(-1), pad)
            ids[:, P + t] = token
            unfinished &= ~torch.isin(token, eos)
            t += 1
        completion = ids[:, P:P + t]
        return completion, completion_mask(completion, eos.tolist())


@contextlib.contextmanager
def _capture_generate(model):
    """What `generate` used for its prefill: the model inputs (ids, mask, positions, cache) and the logits
    processors it built (the model's generation_config defaults merged in, our sampler last)."""
    seen = {"processors": None}

    def pre_hook(_module, _args, kwargs):
        if "input_ids" not in seen or "cache" in seen:  # generate's prefill only (not a shared prompt's pass)
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, DynamicCache):
            raise RuntimeError("the compiled rollout expected generate's prefill to fill a DynamicCache")
        seen.update(cache=cache, position_ids=kwargs.get("position_ids"), prefill_ids=kwargs["input_ids"])

    get_processors = model._get_logits_processor

    def spy(*args, **kwargs):
        seen["processors"] = get_processors(*args, **kwargs)
        return seen["processors"]

    original_generate = model.generate

    def generate(*args, **kwargs):
        seen["input_ids"] = kwargs["input_ids"]
        seen["attention_mask"] = kwargs["attention_mask"]
        return original_generate(*args, **kwargs)

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model._get_logits_processor, model.generate = spy, generate
    try:
        yield seen
    finally:
        handle.remove()
        del model._get_logits_processor, model.generate
    if seen["processors"] is None or "cache" not in seen:
        raise RuntimeError("the compiled rollout could not follow transformers' generate (its internals changed); "
                           "use --cache_implementation dynamic")
