"""What the controller asks of warehouses: free samples and partitions, measure a column for
balancing, write or load a checkpoint file. The warehouse hosted in the controller's own
process (`LocalWarehouse`) is called directly; the others over their links."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockDataLost
from dockd.peer import Peer

if TYPE_CHECKING:
    from dockd.controller.membership import WarehouseEntry
    from dockd.controller.partition import _Partition
    from dockd.controller.service import ControllerService

logger = logging.getLogger(__name__)


class LocalWarehouse(Protocol):
    """The warehouse hosted in the controller's own process, called directly instead of over a link."""

    def free(self, partition: str, indexes: np.ndarray | None = None) -> int:
        """Free a partition, or some of its samples; returns the bytes freed."""

    def measure(self, partition: str, column: str, indexes: np.ndarray) -> np.ndarray:
        """Per sample, a column's number (a scalar column) or size in bytes."""

    async def dump(self, req: pb.DumpRequest) -> pb.DumpReply:
        """Write (or, with req.load, store) a checkpoint file of what this warehouse holds of a partition."""

    async def replicate(self, req: pb.ReplicateRequest) -> int:
        """Copy values this warehouse holds to req.target as their replica; returns the bytes sent."""

    def inline(self, peer: Peer, partition: str, columns: list[str], indexes: np.ndarray, locations: np.ndarray,
               device: bool = False) -> tuple[list[pb.ColumnData], Any, list, list[pb.DeviceBuffer]]:
        """For an acquire: the whole columns this warehouse holds, encoded for the reply (may be empty),
        and the device buffers of their device-tier runs (`device`: a same-node reader maps them)."""


class WarehouseCalls:
    def __init__(self, svc: ControllerService) -> None:
        self.svc = svc
        self._frees_soon = False

    def _live(self, wid: int) -> WarehouseEntry | None:
        entry = self.svc.members.get(wid)
        return entry if entry is not None and entry.alive else None

    @property
    def _local(self) -> LocalWarehouse:
        """The warehouse in this process (a member is local only when there is one)."""
        local = self.svc.local
        assert local is not None
        return local

    @staticmethod
    def _peer(entry: WarehouseEntry) -> Peer:
        """A live member's connection (one that is not local has one until it is away)."""
        assert entry.peer is not None
        return entry.peer

    # -- frees --------------------------------------------------------------------------------
    def schedule_frees(self) -> None:
        if self.svc.core.pending_frees and not self._frees_soon:
            self._frees_soon = True
            self.svc.loop.call_soon(self._flush_frees)

    def _flush_frees(self) -> None:
        """Tell warehouses to free the samples deletes and retirement left (one request per warehouse
        and partition). A warehouse that is away frees them when it rejoins (its inventory shows them)."""
        self._frees_soon = False
        for partition, ws in self.svc.core.take_frees().items():
            for wid, idx in ws.items():
                entry = self._live(wid)
                if entry is None:
                    continue
                if entry.local:
                    self._freed(partition, wid, self._local.free(partition, idx))
                    continue
                req = pb.FreeRequest(partition=partition, indexes=idx.tolist())
                fut = self._peer(entry).request(pb.Frame(free=req))
                fut.add_done_callback(functools.partial(self._remote_freed, partition, wid))

    def _remote_freed(self, partition: str, wid: int, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            logger.warning("[controller] free of deleted samples failed warehouse=%d partition=%s error=%s", wid,
                           partition, None if fut.cancelled() else fut.exception())
            return
        reply, _ = fut.result()
        self._freed(partition, wid, reply.free_reply.nbytes)

    def _freed(self, partition: str, wid: int, nbytes: int) -> None:
        part = self.svc.core.partitions.get(partition)
        if part is not None and wid in part.nbytes:
            part.nbytes[wid] = max(0, part.nbytes[wid] - nbytes)

    async def free_everywhere(self, partition: str) -> None:
        """Free a partition on every live warehouse, in parallel. One that is away is told when it
        rejoins (its inventory shows a partition the dock no longer has); a wedged one must not
        hang the caller: it gets daemon_timeout."""
        remote = []
        for entry in self.svc.members.entries.values():
            if not entry.alive:
                continue
            if entry.local:
                self._local.free(partition)
            else:
                remote.append(self._peer(entry).request(pb.Frame(free=pb.FreeRequest(partition=partition))))
        wait = [asyncio.ensure_future(asyncio.wait_for(r, self.svc.daemon_timeout)) for r in remote]
        for res in await asyncio.gather(*wait, return_exceptions=True):
            if isinstance(res, BaseException):
                logger.warning("[controller] free failed on a warehouse partition=%s error=%s", partition, res)

    # -- checkpoints and balancing ------------------------------------------------------------
    async def dump(self, wid: int, req: pb.DumpRequest) -> pb.DumpReply:
        entry = self._live(wid)
        if entry is None:
            raise DockDataLost(f"warehouse {wid} is not reachable")
        if entry.local:
            return await self._local.dump(req)
        reply, _ = await self._peer(entry).request(pb.Frame(dump=req))
        return reply.dump_reply

    async def measure(self, part: _Partition, column: str, idx: np.ndarray) -> np.ndarray:
        """Per sample of idx, the number in `column` (or a tensor's numel), asked of the warehouses holding it."""
        locs = part.loc[column][idx]
        out = np.empty(len(idx), dtype=np.float64)
        asks = []
        for wid in np.unique(locs).tolist():
            sel = np.flatnonzero(locs == wid)
            entry = self._live(wid)
            if entry is None:
                raise DockDataLost(f"column {column!r} of samples {idx[sel][:8].tolist()} of partition {part.name!r} "
                                   f"is on warehouse {wid}, which is not reachable; cannot balance by it")
            if entry.local:
                out[sel] = self._local.measure(part.name, column, idx[sel])
            else:
                req = pb.MeasureRequest(partition=part.name, column=column, indexes=idx[sel].tolist())
                asks.append((sel, self._peer(entry).request(pb.Frame(measure=req))))
        for sel, fut in asks:
            reply, _ = await asyncio.wait_for(fut, self.svc.daemon_timeout)
            out[sel] = reply.measure_reply.values
        return out
