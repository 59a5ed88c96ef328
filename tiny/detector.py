"""The shapes detector behind the `shapes_t2i` reward: segment by palette colour, label connected components,
keep those that look like drawn objects, classify each by how it fills its bounding box, then grade against a
GenEval-schema row.

Two behaviours grade the detections (`score_t2i(..., behaviour=...)`):
- "tiny" (default, what the reward trains on): partial credit for the requested objects times a precision
  term, so unrequested objects and speckle cost and noise or blank images score ~0;
- "geneval": GenEval's own rules (include = at least `count`, exclude = fewer than `count`, anything else
  free), for parity with the real GenEval server.
Both use the same detector, which works at >= 64 px and only trusts components of plausible size, solidity and
isolation (the constants below were measured on `render_t2i` images, clean and noisy, against noise images).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
from PIL import Image, ImageFilter

from tiny.shapes import PALETTE
from tiny.t2i import _meta, relative_position

BEHAVIOURS = ("tiny", "geneval")
# render_t2i draws each object at 55-70% of a cell of a max(3, ceil(sqrt(n))) grid; the detector sizes its
# speckle threshold from that, so keep the two in step.
RENDER_SIZE_FRAC = (0.55, 0.7)
DETECT_MIN_SIDE = 64  # images smaller than this are upsampled (nearest) before detection
MAX_ALPHA = 1.3  # ink darker than its palette colour (alpha > 1) is not that colour: black is not green
MIN_AREA_FRAC = 0.15  # a component under 15% of the expected object area is a fragment, not an object
MIN_FILL = 0.35  # ... and so is one filling under 35% of its box (triangles fill ~1/2): a ragged blob
MIN_ISOLATION = 0.3  # ... and so is one with under 30% background in the ring around it: a blob in noise
MAX_AREA_FRAC = 0.25  # ... and a component over 25% of the image is a painted canvas (render_t2i: <= 5.5%)
BACKGROUND_DIST = 60.0  # pixels within this RGB distance of white are background
CLUTTER_FREE_FRAC = 0.25  # stray ink up to a quarter of one object's area is free
EXTRA_WEIGHT = 0.5  # an extra object costs half of what a missing one does

# --------------------------------------------------------------------------------------------------
# Pixels -> palette labels -> components


def _to_rgb_array(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float32)
    array = np.asarray(image, dtype=np.float32)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(1, 2, 0)  # CHW -> HWC
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    if array.max() <= 1.0:  # float images in [0, 1]
        array = array * 255.0
    return array


def color_labels(image, colors=tuple(PALETTE), min_alpha: float = 0.5, max_residual: float = 0.35,
                 max_alpha: float = MAX_ALPHA) -> np.ndarray:
    """Per-pixel palette index (-1 = background).

    A pixel p of colour c blended with the white background lies on the segment white -> c, i.e.
    255 - p = alpha * (255 - c). Fitting alpha per palette colour and keeping the colour with the
    smallest off-line residual makes blurred or anti-aliased edges keep their object's colour
    instead of looking like a lighter, different colour. Pixels need min_alpha <= alpha <= max_alpha
    (at least half ink, and not much darker than the colour itself: without the upper bound black and
    dark noise fit green) and a residual below max_residual * |alpha * (255 - c)|."""
    rgb = _to_rgb_array(image)
    ink = 255.0 - rgb  # [H, W, 3]
    dirs = np.array([[255.0 - v for v in PALETTE[c]] for c in colors])  # [K, 3]
    alpha = np.einsum("hwc,kc->hwk", ink, dirs) / (dirs**2).sum(-1)  # [H, W, K]
    residual = np.linalg.norm(ink[:, :, None, :] - alpha[..., None] * dirs, axis=-1)
    scale = np.maximum(alpha, 1e-6) * np.linalg.norm(dirs, axis=-1)
    rel = np.where((alpha >= min_alpha) & (alpha <= max_alpha), residual / scale, np.inf)
    best = rel.argmin(-1)
    ok = np.take_along_axis(rel, best[..., None], -1)[..., 0] <= max_residual
    return np.where(ok, best, -1)


def label_components(mask_labels: np.ndarray) -> list[np.ndarray]:
    """4-connected components of equal non-negative labels; returns one (N, 2) array of (y, x) each.
    A plain BFS: images here are at most a few hundred pixels wide."""
    height, width = mask_labels.shape
    seen = np.zeros_like(mask_labels, dtype=bool)
    components = []
    for start_y, start_x in zip(*np.nonzero(mask_labels >= 0)):
        if seen[start_y, start_x]:
            continue
        value = mask_labels[start_y, start_x]
        seen[start_y, start_x] = True
        queue, pixels = deque([(start_y, start_x)]), []
        while queue:
            y, x = queue.popleft()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and not seen[ny, nx] and mask_labels[ny, nx] == value:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        components.append(np.array(pixels))
    return components


def top_share(pixels: np.ndarray, y0: int, y1: int) -> float:
    """Fraction of a component's pixels in the upper half of its box: ~1/4 for an apex-up triangle (<= 0.33
    measured, blurred and noisy), 1/2 for circles and squares. Unlike the fill ratio it stays apart for
    6 px objects, where a rasterised circle fills ~0.67 and a blurred triangle ~0.65 of its box."""
    centre = pixels[:, 0] + 0.5 - (y0 + y1) / 2
    return float(((centre < 0).sum() + 0.5 * (centre == 0).sum()) / len(pixels))


def classify_shape(fill: float, top: float) -> str:
    """Shape from `top_share` (apex-up triangle ~1/4, others ~1/2) and the fill ratio (square ~1, circle
    ~pi/4; blur rounds a small square's corners to ~0.87, hence 0.86). A balanced component filling under
    0.6 of its box is like none of them (a ragged blob): "other", which no row asks for."""
    if top < 0.4:
        return "triangle"
    if fill >= 0.86:
        return "square"
    if fill >= 0.6:
        return "circle"
    return "other"


def is_noisy(rgb: np.ndarray, level: float = 2.0) -> bool:
    """Flat renders have (almost) no difference between neighbouring pixels; generated images do."""
    return float(np.median(np.abs(np.diff(rgb, axis=1)))) > level


def detection_factor(height: int, width: int, min_side: int | None = DETECT_MIN_SIDE) -> int:
    """Integer upsampling factor that brings the short side to >= min_side (1 = none).

    The 3x3 median works in pixels: on a 32 px image it shaves a 6 px object to a different shape
    (noisy 32 px renders scored 0.82 without upsampling, 1.0 with it). Nearest-neighbour by an integer
    factor keeps palette pixels exact and boxes on the input grid; bilinear invents blended colours at
    every edge (0.96 measured)."""
    if not min_side:
        return 1
    return max(1, math.ceil(min_side / max(1, min(height, width))))


def _median3(rgb: np.ndarray) -> np.ndarray:
    image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    return np.asarray(image.filter(ImageFilter.MedianFilter(3)), dtype=np.float32)


def _dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    """Square (Chebyshev) dilation without wrap-around: a max over all shifts up to `radius`."""
    height, width = mask.shape
    padded = np.pad(mask, radius)
    out = np.zeros_like(mask)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            out |= padded[dy:dy + height, dx:dx + width]
    return out


def _isolation(pixels: np.ndarray, box, background: np.ndarray, radius: int) -> float:
    """Share of background pixels in the ring of `radius` around a component (box in detection pixels).

    Drawn objects sit on the white canvas, so most of their ring is background even when blurred or
    touching a neighbour (>= 0.4 measured); a blob that noise or a smooth untrained generator made out of
    palette-ish pixels is surrounded by more noise (<= 0.05 measured)."""
    x0, y0, x1, y1 = box
    top, left = max(0, y0 - radius), max(0, x0 - radius)
    local = background[top:y1 + radius, left:x1 + radius]
    mask = np.zeros(local.shape, dtype=bool)
    mask[pixels[:, 0] - top, pixels[:, 1] - left] = True
    ring = _dilate(mask, radius) & ~mask
    return float(local[ring].mean()) if ring.any() else 1.0


def _prepare(image, denoise, min_side) -> tuple[np.ndarray, int]:
    """The image at detection scale: upsampled by `detection_factor`, then 3x3-median denoised when asked
    (or, for "auto", when the input `is_noisy`: decided before upsampling, which flattens differences)."""
    rgb = _to_rgb_array(image)
    if denoise == "auto":
        denoise = is_noisy(rgb)
    factor = detection_factor(rgb.shape[0], rgb.shape[1], min_side)
    if factor > 1:
        rgb = rgb.repeat(factor, axis=0).repeat(factor, axis=1)
    return (_median3(rgb) if denoise else rgb), factor


def _box_and_fill(pixels: np.ndarray) -> tuple[tuple[int, int, int, int], float]:
    """Bounding box (x0, y0, x1, y1) of a component and the share of it that the component fills."""
    y0, x0 = pixels.min(0)
    y1, x1 = pixels.max(0) + 1
    return (int(x0), int(y0), int(x1), int(y1)), len(pixels) / float((y1 - y0) * (x1 - x0))


def _describe(pixels: np.ndarray, box, fill: float, color: str, factor: int) -> dict:
    """One detected object in input-image pixels (boxes and areas are floats when upsampled)."""
    shape = classify_shape(fill, top_share(pixels, box[1], box[3]))
    area = len(pixels)
    if factor > 1:
        box, area = tuple(v / factor for v in box), area / factor**2
    return dict(shape=shape, color=color, box=box, area=area, fill=float(fill))


def segment_shapes(image, *, colors=tuple(PALETTE), min_area: float | None = None, min_fill: float = MIN_FILL,
                   min_isolation: float = MIN_ISOLATION, denoise="auto",
                   min_side: int | None = DETECT_MIN_SIDE) -> dict:
    """Objects of an image of flat shapes on white, and the ink they leave unexplained, in input pixels:
    {"objects": [{shape, color, box=(x0, y0, x1, y1), area, fill}], "stray_pixels": float, "factor": int}.

    The image is brought to detection scale (`_prepare`), labelled by palette colour and split into
    4-connected components. A component is an object only if it has >= min_area input pixels (default
    0.25% of the image, at least 6 detection pixels), fills >= min_fill of its box and has >= min_isolation
    background in the ring 2 input pixels around it (`_isolation`) and covers at most MAX_AREA_FRAC of the
    image (a canvas painted in one colour has no ring inside the image): speckle, noise blobs and floods are not
    objects. stray_pixels counts the non-background pixels (further than BACKGROUND_DIST from white)
    outside the objects and their 2-pixel halo (blurred edges): speckle, noise, non-palette junk, so a
    scorer can charge for them."""
    rgb, factor = _prepare(image, denoise, min_side)
    labels = color_labels(rgb, colors)
    background = np.linalg.norm(255.0 - rgb, axis=-1) < BACKGROUND_DIST
    min_pixels = max(6, int(0.0025 * labels.size)) if min_area is None else min_area * factor**2
    radius = 2 * factor
    objects, explained = [], np.zeros(labels.shape, dtype=bool)
    for pixels in label_components(labels):
        if len(pixels) < min_pixels or len(pixels) > MAX_AREA_FRAC * labels.size:
            continue
        box, fill = _box_and_fill(pixels)
        if fill < min_fill or _isolation(pixels, box, background, radius) < min_isolation:
            continue
        objects.append(_describe(pixels, box, fill, colors[labels[pixels[0][0], pixels[0][1]]], factor))
        explained[pixels[:, 0], pixels[:, 1]] = True
    stray = ~background & ~_dilate(explained, radius)
    return {"objects": objects, "stray_pixels": float(stray.sum()) / factor**2, "factor": factor}


def detect_shapes(image, *, colors=tuple(PALETTE), min_area: float | None = None, min_fill: float = MIN_FILL,
                  min_isolation: float = MIN_ISOLATION, denoise="auto",
                  min_side: int | None = DETECT_MIN_SIDE) -> list[dict]:
    """Objects in an image of flat shapes on white: [{shape, color, box=(x0, y0, x1, y1), area, fill}]
    (see `segment_shapes` for the options)."""
    return segment_shapes(image, colors=colors, min_area=min_area, min_fill=min_fill, min_isolation=min_isolation,
                          denoise=denoise, min_side=min_side)["objects"]


def detected_scene(image, grid: int = 3) -> list[tuple[int, str, str]]:
    """The detected objects as a scene key: (cell of the grid x grid layout, colour, shape) of each, by the centre
    of its box, sorted (what tiny.edits.scene_key says of a scene's object list)."""
    height, width = _to_rgb_array(image).shape[:2]
    found = []
    for o in detect_shapes(image):
        x0, y0, x1, y1 = o["box"]
        row, col = min(grid - 1, int((y0 + y1) / 2 * grid / height)), min(grid - 1, int((x0 + x1) / 2 * grid / width))
        found.append((row * grid + col, o["color"], o["shape"]))
    return sorted(found)


# --------------------------------------------------------------------------------------------------
# Grading against a GenEval-schema row


def expected_object_area(n_objects: int, side: float) -> float:
    """Mean area (pixels) of one of n objects as `render_t2i` draws them on a side x side canvas: a box
    of RENDER_SIZE_FRAC of a grid cell, filled ~3/4 (square 1, circle pi/4, triangle 1/2). Speckle is
    judged against it: 33 px at 32 px for up to 9 objects, 133 px at 64 px."""
    grid = max(3, math.ceil(math.sqrt(max(1, n_objects))))
    return 0.75 * (sum(RENDER_SIZE_FRAC) / 2 * side / grid) ** 2


def _matching(objects, item):
    return [o for o in objects if o["shape"] == item["class"]
            and (item.get("color") is None or o["color"] == item["color"])]


def _include_credit(objects, includes, item) -> float:
    """GenEval partial credit of one include item: the mean of its checks, each min(k, count) / count."""
    want = int(item["count"])
    matched = _matching(objects, item)
    checks = [min(len([o for o in objects if o["shape"] == item["class"]]), want) / want]
    if item.get("color") is not None:
        checks.append(min(len(matched), want) / want)
    if item.get("position"):
        relation, target = item["position"]
        targets = _matching(objects, includes[int(target)])[: int(includes[int(target)]["count"])]
        placed = [o for o in matched
                  if targets and all(relation in relative_position(o["box"], t["box"]) for t in targets)]
        checks.append(min(len(placed), want) / want)
    return sum(checks) / len(checks)


def _exclude_credit(objects, item) -> float:
    """GenEval exclude item: 1 if fewer than `count` objects match, else (count - 1) / found."""
    limit, found = int(item["count"]), len(_matching(objects, item))
    return 1.0 if found < limit else (limit - 1) / found


def _all_hold(credits) -> bool:
    return bool(credits) and all(c >= 1.0 - 1e-9 for c in credits)


def _geneval_grade(credits, excluded) -> tuple[float, bool]:
    """GenEval: the mean over include and exclude items; strict when every item holds."""
    items = credits + excluded
    return (sum(items) / len(items) if items else 0.0), _all_hold(items)


def _tiny_grade(credits, excluded, requested: int, extra: float, extra_weight: float) -> tuple[float, bool]:
    """Include credit times precision requested / (requested + extra_weight * extra)."""
    if not requested:
        return 0.0, False
    credit = sum(credits) / len(credits)
    return credit * requested / (requested + extra_weight * extra), _all_hold(credits + excluded) and extra == 0


def score_t2i(image, meta, *, behaviour: str = "tiny", min_area: float | None = None, denoise="auto",
              extra_weight: float = EXTRA_WEIGHT) -> dict:
    """Grade an image against a GenEval-schema row.

    Returns {"score": float in [0, 1], "strict": 0/1, "detected": objects found, "requested": objects the
    include items ask for, "extra": what is there beyond the request, in objects}.

    Detection (both behaviours, `segment_shapes`): images are upsampled to >= 64 px; a component is an
    object only if it covers >= MIN_AREA_FRAC of `expected_object_area` for this row (or min_area input
    pixels), fills >= MIN_FILL of its box and sits on background (MIN_ISOLATION), so speckle and noise
    are not a crowd of objects that passes every "at least n" check.

    Include item credit (both): GenEval's partial credit, the mean of its checks, each min(k, count) /
    count where k is the number of detected objects that pass it: the class; + the colour (if given);
    + the position relation to all objects of the referenced item (if given).

    behaviour="geneval" (GenEval's rules, include = at least `count`, exclude = fewer than `count`):
    score = mean over include and exclude items, an exclude item scoring 1 if fewer than `count` match,
    else (count - 1) / found; strict = every item 1. Like the real GenEval server, it penalises
    over-counting only through exclude items (counting rows carry "fewer than n + 1"); other extra
    objects are free, and a blank image earns a counting row's exclude half. "extra" is reported only.

    behaviour="tiny" (default, what the reward trains on) additionally charges for everything not asked
    for: score = credit * requested / (requested + extra_weight * extra), credit = mean over include
    items, extra = max(0, detected - requested) (another class or colour, "other" blobs, one more of the
    same) + stray ink (`segment_shapes`) beyond CLUTTER_FREE_FRAC of an object, in `expected_object_area`
    units. With the default extra_weight (EXTRA_WEIGHT = 1/2) an extra object costs about half of a missing
    one (single object: missing 0, extra 2/3; two objects: missing 1/2, extra 4/5); a reward may charge more
    (`shapes_t2i_reward(extra_weight=...)`). Exclude items get no term of their own: what they forbid is
    unrequested and so already extra; strict = 1 only when every include and exclude item holds and nothing is
    extra. Blank and noise images score 0.
    `image` may be a PIL image or an HWC/CHW array (uint8, or float in [0, 1]).
    """
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"score_t2i: behaviour must be one of {BEHAVIOURS}, got {behaviour!r}")
    if extra_weight < 0:
        raise ValueError(f"score_t2i: extra_weight must be >= 0, got {extra_weight}")
    meta = _meta(meta)
    includes, excludes = meta["include"], meta.get("exclude") or []
    requested = sum(int(item["count"]) for item in includes)
    rgb = _to_rgb_array(image)
    unit = expected_object_area(requested, min(rgb.shape[0], rgb.shape[1]))
    seg = segment_shapes(rgb, min_area=MIN_AREA_FRAC * unit if min_area is None else min_area, denoise=denoise)
    objects = seg["objects"]
    credits = [_include_credit(objects, includes, item) for item in includes]
    excluded = [_exclude_credit(objects, item) for item in excludes]
    extra = max(0, len(objects) - requested)
    if behaviour == "geneval":
        score, strict = _geneval_grade(credits, excluded)
    else:
        extra += max(0.0, seg["stray_pixels"] - CLUTTER_FREE_FRAC * unit) / unit
        score, strict = _tiny_grade(credits, excluded, requested, extra, extra_weight)
    return {"score": float(score), "strict": float(strict), "detected": len(objects), "requested": requested,
            "extra": float(extra)}
