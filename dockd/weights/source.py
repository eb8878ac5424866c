"""Where a reader's buckets come from: its own warehouse, which holds the version once (the relay).

The reader asks its warehouse (its client's home, on its own node) to hold the version
(`WeightsWait`): the origin holds it already; any other warehouse pulls it once, from the origin or
from a warehouse that holds it (see `dockd.warehouse.weights`), and answers as buckets arrive. The
reader then fetches each bucket held there with an ordinary fetch: shared memory when the
warehouse is on its host, else the client's transport (TCP, or Mooncake where it serves).

These helpers reach into the client's router and fetcher (`Dock._router`, `Dock._fetcher`): a
fetch from a named warehouse without the controller has no public call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dockd._proto import dockd_pb2 as pb
from dockd.client.batch import Batch
from dockd.client.lease import Lease
from dockd.errors import DockNotFound, DockTimeout

if TYPE_CHECKING:
    from dockd.client.interface import DockInterface as Dock

WAIT_S = 10.0  # seconds one wait may take at the warehouse before it answers with what it holds
COLUMN = "data"


def origin_info(dock: Dock, wid: int) -> pb.WarehouseInfo:
    """How to reach warehouse `wid` (the version's origin), as the controller lists it."""
    router = dock._router
    info = router.warehouses.get(wid)
    if info is None:
        router.warehouse_state(wid)  # (asks the controller; learns the dock's warehouses)
        info = router.warehouses.get(wid)
    if info is None:
        raise DockNotFound(f"warehouse {wid}, where the weights were published, is not in the dock (gone?)")
    return info


class RelaySource:
    """The buckets of one version, read from this client's own warehouse as they arrive there."""

    def __init__(self, dock: Dock, partition: str, samples: list[int], origin: int, *, fanout: int = 1,
                 stall: float | None = None) -> None:
        self.dock = dock
        self.samples = samples
        self.version = pb.WeightsVersion(partition=partition, samples=samples, origin=origin_info(dock, origin),
                                         fanout=fanout)
        self.stall = stall if stall is not None else dock.fetch_timeout
        self.held = 0
        self.depth = 0

    @property
    def partition(self) -> str:
        return self.version.partition

    def wait(self, bucket: int) -> None:
        """Until this client's warehouse holds `bucket` (and those before it)."""
        since = time.monotonic()
        while self.held <= bucket:
            before = self.held
            reply, _, _ = self.dock._router.warehouse(self._ask_wait)
            self.held = max(self.held, reply.weights_wait_reply.held)
            self.depth = reply.weights_wait_reply.depth
            if self.held > before:
                since = time.monotonic()
            elif time.monotonic() - since > self.stall:
                raise DockTimeout(f"{self.partition}: this reader's warehouse received no bucket for "
                                  f"{self.stall:g}s (it holds {self.held} of {len(self.samples)}); its relay stalled")

    def _ask_wait(self, wid: int, pool: Any) -> tuple:
        req = pb.WeightsWait(version=self.version, held=self.held, timeout=min(WAIT_S, self.stall))
        return pool.call(pb.Frame(weights_wait=req), timeout=WAIT_S + self.dock.connect_timeout)

    def bucket(self, b: int) -> torch.Tensor:
        """Bucket `b` (waiting for it), fetched from this client's warehouse."""
        self.wait(b)
        home = self.dock.home
        lease = Lease(0, self.partition, [COLUMN], [int(self.samples[b])], np.full((1, 1), home, dtype=np.int64))
        values: dict[str, Any] = self.dock._fetcher.fetch(lease, lazy=True)
        return Batch(self.partition, lease.indexes, values)[COLUMN][0]

    def buckets(self) -> Iterator[tuple[int, torch.Tensor]]:
        for b in range(len(self.samples)):
            yield b, self.bucket(b)

    def ranges(self, samples: list[int], offsets: list[int], lengths: list[int], counts: list[int],
               strides: list[int]) -> np.ndarray:
        """Byte ranges of held buckets, back to back (`WeightsRead`): a tensor-parallel rank's slices."""
        req = pb.WeightsRead(partition=self.partition, samples=samples, offsets=offsets, lengths=lengths,
                             counts=counts, strides=strides)
        reply, body, _ = self.dock._router.warehouse(
            lambda wid, pool: pool.call(pb.Frame(weights_read=req), timeout=self.dock.fetch_timeout))
        if len(body) != reply.weights_read_reply.nbytes:
            raise DockNotFound(f"{self.partition}: a read of {reply.weights_read_reply.nbytes} bytes of slices came "
                               f"with {len(body)}")
        return body
