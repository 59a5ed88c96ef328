"""`Record`: the base of the training loops' dataclasses (train_grpo.py's MicroBatch, train_mixgrpo.py's rollouts).
Their fields are read as attributes (`mb.rewards`); a record is also a read-only mapping of its fields
(`mb["rewards"]`, `mb.get(...)`, `dict(mb)`, `**mb`), for code written against the dicts these dataclasses replaced
(utils.core.groups reads micro-batches that way, and its tests pass plain dicts)."""

import dataclasses
from collections.abc import Mapping


class Record(Mapping):
    def __getitem__(self, key):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __iter__(self):
        return (f.name for f in dataclasses.fields(self))

    def __len__(self):
        return len(dataclasses.fields(self))
