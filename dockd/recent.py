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
from collections.abc import Callable, Hashable, Iterator, KeysView
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
        d, costs = self._d, self._costs
        if d.pop(key, None) is not None:
            self.held -= costs.pop(key, 0)
        d[key] = value
        cost = self._cost(value)
        if cost:
            costs[key] = cost
            self.held += cost
        n = len(d)
        while n > 1 and (n > self.count or self.held > self.cells):
            gone, _ = d.popitem(last=False)
            n -= 1
            if costs:
                self.held -= costs.pop(gone, 0)

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
