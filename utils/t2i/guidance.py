"""Classifier-free guidance settings (`Guidance`) and the rescalings of a guided velocity (`renormalize`).

Two families of rescaling exist. The pipelines' own (Qwen-Image's true CFG): the text-guided velocity is rescaled to
the conditional velocity's norm per latent token, whatever the ratio (`renorm=True`; None = the pipeline's choice).
BAGEL's, which R3 trains with (`renorm="global" | "channel" | "text_channel"`): the ratio ||v_cond|| / ||v_guided|| is
clamped to [renorm_min, 1], so guidance may shrink a velocity back towards the conditional one's norm but never grow
it; "global" takes the norms over a whole image's latents, "channel" over each latent token's channels, both on the
fully guided velocity (text CFG, then the edit's image CFG); "text_channel" rescales the text-guided velocity per
token before the image CFG is added on top (R3's edit setting; its generation uses "global").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RENORM_TYPES = ("pipeline", "none", "global", "channel", "text_channel")  # the --cfg_renorm_type_* choices
BAGEL_RENORMS = ("global", "channel", "text_channel")
EPS = 1e-8  # BAGEL's guard against a zero guided velocity


@dataclass
class Guidance:
    """Classifier-free guidance as the pipelines compute it: v = v_neg + scale * (v_pos - v_neg).

    scale <= 1 or a condition without a negative branch turns CFG off, as in the pipelines.
    interval=(lo, hi): CFG only where lo < sigma <= hi (R3: (0.4, 1.0)); elsewhere the conditional velocity.
    renorm: None = the pipeline's choice (Qwen-Image: on); True / False = the pipelines' per-token rescale to the
    conditional norm on / off; "global" / "channel" / "text_channel" = BAGEL's clamped rescales (module docstring),
    the ratio clamped to [renorm_min, 1].
    embedded: the guidance input of guidance-distilled transformers (FLUX.1-dev); None = the adapter's default.
    image_scale > 1: an edit's image CFG on top (BAGEL's cfg_img_scale; R3: 1.5), where the text CFG is on:
    v = v_free + image_scale * (v_text - v_free), v_text the text-guided velocity and v_free the prompt's without
    the input image (a condition's `no_image` branch; without one, no image CFG).
    """

    scale: float = 4.0
    interval: tuple | None = None
    renorm: bool | str | None = None
    embedded: float | None = None
    image_scale: float = 1.0
    renorm_min: float = 0.0

    def __post_init__(self):
        if isinstance(self.renorm, str) and self.renorm not in BAGEL_RENORMS:
            raise ValueError(f"Guidance(renorm={self.renorm!r}): expected None, a bool or one of {BAGEL_RENORMS}")

    def active(self, sigma):
        on = torch.full_like(sigma, self.scale > 1, dtype=torch.bool)
        if self.interval is not None:
            lo, hi = self.interval
            on &= (sigma > lo) & (sigma <= hi)
        return on


def guidance_from_flags(scale, interval, renorm_type, renorm_min=0.0, image_scale=1.0):
    """A Guidance from the scripts' --cfg_renorm_type_* value ("pipeline" = the pipeline's own, "none" = off)."""
    renorm = {"pipeline": None, "none": False}.get(renorm_type, renorm_type)
    return Guidance(scale, interval=tuple(interval), renorm=renorm, renorm_min=renorm_min, image_scale=image_scale)


def renormalize(guided, cond, kind, *, renorm_min=0.0, channel_dim=-1):
    """`guided` rescaled towards the conditional velocity `cond` (both [B, ...]): "pipeline" multiplies each latent
    token by ||cond|| / ||guided|| over its channels; "global" / "channel" / "text_channel" (BAGEL) by that ratio
    over the whole image (global) or per token (channel, text_channel), clamped to [renorm_min, 1]."""
    if kind == "global":
        dims = tuple(range(1, guided.ndim))
    elif kind in ("channel", "text_channel", "pipeline"):
        dims = (channel_dim,)
    else:
        raise ValueError(f"renormalize: unknown kind {kind!r}")
    ratio_top, ratio_bottom = cond.norm(dim=dims, keepdim=True), guided.norm(dim=dims, keepdim=True)
    if kind == "pipeline":
        return guided * (ratio_top / ratio_bottom)
    return guided * (ratio_top / (ratio_bottom + EPS)).clamp(min=renorm_min, max=1.0)
