"""An image reward with known values for train_mixgrpo.py's tests: it varies with every pixel, so the SDE noise
alone gives a group non-zero image advantages (the random tiny generator draws no shapes to score)."""

import numpy as np


def brightness(completions, images=None, **columns):
    """Mean pixel value in [0, 1] of each image."""
    return [float(np.asarray(im.convert("RGB"), dtype=np.float64).mean() / 255.0) for im in images]


def no_score(completions, images=None, **columns):
    """A judge that answers with no verdict: no image gets a score."""
    return [None for _ in images]
