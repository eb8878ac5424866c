"""What a warehouse keeps outside its memory, as the pure store (`dockd.warehouse.core`) sees it:
the data dir every stored put is written to first (`Keeper`: `dockd.warehouse.datadir.DataDir`) and
the spill tier that takes puts out of memory when it is full (`Tier`: `dockd.warehouse.spill.SpillTier`).
Interfaces only: the store calls them, the daemon hands it the implementations (`Warehouse.keeper`,
`Warehouse.tier`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa

from dockd._proto import dockd_pb2 as pb
from dockd.warehouse.layout import Spilled, _Part
from dockd.warehouse.putfile import Room


class Keeper(Protocol):
    """Where every put the warehouse stores is written first, and its deletes recorded."""

    def stored(self, partition: str, idx: np.ndarray, columns: Sequence[pb.ColumnData], body: pa.Buffer | None,
               nbytes: int, group_size: int, token: int, room: Room | None = None) -> str:
        """Write one put (into `room`, if one was taken for it); its file's path."""

    def deleted(self, partition: str, idx: np.ndarray) -> None:
        """Samples deleted while the rest of their put lives."""

    def remove(self, path: str) -> None:
        """A put whose samples are all gone."""

    def cleared(self, partition: str) -> None:
        """A partition freed whole."""


class Tier(Protocol):
    """Where stored puts go when memory is full, and come back from on a fetch."""

    bytes: int     # bytes it holds now
    capacity: int  # bytes it may hold (0: the disk's free space less a margin)

    def make_room(self, nbytes: int, background: bool = False) -> None:
        """Spill puts until `nbytes` more fit in memory (or nothing more can go)."""

    def discard(self, where: Spilled) -> None:
        """A spilled put is gone: its file goes too."""

    def resolve(self, partition: str, part: _Part, out: list[tuple[str, list[tuple]]]) -> list[tuple[str, list[tuple]]]:
        """A fetch's slices with their puts in memory (spilled ones restored, or read for this reply)."""

    def describe(self) -> str:
        """Its space, for DockFull's message."""
