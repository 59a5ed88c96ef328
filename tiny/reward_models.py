"""Tiny image reward models built from configs, laid out as their hub repositories, for tests and benchmarks:

    make_tiny_clip(out)         a transformers CLIP + CLIPProcessor folder (PickScore_v1 / openai/clip-* layout)
    make_tiny_aesthetic(out)    a CLIP folder and the aesthetic MLP (aesthetic-model.pth) beside it
    make_tiny_hps(out)          an open_clip config (.json) and HPS_v2.1_compressed.pt ({"state_dict": ...})
    make_tiny_imagereward(out)  ImageReward.pt (BLIP's names) + med_config.json + a BERT tokenizer

Each returns what the reward takes (folders, the config path) and the modules it saved, so a test can compute the
published formula on the same weights by another route.
"""

from __future__ import annotations

import json
import os

import torch

from rewards.models import score_mlp

TEXT_WIDTH, VISION_WIDTH, PROJECTION = 32, 64, 16
IMAGE_SIZE, PATCH = 32, 8


def _bytes_to_unicode() -> list[str]:
    """CLIP's byte -> printable character table (GPT-2's)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tiny_clip_tokenizer(out_dir: str, words: tuple[str, ...] = ()):
    """A CLIPTokenizer over single characters (each also with the end-of-word mark) and a few whole words."""
    from transformers import CLIPTokenizer

    os.makedirs(out_dir, exist_ok=True)
    chars = _bytes_to_unicode()
    vocab = {}
    for token in chars + [c + "</w>" for c in chars]:
        vocab.setdefault(token, len(vocab))
    merges = []
    for word in words:  # whole-word tokens through left-to-right merges
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merges.append(f"{parts[0]} {parts[1]}")
            parts = [parts[0] + parts[1]] + parts[2:]
            vocab.setdefault(parts[0], len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    with open(os.path.join(out_dir, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(out_dir, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(m + "\n" for m in dict.fromkeys(merges)))
    return CLIPTokenizer(os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt"),
                         model_max_length=77)


def make_tiny_clip(out_dir: str, seed: int = 0, projection_dim: int = PROJECTION, max_positions: int = 77):
    """A tiny CLIPModel with its CLIPProcessor saved in ``out_dir``; returns (model, processor)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = tiny_clip_tokenizer(out_dir, words=("a", "photo", "of", "cat", "dog", "red", "blue"))
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=VISION_WIDTH, intermediate_size=2 * VISION_WIDTH, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH),
        projection_dim=projection_dim)
    model = CLIPModel(config).eval()
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return model, processor


def make_tiny_aesthetic(out_dir: str, seed: int = 0):
    """A tiny CLIP in ``out_dir/clip`` and the aesthetic MLP on its embedding in ``out_dir/mlp/aesthetic-model.pth``
    (the improved aesthetic predictor's layers); returns (clip folder, mlp folder, model, processor, mlp state)."""
    model, processor = make_tiny_clip(os.path.join(out_dir, "clip"), seed=seed)
    torch.manual_seed(seed + 1)
    mlp = score_mlp(PROJECTION)
    os.makedirs(os.path.join(out_dir, "mlp"), exist_ok=True)
    torch.save(mlp.state_dict(), os.path.join(out_dir, "mlp", "aesthetic-model.pth"))
    return os.path.join(out_dir, "clip"), os.path.join(out_dir, "mlp"), model, processor, mlp.state_dict()


TINY_HPS_CONFIG = {"embed_dim": PROJECTION,
                   "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 2, "width": VISION_WIDTH, "head_width": 32,
                                  "patch_size": PATCH},
                   "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": TEXT_WIDTH, "heads": 2,
                                "layers": 2}}


def make_tiny_hps(out_dir: str, seed: int = 0, name: str = "TinyHPS"):
    """An open_clip model config ``out_dir/{name}.json`` (ViT-H-14's layout, tiny) and its weights as
    ``out_dir/HPS_v2.1_compressed.pt`` in HPS's ``{"state_dict": ...}`` form; returns (config path, model)."""
    import open_clip

    os.makedirs(out_dir, exist_ok=True)
    config = os.path.join(out_dir, f"{name}.json")
    with open(config, "w") as f:
        json.dump(TINY_HPS_CONFIG, f)
    open_clip.add_model_config(config)
    torch.manual_seed(seed)
    model = open_clip.create_model(name, pretrained=None).eval()
    torch.save({"state_dict": model.state_dict()}, os.path.join(out_dir, "HPS_v2.1_compressed.pt"))
    return config, model


def tiny_bert_tokenizer(out_dir: str):
    from transformers import BertTokenizer

    words = ["a", "photo", "of", "cat", "dog", "red", "blue", "on", "the", "table"]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.txt"), "w") as f:
        f.write("\n".join(specials + words + list("abcdefghijklmnopqrstuvwxyz")) + "\n")
    tokenizer = BertTokenizer(os.path.join(out_dir, "vocab.txt"))
    tokenizer.save_pretrained(out_dir)
    return tokenizer


# transformers' BlipVisionModel names -> BLIP's ViT names (how ImageReward.pt spells them)
_TO_BLIP_VISION = [("embeddings.class_embedding", "cls_token"), ("embeddings.position_embedding", "pos_embed"),
                   ("embeddings.patch_embedding.", "patch_embed.proj."), ("encoder.layers.", "blocks."),
                   (".layer_norm1.", ".norm1."), (".layer_norm2.", ".norm2."), (".self_attn.qkv.", ".attn.qkv."),
                   (".self_attn.projection.", ".attn.proj."), ("post_layernorm.", "norm.")]


def make_tiny_imagereward(out_dir: str, seed: int = 0):
    """ImageReward's hub layout, tiny: ``ImageReward.pt`` (BLIP's parameter names: ``blip.visual_encoder.*``,
    ``blip.text_encoder.*``, ``mlp.layers.*``), ``med_config.json`` and a BERT tokenizer folder ``out_dir/tokenizer``.
    Returns (model folder, tokenizer folder, vision model, text model, mlp)."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = tiny_bert_tokenizer(os.path.join(out_dir, "tokenizer"))
    med = {"vocab_size": len(tokenizer), "hidden_size": TEXT_WIDTH, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 2 * TEXT_WIDTH, "hidden_act": "gelu", "max_position_embeddings": 40,
           "layer_norm_eps": 1e-12, "encoder_width": VISION_WIDTH, "pad_token_id": 0, "bos_token_id": 2,
           "sep_token_id": 3, "add_cross_attention": True}
    torch.manual_seed(seed)
    vision = BlipVisionModel(BlipVisionConfig(hidden_size=VISION_WIDTH, intermediate_size=2 * VISION_WIDTH,
                                              num_hidden_layers=2, num_attention_heads=1, image_size=IMAGE_SIZE,
                                              patch_size=PATCH, layer_norm_eps=1e-6)).eval()
    text = BlipTextModel(BlipTextConfig(vocab_size=med["vocab_size"], hidden_size=TEXT_WIDTH, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=2 * TEXT_WIDTH,
                                        max_position_embeddings=40, encoder_hidden_size=VISION_WIDTH,
                                        is_decoder=True, pad_token_id=0, bos_token_id=2, sep_token_id=3),
                         add_pooling_layer=False).eval()
    mlp = score_mlp(TEXT_WIDTH).eval()
    with torch.no_grad():  # weights of ImageReward's scale so the scores spread
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    state = {}
    for key, value in vision.state_dict().items():
        for ours, theirs in _TO_BLIP_VISION:
            key = key.replace(ours, theirs)
        state[f"blip.visual_encoder.{key}"] = value
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    state.update({f"mlp.{k}": v for k, v in mlp.state_dict().items()})
    torch.save(state, os.path.join(out_dir, "ImageReward.pt"))
    with open(os.path.join(out_dir, "med_config.json"), "w") as f:
        json.dump(med, f)
    return out_dir, os.path.join(out_dir, "tokenizer"), vision, text, mlp
