"""Load any HF VLM or LLM with its processor and prepare it for training (vision tower frozen, LoRA,
gradient checkpointing); `model_flags` reads a script's flags for the loader (utils.core.flags)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from utils.core.errors import InputError

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Attribute names under which transformers' VLMs keep their vision encoder, and the names of the
# projector that maps vision features into the LM (kept trainable by default, as LLaMA-Factory does).
VISION_MODULE_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder")
PROJECTOR_MODULE_NAMES = ("merger", "multi_modal_projector", "mm_projector", "connector")


class ModelLoadError(OSError, InputError):
    """A model path that is neither a usable local folder nor a reachable hub repository."""


def resolve_dtype(dtype):
    """'auto' | 'float32' | 'bfloat16' | 'float16' | torch.dtype | None -> what from_pretrained takes."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype or "auto"
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown value {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _looks_like_local_path(name: str) -> bool:
    # A hub id is "name" or "owner/name"; anything else can only be a folder on this machine.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _load_config(name_or_path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            raise ModelLoadError(f"model folder {name_or_path!r} has no config.json; is it a saved HF model?")
    elif os.path.exists(name_or_path):
        raise ModelLoadError(f"model path {name_or_path!r} is a file; expected a model folder or a hub name")
    elif _looks_like_local_path(name_or_path):
        raise ModelLoadError(f"model path {name_or_path!r} does not exist")
    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # hub errors (offline, 404, bad repo id) are OSError/ValueError
        reason = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        if os.path.isdir(name_or_path):
            raise ModelLoadError(f"cannot read the model config in folder {name_or_path!r} ({reason})") from err
        raise ModelLoadError(
            f"cannot load model {name_or_path!r}: it is not a local folder and could not be fetched from the "
            f"Hugging Face Hub ({reason})"
        ) from err


def _is_image_text_to_text(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or (
        getattr(config, "vision_config", None) is not None
    )


def load_model_and_processor(
    name_or_path,
    *,
    dtype="auto",
    attn_implementation=None,
    freeze_vision_tower=False,
    max_pixels=None,
    min_pixels=None,
    max_anyres_num=None,
    trust_remote_code=False,
):
    """Load a VLM (AutoModelForImageTextToText + AutoProcessor) or an LLM (AutoModelForCausalLM + tokenizer).

    dtype: "auto" | "float32" | "bfloat16" | "float16" (or a torch.dtype).
    attn_implementation: passed through to from_pretrained ("sdpa", "eager", "flash_attention_2", ...).
    freeze_vision_tower: freeze the vision encoder (see `freeze_vision_tower`).
    min_pixels / max_pixels: the pixel budget of Qwen-style image processors (smart_resize rounds
        height and width to multiples of patch*merge within it; GLM-4V counts its 2 frames per image).
    max_anyres_num: maximum number of image tiles of InternVL-style (crop-to-patches) image processors.
    Returns (model, processor); the processor is the tokenizer for a text-only model. Callers set
    padding_side themselves (left for generation).
    """
    name_or_path = os.fspath(name_or_path)
    config = _load_config(name_or_path, trust_remote_code)
    kwargs = dict(dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if _is_image_text_to_text(config):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        try:  # the processor first: a family whose processor cannot run here is refused before its weights load
            processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except ImportError as err:  # e.g. SmolVLM2's SmolVLMProcessor needs num2words
            raise ModelLoadError(f"model {name_or_path!r} ({config.model_type}): its processor needs a package this "
                                 f"environment lacks: {(str(err).splitlines() or [''])[0]}") from err
        model = AutoModelForImageTextToText.from_pretrained(name_or_path, **kwargs)
        _configure_image_processor(processor, name_or_path, min_pixels, max_pixels, max_anyres_num)
        tokenizer = processor.tokenizer
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        for flag, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels),
                            ("max_anyres_num", max_anyres_num)):
            if value is not None:
                raise ValueError(f"--{flag} is set but {name_or_path!r} is a text-only model")
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        processor = tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:  # batched generation needs a pad token
        tokenizer.pad_token = tokenizer.eos_token
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled() and getattr(model, "_weight_conversions", None):
        # Loaded sharded (ZeRO-3), transformers 5 keeps its whole key-renaming table, legacy renamings included
        # (integrations/deepspeed.py), not only those this checkpoint used (core_model_loading.py); reverting all of
        # them on save named the language model's weights model.model.layers.*. None: save_pretrained reverts the
        # model's own renamings, as after an unsharded load (model.layers.*, what vLLM and the hub checkpoints use).
        model._weight_conversions = None
    if freeze_vision_tower:
        _freeze_vision_tower(model)  # the flag shadows the function's name here
    return model, processor


def model_flags(cfg, **overrides) -> dict:
    """The keyword arguments of `load_model_and_processor` that a script's flags give, one spelling for every
    script: --dtype, --attn_implementation, --freeze_vision_tower (off where the script has no such flag) and the
    image processor's --max_pixels, --min_pixels, --max_anyres_num; `overrides` win."""
    return dict(dict(dtype=cfg.dtype, attn_implementation=cfg.attn_implementation,
                     freeze_vision_tower=getattr(cfg, "freeze_vision_tower", False), max_pixels=cfg.max_pixels,
                     min_pixels=cfg.min_pixels, max_anyres_num=getattr(cfg, "max_anyres_num", None)), **overrides)


def _configure_image_processor(processor, name, min_pixels, max_pixels, max_anyres_num):
    image_processor = getattr(processor, "image_processor", None)
    kind = type(image_processor).__name__
    if min_pixels is not None or max_pixels is not None:
        size = dict(getattr(image_processor, "size", None) or {})
        if size.get("longest_edge") is None or size.get("shortest_edge") is None:
            raise ValueError(f"--min_pixels/--max_pixels: the image processor of {name!r} ({kind}) has no pixel "
                             "budget (Qwen-style shortest_edge/longest_edge)")
        if min_pixels is not None:
            size["shortest_edge"] = int(min_pixels)
        if max_pixels is not None:
            size["longest_edge"] = int(max_pixels)
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(f"--min_pixels ({size['shortest_edge']}) is larger than --max_pixels "
                             f"({size['longest_edge']})")
        old = image_processor.size
        image_processor.size = size if isinstance(old, dict) else type(old)(**size)  # v5 keeps a SizeDict
        for attr in ("min_pixels", "max_pixels"):  # older processors read these attributes instead
            if hasattr(image_processor, attr):
                setattr(image_processor, attr, size["shortest_edge" if attr == "min_pixels" else "longest_edge"])
    if max_anyres_num is not None:
        if not hasattr(image_processor, "max_patches"):
            raise ValueError(f"--max_anyres_num: the image processor of {name!r} ({kind}) does not tile images")
        if int(max_anyres_num) < 1:
            raise ValueError(f"--max_anyres_num must be >= 1, got {max_anyres_num}")
        image_processor.max_patches = int(max_anyres_num)
        image_processor.crop_to_patches = True


# --------------------------------------------------------------------------------------------------
# Vision tower
# --------------------------------------------------------------------------------------------------


def _unwrap(model):
    # DDP / DeepSpeed engines keep the model in .module; peft models expose get_base_model().
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def is_vision_model(model) -> bool:
    """True for a model that takes images (it has a vision config or a vision encoder module)."""
    model = _unwrap(model)
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        return True
    return bool(_vision_modules(model))


def _vision_modules(model):
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_MODULE_NAMES and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    return found


def _numel(param) -> int:
    return getattr(param, "ds_numel", None) or param.numel()  # ZeRO-3 keeps only a shard locally


def freeze_vision_tower(model, *, include_projector: bool = False) -> int:
    """Set requires_grad=False on the vision encoder; return the number of parameters (elements) frozen.

    Works for Qwen2.5-VL / GLM-4V (`visual`), InternVL / LLaVA-style (`vision_tower`), and models
    wrapped by peft, DDP or DeepSpeed. The projector into the LM (`visual.merger`,
    `multi_modal_projector`) stays trainable unless include_projector=True.
    """
    base = _unwrap(model)
    towers = _vision_modules(base)
    if not towers:
        raise ValueError(f"freeze_vision_tower: no vision encoder ({'/'.join(VISION_MODULE_NAMES)}) found in "
                         f"{type(base).__name__}")
    frozen = 0
    for _, tower in towers:
        for name, param in tower.named_parameters():
            if not include_projector and set(name.split(".")) & set(PROJECTOR_MODULE_NAMES):
                continue
            if param.requires_grad:
                param.requires_grad_(False)
                frozen += _numel(param)
    if include_projector:
        for name, module in base.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTOR_MODULE_NAMES:
                for param in module.parameters():
                    if param.requires_grad:
                        param.requires_grad_(False)
                        frozen += _numel(param)
    return frozen


_freeze_vision_tower = freeze_vision_tower


def enable_activation_checkpointing(model):
    """Recompute activations in backward (non-reentrant). transformers 5.24 renamed `gradient_checkpointing_enable`
    to `activation_checkpointing_enable` (the old name warns and goes in v6); the vLLM set's 5.20 has only the old."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def activation_checkpointing_on(model) -> bool:
    """Whether `model` recomputes activations: `is_activation_checkpointing` (5.24) or `is_gradient_checkpointing`
    (5.20; a property that warns on every read in 5.24), looked up on the class so the old one is never read."""
    name = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing")
    return bool(getattr(model, name, False))


def prepare_for_training(model, cfg):
    """Gradient checkpointing and LoRA as the train scripts' flags ask (`gradient_checkpointing`,
    `use_peft`, `lora_r`, `lora_alpha`, `lora_dropout`, `lora_target_modules`); returns the model to train. With LoRA,
    `freeze_vision_tower` / `freeze_multi_modal_projector` (where the config has them) freeze those parts' adapters;
    `freeze_input_embeddings` keeps the input token embeddings as loaded."""
    if getattr(cfg, "freeze_input_embeddings", False):
        model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
        model.config.use_cache = False
    if cfg.use_peft:
        from peft import LoraConfig, get_peft_model

        targets = cfg.lora_target_modules[0] if cfg.lora_target_modules == ["all-linear"] else cfg.lora_target_modules
        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
        projector = getattr(cfg, "freeze_multi_modal_projector", False)
        if getattr(cfg, "freeze_vision_tower", False) or projector:  # all-linear LoRA wraps the tower too: frozen
            freeze_vision_tower(model, include_projector=projector)
    return model


@contextmanager
def adapters_disabled(module):
    """Run `module` on its base weights: peft LoRA layers off (the reference of a LoRA run). The flag is set
    directly: peft's disable_adapter() turns the adapters back on with set_adapter(), which makes every adapter
    weight trainable again, the frozen vision tower's LoRA included (an optimizer may hold some, not others)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def has_adapters(module):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


def disable_dropout(model):
    """Dropout off everywhere (TRL's `disable_dropout`): every `nn.Dropout` gets p = 0, LoRA's included, and so
    do the float `*dropout` rates that attention layers apply inside their kernels (`attention_dropout`).
    Then log-probs are the same in train() and eval() mode, so the importance ratio is exactly 1 on a first
    pass. Returns the number of modules changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p = 0.0
            changed += 1
        for name, value in list(vars(module).items()):
            if name.endswith("dropout") and isinstance(value, float) and value:
                setattr(module, name, 0.0)
                changed += 1
    return changed


def image_token_id(processor_or_config):
    """The id of the token each image feature replaces (the one the model counts), from a model config or a
    processor: InternVL's <IMG_CONTEXT>, Gemma's soft token (not its <start_of_image> placeholder), Qwen's
    <|image_pad|>, ... None for a text-only model."""
    config = processor_or_config
    for name in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, name, None), int) and hasattr(config, "vision_config"):
            return getattr(config, name)
    tokenizer = getattr(processor_or_config, "tokenizer", None)
    if tokenizer is None:
        return None
    for name in ("context_image_token_id", "image_token_id"):
        if isinstance(getattr(tokenizer, name, None), int):
            return getattr(tokenizer, name)
    token = getattr(processor_or_config, "image_token", None)
    return tokenizer.convert_tokens_to_ids(token) if token else None


def vision_feature_count(config, inputs):
    """How many image features the vision inputs of a batch produce (so how many image tokens its input_ids
    must hold), or None where the count depends on more than these tensors (then transformers' own check holds).

    Grid families (Qwen2/2.5/3-VL, Qwen3.5, GLM-4.1V): each image is t*h*w patches merged merge_size^2 to one.
    Fixed-length families: Gemma 3 (mm_tokens_per_image per image, pan-and-scan crops included), InternVL
    (image_seq_length per tile)."""
    pixels = inputs.get("pixel_values")
    if pixels is None:
        return 0
    if inputs.get("image_grid_thw") is not None:
        merge = getattr(config.vision_config, "spatial_merge_size", None)
        return int(inputs["image_grid_thw"].prod(-1).sum()) // merge**2 if merge else None
    if config.model_type == "gemma3":
        return int(pixels.shape[0]) * config.mm_tokens_per_image
    if config.model_type == "internvl":
        return int(pixels.shape[0]) * config.image_seq_length
    return None
