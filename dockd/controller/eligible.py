"""Eligibility bitmaps: per consumer and column set (a partition's subscription), which units
(samples, or groups) that request could take right now, with a population count per block of
1024 units, so the first n set units are found by walking the non-empty blocks: O(n + size/1024),
not a scan. A few units at a time are flipped one by one (numpy calls on tiny arrays cost more)."""

from __future__ import annotations

import numpy as np

_BLOCK_SHIFT = 10
#: Up to this many samples (or group members), eligibility and commits are updated one sample at a
#: time: a numpy call on a tiny array costs about as much as a dozen scalar updates.
FEW = 8


class Eligible:
    """A bitmap of units (samples or groups) with a population count per block."""

    __slots__ = ("bits", "blocks", "total")

    def __init__(self, capacity: int) -> None:
        self.bits = np.zeros(capacity, dtype=bool)
        self.blocks = np.zeros((capacity >> _BLOCK_SHIFT) + 1, dtype=np.int64)
        self.total = 0

    def grow(self, capacity: int) -> None:
        if capacity <= len(self.bits):
            return
        bits = np.zeros(capacity, dtype=bool)
        bits[: len(self.bits)] = self.bits
        blocks = np.zeros((capacity >> _BLOCK_SHIFT) + 1, dtype=np.int64)
        blocks[: len(self.blocks)] = self.blocks
        self.bits, self.blocks = bits, blocks

    def _count(self, units: np.ndarray, delta: int) -> None:
        if len(units) <= FEW:  # np.add.at costs more than a few scalar updates
            blocks = self.blocks
            for b in (units >> _BLOCK_SHIFT).tolist():
                blocks[b] = blocks.item(b) + delta
        else:
            np.add.at(self.blocks, units >> _BLOCK_SHIFT, delta)
        self.total += delta * len(units)

    def set(self, units: np.ndarray) -> None:
        if len(units) <= FEW:  # a few units: scalar updates cost less than the array calls
            self._flip(units.tolist(), True)
            return
        new = units[~self.bits[units]]
        if len(new):
            self.bits[new] = True
            self._count(new, 1)

    def clear(self, units: np.ndarray) -> None:
        if len(units) <= FEW:
            self._flip(units.tolist(), False)
            return
        old = units[self.bits[units]]
        if len(old):
            self.bits[old] = False
            self._count(old, -1)

    def flip(self, on: list[int], off: list[int]) -> None:
        """Set the units `on` and clear the units `off` (a few of each)."""
        if on:
            self._flip(on, True)
        if off:
            self._flip(off, False)

    def _flip(self, units: list[int], value: bool) -> None:
        # (elements read with .item(): indexing gives numpy scalars, whose compare and add cost ~4x more)
        bits, blocks, delta = self.bits, self.blocks, 1 if value else -1
        bit, count, moved = bits.item, blocks.item, 0
        for u in units:
            if bit(u) != value:
                bits[u] = value
                b = u >> _BLOCK_SHIFT
                blocks[b] = count(b) + delta
                moved += delta
        self.total += moved

    def first(self, n: int) -> np.ndarray:
        """The n smallest set units (fewer if fewer are set)."""
        out: list[np.ndarray] = []
        need = n
        if self.total == 0:
            return np.empty(0, dtype=np.int64)
        if n == 1:  # (a one-sample get: the first non-empty block's first set unit, with no array arithmetic)
            lo = self.blocks.nonzero()[0].item(0) << _BLOCK_SHIFT
            return np.array([lo + int(self.bits[lo : lo + (1 << _BLOCK_SHIFT)].argmax())], dtype=np.int64)
        for b in self.blocks.nonzero()[0]:  # (.nonzero of a 1-D array: np.flatnonzero without its wrappers)
            lo = int(b) << _BLOCK_SHIFT
            # (cut to `need` before adding lo: a fresh array of what is handed out, not a view of the block's)
            found = self.bits[lo : lo + (1 << _BLOCK_SHIFT)].nonzero()[0][:need] + lo
            out.append(found)
            need -= len(found)
            if need <= 0:
                break
        return out[0] if len(out) == 1 else np.concatenate(out)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n distinct set units drawn uniformly at random, in draw order."""
        n = min(n, self.total)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        ranks = rng.choice(self.total, size=n, replace=False)
        nz = np.flatnonzero(self.blocks)
        cum = np.cumsum(self.blocks[nz])
        which = np.searchsorted(cum, ranks, side="right")
        out = np.empty(n, dtype=np.int64)
        for k, (w, r) in enumerate(zip(which, ranks)):
            lo = int(nz[w]) << _BLOCK_SHIFT
            within = int(r) - (int(cum[w - 1]) if w else 0)
            out[k] = lo + np.flatnonzero(self.bits[lo : lo + (1 << _BLOCK_SHIFT)])[within]
        return out
