"""What the in-process image reward models share: the device, the once-per-process load, the package check, hub files,
batched scoring and the score MLP of the aesthetic predictor and ImageReward.

Each reward model (``pickscore``, ``clipscore``, ``aesthetic``, ``hpsv2``, ``imagereward``, ``ocr``) is built by its
factory at configuration time: its package is checked first (a missing one is refused in one line naming
``requirements-rewards.txt``), then its weights load once per process (by hub name or from a local folder laid out as
the hub repository), on the chosen device, in eval mode; scoring runs under ``torch.no_grad`` in batches.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from typing import Callable, Sequence

from rewards.reward_model import resolve_device
from utils.core.config import ConfigError

OPTIONAL_REQUIREMENTS = "requirements-rewards.txt"
# the module each optional package is imported as -> its name on the package index
PACKAGES = {"open_clip": "open_clip_torch", "rapidocr": "rapidocr", "onnxruntime": "onnxruntime",
            "Levenshtein": "levenshtein"}

_LOADED: dict = {}
_LOCK = threading.Lock()


def require(reward: str, *modules: str) -> None:
    """Refuse, in one line naming the requirements file, a reward whose package is not installed."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"reward {reward!r} needs the package {PACKAGES.get(module, module)!r}, which is not "
                              f"installed ({type(exc).__name__}: {str(exc).splitlines()[0]}): "
                              f"pip install -r {OPTIONAL_REQUIREMENTS}") from None


def reward_device(device: str | None):
    """The device a reward model runs on: ``auto`` (or None) takes this process's GPU (``cuda:$LOCAL_RANK``), else the
    CPU; anything else is a torch device (the text reward models' rule)."""
    return resolve_device(device or "auto")


def torch_dtype(dtype: str):
    import torch

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"reward model dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return getattr(torch, dtype)


def load_once(key: tuple, loader: Callable):
    """``loader()``'s result, built once per process for ``key`` (a reward built twice, for training and held-out
    scoring, shares its weights), always whole (`whole_weights`)."""
    with _LOCK:
        if key not in _LOADED:
            with whole_weights():
                _LOADED[key] = loader()
        return _LOADED[key]


@contextlib.contextmanager
def whole_weights():
    """Models built inside are whole on each process: under an accelerate ZeRO-3 config transformers would build
    them sharded (deepspeed.zero.Init, while its HF DeepSpeed config is registered), but a reward model is not
    trained and every process scores its own images with all of it."""
    from transformers.integrations import deepspeed

    registered = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = registered


def hub_file(name_or_path: str, filename: str) -> str:
    """A file of a hub repository: ``name_or_path`` is the file itself, a local folder laid out as the repository,
    or the repository's hub name (downloaded once into the hub cache)."""
    if os.path.isfile(name_or_path):
        return name_or_path
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{name_or_path}: no {filename} in this folder (it is laid out as the hub "
                                    f"repository, which holds {filename})")
        return path
    from huggingface_hub import hf_hub_download

    return hf_hub_download(name_or_path, filename)


def load_state_dict(path: str) -> dict:
    """A checkpoint of tensors (``torch.load(weights_only=True)``: nothing in it can run code); a ``state_dict`` entry
    is unwrapped."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    return {k.removeprefix("module."): v for k, v in state.items()}


def rgb(images: Sequence) -> list:
    """PIL images in RGB (HWC uint8 arrays are converted)."""
    from PIL import Image

    out = []
    for image in images:
        if type(image).__module__ == "numpy":
            image = Image.fromarray(image)
        out.append(image if image.mode == "RGB" else image.convert("RGB"))
    return out


def score_in_batches(images: Sequence, texts: Sequence[str] | None, score: Callable, batch_size: int
                     ) -> list[float | None]:
    """``score(images, texts) -> [B] tensor`` over batches of the images that are not None; None stays None."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out: list[float | None] = [None] * len(images)
    keep = [i for i, image in enumerate(images) if image is not None]
    for start in range(0, len(keep), batch_size):
        chunk = keep[start:start + batch_size]
        with torch.no_grad():
            values = score(rgb([images[i] for i in chunk]), None if texts is None else [texts[i] for i in chunk])
        for i, value in zip(chunk, values.float().cpu().tolist()):
            out[i] = float(value)
    return out


def score_mlp(input_size: int):
    """The MLP head of the LAION aesthetic predictor and of ImageReward (the same layers: 1024, 128, 64, 16, 1; the
    dropouts hold the checkpoints' layer indices and do nothing in eval mode)."""
    from torch import nn

    class ScoreMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                                        nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16),
                                        nn.Linear(16, 1))

        def forward(self, x):
            return self.layers(x).squeeze(-1)

    return ScoreMLP()


def frozen(module, device, dtype=None):
    """``module`` on ``device`` (and ``dtype``), in eval mode, with no parameter that takes a gradient."""
    module = module.to(device=device, dtype=dtype) if dtype is not None else module.to(device)
    return module.eval().requires_grad_(False)
