"""What the controller asks of warehouses: free samples and partitions, measure a column for
balancing, write or load a checkpoint file. The warehouse hosted in the controller's own
process (`LocalWarehouse`) is called directly; the others over their links.

A free that does not reach a warehouse (its connection closes, or it is away) is applied once
the warehouse is back, until it is declared lost: deleted samples are sent again when it has
rejoined (a free is idempotent), and a partition cleared meanwhile goes with its rejoin, also
when the dock has a partition of that name again by then (`cleared_meanwhile`): its copy holds
the old partition's values under the new one's indexes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Protocol

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller.clock import Timers
from dockd.controller.core import Controller
from dockd.controller.member import WarehouseEntry
from dockd.controller.membership import Membership
from dockd.controller.partition import _Partition
from dockd.errors import DockConnectionError, DockDataLost
from dockd.logutil import Throttle
from dockd.net.peer import Peer

logger = logging.getLogger(__name__)
_failed_log = Throttle()

FREE_RETRY_S = 1.0
"""A free a connected warehouse answered with an error is sent again after this long."""


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
    """Calls to the dock's warehouses: `local` is the one in this process (None: there is none), the
    others are called over their links, each call given up after `daemon_timeout` seconds."""

    def __init__(self, core: Controller, members: Membership, local: LocalWarehouse | None, timers: Timers, *,
                 daemon_timeout: float) -> None:
        self.core = core
        self.members = members
        self.local = local
        self.timers = timers
        self.daemon_timeout = daemon_timeout
        self._frees_soon = False
        self.uncleared: dict[int, set[str]] = {}  # warehouse -> partitions cleared that it may still hold

    def _live(self, wid: int) -> WarehouseEntry | None:
        entry = self.members.get(wid)
        return entry if entry is not None and entry.alive else None

    @property
    def _local(self) -> LocalWarehouse:
        """The warehouse in this process (a member is local only when there is one)."""
        local = self.local
        assert local is not None
        return local

    @staticmethod
    def _peer(entry: WarehouseEntry) -> Peer:
        """A live member's connection (one that is not local has one until it is away)."""
        assert entry.peer is not None
        return entry.peer

    # -- frees --------------------------------------------------------------------------------
    def schedule_frees(self) -> None:
        if self.core.pending_frees and not self._frees_soon:
            self._frees_soon = True
            asyncio.get_running_loop().call_soon(self._flush_frees)

    def _flush_frees(self) -> None:
        """Tell warehouses to free the samples deletes and retirement left (one request per warehouse
        and partition). Those of a warehouse that is away wait for it to rejoin; those of one declared
        lost go (its rejoin inventory would show them)."""
        self._frees_soon = False
        for partition, ws in self.core.take_frees().items():
            for wid, idx in ws.items():
                entry = self.members.get(wid)
                if entry is None or not entry.alive:
                    if entry is not None and entry.reachable:
                        self._again(partition, wid, idx)
                    continue
                if entry.local:
                    self._freed(partition, wid, self._local.free(partition, idx))
                    continue
                req = pb.FreeRequest(partition=partition, indexes=idx.tolist())
                fut = self._peer(entry).request(pb.Frame(free=req))
                fut.add_done_callback(functools.partial(self._remote_freed, partition, wid, idx))

    def _again(self, partition: str, wid: int, idx: np.ndarray) -> None:
        """Free these samples on the next flush (a rejoin, a delete, or a timer, wakes it)."""
        self.core.pending_frees.setdefault(partition, {}).setdefault(wid, []).append(idx)

    def _remote_freed(self, partition: str, wid: int, idx: np.ndarray, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            err = fut.exception() if not fut.cancelled() else "cancelled"
            entry = self.members.get(wid)
            again = entry is not None and entry.reachable and partition in self.core.partitions
            _failed_log.log(logger, logging.WARNING, "[controller] free of deleted samples failed warehouse=%d "
                            "partition=%s samples=%d error=%s; %s", wid, partition, len(idx), err,
                            "sent again once it answers" if again else "not sent again (the warehouse or the "
                            "partition is gone)")
            if again:
                self._again(partition, wid, idx)
                if not isinstance(err, DockConnectionError):  # (a lost connection: its rejoin flushes them)
                    self.timers.call_later(FREE_RETRY_S, self.schedule_frees)
            return
        reply, _ = fut.result()
        self._freed(partition, wid, reply.free_reply.nbytes)

    def _freed(self, partition: str, wid: int, nbytes: int) -> None:
        part = self.core.partitions.get(partition)
        if part is not None and wid in part.nbytes:
            part.nbytes[wid] = max(0, part.nbytes[wid] - nbytes)

    async def free_everywhere(self, partition: str) -> None:
        """Free a partition on every live warehouse, in parallel. One that is away, or whose free fails,
        is told when it rejoins (`cleared_meanwhile`); a wedged one must not hang the caller: it gets
        daemon_timeout."""
        remote, sent = [], []
        for wid in [w for w in self.uncleared if not (e := self.members.get(w)) or not e.reachable]:
            del self.uncleared[wid]  # (declared lost, or gone)
        for entry in self.members.entries.values():
            if entry.local and entry.alive:
                self._local.free(partition)
            elif entry.alive:
                remote.append(self._peer(entry).request(pb.Frame(free=pb.FreeRequest(partition=partition))))
                sent.append(entry.id)
            elif entry.reachable:
                self.uncleared.setdefault(entry.id, set()).add(partition)
        wait = [asyncio.ensure_future(asyncio.wait_for(r, self.daemon_timeout)) for r in remote]
        for wid, res in zip(sent, await asyncio.gather(*wait, return_exceptions=True)):
            if isinstance(res, BaseException):
                self.uncleared.setdefault(wid, set()).add(partition)
                logger.warning("[controller] free failed on warehouse %d partition=%s error=%s; it frees the partition "
                               "when it rejoins", wid, partition, res)

    def cleared_meanwhile(self, req: pb.RegisterWarehouse) -> list[str]:
        """The partitions a rejoining warehouse holds from before a clear it may not have applied (its
        free failed, or it was away), which the dock has again: its copy is the old partition's, so it
        leaves the inventory (nothing of it is adopted or counted) and the warehouse drops it (the
        reply's drop list, freed before the commits it re-sends are filed). Kept is a copy that must
        be the new partition's: the dock records values of it there (not those of the re-sent commits,
        which the warehouse files only after the reply), so the warehouse read the clear's free before
        them. A name the dock no longer has is dropped by the rejoin itself."""
        names = self.uncleared.pop(req.id, None) if req.rejoin else None
        if not names:
            return []
        held = {p.name for p in req.inventory}
        out = []
        for name in sorted(names & held):
            part = self.core.partitions.get(name)
            if part is not None and not self._holds_new(part, req.id, req.pending):
                out.append(name)
        if out:
            keep = [p for p in req.inventory if p.name not in out]
            del req.inventory[:]
            req.inventory.extend(keep)
            logger.warning("[controller] warehouse %d rejoins with partition(s) %s from before they were cleared "
                           "(their free did not reach it); it drops them", req.id, out)
        return out

    def _holds_new(self, part: _Partition, wid: int, pending) -> bool:
        """Whether the controller records values of `part` on warehouse `wid` other than those of its
        re-sent commits (`pending`) that it applied before (their answers were lost)."""
        resent = [self.core.catalog.recall(wid, c.put_id) for c in pending if c.partition == part.name]
        skip = np.concatenate([r for r in resent if r is not None] or [np.empty(0, dtype=np.int64)])
        for loc in part.loc.values():
            mine = np.flatnonzero(loc[: part.size] == wid)
            if len(mine) and not np.isin(mine, skip).all():
                return True
        return False

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
            reply, _ = await asyncio.wait_for(fut, self.daemon_timeout)
            out[sel] = reply.measure_reply.values
        return out
