"""The controller on the wire: waiting acquires, leases tied to connections, the
journal. All decisions are made by `core.Controller`; this layer only holds
waiters and timers, records decisions in the journal (with a state dir), and
turns results into frames. Warehouse membership is `membership.Membership`.

Waiting is event-driven: a blocked acquire is parked per partition and retried
when a commit, a release or a lost warehouse changes that partition; its
timeout is a loop timer, never a poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller.core import AcquireResult, Controller
from dockd.controller.journal import Journal
from dockd.controller.membership import Membership
from dockd.errors import DockClosed, DockError, DockTimeout, DockValueError
from dockd.peer import Peer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class _Waiter:
    peer: Peer
    frame: pb.Frame
    timer: asyncio.TimerHandle | None = None


class ControllerService:
    """The controller of one dock.

    Args:
        core: the pure controller (a fresh one, or none to rebuild from `state_dir`).
        free_local: frees a partition in the warehouse hosted in this process.
        inline: values of the local warehouse for acquire replies (see AcquireRequest.inline).
        state_dir: journal decisions there and rebuild from it on start (None: keep nothing).
        warehouse_grace: seconds a warehouse whose connection dropped has to rejoin.
    """

    def __init__(self, core: Controller, *, free_local: Callable[[str], int], inline: Callable | None = None,
                 state_dir: str | None = None, warehouse_grace: float = 15.0, fsync_interval: float = 0.05) -> None:
        self.core = core
        self.free_local = free_local
        self.inline = inline
        self.journal = Journal(state_dir, fsync_interval=fsync_interval) if state_dir else None
        self.members = Membership(core, self.journal, grace=warehouse_grace, on_change=self._wake_all)
        self.waiters: dict[str, list[_Waiter]] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = float("inf")
        self._sync_timer: asyncio.TimerHandle | None = None
        self._syncing = False
        self.closing = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def start(self) -> None:
        """Rebuild from the state dir, if any (in the event loop, before serving)."""
        if self.journal is None:
            return
        core, records = self.journal.load(lease_timeout=self.core.lease_timeout, now=self.loop.time())
        self.core = self.members.core = core
        self.members.restore(records)
        self._schedule_expiry()
        self._sync_timer = self.loop.call_later(self.journal.fsync_interval, self._sync)

    def _sync(self) -> None:
        """Batched durability: fsync the journal in a worker thread; compact it when large."""
        self._sync_timer = self.loop.call_later(self.journal.fsync_interval, self._sync)
        if self.journal.needs_compaction():
            self.journal.compact(self.core, {e.id: e.record() for e in self.members.entries.values()}, now=self.loop.time())
        elif self.journal.dirty and not self._syncing:
            self._syncing = True
            self.loop.run_in_executor(None, self.journal.sync).add_done_callback(self._synced)

    def _synced(self, fut) -> None:
        self._syncing = False
        if fut.exception() is not None:
            logger.error("[journal] fsync failed: %s", fut.exception())

    # -- membership -------------------------------------------------------------------------
    def register(self, peer: Peer | None, req: pb.RegisterWarehouse) -> pb.RegisterReply:
        return self.members.register(peer, req, self.commit)

    def warehouse_infos(self, ids=None, *, usage: bool = True) -> list[pb.WarehouseInfo]:
        return self.members.infos(ids, usage=usage)

    def leave(self, peer: Peer, req: pb.LeaveRequest) -> None:
        self.members.leave(peer, req.id)

    def on_lost(self, peer: Peer) -> None:
        if self.closing:  # the controller is stopping: what it recorded stands for the next start
            return
        released = self.core.release_owner(peer.id)
        if self.journal is not None:
            for lease in released:
                self.journal.release(lease.id)
        touched = {lease.partition for lease in released}
        for part, ws in list(self.waiters.items()):  # _drop deletes emptied partitions
            for w in [w for w in ws if w.peer is peer]:
                self._drop(part, w)
        self.members.connection_lost(peer)
        for part in touched:
            self._wake(part)

    def _wake_all(self) -> None:
        for part in list(self.waiters):
            self._wake(part)

    # -- requests ---------------------------------------------------------------------------
    def commit(self, req: pb.CommitRequest) -> np.ndarray:
        entry = self.members.get(req.warehouse)
        if entry is None or not entry.alive:
            raise DockValueError(f"warehouse {req.warehouse} is not a live member of this dock")
        indexes = list(req.indexes) if req.indexes else None
        gs = req.group_size or 1
        idx = self.core.commit(req.partition, list(req.columns), warehouse=req.warehouse, indexes=indexes,
                               new_count=req.new_count, group_size=gs, nbytes=req.nbytes, put_id=req.put_id)
        if self.journal is not None:
            self.journal.commit(req.partition, req.columns, req.warehouse, indexes, req.new_count, gs, req.nbytes,
                                req.put_id)
        if req.partition in self.waiters:
            self._wake(req.partition)
        return idx

    def acquire(self, peer: Peer, frame: pb.Frame) -> None:
        r = frame.acquire
        self._confirm(r.confirm)
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

    def confirm(self, req: pb.ConfirmRequest) -> pb.ConfirmReply:
        return pb.ConfirmReply(unknown=self._confirm(req.leases))

    def _confirm(self, leases) -> list[int]:
        """Confirm leases; returns the ids that were no longer outstanding."""
        if not leases:
            return []
        done, unknown = [], []
        for lid in leases:
            (done if self.core.confirm(lid) else unknown).append(lid)
        if done and self.journal is not None:
            self.journal.confirm(done)
        if unknown:
            logger.warning("[controller] confirms of leases no longer outstanding count=%d (expired or released: "
                           "their samples were handed out again)", len(unknown))
        return unknown

    def release(self, req: pb.ReleaseRequest) -> int:
        lease = self.core.release(req.lease)
        if lease is None:
            return 0
        if self.journal is not None:
            self.journal.release(lease.id)
        self._wake(lease.partition)
        return len(lease.indexes)

    async def clear(self, req: pb.ClearRequest) -> int:
        n = self.core.clear(req.partition)
        if self.journal is not None:
            self.journal.clear(req.partition)
        for w in list(self.waiters.get(req.partition, ())):
            self._drop(req.partition, w)
            w.peer.reply_error(w.frame, DockClosed(f"partition {req.partition!r} was cleared while this get waited"))
        local = 0
        remote = []
        for entry in self.members.entries.values():
            if not entry.alive:
                continue  # one that rejoins later is told to drop the partition
            if entry.local:
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
        out = pb.StatsReply(warehouses=self.warehouse_infos(), waiting=sum(map(len, self.waiters.values())))
        for p in self.core.stats():
            ps = pb.PartitionStats(name=p["name"], samples=p["samples"], group_size=p["group_size"],
                                   recovered=p["recovered"])
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
        self.members.close()
        for timer in (self._expiry, self._sync_timer):
            if timer is not None:
                timer.cancel()
        if self.journal is not None:
            self.journal.close()

    # -- waiting -----------------------------------------------------------------------------
    def _try(self, peer: Peer, r: pb.AcquireRequest) -> AcquireResult | None:
        again = self.core.leases.get(self.core.lease_tokens.get(r.token, 0)) if r.token else None
        res = self.core.acquire(
            r.partition, r.consumer, list(r.columns), r.count,
            groups=r.groups, allow_partial=r.allow_partial, shuffle=r.shuffle,
            seed=r.seed if r.has_seed else None, owner=peer.id, now=self.loop.time(), token=r.token,
        )
        if again is not None:
            again.owner = peer.id  # the client that retried holds it now (a restored lease had no owner)
        elif res is not None:
            if self.journal is not None:
                lease = self.core.leases[res.lease]
                self.journal.grant(lease, lease.deadline + time.time() - self.loop.time())
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
        part = self.core.partitions.get(r.partition)
        reply.recovered = part is not None and part.recovered
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
        if self.journal is not None:
            for lease in expired:
                self.journal.release(lease.id)
        if expired:
            logger.warning("[controller] leases expired unconfirmed count=%d; their samples return to the pool", len(expired))
        for part in {l.partition for l in expired}:
            self._wake(part)
        self._schedule_expiry()
