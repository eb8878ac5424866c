"""The remembered outcomes of recent requests, so that a re-sent one is answered instead of applied again.

A put's outcome is its indexes: a range for new samples (no memory per sample), an int64 array when it
wrote explicit indexes. Such arrays are bounded in total (`cells`), not only in number: a client that
writes columns of millions of existing samples and clears them again made each remembered put hold
8 bytes per index for as long as the last few thousand puts are kept. Past either bound the oldest
entries go (the newest always stays). An explicit-index put re-sent after its entry went is refused
by the controller's "already written" check rather than applied twice.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable, Iterator, KeysView
from typing import Any, Generic, TypeVar

import numpy as np

V = TypeVar("V")


def array_cells(value: Any) -> int:
    """What a remembered value costs: the elements of its int64 arrays (ranges and the rest: nothing)."""
    if isinstance(value, np.ndarray):
        return len(value)
    n = 0
    if isinstance(value, tuple):
        for v in value:
            if isinstance(v, (np.ndarray, tuple)):
                n += array_cells(v)
    return n


class Recent(Generic[V]):
    """Entries in insertion order (oldest first), at most `count` of them holding at most `cells` array
    elements together (see `array_cells`)."""

    __slots__ = ("_d", "_costs", "count", "cells", "held", "_cost")

    def __init__(self, count: int, cells: int, cost: Callable[[Any], int] = array_cells) -> None:
        self._d: collections.OrderedDict[Hashable, V] = collections.OrderedDict()
        self._costs: dict[Hashable, int] = {}  # the entries that cost anything, and what (measured once, when added)
        self.count, self.cells, self.held, self._cost = count, cells, 0, cost

    def add(self, key: Hashable, value: V) -> None:
        self.add_all(((key, value),))

    def add_all(self, items: Iterable[tuple[Hashable, V]]) -> None:
        """Add each (key, value) in order, keeping what `add` one by one would keep at less cost: the bounds
        are applied once at the end, and before a key already held is added again (up to there each add only
        grows what is held, so the oldest that `add` would have dropped on the way are dropped then)."""
        d, costs, cost = self._d, self._costs, self._cost
        held = self.held
        for key, value in items:
            if key in d:
                held = self._trim(held)
                if d.pop(key, None) is not None:
                    held -= costs.pop(key, 0)
            d[key] = value
            c = cost(value)
            if c:
                costs[key] = c
                held += c
        self.held = self._trim(held)

    def _trim(self, held: int) -> int:
        """Drop the oldest entries until within the bounds (the newest always stays); returns the cells held."""
        d, costs = self._d, self._costs
        n = len(d)
        while n > 1 and (n > self.count or held > self.cells):
            gone, _ = d.popitem(last=False)
            n -= 1
            if costs:
                held -= costs.pop(gone, 0)
        return held

    def get(self, key: Hashable, default: Any = None) -> V | Any:
        return self._d.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._d)

    def keys(self) -> KeysView[Hashable]:
        return self._d.keys()

    def values(self) -> Iterator[V]:
        return iter(self._d.values())

    def items(self) -> Iterator[tuple[Hashable, V]]:
        return iter(self._d.items())
