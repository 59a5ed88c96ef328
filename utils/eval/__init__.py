"""Scoring: held-out generation (`heldout`), grading as crystal-metrics grades (`grading`), benchmarks,
distilled reasoning chains (`chains`), reasoning-keyword statistics (`keywords`)."""
