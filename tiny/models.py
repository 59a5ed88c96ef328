"""Tiny models built from configs, so the whole stack runs on a CPU without downloading anything.

- `make_tiny_vlm`: a tiny VLM of one family (tiny.tokenizer.ALL_FAMILIES: Qwen2.5-VL (default), Qwen2-VL, Qwen3-VL,
  Qwen3.5, Gemma 3, Gemma 4, InternVL3 / InternVL3.5, GLM-4.1V, SmolVLM, LLaVA-OneVision) with transformers' own
  classes and processors, saved as an ordinary HF folder (`AutoModelForImageTextToText` / `AutoProcessor` load it).
- `make_tiny_llm`: a tiny text-only Qwen2 or Qwen3 causal LM with the same tokenizer and chat template.
- `make_tiny_flow_model`: a tiny diffusers flow-matching generator (SD3 transformer, VAE, scheduler).

All share the byte-level BPE of `tiny.tokenizer`. Weights are random but deterministic for a seed.
Over 400 lines on purpose: each family's builder sits beside the others, so their differences read side by side.
"""

from __future__ import annotations

import json
import os

import torch

from tiny.tokenizer import _FAMILY_TOKENS, ALL_FAMILIES, DEFAULT_BPE_VOCAB, _token_ids, make_tiny_tokenizer
from utils.models import ModelLoadError, resolve_dtype

# --------------------------------------------------------------------------------------------------
# Vision-language models
# --------------------------------------------------------------------------------------------------


def _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, eos_id, pad_id):
    return dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=max(1, num_attention_heads // 2),
        max_position_embeddings=2048,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )


def _mrope_section(head_dim: int) -> list[int]:
    # (temporal, height, width) rotary halves; they must sum to head_dim / 2.
    half = head_dim // 2
    t = half - 2 * (3 * half // 8)
    return [t, 3 * half // 8, 3 * half // 8]


def _qwen2_vl(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
              vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    """Qwen2-VL: Qwen2.5-VL's tokens, processor and M-RoPE, but a ViT of full attention (no windows), LayerNorm and
    a quick-GELU MLP, with its own width (`embed_dim`) merged into the LM's (`hidden_size`)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    config = Qwen2VLConfig(
        vision_config=dict(depth=vision_depth, embed_dim=vision_hidden_size, hidden_size=hidden_size, mlp_ratio=4,
                           num_heads=vision_heads, patch_size=patch_size, spatial_merge_size=merge_size,
                           temporal_patch_size=2),
        **_qwen_vl_text(tok, vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size),
    )
    image_processor, video_processor = _qwen_vl_processors(image_size, patch_size, merge_size)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                 chat_template=tok.chat_template)
    return Qwen2VLForConditionalGeneration(config), processor


def _qwen_vl_text(tok, vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size):
    """The config arguments Qwen2-VL and Qwen2.5-VL share: the text config with M-RoPE, the vision token ids."""
    ids = _token_ids(tok, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": _mrope_section(hidden_size // num_attention_heads)}
    return dict(text_config=text, image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2],
                vision_end_token_id=ids[3], tie_word_embeddings=True)


def _qwen_vl_processors(image_size, patch_size, merge_size):
    """The image and video processors of Qwen2-VL and Qwen2.5-VL."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    factor = patch_size * merge_size
    # An image_size x image_size image keeps its size (smart_resize rounds to multiples of `factor`);
    # larger ones are capped at 4x the pixels so a stray big image cannot blow up the sequence.
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": factor * factor, "longest_edge": 4 * image_size * image_size},
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
    )
    return image_processor, Qwen2VLVideoProcessor(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2)


def _qwen2_5_vl(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    config = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=4 * vision_hidden_size,
            num_heads=vision_heads, patch_size=patch_size, spatial_merge_size=merge_size,
            temporal_patch_size=2, out_hidden_size=hidden_size, window_size=patch_size * merge_size * 4,
            fullatt_block_indexes=[vision_depth - 1],
        ),
        **_qwen_vl_text(tok, vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size),
    )
    image_processor, video_processor = _qwen_vl_processors(image_size, patch_size, merge_size)
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                                    video_processor=video_processor, chat_template=tok.chat_template)
    return Qwen2_5_VLForConditionalGeneration(config), processor


def _internvl(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
              vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab, text_type="qwen2"):
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    per_side = image_size // patch_size
    if per_side * patch_size != image_size or per_side % merge_size:
        raise ValueError(f"internvl: image_size {image_size} must be a multiple of patch_size*{merge_size}")
    image_seq_length = (per_side // merge_size) ** 2
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text.update(model_type=text_type, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = InternVLConfig(
        text_config=text,
        vision_config=dict(
            hidden_size=vision_hidden_size, num_hidden_layers=vision_depth, num_attention_heads=vision_heads,
            intermediate_size=4 * vision_hidden_size, image_size=image_size, patch_size=patch_size,
        ),
        image_token_id=tok.context_image_token_id,
        image_seq_length=image_seq_length,
        downsample_ratio=1.0 / merge_size,
        tie_word_embeddings=True,
    )
    image_processor = GotOcr2ImageProcessor(
        size={"height": image_size, "width": image_size}, crop_to_patches=True, min_patches=1, max_patches=4,
    )
    video_processor = InternVLVideoProcessor(size={"height": image_size, "width": image_size})
    processor = InternVLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                  image_seq_length=image_seq_length, chat_template=tok.chat_template)
    return InternVLForConditionalGeneration(config), processor


def _glm4v(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
           vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    from transformers import (
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vVideoProcessor,
    )

    ids = dict(zip(
        ("image", "video", "image_start", "image_end", "video_start", "video_end"),
        _token_ids(tok, ["<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>",
                         "<|begin_of_video|>", "<|end_of_video|>"]),
    ))
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text["eos_token_id"] = _token_ids(tok, _FAMILY_TOKENS["glm4v"]["stop"])
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": _mrope_section(hidden_size // num_attention_heads // 2),
                               "partial_rotary_factor": 0.5}  # GLM rotates half of each head
    config = Glm4vConfig(
        text_config=text,
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=4 * vision_hidden_size,
            num_heads=vision_heads, image_size=image_size, patch_size=patch_size,
            spatial_merge_size=merge_size, temporal_patch_size=2, out_hidden_size=hidden_size,
        ),
        image_token_id=ids["image"], video_token_id=ids["video"],
        image_start_token_id=ids["image_start"], image_end_token_id=ids["image_end"],
        video_start_token_id=ids["video_start"], video_end_token_id=ids["video_end"],
        tie_word_embeddings=False,
    )
    factor = patch_size * merge_size
    # GLM repeats a still image over 2 frames, so the pixel budget counts 2 frames.
    image_processor = Glm4vImageProcessor(
        size={"shortest_edge": 2 * factor * factor, "longest_edge": 2 * 4 * image_size * image_size},
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
    )
    video_processor = Glm4vVideoProcessor(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2)
    processor = Glm4vProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                               chat_template=tok.chat_template)
    return Glm4vForConditionalGeneration(config), processor


def _qwen_vision_processor(tok, image_size, patch_size, merge_size, video_cls):
    """Qwen-VL's image processor at tiny pixel bounds: an image_size x image_size image keeps its size."""
    from transformers import Qwen2VLImageProcessor

    factor = patch_size * merge_size
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": factor * factor, "longest_edge": 4 * image_size * image_size},
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],  # Qwen3-VL's normalisation (not CLIP's)
    )
    return image_processor, video_cls(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2)


def _qwen3_vl_like(config_cls, model_cls, tok, image_size, hidden_size, num_hidden_layers, num_attention_heads,
                   intermediate_size, vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab,
                   text_extra, vision_extra):
    """Qwen3-VL and Qwen3.5: 16 px patches, learned vision position embeddings (one per patch of an image_size
    image), interleaved 3-D rope, Qwen3-VL's processor with Qwen-VL's image processor."""
    from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

    ids = dict(zip(("image", "video", "start", "end"), _token_ids(
        tok, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])))
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text.update(head_dim=hidden_size // num_attention_heads, **text_extra)
    per_side = image_size // patch_size
    config = config_cls(
        text_config=text,
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=4 * vision_hidden_size,
            num_heads=vision_heads, patch_size=patch_size, spatial_merge_size=merge_size, temporal_patch_size=2,
            out_hidden_size=hidden_size, num_position_embeddings=per_side * per_side, **vision_extra,
        ),
        image_token_id=ids["image"], video_token_id=ids["video"],
        vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
        tie_word_embeddings=True,
    )
    image_processor, video_processor = _qwen_vision_processor(tok, image_size, patch_size, merge_size,
                                                              Qwen3VLVideoProcessor)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                 chat_template=tok.chat_template)
    return model_cls(config), processor


def _qwen3_vl(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, *sizes):
    """Qwen3-VL (dense), with DeepStack: the features of vision block 0 are added to the LM's first hidden layer."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    head_dim = hidden_size // num_attention_heads
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": _mrope_section(head_dim),
            "mrope_interleaved": True}
    return _qwen3_vl_like(Qwen3VLConfig, Qwen3VLForConditionalGeneration, tok, image_size, hidden_size,
                          num_hidden_layers, num_attention_heads, *sizes, text_extra={"rope_parameters": rope},
                          vision_extra={"deepstack_visual_indexes": [0]})


def _qwen3_5(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, *sizes):
    """Qwen3.5 (its VLM class): a hybrid LM, Gated DeltaNet linear-attention layers then a full-attention layer
    (here 1 + 1), a quarter of each head rotated; Qwen3-VL's tower without DeepStack."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    head_dim = hidden_size // num_attention_heads
    text = dict(layer_types=["linear_attention"] * (num_hidden_layers - 1) + ["full_attention"],
                linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": _mrope_section(head_dim // 4), "mrope_interleaved": True})
    return _qwen3_vl_like(Qwen3_5Config, Qwen3_5ForConditionalGeneration, tok, image_size, hidden_size,
                          num_hidden_layers, num_attention_heads, *sizes, text_extra=text, vision_extra={})


def _gemma3(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
            vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    """Gemma 3: a SigLIP tower whose patches are average-pooled merge_size x merge_size to a fixed number of soft
    tokens per image, attended bidirectionally (token_type_ids); sliding-window and global layers alternate."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    per_side = image_size // patch_size
    if per_side * patch_size != image_size or per_side % merge_size:
        raise ValueError(f"gemma3: image_size {image_size} must be a multiple of patch_size*{merge_size}")
    tokens_per_image = (per_side // merge_size) ** 2
    head_dim = hidden_size // num_attention_heads
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text.update(bos_token_id=tok.bos_token_id, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * (num_hidden_layers // 2)
                + ["sliding_attention"] * (num_hidden_layers % 2))
    boi, eoi, soft = _token_ids(tok, ["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    config = Gemma3Config(
        text_config=text,
        vision_config=dict(hidden_size=vision_hidden_size, intermediate_size=4 * vision_hidden_size,
                           num_hidden_layers=vision_depth, num_attention_heads=vision_heads, image_size=image_size,
                           patch_size=patch_size, vision_use_head=False),
        mm_tokens_per_image=tokens_per_image, boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft,
        tie_word_embeddings=True,
    )
    image_processor = Gemma3ImageProcessor(size={"height": image_size, "width": image_size},
                                           image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                           do_pan_and_scan=False, pan_and_scan_min_crop_size=image_size // 2,
                                           pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=tokens_per_image,
                                chat_template=tok.chat_template)
    return Gemma3ForConditionalGeneration(config), processor


def _gemma4(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
            vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    """Gemma 4: a vision tower whose patches are pooled pooling_kernel x pooling_kernel (3x3, as released) into soft
    tokens, each image resized (aspect kept) to a soft-token budget (`max_soft_tokens`: 70, the smallest the
    processor allows) and wrapped in `<|image>` ... `<image|>`; image tokens attend to each other bidirectionally
    (`use_bidirectional_attention="vision"`, mm_token_type_ids); sliding and global layers (the last global), per-layer
    input embeddings. No audio tower (the processor still carries the audio feature extractor it requires).
    `image_size` is unused: the processor sizes every image to the budget."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    head_dim = hidden_size // num_attention_heads
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text.update(bos_token_id=tok.bos_token_id, head_dim=head_dim, global_head_dim=head_dim, sliding_window=8,
                layer_types=["sliding_attention"] * (num_hidden_layers - 1) + ["full_attention"],
                vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=16,
                use_bidirectional_attention="vision")
    ids = dict(zip(("boi", "eoi", "image", "video", "boa", "eoa", "audio"), _token_ids(
        tok, ["<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>"])))
    budget, pool = 70, 3
    config = Gemma4Config(
        text_config=text,
        vision_config=dict(hidden_size=vision_hidden_size, intermediate_size=4 * vision_hidden_size,
                           num_hidden_layers=vision_depth, num_attention_heads=vision_heads,
                           num_key_value_heads=vision_heads, head_dim=vision_hidden_size // vision_heads,
                           patch_size=patch_size, pooling_kernel_size=pool,
                           position_embedding_size=4 * int((budget * pool * pool) ** 0.5)),
        audio_config=None, boi_token_id=ids["boi"], eoi_token_id=ids["eoi"], image_token_id=ids["image"],
        video_token_id=ids["video"], boa_token_id=ids["boa"], eoa_token_index=ids["eoa"], audio_token_id=ids["audio"],
        tie_word_embeddings=True,
    )
    settings = dict(patch_size=patch_size, pooling_kernel_size=pool, max_soft_tokens=budget)
    processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                                image_processor=Gemma4ImageProcessor(**settings), tokenizer=tok,
                                video_processor=Gemma4VideoProcessor(**settings), image_seq_length=budget,
                                chat_template=tok.chat_template)
    return Gemma4ForConditionalGeneration(config), processor


def _internvl3_5(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                 vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    """InternVL3.5: InternVL's tiles and pixel shuffle on a Qwen3 LM (q/k norms), transformers' InternVL class."""
    return _internvl(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                     vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab, text_type="qwen3")


def _smolvlm(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
             vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    """SmolVLM as released (SmolVLM-256M/500M/2B-Instruct are Idefics3 checkpoints: transformers' Idefics3 classes):
    an image is split into image_size tiles plus a global view, each tile's patches pixel-shuffled by merge_size
    (scale_factor) into image_seq_len tokens wrapped in `<fake_token_around_image><row_r_col_c>...`; a Llama LM.
    (SmolVLM2's own SmolVLMProcessor needs the num2words package, which the pinned environment lacks.)"""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    per_side = image_size // patch_size
    if per_side * patch_size != image_size or per_side % merge_size:
        raise ValueError(f"smolvlm: image_size {image_size} must be a multiple of patch_size*{merge_size}")
    image_seq_len = (per_side // merge_size) ** 2
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text.update(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    config = Idefics3Config(
        text_config=text,
        vision_config=dict(hidden_size=vision_hidden_size, intermediate_size=4 * vision_hidden_size,
                           num_hidden_layers=vision_depth, num_attention_heads=vision_heads, image_size=image_size,
                           patch_size=patch_size),
        image_token_id=_token_ids(tok, ["<image>"])[0], scale_factor=merge_size, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    # SmolVLM: tiles of the tower's image size, the long edge capped at 4 tiles (2048 px for 512 px tiles); here 2.
    image_processor = Idefics3ImageProcessor(
        do_image_splitting=True, max_image_size={"longest_edge": image_size},
        size={"longest_edge": 2 * image_size}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len,
                                  chat_template=tok.chat_template)
    return Idefics3ForConditionalGeneration(config), processor


def _llava_onevision(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                     vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    """LLaVA-OneVision: a SigLIP tower on the image at base resolution plus its anyres grid of tiles (pinpoints
    up to 2x2 tiles), features unpadded to the image's aspect ratio with a newline embedding per row; a Qwen2 LM."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    per_side = image_size // patch_size
    if per_side * patch_size != image_size:
        raise ValueError(f"llava_onevision: image_size {image_size} must be a multiple of patch_size")
    pinpoints = [[image_size * r, image_size * c] for r in (1, 2) for c in (1, 2)]
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    image_id, video_id = _token_ids(tok, ["<image>", "<video>"])
    config = LlavaOnevisionConfig(
        text_config=text,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=vision_hidden_size,
                           intermediate_size=4 * vision_hidden_size, num_hidden_layers=vision_depth,
                           num_attention_heads=vision_heads, image_size=image_size, patch_size=patch_size,
                           vision_use_head=False),
        image_token_index=image_id, video_token_index=video_id, image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full", vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=True,
    )
    image_processor = LlavaOnevisionImageProcessor(size={"height": image_size, "width": image_size},
                                                   image_grid_pinpoints=pinpoints, image_mean=[0.5, 0.5, 0.5],
                                                   image_std=[0.5, 0.5, 0.5])
    video_processor = LlavaOnevisionVideoProcessor(size={"height": image_size, "width": image_size})
    processor = LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tok,
                                        video_processor=video_processor, num_image_tokens=per_side * per_side,
                                        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                                        chat_template=tok.chat_template)
    return LlavaOnevisionForConditionalGeneration(config), processor


_BUILDERS = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl, "qwen3_5": _qwen3_5,
             "gemma3": _gemma3, "gemma4": _gemma4, "internvl": _internvl, "internvl3_5": _internvl3_5, "glm4v": _glm4v,
             "smolvlm": _smolvlm, "llava_onevision": _llava_onevision}
# Each family at the tiny sizes that still exercise its features (patch and merge sizes of the released models
# where the tower allows; an image of `image_size` px is one tile / one base view).
FAMILY_DEFAULTS = {
    "qwen3_vl": dict(image_size=96, patch_size=16),  # 6x6 patches of 16 px -> 9 tokens
    "qwen3_5": dict(image_size=96, patch_size=16),
    "gemma3": dict(image_size=56, patch_size=14),  # 4x4 patches pooled 2x2 -> 4 soft tokens
    "gemma4": dict(patch_size=16),  # each image resized to <= 70 x 3x3 patches of 16 px, pooled 3x3 -> <= 70 tokens
    "smolvlm": dict(image_size=64, patch_size=16),  # 4x4 patches shuffled 2x -> 4 tokens a tile
    "llava_onevision": dict(image_size=28, patch_size=14),  # 2x2 patches: 4 tokens a view
}


def _save(model, processor_or_tokenizer, out_dir, stop_tokens, tok):
    from transformers import GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    stop_ids = _token_ids(tok, stop_tokens)
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out_dir)
    processor_or_tokenizer.save_pretrained(out_dir)
    # Load back as the generic fast tokenizer: the family's own class would rebuild the pre-tokenizer
    # from its hard-coded regex and lose the JSON-punctuation split the BPE was trained with.
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "TokenizersBackend"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def _untie_word_embeddings(model):
    """Give the LM head its own weight, a copy of the input embeddings. Tied, a word that is a random choice as a
    target (a plan's colour when the prompt names none) is pulled towards its siblings' output vector, and as an input
    it can no longer be told apart from them (docs/results/2026-12-05-tiny-planner-untied.md)."""
    import torch

    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None:
            config.tie_word_embeddings = False
    model.get_output_embeddings().weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())


def make_tiny_vlm(
    out_dir,
    *,
    family: str = "qwen2_5_vl",
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    intermediate_size: int | None = None,
    vision_depth: int = 2,
    vision_hidden_size: int = 64,
    vision_heads: int = 2,
    image_size: int | None = None,
    patch_size: int | None = None,
    merge_size: int = 2,
    vocab_size: int = DEFAULT_BPE_VOCAB,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> str:
    """Build a tiny randomly initialised VLM of `family` and save it (model, processor, tokenizer) to out_dir.

    Defaults (qwen2_5_vl): text hidden 128, 2 layers; vision 64 wide, 2 blocks; an 84x84 image is
    6x6 patches of 14 px, merged 2x2 into 9 image tokens. InternVL: one 84x84 tile -> 9 tokens
    (pixel shuffle 0.5) between <img> and </img>. GLM-4V: 9 `<|image|>` tokens. Returns out_dir.
    """
    if family not in _BUILDERS:
        raise ValueError(f"make_tiny_vlm: unknown family {family!r}; choose one of {ALL_FAMILIES}")
    sizes = {"image_size": 84, "patch_size": 14, **FAMILY_DEFAULTS.get(family, {})}
    image_size, patch_size = image_size or sizes["image_size"], patch_size or sizes["patch_size"]
    tok = make_tiny_tokenizer(family, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model, processor = _BUILDERS[family](
        tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
        vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, len(tok),
    )
    if not tie_word_embeddings:
        _untie_word_embeddings(model)
    _save(model, processor, str(out_dir), _FAMILY_TOKENS[family]["stop"], tok)
    return str(out_dir)


def make_tiny_llm(
    out_dir,
    *,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    intermediate_size: int | None = None,
    vocab_size: int = DEFAULT_BPE_VOCAB,
    seed: int = 0,
    family: str = "qwen2",
) -> str:
    """A tiny text-only causal LM, Qwen2 or Qwen3 (`family`; Qwen3 adds q/k norms and an explicit head_dim), with
    the VLMs' tokenizer and ChatML template. Returns out_dir."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    if family not in classes:
        raise ValueError(f"make_tiny_llm: unknown family {family!r}; choose one of {sorted(classes)}")
    tok = make_tiny_tokenizer(family, vocab_size=vocab_size)
    torch.manual_seed(seed)
    text = _text_kwargs(len(tok), hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    if family == "qwen3":
        text["head_dim"] = hidden_size // num_attention_heads
    config_cls, model_cls = classes[family]
    model = model_cls(config_cls(**text, tie_word_embeddings=True))
    _save(model, tok, str(out_dir), _FAMILY_TOKENS[family]["stop"], tok)
    return str(out_dir)


# --------------------------------------------------------------------------------------------------
# Flow-matching image generator
# --------------------------------------------------------------------------------------------------


def make_tiny_flow_model(
    out_dir,
    *,
    image_size: int = 32,
    latent_size: int = 8,
    latent_channels: int = 4,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    joint_attention_dim: int = 128,
    pooled_projection_dim: int = 128,
    shift: float = 3.0,
    seed: int = 0,
) -> str:
    """A tiny SD3-style flow-matching generator saved as a diffusers folder. Returns out_dir.

    Components (each in its own subfolder, loadable with `<Class>.from_pretrained(out_dir, subfolder=...)`
    or all at once with `tiny.models.load_flow_model`):
      transformer  SD3Transformer2DModel on `latent_channels` x latent_size x latent_size latents, patch 2
      vae          AutoencoderKL mapping image_size x image_size RGB <-> latents (scale factor 1, shift 0)
      scheduler    FlowMatchEulerDiscreteScheduler (sigma from 1 to 0, timestep `shift`)
    There are no text encoders: in Mix-GRPO the conditioning (`encoder_hidden_states` of width
    `joint_attention_dim`, `pooled_projections` of width `pooled_projection_dim`) comes from the VLM's
    hidden states through a projection owned by the training script. The defaults match the tiny VLM's
    hidden size (128).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    ratio = image_size // latent_size
    if ratio * latent_size != image_size or ratio & (ratio - 1):
        raise ValueError(f"make_tiny_flow_model: image_size/latent_size ({image_size}/{latent_size}) "
                         "must be a power of two")
    num_down = ratio.bit_length()  # one VAE block per halving, plus the first
    torch.manual_seed(seed)
    inner = num_attention_heads * attention_head_dim
    transformer = SD3Transformer2DModel(
        sample_size=latent_size, patch_size=2, in_channels=latent_channels, out_channels=latent_channels,
        num_layers=num_layers, num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
        joint_attention_dim=joint_attention_dim, caption_projection_dim=inner,
        pooled_projection_dim=pooled_projection_dim, pos_embed_max_size=latent_size // 2 * 2,
    )
    channels = tuple(min(16 * 2**i, 32) for i in range(num_down))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=channels,
        down_block_types=("DownEncoderBlock2D",) * num_down, up_block_types=("UpDecoderBlock2D",) * num_down,
        layers_per_block=1, norm_num_groups=8, sample_size=image_size,
        scaling_factor=1.0, shift_factor=0.0,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    out_dir = str(out_dir)
    for name, component in (("transformer", transformer), ("vae", vae), ("scheduler", scheduler)):
        component.save_pretrained(os.path.join(out_dir, name))
    _write_model_index(out_dir, {"transformer": transformer, "vae": vae, "scheduler": scheduler})
    return out_dir


def _write_model_index(out_dir, components):
    import diffusers

    index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": diffusers.__version__}
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3",
                 "image_encoder", "feature_extractor"):
        index[name] = [None, None]  # conditioning comes from the VLM, not from text encoders
    for name, component in components.items():
        index[name] = ["diffusers", type(component).__name__]
    with open(os.path.join(out_dir, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


# --------------------------------------------------------------------------------------------------
# Loading the tiny flow-matching generator
# --------------------------------------------------------------------------------------------------


def load_flow_model(path, *, dtype="float32") -> dict:
    """Load a diffusers flow-matching folder component-wise -> dict(transformer, vae, scheduler).

    The folder needs transformer/, vae/ and scheduler/ subfolders (as `make_tiny_flow_model` writes
    them, or an SD3 checkpoint); text encoders are not loaded (Mix-GRPO conditions on the VLM).
    To get a full pipeline instead: `StableDiffusion3Pipeline.from_pretrained(path, text_encoder=None,
    text_encoder_2=None, text_encoder_3=None, tokenizer=None, tokenizer_2=None, tokenizer_3=None)`.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"flow model folder {path!r} does not exist")
    missing = [sub for sub in ("transformer", "vae", "scheduler") if not os.path.isdir(os.path.join(path, sub))]
    if missing:
        raise ModelLoadError(f"flow model folder {path!r} lacks the subfolder(s) {missing}")
    torch_dtype = resolve_dtype(dtype)
    torch_dtype = torch.float32 if torch_dtype == "auto" else torch_dtype
    classes = {"transformer": SD3Transformer2DModel, "vae": AutoencoderKL}
    index_path = os.path.join(path, "model_index.json")
    if os.path.isfile(index_path):  # honour the classes the folder declares (e.g. a Flux transformer)
        import diffusers

        with open(index_path) as f:
            index = json.load(f)
        for name in classes:
            entry = index.get(name)
            if entry and entry[0] == "diffusers" and isinstance(getattr(diffusers, entry[1], None), type):
                classes[name] = getattr(diffusers, entry[1])
    out = {name: cls.from_pretrained(path, subfolder=name, torch_dtype=torch_dtype) for name, cls in classes.items()}
    out["scheduler"] = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
    return out
