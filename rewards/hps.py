"""``hpsv2``: Human Preference Score v2.1, cos(image, prompt) of the HPS checkpoint on open_clip's ViT-H-14.

HPSv2 is an open_clip ViT-H-14 fine-tuned on human preferences; its authors build the model with open_clip
(their package vendors a copy of it), load ``HPS_v2.1_compressed.pt`` (``{"state_dict": ...}``) from the hub
repository ``xswu/HPSv2`` over it, and score with the normalised features' dot product. The image is resized by its
longest side to the model's size and centred on a square (HPS's validation transform); the prompt goes through the
architecture's tokenizer (OpenAI's BPE, 77 tokens).
"""

from __future__ import annotations

import os

from rewards.common import RewardFunction, images_column, prompt_texts
from rewards.models import (
    frozen,
    hub_file,
    load_once,
    load_state_dict,
    require,
    reward_device,
    score_in_batches,
    torch_dtype,
)

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
HPS_ARCHITECTURE = "ViT-H-14"


class HPSScorer:
    def __init__(self, checkpoint: str, architecture: str, device, dtype):
        import open_clip

        if architecture.endswith(".json"):  # an open_clip model config of one's own: registered under its file name
            open_clip.add_model_config(architecture)
            architecture = os.path.splitext(os.path.basename(architecture))[0]
        model, _, preprocess = open_clip.create_model_and_transforms(architecture, pretrained=None,
                                                                     image_resize_mode="longest")
        model.load_state_dict(load_state_dict(checkpoint))
        self.model, self.preprocess = frozen(model, device, dtype), preprocess
        self.tokenizer = open_clip.get_tokenizer(architecture)
        self.device, self.dtype = device, dtype

    def __call__(self, images, texts):
        import torch

        pixels = torch.stack([self.preprocess(image) for image in images]).to(self.device, self.dtype)
        image = self.model.encode_image(pixels, normalize=True).float()
        text = self.model.encode_text(self.tokenizer(list(texts)).to(self.device), normalize=True).float()
        return (image * text).sum(-1)


def hpsv2_reward(model_name_or_path: str = HPS_REPO, version: str = "v2.1", architecture: str = HPS_ARCHITECTURE,
                 device: str = "auto", dtype: str = "float32", batch_size: int = 32,
                 prompt_column: str = "prompt"):
    """HPSv2 (``version`` v2.1 or v2.0): cos(image, prompt) of the HPS checkpoint in the hub repository or folder
    ``model_name_or_path`` (or the .pt file itself), on open_clip's ``architecture`` (ViT-H-14; a path to an
    open_clip model config .json registers that one)."""
    require("hpsv2", "open_clip")
    if version not in HPS_FILES:
        raise ValueError(f"hpsv2: version must be one of {sorted(HPS_FILES)}, got {version!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    device, torch_type = reward_device(device), torch_dtype(dtype)
    checkpoint = hub_file(model_name_or_path, HPS_FILES[version])
    scorer = load_once(("hpsv2", checkpoint, architecture, str(device), dtype),
                       lambda: HPSScorer(checkpoint, architecture, device, torch_type))
    return RewardFunction("hpsv2", _hpsv2, scorer=scorer, batch_size=batch_size, prompt_column=prompt_column)


def _hpsv2(completions, images=None, *, scorer, batch_size, prompt_column, **columns):
    n = len(completions)
    images = images_column(images, n, "hpsv2")
    return score_in_batches(images, prompt_texts(columns, n, "hpsv2", prompt_column), scorer, batch_size)
