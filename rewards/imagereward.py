"""``imagereward``: ImageReward (Xu et al. 2023), BLIP's image-grounded text encoder with a score MLP.

The ImageReward package builds BLIP from its own copy of BLIP's code and a transformers release it no longer runs
on; BLIP itself is in transformers, so this module loads the released checkpoint (``ImageReward.pt`` and
``med_config.json`` of the hub repository ``THUDM/ImageReward``) into transformers' ``BlipVisionModel`` and
``BlipTextModel`` (the same layers under other names) and keeps ImageReward's forward pass:

    image  -> ViT (224 px, bicubic resize + centre crop, CLIP's mean / std)  -> patch embeddings E
    prompt -> BERT tokens (padded to 35) -> text encoder cross-attending to E -> first token's hidden state h
    reward = (MLP(h) - 0.16717362830052426) / 1.0333394966054072

The vision tower's size is read from the checkpoint's shapes (ViT-L/16 for the release); the tokenizer is BERT's
(bert-base-uncased), from ``tokenizer_name_or_path`` or the model folder when it holds one.
"""

from __future__ import annotations

import json
import math
import os
import re

from rewards.common import RewardFunction, images_column, prompt_texts
from rewards.models import (
    frozen,
    hub_file,
    load_once,
    load_state_dict,
    reward_device,
    score_in_batches,
    score_mlp,
    torch_dtype,
)

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_TOKENIZER = "google-bert/bert-base-uncased"
REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's normalisation of the MLP output
MAX_PROMPT_TOKENS = 35  # ImageReward pads / truncates prompts to 35 tokens
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# BLIP's ViT names -> transformers' BlipVisionModel names
_VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def split_checkpoint(state: dict) -> tuple[dict, dict, dict]:
    """ImageReward's state dict as (BlipVisionModel's, BlipTextModel's, the MLP's) state dicts."""
    vision, text, mlp = {}, {}, {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key[len("blip.visual_encoder."):]
            for pattern, repl in _VISION_RENAMES:
                name, hits = re.subn(pattern, repl, name)
                if hits:
                    break
            vision[name] = value
        elif key.startswith("blip.text_encoder."):
            text[key[len("blip.text_encoder."):]] = value  # BLIP's med.py BERT and BlipTextModel share names
        elif key.startswith("mlp."):
            mlp[key[len("mlp."):]] = value
    return vision, text, mlp


def vision_config(vision: dict):
    """BLIP ViT's configuration read from its weights (heads: 64-wide, as ViT-B and ViT-L)."""
    from transformers import BlipVisionConfig

    width, _, patch, _ = vision["embeddings.patch_embedding.weight"].shape
    positions = vision["embeddings.position_embedding"].shape[1]
    depth = 1 + max(int(k.split(".")[2]) for k in vision if k.startswith("encoder.layers."))
    return BlipVisionConfig(hidden_size=width, intermediate_size=vision["encoder.layers.0.mlp.fc1.weight"].shape[0],
                            num_hidden_layers=depth, num_attention_heads=max(1, width // 64),
                            image_size=int(math.isqrt(positions - 1)) * patch, patch_size=patch,
                            layer_norm_eps=1e-6, hidden_act="gelu")  # BLIP's ViT: LayerNorm eps 1e-6, exact GELU


def text_config(med: dict):
    """BlipTextConfig from ImageReward's med_config.json (BERT-base with cross-attention to the ViT's width)."""
    from transformers import BlipTextConfig

    return BlipTextConfig(vocab_size=med["vocab_size"], hidden_size=med["hidden_size"],
                          num_hidden_layers=med["num_hidden_layers"], num_attention_heads=med["num_attention_heads"],
                          intermediate_size=med["intermediate_size"], hidden_act=med.get("hidden_act", "gelu"),
                          max_position_embeddings=med["max_position_embeddings"],
                          layer_norm_eps=med.get("layer_norm_eps", 1e-12), encoder_hidden_size=med["encoder_width"],
                          pad_token_id=med.get("pad_token_id", 0), bos_token_id=med.get("bos_token_id", 30522),
                          sep_token_id=med.get("sep_token_id", 102),
                          is_decoder=True)  # is_decoder: the layers get their cross-attention


class ImageRewardScorer:
    def __init__(self, checkpoint: str, med_config: str, tokenizer: str, device, dtype):
        import torch
        from torchvision import transforms
        from transformers import AutoTokenizer
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        vision_state, text_state, mlp_state = split_checkpoint(load_state_dict(checkpoint))
        with open(med_config) as f:
            med = json.load(f)
        vision = BlipVisionModel(vision_config(vision_state))
        text = BlipTextModel(text_config(med), add_pooling_layer=False)
        mlp = score_mlp(med["hidden_size"])
        for part, state, where in ((vision, vision_state, "blip.visual_encoder"), (text, text_state,
                                   "blip.text_encoder"), (mlp, mlp_state, "mlp")):
            missing, _ = part.load_state_dict(state, strict=False)  # BLIP's extra buffers (position_ids) are left out
            if missing:
                raise ValueError(f"{checkpoint}: no weights for {where}: {', '.join(missing[:4])}"
                                 f"{' ...' if len(missing) > 4 else ''}")
        self.vision, self.text = frozen(vision, device, dtype), frozen(text, device, dtype)
        self.mlp = frozen(mlp, device)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        size = vision.config.image_size
        self.preprocess = transforms.Compose([
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(size),
            transforms.ToTensor(), transforms.Normalize(CLIP_MEAN, CLIP_STD)])
        self.device, self.dtype, self.torch = device, dtype, torch

    def __call__(self, images, texts):
        torch = self.torch
        pixels = torch.stack([self.preprocess(image) for image in images]).to(self.device, self.dtype)
        embeds = self.vision(pixel_values=pixels).last_hidden_state
        tokens = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS,
                                return_tensors="pt").to(self.device)
        hidden = self.text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                           encoder_hidden_states=embeds,
                           encoder_attention_mask=torch.ones(embeds.shape[:-1], dtype=torch.long, device=self.device)
                           ).last_hidden_state[:, 0].float()
        return (self.mlp(hidden) - REWARD_MEAN) / REWARD_STD


def imagereward_reward(model_name_or_path: str = IMAGEREWARD_REPO, tokenizer_name_or_path: str | None = None,
                       device: str = "auto", dtype: str = "float32", batch_size: int = 32,
                       prompt_column: str = "prompt"):
    """ImageReward-v1.0: ``ImageReward.pt`` and ``med_config.json`` from the hub repository or folder
    ``model_name_or_path``; BERT's tokenizer from ``tokenizer_name_or_path`` (none: the model folder when it holds
    a tokenizer, else bert-base-uncased). Scores are standardised (mean 0, std 1 on ImageReward's data)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    checkpoint = hub_file(model_name_or_path, "ImageReward.pt")
    med_config = hub_file(model_name_or_path, "med_config.json")
    if tokenizer_name_or_path is None:
        folder = os.path.dirname(checkpoint)
        tokenizer_name_or_path = folder if os.path.isfile(os.path.join(folder, "tokenizer_config.json")) \
            else IMAGEREWARD_TOKENIZER
    device, torch_type = reward_device(device), torch_dtype(dtype)
    scorer = load_once(("imagereward", checkpoint, tokenizer_name_or_path, str(device), dtype),
                       lambda: ImageRewardScorer(checkpoint, med_config, tokenizer_name_or_path, device, torch_type))
    return RewardFunction("imagereward", _imagereward, scorer=scorer, batch_size=batch_size,
                          prompt_column=prompt_column)


def _imagereward(completions, images=None, *, scorer, batch_size, prompt_column, **columns):
    n = len(completions)
    images = images_column(images, n, "imagereward")
    return score_in_batches(images, prompt_texts(columns, n, "imagereward", prompt_column), scorer, batch_size)
