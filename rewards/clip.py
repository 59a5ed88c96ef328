"""Image rewards on a transformers CLIP: ``pickscore``, ``clipscore``, ``aesthetic``.

    pickscore   logit_scale.exp() * cos(image, prompt) on PickScore's CLIP-H (yuvalkirstain/PickScore_v1) with the
                laion/CLIP-ViT-H-14-laion2B-s32B-b79K processor; Flow-GRPO trains on it divided by 26 (divisor=26)
    clipscore   weight * cos(image, prompt) on any CLIP (100 x cos, as many RL repositories), or with
                nonnegative=True weight * max(cos, 0) (the CLIPScore paper: weight 2.5 on ViT-B/32)
    aesthetic   the LAION improved aesthetic predictor: an MLP on the L2-normalised CLIP ViT-L/14 image embedding

Each is ``fn(completions, images=[PIL, ...], prompt=[...], **columns) -> list[float | None]``; an image that is None
gets None. The prompt comes from ``prompt_column`` (default ``prompt``), else TRL's ``prompts``.
"""

from __future__ import annotations

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

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # PickScore was trained from this CLIP; its processor
CLIPSCORE_MODEL = "openai/clip-vit-base-patch32"  # the CLIPScore paper's CLIP
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_MLP = "trl-lib/ddpo-aesthetic-predictor"  # sac+logos+ava1-l14-linearMSE.pth, as TRL's DDPO example loads it
AESTHETIC_MLP_FILE = "aesthetic-model.pth"


class CLIPEmbedder:
    """A transformers CLIP and its processor, frozen on a device: L2-normalised image and text embeddings."""

    def __init__(self, model_name_or_path: str, processor_name_or_path: str, device, dtype):
        from transformers import AutoModel, AutoProcessor

        self.device, self.dtype = device, dtype
        self.model = frozen(AutoModel.from_pretrained(model_name_or_path), device, dtype)
        self.processor = AutoProcessor.from_pretrained(processor_name_or_path)
        # 77 on the released CLIPs, as Flow-GRPO's max_length
        self.max_length = self.model.config.text_config.max_position_embeddings

    def image_embeds(self, images):
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        out = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
        out = getattr(out, "pooler_output", out).float()  # transformers 5: an output whose pooler_output is projected
        return out / out.norm(p=2, dim=-1, keepdim=True)

    def text_embeds(self, texts):
        tokens = self.processor(text=list(texts), padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        out = self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                           attention_mask=tokens["attention_mask"].to(self.device))
        out = getattr(out, "pooler_output", out).float()
        return out / out.norm(p=2, dim=-1, keepdim=True)

    def cosine(self, images, texts):
        return (self.image_embeds(images) * self.text_embeds(texts)).sum(-1)


def clip_embedder(model_name_or_path, processor_name_or_path, device, dtype) -> CLIPEmbedder:
    device, dtype = reward_device(device), torch_dtype(dtype)
    return load_once(("clip", model_name_or_path, processor_name_or_path, str(device), str(dtype)),
                     lambda: CLIPEmbedder(model_name_or_path, processor_name_or_path, device, dtype))


def _check_batch(batch_size):
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")


# ---- pickscore ----


def pickscore_reward(model_name_or_path: str = PICKSCORE_MODEL, processor_name_or_path: str | None = None,
                     divisor: float = 1.0, device: str = "auto", dtype: str = "float32", batch_size: int = 32,
                     prompt_column: str = "prompt"):
    """PickScore: ``logit_scale.exp() * cos(image embedding, prompt embedding) / divisor``.

    ``processor_name_or_path``: none takes PickScore's own (laion/CLIP-ViT-H-14-laion2B-s32B-b79K) for the default
    model, else the model's folder. ``divisor=26`` is Flow-GRPO's training scale (scores near 1).
    """
    _check_batch(batch_size)
    if not divisor > 0:
        raise ValueError(f"pickscore: divisor must be > 0, got {divisor!r}")
    if processor_name_or_path is None:
        processor_name_or_path = PICKSCORE_PROCESSOR if model_name_or_path == PICKSCORE_MODEL else model_name_or_path
    clip = clip_embedder(model_name_or_path, processor_name_or_path, device, dtype)
    return RewardFunction("pickscore", _pickscore, clip=clip, divisor=float(divisor), batch_size=batch_size,
                          prompt_column=prompt_column)


def _pickscore(completions, images=None, *, clip, divisor, batch_size, prompt_column, **columns):
    n = len(completions)
    images = images_column(images, n, "pickscore")
    texts = prompt_texts(columns, n, "pickscore", prompt_column)
    scale = clip.model.logit_scale.exp().float()
    return score_in_batches(images, texts, lambda ims, txt: scale * clip.cosine(ims, txt) / divisor, batch_size)


# ---- clipscore ----


def clipscore_reward(model_name_or_path: str = CLIPSCORE_MODEL, processor_name_or_path: str | None = None,
                     weight: float = 100.0, nonnegative: bool = False, device: str = "auto",
                     dtype: str = "float32", batch_size: int = 32, prompt_column: str = "prompt"):
    """CLIPScore: ``weight * cos(image, prompt)``; ``nonnegative=True`` gives ``weight * max(cos, 0)``, the CLIPScore
    paper's form (Hessel et al.: weight 2.5, openai/clip-vit-base-patch32)."""
    _check_batch(batch_size)
    clip = clip_embedder(model_name_or_path, processor_name_or_path or model_name_or_path, device, dtype)
    return RewardFunction("clipscore", _clipscore, clip=clip, weight=float(weight), nonnegative=bool(nonnegative),
                          batch_size=batch_size, prompt_column=prompt_column)


def _clipscore(completions, images=None, *, clip, weight, nonnegative, batch_size, prompt_column, **columns):
    n = len(completions)
    images = images_column(images, n, "clipscore")
    texts = prompt_texts(columns, n, "clipscore", prompt_column)

    def score(ims, txt):
        cos = clip.cosine(ims, txt)
        return weight * (cos.clamp(min=0) if nonnegative else cos)

    return score_in_batches(images, texts, score, batch_size)


# ---- aesthetic ----


class AestheticScorer:
    """CLIP image embedding, L2-normalised, through the predictor's MLP."""

    def __init__(self, clip: CLIPEmbedder, mlp_path: str):
        state = load_state_dict(mlp_path)
        in_features = state["layers.0.weight"].shape[1]
        width = clip.model.config.projection_dim
        if in_features != width:
            raise ValueError(f"{mlp_path}: the aesthetic MLP reads {in_features}-wide embeddings, the CLIP gives "
                             f"{width} (the predictor belongs to CLIP ViT-L/14: 768)")
        mlp = score_mlp(in_features)
        mlp.load_state_dict(state)
        self.clip, self.mlp = clip, frozen(mlp, clip.device)

    def __call__(self, images, texts=None):
        return self.mlp(self.clip.image_embeds(images))


def aesthetic_reward(clip_name_or_path: str = AESTHETIC_CLIP, mlp_name_or_path: str = AESTHETIC_MLP,
                     mlp_filename: str = AESTHETIC_MLP_FILE, device: str = "auto", dtype: str = "float32",
                     batch_size: int = 32):
    """LAION aesthetic score (about 1-10): the improved aesthetic predictor's MLP (``mlp_filename`` in the hub repo
    or folder ``mlp_name_or_path``) on the L2-normalised image embedding of CLIP ViT-L/14. Reads no prompt."""
    _check_batch(batch_size)
    clip = clip_embedder(clip_name_or_path, clip_name_or_path, device, dtype)
    mlp_path = hub_file(mlp_name_or_path, mlp_filename)
    scorer = load_once(("aesthetic", clip_name_or_path, mlp_path, str(clip.device), str(clip.dtype)),
                       lambda: AestheticScorer(clip, mlp_path))
    return RewardFunction("aesthetic", _aesthetic, scorer=scorer, batch_size=batch_size)


def _aesthetic(completions, images=None, *, scorer, batch_size, **columns):
    images = images_column(images, len(completions), "aesthetic")
    return score_in_batches(images, None, scorer, batch_size)
