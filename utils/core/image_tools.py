"""Built-in image tools (`--tools crop_image zoom_image rotate_image`): "thinking with images" as DeepEyes and
Pixel-Reasoner do it, the model asks for a part of an image and reads it at full resolution.

Boxes are `[x1, y1, x2, y2]` in 0-1000 coordinates of the image (Qwen3-VL's convention: 0 is the left / top
edge, 1000 the right / bottom one), so they do not depend on how the processor resized the image the model saw.
`image_index` counts the conversation's images from 0: the prompt's, then those tools returned. Each tool checks its
arguments (a ValueError the model reads as the tool's error) and returns a PIL image within the processor's pixel
budget (`max_pixels`, filled in by the rollout): the region at most at the budget, never more.
"""

from __future__ import annotations

import math

from PIL import Image


def _image(images, image_index):
    if not images:
        raise ValueError("the conversation has no image")
    if not isinstance(image_index, int) or isinstance(image_index, bool) or not 0 <= image_index < len(images):
        raise ValueError(f"image_index {image_index!r} is not one of 0..{len(images) - 1}")
    return images[image_index]


def _pixel_box(box, image):
    """The 0-1000 box as pixel edges of `image`, checked."""
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        raise ValueError(f"box must be [x1, y1, x2, y2], got {box!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box):
        raise ValueError(f"box must hold 4 numbers, got {box!r}")
    x1, y1, x2, y2 = box
    if not (0 <= x1 < x2 <= 1000 and 0 <= y1 < y2 <= 1000):
        raise ValueError(f"box {list(box)} must satisfy 0 <= x1 < x2 <= 1000 and 0 <= y1 < y2 <= 1000")
    w, h = image.size
    left, top = int(math.floor(x1 * w / 1000)), int(math.floor(y1 * h / 1000))
    right, bottom = max(left + 1, int(math.ceil(x2 * w / 1000))), max(top + 1, int(math.ceil(y2 * h / 1000)))
    return left, top, min(right, w), min(bottom, h)


def fit_pixels(image, max_pixels, *, upscale=False):
    """`image` resized (aspect kept, bicubic) to at most `max_pixels` pixels; with `upscale`, also enlarged to fill
    them. No budget (None): unchanged."""
    if not max_pixels:
        return image
    w, h = image.size
    scale = math.sqrt(max_pixels / (w * h))
    if scale >= 1 and not upscale:
        return image
    size = (max(1, int(w * scale)), max(1, int(h * scale)))
    return image if size == image.size else image.resize(size, Image.BICUBIC)


def crop_image(box: list[int], image_index: int = 0, images: list = None, max_pixels: int = None):
    """Crop a region of an image, at its own resolution.

    Args:
        box: [x1, y1, x2, y2], 0-1000 from the left / top edge.
        image_index: Which image, from 0.
    """
    image = _image(images, image_index)
    return fit_pixels(image.crop(_pixel_box(box, image)), max_pixels)


def zoom_image(box: list[int], image_index: int = 0, images: list = None, max_pixels: int = None):
    """Zoom into a region of an image, enlarged to full resolution.

    Args:
        box: [x1, y1, x2, y2], 0-1000 from the left / top edge.
        image_index: Which image, from 0.
    """
    image = _image(images, image_index)
    region = image.crop(_pixel_box(box, image))
    return fit_pixels(region, max_pixels or image.size[0] * image.size[1], upscale=True)


def rotate_image(degrees: int, image_index: int = 0, images: list = None, max_pixels: int = None):
    """Rotate an image counter-clockwise, keeping all of it.

    Args:
        degrees: The angle, -360 to 360 (90 turns the top to the left).
        image_index: Which image, from 0.
    """
    if not isinstance(degrees, (int, float)) or isinstance(degrees, bool) or not -360 <= degrees <= 360:
        raise ValueError(f"degrees must be a number in [-360, 360], got {degrees!r}")
    image = _image(images, image_index)
    if degrees % 90 == 0:
        rotated = image.rotate(degrees, expand=True)  # exact: no resampling
    else:
        rotated = image.rotate(degrees, resample=Image.BICUBIC, expand=True, fillcolor=(255, 255, 255))
    return fit_pixels(rotated, max_pixels)
