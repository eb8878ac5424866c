"""The controller on the wire: waiting acquires, leases tied to connections,
warehouse membership. All decisions are made by `core.Controller`; this layer
only holds waiters and timers and turns results into frames.

Waiting is event-driven: a blocked acquire is parked per partition and retried
when a commit, a release or a lost warehouse changes that partition; its
timeout is a loop timer, never a poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller.core import AcquireResult, Controller
from dockd.errors import DockClosed, DockError, DockTimeout, DockValueError
from dockd.peer import Peer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class WarehouseEntry:
    id: int
    host: str
    port: int
    capacity: int
    peer: Peer | None  # None: hosted in this process
    unix: str = ""
    alive: bool = True

    def info(self, used: int = 0) -> pb.WarehouseInfo:
        return pb.WarehouseInfo(id=self.id, host=self.host, port=self.port, alive=self.alive, capacity=self.capacity,
                                used=used, unix=self.unix)


@dataclasses.dataclass(slots=True, eq=False)
class _Waiter:
    peer: Peer
    frame: pb.Frame
    timer: asyncio.TimerHandle | None = None


class ControllerService:
    def __init__(self, core: Controller, *, free_local: Callable[[str], int], inline: Callable | None = None) -> None:
        self.core = core
        self.free_local = free_local
        self.inline = inline
        self.warehouses: dict[int, WarehouseEntry] = {}
        self.waiters: dict[str, list[_Waiter]] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = float("inf")
        self.closing = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # -- membership -------------------------------------------------------------------------
    def register(self, peer: Peer | None, req: pb.RegisterWarehouse) -> int:
        wid = len(self.warehouses)
        if wid >= 0xFFFF:
            raise DockValueError("too many warehouses registered (limit 65535)")
        self.warehouses[wid] = WarehouseEntry(wid, req.host, req.port, req.capacity, peer, req.unix)
        logger.info("[controller] warehouse joined id=%d address=%s:%d capacity=%d", wid, req.host, req.port, req.capacity)
        return wid

    def warehouse_infos(self, ids=None, *, usage: bool = True) -> list[pb.WarehouseInfo]:
        used = self.core.warehouse_bytes() if usage else {}
        ids = self.warehouses.keys() if ids is None else ids
        return [self.warehouses[i].info(used.get(i, 0)) for i in ids]

    def leave(self, peer: Peer, req: pb.LeaveRequest) -> None:
        entry = self.warehouses.get(req.id)
        if entry is not None and entry.peer is peer and entry.alive:
            self._retire(entry, on_purpose=True)
            for part in list(self.waiters):
                self._wake(part)

    def on_lost(self, peer: Peer) -> None:
        touched = {lease.partition for lease in self.core.release_owner(peer.id)}
        for part, ws in list(self.waiters.items()):  # _drop deletes emptied partitions
            for w in [w for w in ws if w.peer is peer]:
                self._drop(part, w)
        for entry in self.warehouses.values():
            if entry.peer is peer and entry.alive:
                self._retire(entry, on_purpose=False)
                touched.update(self.waiters)
        for part in touched:
            self._wake(part)

    def _retire(self, entry: WarehouseEntry, *, on_purpose: bool) -> None:
        """A warehouse is gone: its samples become lost for every consumer that meets them."""
        entry.alive = False
        held = self.core.warehouse_bytes().get(entry.id, 0)
        self.core.warehouse_lost(entry.id)
        level = logging.WARNING if held and not on_purpose else logging.INFO
        logger.log(level, "[controller] warehouse %s id=%d address=%s:%d bytes=%d",
                   "shut down" if on_purpose else "left", entry.id, entry.host, entry.port, held)

    # -- requests ---------------------------------------------------------------------------
    def commit(self, req: pb.CommitRequest) -> np.ndarray:
        entry = self.warehouses.get(req.warehouse)
        if entry is None or not entry.alive:
            raise DockValueError(f"warehouse {req.warehouse} is not a live member of this dock")
        idx = self.core.commit(
            req.partition,
            list(req.columns),
            warehouse=req.warehouse,
            indexes=list(req.indexes) if req.indexes else None,
            new_count=req.new_count,
            group_size=req.group_size or 1,
            nbytes=req.nbytes,
        )
        if req.partition in self.waiters:
            self._wake(req.partition)
        return idx

    def acquire(self, peer: Peer, frame: pb.Frame) -> None:
        r = frame.acquire
        for lease in r.confirm:
            self.core.confirm(lease)
        Controller.validate_acquire(r.partition, r.consumer, r.columns, r.count, r.groups)
        if self.closing:
            raise DockClosed("the controller is shutting down")
        res = self._try(peer, r)
        if res is not None:
            self._reply_acquired(peer, frame, r, res)
            return
        if r.timeout == 0:
            raise self._timeout_error(r)
        w = _Waiter(peer, frame)
        self.waiters.setdefault(r.partition, []).append(w)
        if r.timeout > 0:
            w.timer = self.loop.call_later(r.timeout, self._expire_waiter, r.partition, w)

    def confirm(self, req: pb.ConfirmRequest) -> None:
        for lease in req.leases:
            self.core.confirm(lease)

    def release(self, req: pb.ReleaseRequest) -> int:
        lease = self.core.release(req.lease)
        if lease is None:
            return 0
        self._wake(lease.partition)
        return len(lease.indexes)

    async def clear(self, req: pb.ClearRequest) -> int:
        n = self.core.clear(req.partition)
        for w in list(self.waiters.get(req.partition, ())):
            self._drop(req.partition, w)
            w.peer.reply_error(w.frame, DockClosed(f"partition {req.partition!r} was cleared while this get waited"))
        local = 0
        remote = []
        for entry in self.warehouses.values():
            if not entry.alive:
                continue
            if entry.peer is None:
                local += self.free_local(req.partition)
            else:
                remote.append(entry.peer.request(pb.Frame(free=pb.FreeRequest(partition=req.partition))))
        for res in await asyncio.gather(*remote, return_exceptions=True):
            if isinstance(res, BaseException):
                logger.warning("[controller] free failed on a warehouse partition=%s error=%s", req.partition, res)
        return n

    def locate(self, req: pb.LocateRequest) -> pb.Frame:
        locs = self.core.locate(req.partition, list(req.indexes), list(req.columns)).ravel().tolist()
        out = pb.Frame()
        out.locate_reply.locations.extend(locs)
        out.locate_reply.warehouses.extend(self.warehouse_infos(sorted(set(locs)), usage=False))
        return out

    def stats(self) -> pb.StatsReply:
        out = pb.StatsReply(warehouses=self.warehouse_infos())
        for p in self.core.stats():
            ps = pb.PartitionStats(name=p["name"], samples=p["samples"], group_size=p["group_size"])
            for c, n in p["columns"].items():
                ps.columns.append(c)
                ps.column_ready.append(n)
            for name, c in p["consumers"].items():
                ps.consumers.append(pb.ConsumerStats(name=name, taken=c["taken"], leased=c["leased"]))
            out.partitions.append(ps)
        return out

    def shutdown(self) -> None:
        self.closing = True
        for part, ws in list(self.waiters.items()):
            for w in list(ws):
                self._drop(part, w)
                w.peer.reply_error(w.frame, DockClosed("the controller is shutting down"))

    # -- waiting -----------------------------------------------------------------------------
    def _try(self, peer: Peer, r: pb.AcquireRequest) -> AcquireResult | None:
        res = self.core.acquire(
            r.partition, r.consumer, list(r.columns), r.count,
            groups=r.groups, allow_partial=r.allow_partial, shuffle=r.shuffle,
            seed=r.seed if r.has_seed else None, owner=peer.id, now=self.loop.time(),
        )
        if res is not None:
            self._schedule_expiry()
        return res

    def _reply_acquired(self, peer: Peer, frame: pb.Frame, r: pb.AcquireRequest, res: AcquireResult) -> None:
        locs = res.locations.ravel().tolist()
        out = pb.Frame()
        reply = out.acquire_reply  # filled in place: building a message and wrapping it would copy it
        reply.lease = res.lease
        reply.indexes.extend(res.indexes.tolist())
        reply.locations.extend(locs)
        reply.warehouses.extend(self.warehouse_infos(sorted(set(locs)), usage=False))
        if r.inline and self.inline is not None:
            cols, body, segs = self.inline(peer, r.partition, list(r.columns), res.indexes, res.locations)
            reply.inline.extend(cols)
            peer.reply(frame, out, body.buffers, body.size, segs)
            return
        peer.reply(frame, out)

    def _wake(self, partition: str) -> None:
        ws = self.waiters.get(partition)
        if not ws:
            return
        for w in list(ws):
            r = w.frame.acquire
            try:
                res = self._try(w.peer, r)
            except DockError as e:
                self._drop(partition, w)
                w.peer.reply_error(w.frame, e)
                continue
            if res is not None:
                self._drop(partition, w)
                self._reply_acquired(w.peer, w.frame, r, res)

    def _drop(self, partition: str, w: _Waiter) -> None:
        ws = self.waiters.get(partition)
        if ws and w in ws:
            ws.remove(w)
            if not ws:
                del self.waiters[partition]
        if w.timer is not None:
            w.timer.cancel()

    def _timeout_error(self, r: pb.AcquireRequest) -> DockTimeout:
        ready = self.core.ready_count(r.partition, r.consumer, list(r.columns), r.groups)
        unit = "samples in whole groups" if r.groups else "samples"
        return DockTimeout(
            f"get(consumer={r.consumer!r}, partition={r.partition!r}, columns={list(r.columns)}) timed out after "
            f"{r.timeout:g}s: {ready} of {r.count} {unit} were ready."
            + self.core.why_not_ready(r.partition, list(r.columns))
            + " Pass allow_partial=True to take what is ready, or a longer timeout.",
            ready=ready,
        )

    def _expire_waiter(self, partition: str, w: _Waiter) -> None:
        w.timer = None
        self._drop(partition, w)
        w.peer.reply_error(w.frame, self._timeout_error(w.frame.acquire))

    def _schedule_expiry(self) -> None:
        deadline = self.core.next_lease_deadline()
        if deadline is None or deadline >= self._expiry_at:
            return
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = deadline
        self._expiry = self.loop.call_at(deadline, self._on_expiry)

    def _on_expiry(self) -> None:
        self._expiry, self._expiry_at = None, float("inf")
        expired = self.core.expire_leases(self.loop.time())
        if expired:
            logger.warning("[controller] leases expired unconfirmed count=%d; their samples return to the pool", len(expired))
        for part in {l.partition for l in expired}:
            self._wake(part)
        self._schedule_expiry()
