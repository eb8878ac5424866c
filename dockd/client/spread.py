"""A spread partition's indexes: one numbering over its shards.

A partition declared with ``--shards NAME=S`` (dockd.owners) is S ordinary
partitions, its shards, each numbering its own samples from 0. The client shows
them as one partition: sample `i` of shard `k` is the spread partition's sample
``i * S + k``, so every index names its shard (``index % S``) and the indexes a
shard hands out in order stay in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dockd import owners


@dataclasses.dataclass(frozen=True, slots=True)
class Spread:
    """Spread partition `name` and its `count` shards."""

    name: str
    count: int

    def shard(self, k: int) -> str:
        """The name of shard k (an ordinary partition on its own controller)."""
        return owners.shard_name(self.name, k, self.count)

    def shards(self) -> list[str]:
        return [self.shard(k) for k in range(self.count)]

    def outward(self, k: int, local: Sequence[int]) -> list[int]:
        """Shard k's indexes as the spread partition's."""
        return (np.asarray(local, dtype=np.int64) * self.count + k).tolist()

    def inward(self, indexes: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
        """Indexes of the spread partition by shard: k -> (their places in `indexes`, shard k's own indexes)."""
        idx = np.asarray(indexes, dtype=np.int64)
        local, shard = np.divmod(idx, self.count)
        out = {}
        for k in np.unique(shard).tolist():
            where = np.flatnonzero(shard == k)
            out[k] = (where.tolist(), local[where].tolist())
        return out


def home(warehouse: int, controllers: int, count: int) -> int:
    """The shard (of `count`) that the clients homed on warehouse `warehouse` put to and get from first
    (0 while they have no home). Controller k of K numbers the warehouses it admits k, k + K, k + 2K,
    ..., so the id mod S alone would send every warehouse one controller numbered to one shard when S
    divides K; warehouse k + jK's shard is (k + j) mod S instead, which spreads each controller's
    warehouses over the shards in turn."""
    if warehouse < 0:
        return 0
    j, k = divmod(warehouse, max(controllers, 1))
    return (k + j) % count


def of(shards: dict[str, int], partition: object) -> Spread | None:
    """The spread partition named `partition` in a dock's `shards` (from its hello), or None: an
    ordinary partition (a dock without spread partitions pays one emptiness test; a `partition` that
    is not a string is left to the call's own check, which says what is wrong with it)."""
    if not shards or not isinstance(partition, str):
        return None
    count = shards.get(partition)
    return None if count is None else Spread(partition, count)
