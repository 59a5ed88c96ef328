"""What the flow-generator tests share: the tiny image size, two prompts of different lengths, seeded generators,
random input images, and a closeness check that prints the largest difference."""

import torch
from PIL import Image

SIZE = 32
PROMPTS = ["a photo of two red circles", "a blue square"]


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def random_image(seed=0, size=SIZE):
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr)


def assert_close(a, b, atol=1e-5):
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=atol, rtol=0), f"max diff {(a - b).abs().max().item():.3g}"
