"""Tiny models built from configs, so the whole stack runs on a CPU without downloading anything.

- `make_tiny_vlm`: a tiny Qwen2.5-VL (default), InternVL or GLM-4V with transformers' own classes and
  processors, saved as an ordinary HF folder (`AutoModelForImageTextToText` / `AutoProcessor` load it).
- `make_tiny_llm`: a tiny text-only Qwen2 causal LM with the same tokenizer and chat template.
- `make_tiny_flow_model`: a tiny diffusers flow-matching generator (SD3 transformer, VAE, scheduler).

All share the byte-level BPE of `tiny.tokenizer`. Weights are random but deterministic for a seed.
"""

from __future__ import annotations

import json
import os

import torch

from tiny.tokenizer import _FAMILY_TOKENS, DEFAULT_BPE_VOCAB, FAMILIES, _token_ids, make_tiny_tokenizer
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


def _qwen2_5_vl(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    ids = dict(zip(("image", "video", "start", "end"), _token_ids(
        tok, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])))
    text = _text_kwargs(vocab, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": _mrope_section(hidden_size // num_attention_heads)}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=4 * vision_hidden_size,
            num_heads=vision_heads, patch_size=patch_size, spatial_merge_size=merge_size,
            temporal_patch_size=2, out_hidden_size=hidden_size, window_size=patch_size * merge_size * 4,
            fullatt_block_indexes=[vision_depth - 1],
        ),
        image_token_id=ids["image"], video_token_id=ids["video"],
        vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
        tie_word_embeddings=True,
    )
    factor = patch_size * merge_size
    # An image_size x image_size image keeps its size (smart_resize rounds to multiples of `factor`);
    # larger ones are capped at 4x the pixels so a stray big image cannot blow up the sequence.
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": factor * factor, "longest_edge": 4 * image_size * image_size},
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2)
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                                    video_processor=video_processor, chat_template=tok.chat_template)
    return Qwen2_5_VLForConditionalGeneration(config), processor


def _internvl(tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
              vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, vocab):
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
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
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


_BUILDERS = {"qwen2_5_vl": _qwen2_5_vl, "internvl": _internvl, "glm4v": _glm4v}


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
    image_size: int = 84,
    patch_size: int = 14,
    merge_size: int = 2,
    vocab_size: int = DEFAULT_BPE_VOCAB,
    seed: int = 0,
) -> str:
    """Build a tiny randomly initialised VLM of `family` and save it (model, processor, tokenizer) to out_dir.

    Defaults (qwen2_5_vl): text hidden 128, 2 layers; vision 64 wide, 2 blocks; an 84x84 image is
    6x6 patches of 14 px, merged 2x2 into 9 image tokens. InternVL: one 84x84 tile -> 9 tokens
    (pixel shuffle 0.5) between <img> and </img>. GLM-4V: 9 `<|image|>` tokens. Returns out_dir.
    """
    if family not in _BUILDERS:
        raise ValueError(f"make_tiny_vlm: unknown family {family!r}; choose one of {FAMILIES}")
    tok = make_tiny_tokenizer(family, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model, processor = _BUILDERS[family](
        tok, image_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
        vision_depth, vision_hidden_size, vision_heads, patch_size, merge_size, len(tok),
    )
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
) -> str:
    """A tiny text-only Qwen2 causal LM with the VLMs' tokenizer and ChatML template. Returns out_dir."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = make_tiny_tokenizer("qwen2", vocab_size=vocab_size)
    torch.manual_seed(seed)
    text = _text_kwargs(len(tok), hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                        tok.eos_token_id, tok.pad_token_id)
    model = Qwen2ForCausalLM(Qwen2Config(**text, tie_word_embeddings=True))
    _save(model, tok, str(out_dir), _FAMILY_TOKENS["qwen2"]["stop"], tok)
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
