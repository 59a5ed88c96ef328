"""Image rewards scored off the critical path (train_mixgrpo.py --overlap_rewards): a background thread per reward
scores one step's images while the loop draws the next step's.

    scorer = RewardScorer(cfg, reward_fn, background=True)
    pending = scorer.submit(texts, images, rows)   # returns at once; at most `queue_size` jobs wait
    ...                                             # draw the next step's images
    scores = pending.result()                       # this step's scores; a reward that failed raises here

The reward runs as `score_images` runs it (None -> NaN, never 0). A failure is kept in its job and raised when the
loop asks for that job's scores (the next step), never turned into a score; a full queue makes `submit` wait. With
`background=False` the job runs at once in the caller's thread, so the loop reads the same either way.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from utils.core.reward_calls import score_images


class RewardScorer:
    def __init__(self, cfg, reward_fn, *, background: bool, queue_size: int = 2):
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.cfg, self.reward_fn, self.background = cfg, reward_fn, background
        name = getattr(reward_fn, "__name__", "reward")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{name}") if background else None
        self._slots = threading.BoundedSemaphore(queue_size)  # jobs queued or running

    def _score(self, texts, images, rows):
        try:
            return score_images(self.cfg, self.reward_fn, texts, images, rows)
        finally:
            self._slots.release()

    def submit(self, texts, images, rows) -> Future:
        """Score (texts, images, rows) as `score_images` does; the future's result is the [N] float tensor."""
        self._slots.acquire()
        if self._pool is not None:
            return self._pool.submit(self._score, list(texts), list(images), list(rows))
        future = Future()
        try:
            future.set_result(self._score(texts, images, rows))
        except Exception as exc:  # kept for result(), as a background job's would be
            future.set_exception(exc)
        return future

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
