"""Per-token log-probs of sampled completions under the policy and the reference model, through the fused
LM-head kernel (the [tokens, vocab] logits never exist); a group's completions can share one prompt pass."""

import contextlib

import torch
from torch import nn

from kernels import fused_token_logprobs
from utils.core.encoding import check_features_match_tokens
from utils.core.models import activation_checkpointing_on, adapters_disabled, load_model_and_processor, model_flags
from utils.core.packing import packed_completion_hidden
from utils.core.rollout import cache_kwargs
from utils.core.trajectories import PIXEL_KEYS, full_side, has_media, sequence_media, side_keys


def hf_core(model):
    """The HF model behind PEFT/DDP wrappers (LoRA layers stay injected in it)."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    return model


class CompletionLogProbs(nn.Module):
    """Wraps a causal LM / VLM so that forward returns per-token log-probs of the completion.

    Only the completion positions go through the LM head, via `kernels.fused_token_logprobs`: the
    [tokens, vocab] logits never exist. Wrapping (rather than reaching into the model from outside)
    keeps DDP gradient hooks and ZeRO-3 parameter gathering working, since everything runs in forward.
    """

    def __init__(self, model, padding_free=False):
        super().__init__()
        self.model = model
        self.padding_free = padding_free  # one packed pass without padding tokens (utils/core/packing.py)
        head = hf_core(model).get_output_embeddings()
        self._zero3_register(head)

    def _zero3_register(self, head):
        # Under ZeRO-3 a weight is only gathered while its own module runs; the head's forward never
        # runs here, so register its weight as used by this module's forward.
        if hasattr(head.weight, "ds_id"):
            import deepspeed  # `deepspeed.zero` is an attribute, not an importable module: `from deepspeed.zero` fails

            deepspeed.zero.register_external_parameter(self, head.weight)
            if head.bias is not None:
                deepspeed.zero.register_external_parameter(self, head.bias)

    @property
    def config(self):
        return hf_core(self.model).config

    def forward(self, prompt_inputs, completion_ids, completion_mask, temperature=1.0, return_entropy=False,
                prompt_index=None, completion_inputs=None, label_mask=None):
        """Log-probs [B, T] of the completions. With `prompt_index` ([B], row of `prompt_inputs` for each
        completion) the G completions of a group share one forward pass over their prompt.

        Tool trajectories (utils/core/tool_rollout.py): `completion_inputs` holds the side inputs and images of the
        tool tokens inside the completions (utils/core/trajectories.py), and `label_mask` the tokens to score (the
        model's own; default: all of `completion_mask`, which stays the attention's); 0 elsewhere."""
        core = hf_core(self.model)
        labels = completion_mask if label_mask is None else label_mask
        if self.padding_free:
            hidden, _ = packed_completion_hidden(core.base_model, prompt_inputs, prompt_index, completion_ids,
                                                 completion_mask, completion_inputs=completion_inputs)
            return self._head_logprobs(core, hidden, completion_ids, labels, temperature, return_entropy)
        if prompt_index is not None:
            if not activation_checkpointing_on(core):
                return self._shared_prompt_forward(core, prompt_inputs, prompt_index, completion_ids, completion_mask,
                                                   temperature, return_entropy, completion_inputs, labels)
            prompt_inputs = expand_prompts(prompt_inputs, prompt_index)
        input_ids = torch.cat([prompt_inputs["input_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([prompt_inputs["attention_mask"],
                                    completion_mask.to(prompt_inputs["attention_mask"])], dim=1)
        extra = {}
        for key, value in prompt_inputs.items():
            if key in ("input_ids", "attention_mask"):
                continue
            if torch.is_tensor(value) and value.dim() == 2 and value.shape == prompt_inputs["input_ids"].shape:
                # Per-token side inputs (mm_token_type_ids, token_type_ids): the tool tokens' own, text (0) elsewhere.
                value = full_side(value, completion_ids, completion_inputs, key)
            extra[key] = value
        if has_media(completion_inputs):  # each sequence's prompt images, then its tool images
            extra.update(sequence_media(core.config, prompt_inputs, None, completion_ids, completion_mask,
                                        completion_inputs))
        check_features_match_tokens(core.config, dict(extra, input_ids=input_ids))
        hidden = core.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
        prompt_length = prompt_inputs["input_ids"].shape[1]
        # The hidden state at position i predicts token i + 1.
        hidden = hidden[:, prompt_length - 1 : -1, :]
        return self._head_logprobs(core, hidden, completion_ids, labels, temperature, return_entropy)

    @staticmethod
    def _head_logprobs(core, hidden, completion_ids, completion_mask, temperature, return_entropy):
        """Log-probs of the completion tokens from the hidden states that predict them (padding ignored)."""
        labels = completion_ids.masked_fill(completion_mask == 0, -100)
        head = core.get_output_embeddings()
        return fused_token_logprobs(hidden, head.weight, labels, bias=head.bias, temperature=temperature,
                                    return_entropy=return_entropy)


    def _shared_prompt_forward(self, core, prompts, prompt_index, completion_ids, completion_mask, temperature,
                               return_entropy, completion_inputs=None, labels=None):
        """Each unique prompt (vision tower included) runs once; its KV cache is then index-selected to the
        completions, so a group's completions share it and its gradient sums over them. Positions (Qwen's
        3-D rope too) are those of the full sequences, as in the unshared forward. Tool images inside the
        completions go through the vision tower in the completions' pass."""
        from transformers import DynamicCache

        check_features_match_tokens(core.config, prompts)
        base = core.base_model
        idx = torch.as_tensor(prompt_index, device=completion_ids.device)
        p_ids, p_mask = prompts["input_ids"], prompts["attention_mask"]
        lp = p_ids.shape[1]
        full_mask = torch.cat([p_mask[idx], completion_mask.to(p_mask)], 1)
        extra = {k: v for k, v in prompts.items() if k not in ("input_ids", "attention_mask")}
        continuation = dict(side_keys(completion_inputs, completion_ids.shape))
        if has_media(completion_inputs):
            continuation.update({k: completion_inputs[k] for k in PIXEL_KEYS})
        prefix_pos = completion_pos = None
        if "mm_token_type_ids" in prompts and hasattr(base, "get_rope_index"):  # Qwen-VL: 3-D rope; Gemma 4: 1-D
            full = expand_prompts(prompts, idx)
            mm = full_side(full["mm_token_type_ids"], completion_ids, completion_inputs, "mm_token_type_ids")
            grids = full.get("image_grid_thw")
            if has_media(completion_inputs):
                grids = sequence_media(core.config, prompts, idx, completion_ids, completion_mask,
                                       completion_inputs)["image_grid_thw"]
            pos, _ = base.get_rope_index(torch.cat([full["input_ids"], completion_ids], 1), mm,
                                         image_grid_thw=grids, attention_mask=full_mask,
                                         **{k: full[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in full})
            first = torch.stack([(idx == p).nonzero()[0, 0] for p in range(p_ids.shape[0])])
            prefix_pos, completion_pos = pos[:, first, :lp], pos[:, :, lp:]
        cache = DynamicCache(config=core.config)
        out = base(input_ids=p_ids, attention_mask=p_mask, position_ids=prefix_pos,
                   **cache_kwargs(base, cache), use_cache=True, **extra)
        last = out.last_hidden_state[:, -1]  # left padding: the last column is each prompt's last token
        cache.batch_select_indices(idx)
        out = base(input_ids=completion_ids, attention_mask=full_mask, position_ids=completion_pos,
                   **cache_kwargs(base, cache), use_cache=True, **continuation)
        hidden = torch.cat([last[idx][:, None], out.last_hidden_state[:, :-1]], 1)
        labels = completion_mask if labels is None else labels
        return self._head_logprobs(core, hidden, completion_ids, labels, temperature, return_entropy)


# Families whose prompt pass (vision tower, rope, image attention) is exact when shared by a group's completions,
# with one image per prompt: Qwen-VL's and GLM's flattened patches split per prompt by image_grid_thw (Qwen3-VL's
# DeepStack features only touch the prompt's image positions, its interleaved rope is rebuilt on the full
# sequences); Gemma 3's soft tokens attend to each other only inside the prompt pass (token_type_ids) and its
# pixel rows are one per image without pan-and-scan crops; Gemma 4's likewise (mm_token_type_ids, on its sliding
# layers only), its positions are 1-D, its pixel and patch-position rows one per image, and its KV-sharing layers
# read their producer layer's cache-extended keys; SmolVLM/Idefics3 and LLaVA-OneVision keep one pixel row per
# prompt. docs/models.md lists the families left out and why.
SHARED_PROMPT_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "gemma3", "gemma4", "idefics3",
                          "llava_onevision")
# with one video per prompt (tests/test_video_train.py, tests/test_video_qwen3_vl.py)
VIDEO_SHARED_PROMPT_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def can_share_prompts(model, images_per_prompt, videos_per_prompt=None):
    """Whether a group's completions can share one prompt pass: text-only models, and the SHARED_PROMPT_FAMILIES
    with one image per prompt; with videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), one video per prompt and one image per
    prompt or none (pixel_values_videos split by video_grid_thw; Qwen3-VL's timestamps are prompt text)."""
    config = hf_core(model).config
    if videos_per_prompt is not None and any(videos_per_prompt):
        return (config.model_type in VIDEO_SHARED_PROMPT_FAMILIES and all(n == 1 for n in videos_per_prompt)
                and len(set(images_per_prompt)) == 1 and images_per_prompt[0] in (0, 1))
    if all(n == 0 for n in images_per_prompt):
        return not hasattr(config, "vision_config")
    return config.model_type in SHARED_PROMPT_FAMILIES and all(n == 1 for n in images_per_prompt)


def expand_prompts(prompts, prompt_index):
    """The per-completion prompt batch from unique prompts (one image / video per prompt when there are any)."""
    idx = torch.as_tensor(prompt_index)
    out = {}
    for key, value in prompts.items():
        grid = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}.get(key)
        if grid in prompts:
            chunks = value.split(prompts[grid].prod(-1).tolist())
            out[key] = torch.cat([chunks[i] for i in idx.tolist()])
        elif torch.is_tensor(value):
            out[key] = value[idx.to(value.device)]
        else:
            out[key] = value
    return type(prompts)(out) if not isinstance(prompts, dict) else out


class AdapterDisabledReference(nn.Module):
    """The reference policy of a LoRA run: the same model with its adapters switched off (no copy). Under
    --sync_ref_model, `adapter_swap` (utils.core.ref_sync) puts the reference's own adapters in place instead, once
    it has synced."""

    def __init__(self, policy, accelerator):
        super().__init__()
        self._policy = [policy]  # a list so the policy is not registered (and not saved) twice
        self._accelerator = accelerator
        self.adapter_swap = None  # () -> context manager yielding whether the reference's adapters are in place

    def forward(self, *args, **kwargs):
        policy = self._policy[0]
        with self.adapter_swap() if self.adapter_swap else contextlib.nullcontext(False) as swapped:
            if swapped:
                return policy(*args, **kwargs)
        with adapters_disabled(self._accelerator.unwrap_model(policy).model):  # requires_grad left as it is
            return policy(*args, **kwargs)


def prepare_reference_model(cfg, model_path, policy, accelerator, padding_free=False):
    """A frozen copy of the initial policy for the KL term (only built when beta != 0).

    With LoRA the base weights are the reference, so adapters are disabled instead of loading a copy.
    Under DeepSpeed the copy is sharded like the policy (ZeRO-3 inference engine).
    """
    if cfg.use_peft:
        return AdapterDisabledReference(policy, accelerator)
    ref, _ = load_model_and_processor(model_path, **model_flags(cfg, freeze_vision_tower=False))
    ref.requires_grad_(False)
    ref = CompletionLogProbs(ref, padding_free=padding_free).eval()
    if accelerator.distributed_type.name == "DEEPSPEED":
        import deepspeed

        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        stage = ds.get("zero_optimization", {}).get("stage", 0)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage if stage == 3 else 0},
                  "bf16": {"enabled": bool(ds.get("bf16", {}).get("enabled", False))}}
        engine, *_ = deepspeed.initialize(model=ref, config=config)
        engine.eval()  # DeepSpeedEngine.eval() returns None, unlike nn.Module.eval()
        return engine
    return ref.to(accelerator.device)
