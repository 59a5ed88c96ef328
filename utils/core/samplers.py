"""Checkpointable data order for hand-written training loops: an endless seeded sampler whose position is two
integers, and a curriculum sampler that walks difficulty stages with one such sampler per stage."""

from __future__ import annotations

import math

import torch


class SeededSampler(torch.utils.data.Sampler):
    """Endless, reproducible stream of dataset indices: epoch e is a permutation seeded by (seed, e).

    Its position is two integers, so it checkpoints exactly: store `state_dict()` in `extra_state` (or register
    the sampler with `accelerator.register_for_checkpointing`). Every rank builds the same stream; scripts that
    want different prompts per rank slice what `take` returns (`indices[rank::world_size]`).
    Draw with `take(n)` from the training loop. Used as a DataLoader sampler it works too, but a DataLoader with
    workers prefetches, so the state then runs ahead of what was trained on.
    """

    def __init__(self, num_items: int, seed: int = 0, shuffle: bool = True):
        if num_items < 1:
            raise ValueError(f"SeededSampler needs at least one item, got num_items={num_items}")
        self.num_items = int(num_items)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0  # index into the current epoch's permutation of the next item to hand out
        self._order = None
        self._order_epoch = None

    def _permutation(self) -> list[int]:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._order = torch.randperm(self.num_items, generator=generator).tolist()
            else:
                self._order = list(range(self.num_items))
            self._order_epoch = self.epoch
        return self._order

    def __len__(self) -> int:
        return self.num_items

    def __iter__(self):
        while True:
            yield self.next_index()

    def next_index(self) -> int:
        if self.position >= self.num_items:
            self.epoch += 1
            self.position = 0
        index = self._permutation()[self.position]
        self.position += 1
        return index

    def take(self, n: int) -> list[int]:
        return [self.next_index() for _ in range(n)]

    def state_dict(self) -> dict:
        return {"num_items": self.num_items, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict):
        for key in ("num_items", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"SeededSampler state was saved with {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; resuming would not continue the same data order"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class CurriculumSampler:
    """Prompt indices stage by stage: stage s owns steps [s * steps_per_stage, (s + 1) * steps_per_stage).

    The stage follows from the global step, and each stage keeps its own seeded sampler whose position
    goes into the checkpoint, so resuming lands on the same stage and the same next question.
    """

    def __init__(self, stages, *, seed, total_steps):
        self.names = list(stages)
        self.indices = [list(v) for v in stages.values()]
        self.samplers = [SeededSampler(len(ix), seed=seed + s) for s, ix in enumerate(self.indices)]
        self.steps_per_stage = max(1, math.ceil(total_steps / len(self.names)))

    def stage(self, global_step):
        return min(global_step // self.steps_per_stage, len(self.names) - 1)

    def take(self, n, global_step):
        s = self.stage(global_step)
        return [self.indices[s][i] for i in self.samplers[s].take(n)]

    def state_dict(self):
        return {"names": self.names, "samplers": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state):
        if state["names"] != self.names:
            raise ValueError(f"checkpoint curriculum {state['names']} differs from --curriculum {self.names}")
        for sampler, s in zip(self.samplers, state["samplers"]):
            sampler.load_state_dict(s)
