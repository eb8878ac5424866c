"""Blocks of new sample indexes a warehouse holds (--commit-window), and the indexes its puts take from them.

A warehouse that answers puts before their commit cannot ask the controller for each put's indexes: it
asks for a block of them ahead (`BlockRequest`: reserved samples, no column written, journaled at the
controller with this warehouse as their owner) and hands them out to the puts of that partition, in order.
A put whose samples do not fit what is left of the current block starts the next one; the rest it leaves
is a hole (reserved, never written: the controller deletes it when the partition is sealed or the block's
owner goes away). A block is asked for again while half of the last one is still left, so that a steady
stream of puts never waits for one.

`Blocks` is the bookkeeping only (no I/O): the link asks the controller (`ControllerLink._ask_block`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

MIN_BLOCK = 64
"""Indexes a block holds at least."""
MAX_BLOCK = 4096
"""... and at most (a put of more gets a block of its own size)."""
PUTS_PER_BLOCK = 16
"""A block holds this many puts of the size that asked for it (within MIN_BLOCK and MAX_BLOCK)."""
REFUSED_BACKOFF_S = 1.0
"""After the controller grants no block for a partition (sealing, paced, full), ask again no sooner."""


@dataclasses.dataclass(slots=True)
class Block:
    id: int
    next: int   # the next index to hand out
    stop: int   # one past the block's last index
    group_size: int

    @property
    def left(self) -> int:
        return self.stop - self.next


class Blocks:
    """Per partition, the blocks this warehouse hands indexes out of, in the order they were granted."""

    def __init__(self, clock=time.monotonic) -> None:
        self._open: dict[str, list[Block]] = {}
        self._asking: set[str] = set()            # partitions with a BlockRequest on its way
        self._refused: dict[str, float] = {}      # partition -> when it may be asked again
        self._clock = clock

    def take(self, partition: str, count: int, group_size: int) -> tuple[int, np.ndarray] | None:
        """The block and indexes for a put of `count` new samples (groups of `group_size`), or None:
        no block of that group size holds them (the put is answered after its commit)."""
        blocks = self._open.get(partition)
        while blocks:
            b = blocks[0]
            if b.group_size == group_size and b.left >= count:
                idx = np.arange(b.next, b.next + count, dtype=np.int64)
                b.next += count
                if not b.left:
                    blocks.pop(0)
                return b.id, idx
            blocks.pop(0)  # (what is left of it is a hole: the put does not fit it, nor would the next ones)
        return None

    def wants(self, partition: str, count: int, group_size: int) -> int:
        """How many indexes to ask for now (0: none: enough is left, a request is on its way, or the
        controller refused one a moment ago); marks the request as on its way."""
        if partition in self._asking or self._clock() < self._refused.get(partition, 0.0):
            return 0
        size = max(count, min(MAX_BLOCK, max(MIN_BLOCK, count * PUTS_PER_BLOCK)))
        size = -(-size // group_size) * group_size
        left = sum(b.left for b in self._open.get(partition, ()) if b.group_size == group_size)
        if left >= count and left * 2 > size:
            return 0
        self._asking.add(partition)
        return size

    def granted(self, partition: str, block: int, start: int, count: int, group_size: int) -> None:
        """The controller's answer to `wants` (block 0: refused; not asked again for a while)."""
        self._asking.discard(partition)
        if not block:
            self._refused[partition] = self._clock() + REFUSED_BACKOFF_S
            return
        self._open.setdefault(partition, []).append(Block(block, start, start + count, group_size))

    def failed(self, partition: str) -> None:
        """The request got no answer (the link dropped): the next put asks again."""
        self._asking.discard(partition)

    def drop(self, partition: str) -> list[int]:
        """Hand out no more of the partition's blocks (cleared, sealing); their ids."""
        self._refused.pop(partition, None)
        return [b.id for b in self._open.pop(partition, ())]

    def forget(self, block: int) -> None:
        """The controller dropped this block (it answered one of its commits `cleared`): no more of it."""
        for partition, blocks in list(self._open.items()):
            blocks[:] = [b for b in blocks if b.id != block]
            if not blocks:
                del self._open[partition]

    def clear(self) -> None:
        """Forget every block (a controller that grants none, or that this warehouse rejoined as another)."""
        self._open.clear()
        self._refused.clear()

    def ids(self) -> list[int]:
        """The blocks indexes are still handed out of."""
        return [b.id for blocks in self._open.values() for b in blocks]
