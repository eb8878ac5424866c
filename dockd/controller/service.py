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
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd._version import __version__
from dockd.controller.core import VERSION_TAG, AcquireResult, Controller, Round
from dockd.controller.journal import Journal
from dockd.controller.membership import Membership
from dockd.errors import (DockClosed, DockDataLost, DockError, DockFull, DockLeaseError, DockNotFound, DockStateFull,
                          DockTimeout, DockValueError)
from dockd.peer import Peer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class _Waiter:
    peer: Peer
    frame: pb.Frame
    timer: asyncio.TimerHandle | None = None


@dataclasses.dataclass(slots=True, eq=False)
class _Paced:
    """A commit of new samples waiting because its partition has max_pending samples pending."""
    req: pb.CommitRequest
    then: Callable[[np.ndarray | BaseException], None]
    peer: Peer | None
    timer: asyncio.TimerHandle | None = None


#: Upper bounds of the staleness histogram's buckets (trainer version minus a handed-out sample's version).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class LocalWarehouse(Protocol):
    """The warehouse hosted in the controller's own process, called directly instead of over a link."""

    def free(self, partition: str, indexes: np.ndarray | None = None) -> int:
        """Free a partition, or some of its samples; returns the bytes freed."""

    def measure(self, partition: str, column: str, indexes: np.ndarray) -> np.ndarray:
        """Per sample, a column's number (a scalar column) or size in bytes."""

    async def dump(self, req: pb.DumpRequest) -> pb.DumpReply:
        """Write (or, with req.load, store) a checkpoint file of what this warehouse holds of a partition."""

    def inline(self, peer: Peer, partition: str, columns: list[str], indexes: np.ndarray,
               locations: np.ndarray) -> tuple[list[pb.ColumnData], Any, list]:
        """For an acquire: the whole columns this warehouse holds, encoded for the reply (may be empty)."""


class ControllerService:
    """The controller of one dock.

    Args:
        core: the pure controller (a fresh one, or none to rebuild from `state_dir`).
        local: the warehouse hosted in this process (see LocalWarehouse), or None for a controller without one.
        state_dir: journal decisions there and rebuild from it on start (None: keep nothing).
        warehouse_grace: seconds a warehouse whose connection dropped has to rejoin.
    """

    def __init__(self, core: Controller, *, local: LocalWarehouse | None = None,
                 state_dir: str | None = None, warehouse_grace: float = 15.0, fsync_interval: float = 0.05,
                 daemon_timeout: float = 30.0, checkpoint_root: str = "") -> None:
        self.daemon_timeout = daemon_timeout
        self.checkpoint_root = checkpoint_root  # checkpoints are written and read only below it ("": anywhere)
        self.core = core
        self.local = local
        self._frees_soon = False
        self._loading: set[str] = set()  # partitions a load is filling
        self.journal = Journal(state_dir, fsync_interval=fsync_interval) if state_dir else None
        self.members = Membership(core, self.journal, grace=warehouse_grace, on_change=self._wake_all)
        self.waiters: dict[str, list[_Waiter]] = {}
        self.sessions: dict[bytes, set[Peer]] = {}  # client session -> its connections (leases belong to sessions)
        self._ticket_key = secrets.token_bytes(32)
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = float("inf")
        self._sync_timer: asyncio.TimerHandle | None = None
        self._full_retry: asyncio.TimerHandle | None = None  # waiting gets tried again once the state dir has room
        self._syncing = False
        self.closing = False
        self.leases_expired = 0
        self.paced: dict[str, list[_Paced]] = {}  # partition -> commits waiting for max_pending, in order
        self._pace_due: set[str] = set()
        self.paced_total = 0  # commits that had to wait for max_pending
        # per bucket of STALENESS_BUCKETS (and past the last), samples handed out; their sum
        self.staleness_counts = [0] * (len(STALENESS_BUCKETS) + 1)
        self.staleness_sum = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def start(self) -> None:
        """Rebuild from the state dir, if any (in the event loop, before serving)."""
        if self.journal is None:
            return
        core, records = self.journal.load(lease_timeout=self.core.lease_timeout, now=self.loop.time())
        core.max_samples = self.core.max_samples
        self.core = self.members.core = core
        self._ticket_key = self.journal.secret()
        self.members.restore(records)
        self._schedule_expiry()
        self._sync_timer = self.loop.call_later(self.journal.fsync_interval, self._sync)

    def _sync(self) -> None:
        """Batched durability: fsync the journal in a worker thread; compact it when large."""
        self._sync_timer = self.loop.call_later(self.journal.fsync_interval, self._sync)
        j = self.journal
        if j.compaction_due(self.loop.time()) and not self._syncing:  # (never under an fsync of the old file)
            broken = j.broken is not None
            if j.compact(self.core, {e.id: e.record() for e in self.members.entries.values()}, now=self.loop.time()) \
                    and broken:
                self._wake_all()  # the journal takes records again: retry the gets that waited meanwhile
        elif j.dirty and not self._syncing:
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

    def session(self, peer: Peer) -> bytes:
        """The session a client connection belongs to (a connection without one is its own)."""
        sid = peer.sid
        if sid is None:  # first request on this connection: register it with its session
            # A connection without a session gets one nobody can name (a claimed session never
            # starts with a zero byte), so no other client can act on its leases.
            own = peer.session and not peer.session.startswith(b"\0")
            sid = peer.sid = peer.session if own else b"\0" + secrets.token_bytes(15)
            self.sessions.setdefault(sid, set()).add(peer)
        return sid

    def ticket(self, lease_id: int) -> bytes:
        """The hand-over proof for a lease: whoever holds it may confirm, release or extend it."""
        return hashlib.blake2b(lease_id.to_bytes(8, "little"), key=self._ticket_key, digest_size=16).digest()

    def _owned(self, peer: Peer, lease_id: int, ticket: bytes):
        """The lease if this peer may act on it; None if it is gone; raises DockLeaseError if it is another's."""
        lease = self.core.leases.get(lease_id)
        if lease is None:
            return None
        sid = self.session(peer)
        if lease.owner == sid or (lease.holders is not None and sid in lease.holders) or (
                ticket and hmac.compare_digest(ticket, self.ticket(lease_id))):
            return lease
        raise DockLeaseError(f"lease {lease_id} belongs to another client; hand it over with its ticket "
                             "(Lease.ticket) to confirm, release or extend it from here")

    def on_lost(self, peer: Peer) -> None:
        if self.closing:  # the controller is stopping: what it recorded stands for the next start
            return
        released = []
        sid = peer.sid
        conns = self.sessions.get(sid) if sid is not None else None
        if conns is not None:
            conns.discard(peer)
            if not conns:  # the client's last connection: it is gone, its leases go back to the pool
                del self.sessions[sid]
                released = self.core.release_owner(sid)
        if self.journal is not None:
            for lease in released:
                self.journal.release(lease.id, applied=True)
        touched = {lease.partition for lease in released}
        for part, ws in list(self.waiters.items()):  # _drop deletes emptied partitions
            for w in [w for w in ws if w.peer is peer]:
                self._drop(part, w)
        for part, ps in list(self.paced.items()):  # (a warehouse re-sends its unanswered commits when it rejoins)
            for p in [p for p in ps if p.peer is peer]:
                self._unpace(part, p)
        self.members.connection_lost(peer)
        for part in touched:
            self._wake(part)

    def _wake_all(self) -> None:
        self._schedule_frees()
        for part in list(self.waiters):
            self._wake(part)

    # -- requests ---------------------------------------------------------------------------
    def commit(self, req: pb.CommitRequest, then: Callable[[np.ndarray | BaseException], None] | None = None,
               peer: Peer | None = None) -> np.ndarray | None:
        """Apply a commit; returns its indexes. With `then`, a commit of new samples to a partition
        that has max_pending samples pending waits (up to req.timeout): None is returned and `then`
        gets the indexes (or the error) when it is applied, from inside the event loop."""
        if then is not None and req.has_timeout and req.new_count and not req.indexes and (
                req.partition in self.paced or self.core.must_wait(req.partition, req.new_count)):
            return self._park_commit(req, then, peer)
        return self._commit(req)

    def _park_commit(self, req: pb.CommitRequest, then, peer: Peer | None) -> np.ndarray | None:
        if req.put_id and req.put_id in self.core.put_keys.get(req.warehouse, ()):
            return self._commit(req)  # re-sent: answered again
        entry = self.members.get(req.warehouse)
        if entry is None or not entry.alive:
            raise DockValueError(f"warehouse {req.warehouse} is not a live member of this dock")
        if req.timeout == 0:
            raise self._full_error(req.partition, 0)
        p = _Paced(req, then, peer)
        self.paced.setdefault(req.partition, []).append(p)
        self.paced_total += 1
        if peer is not None:
            peer.parked += 1
        if req.timeout > 0:
            p.timer = self.loop.call_later(req.timeout, self._pace_expired, req.partition, p)
        return None

    def _full_error(self, partition: str, timeout: float) -> DockFull:
        part = self.core.partitions.get(partition)
        pending, limit = (part.pending(), part.max_pending) if part is not None else (0, 0)
        return DockFull(f"partition {partition!r} is full of pending samples: {pending} wait for its consumers "
                        f"(max_pending={limit}), and this put waited {timeout:g}s for them to take some. Consume "
                        "faster, raise max_pending (create_partition), or give the put a longer timeout; the put "
                        "was not stored")

    def _pace_expired(self, partition: str, p: _Paced) -> None:
        p.timer = None
        self._unpace(partition, p)
        p.then(self._full_error(partition, p.req.timeout))

    def _unpace(self, partition: str, p: _Paced) -> None:
        ps = self.paced.get(partition)
        if ps and p in ps:
            ps.remove(p)
            if p.peer is not None:
                p.peer.parked -= 1
            if not ps:
                del self.paced[partition]
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None

    def _pace_soon(self, partition: str) -> None:
        """Let waiting commits of a partition in once the current request is done (never from
        inside a wake: applying a commit wakes gets itself)."""
        if partition in self.paced and partition not in self._pace_due:
            if not self._pace_due:
                self.loop.call_soon(self._pace_all)
            self._pace_due.add(partition)

    def _pace_all(self) -> None:
        due, self._pace_due = self._pace_due, set()
        for partition in due:
            ps = self.paced.get(partition)
            while ps and not self.core.must_wait(partition, ps[0].req.new_count):
                p = ps[0]
                self._unpace(partition, p)
                try:
                    res = self._commit(p.req)
                except DockStateFull:
                    self.paced.setdefault(partition, []).insert(0, p)  # (it waits on; tried again soon)
                    if p.peer is not None:
                        p.peer.parked += 1
                    self.loop.call_later(1.0, self._pace_soon, partition)
                    break
                except Exception as e:  # noqa: BLE001 - the put's answer
                    res = e
                p.then(res)
                ps = self.paced.get(partition)

    def _fail_paced(self, partition: str, exc: BaseException) -> None:
        for p in list(self.paced.get(partition, ())):
            self._unpace(partition, p)
            p.then(exc)

    def _commit(self, req: pb.CommitRequest) -> np.ndarray:
        entry = self.members.get(req.warehouse)
        if entry is None or not entry.alive:
            raise DockValueError(f"warehouse {req.warehouse} is not a live member of this dock")
        indexes = list(req.indexes) if req.indexes else None
        gs = req.group_size or 1
        if req.partition in self._loading:
            raise DockValueError(f"partition {req.partition!r} is being loaded from a checkpoint; put to it once "
                                 "the load returned")
        tags = {t.name: list(t.values) for t in req.tags} or None
        applied = req.put_id and req.put_id in self.core.put_keys.get(req.warehouse, ())  # (re-sent: answered again)
        if self.journal is not None and not applied:  # written ahead: a commit the journal cannot take is not applied
            self.journal.room()
            self.journal.commit(req.partition, req.columns, req.warehouse, indexes, req.new_count, gs, req.nbytes,
                                req.put_id, tags)
        idx = self.core.commit(req.partition, list(req.columns), warehouse=req.warehouse, indexes=indexes,
                               new_count=req.new_count, group_size=gs, nbytes=req.nbytes, put_id=req.put_id, tags=tags)
        if req.partition in self.waiters:
            self._wake(req.partition)
        return idx

    @property
    def parked(self) -> int:
        """Gets waiting for data, of all connections."""
        return sum(map(len, self.waiters.values()))

    def acquire(self, peer: Peer, frame: pb.Frame) -> None:
        r = frame.acquire
        self._confirm(peer, r.confirm, ())
        cells = max(len(r.columns), 1) * max(r.dp_size, 1)
        if r.allow_partial and r.count * cells > limits.MAX_CELLS:  # "what is ready, up to a lot": up to what a reply holds
            part = self.core.partitions.get(r.partition)
            unit = part.group_size if part is not None and r.groups else 1
            r.count = max(unit, limits.MAX_CELLS // cells // unit * unit)
        Controller.validate_acquire(r.partition, r.consumer, r.columns, r.count, r.groups)
        if self.closing:
            raise DockClosed("the controller is shutting down")
        res = self._try(peer, r)
        if res is not None:
            self._reply_acquired(peer, frame, r, res)
            return
        if r.timeout == 0:
            raise self._timeout_error(r)
        if peer.parked >= limits.MAX_PARKED or self.parked >= limits.MAX_PARKED_DOCK:
            raise DockValueError(
                f"{peer.parked} gets of this connection and {self.parked} of all wait for data already (at most "
                f"{limits.MAX_PARKED} and {limits.MAX_PARKED_DOCK}); wait for some to finish before asking for more")
        w = _Waiter(peer, frame)
        self.waiters.setdefault(r.partition, []).append(w)
        peer.parked += 1  # a blocked get: its connection is busy, not idle
        if r.timeout > 0:
            w.timer = self.loop.call_later(r.timeout, self._expire_waiter, r.partition, w)

    def confirm(self, peer: Peer, req: pb.ConfirmRequest) -> pb.ConfirmReply:
        out = pb.ConfirmReply()
        self._confirm(peer, req.leases, req.tickets, out)
        return out

    def _confirm(self, peer: Peer, leases, tickets, out: pb.ConfirmReply | None = None) -> None:
        """Confirm leases this peer may act on; the rest are reported in `out`."""
        if not leases:
            return
        done, unknown, refused, sealed, mine = [], [], [], set(), []
        for k, lid in enumerate(leases):
            try:
                lease = self._owned(peer, lid, tickets[k] if k < len(tickets) else b"")
            except DockLeaseError:
                refused.append(lid)
                continue
            if lease is None:
                if lid not in self.core.cleared_leases:  # (a clear took its samples: nothing was handed out again)
                    unknown.append(lid)
                continue
            member = lease.holders.get(self.session(peer)) if lease.holders else None
            mine.append((lease, member))
            # (as Controller.confirm decides: a share read by several ranks ends with its last reader's confirm)
            if lease.need <= 1 or member is None or (lease.confirmed | 1 << member).bit_count() >= lease.need:
                done.append(lid)
        if done and self.journal is not None:
            self.journal.confirm(done)  # written ahead: confirms the journal cannot take are not applied
        for lease, member in mine:
            if self.core.confirm(lease.id, member):
                part = self.core.partitions.get(lease.partition)
                if part is not None and part.sealed and lease.partition in self.waiters:
                    sealed.add(lease.partition)  # the last leased samples taken: waiting gets may be at the end
        if done:
            self._schedule_frees()  # (retirement)
            if self.paced:
                for lease, _ in mine:
                    self._pace_soon(lease.partition)
        for name in sealed:
            self._wake(name)
        if unknown or refused:
            logger.warning("[controller] confirms refused peer=%s expired_or_released=%d another_clients=%d",
                           peer.name, len(unknown), len(refused))
        if out is not None:
            out.unknown.extend(unknown)
            out.refused.extend(refused)

    def extend(self, peer: Peer, req: pb.ExtendRequest) -> pb.ExtendReply:
        lease = self._owned(peer, req.lease, req.ticket)
        if lease is None:
            if req.lease in self.core.cleared_leases:
                raise DockLeaseError(f"lease {req.lease} ended when its partition was cleared")
            raise DockLeaseError(f"lease {req.lease} expired or was released: its samples were handed out again")
        seconds = req.seconds if req.seconds > 0 else self.core.lease_timeout
        if not seconds <= 7 * 86400:
            raise DockValueError(f"a lease is extended by at most a week, got {req.seconds}s")
        if self.journal is not None:
            self.journal.extend(lease.id, seconds)
        self.core.extend(lease.id, self.loop.time() + seconds)
        self._schedule_expiry()
        return pb.ExtendReply(seconds=seconds)

    def release(self, peer: Peer, req: pb.ReleaseRequest) -> int:
        lease_id = req.lease or self.core.lease_tokens.get(req.token, 0)
        lease = self._owned(peer, lease_id, req.ticket)
        if lease is None or lease.need > 1:  # (a share other model-parallel ranks read: it expires if unconfirmed)
            return 0
        if self.journal is not None:
            self.journal.release(lease_id)  # written ahead
        lease = self.core.release(lease_id)
        if lease is None:
            return 0
        self._wake(lease.partition)
        return len(lease.indexes)

    async def clear(self, req: pb.ClearRequest) -> int:
        if self.journal is not None and req.partition in self.core.partitions:
            self.journal.clear(req.partition)  # written ahead
        n = self.core.clear(req.partition)
        logger.info("[controller] partition cleared partition=%s samples=%d", req.partition, n)
        for w in list(self.waiters.get(req.partition, ())):
            self._drop(req.partition, w)
            w.peer.reply_error(w.frame, DockClosed(f"partition {req.partition!r} was cleared while this get waited"))
        self._fail_paced(req.partition, DockClosed(f"partition {req.partition!r} was cleared while this put waited "
                                                   "for its consumers (max_pending)"))
        await self._free_everywhere(req.partition)
        return n

    def partition(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        """Operations on a partition's samples: create (options), delete, seal, reserve, set tags,
        set the policy version, list."""
        name, op, out = req.partition, req.WhichOneof("op"), pb.PartitionReply()
        if not name:
            raise DockValueError("partition must be a non-empty string")
        if op == "list":  # reads only: nothing to journal, nobody to wake
            ls = req.list
            limit = min(ls.limit or 1000, limits.MAX_SAMPLES)
            idx, tags = self.core.list_samples(name, consumer=ls.consumer, where=_where(ls), limit=limit,
                                               start=ls.start)
            out.indexes.extend(idx.tolist())
            out.tags.extend(pb.Tag(name=t, values=v.tolist()) for t, v in tags.items())
            out.version = self.core.partitions[name].version
            return out
        if name in self._loading:
            raise DockValueError(f"partition {name!r} is being loaded from a checkpoint; try again once the load "
                                 "returned")
        j = self.journal  # each record is written ahead: an operation the journal cannot take is not applied
        if j is not None and op in ("create", "reserve", "set_tags"):
            j.room()
        if op == "create":
            c = req.create
            gs, retire = c.group_size or 1, list(c.retire_when_consumed_by)
            opts = dict(max_staleness=c.max_staleness - 1 if c.max_staleness else -1, retire_stale=c.retire_stale,
                        max_pending=c.max_pending)
            if j is not None:
                j.create(name, gs, retire, **opts)
            self.core.create_partition(name, group_size=gs, retire=retire, **opts)
            logger.info("[controller] partition options partition=%s group_size=%d retire_when_consumed_by=%s "
                        "max_staleness=%s retire_stale=%s max_pending=%s", name, gs, ",".join(retire) or "-",
                        opts["max_staleness"] if c.max_staleness else "-", c.retire_stale, c.max_pending or "-")
        elif op == "set_version":
            v = req.set_version.version
            if name not in self.core.partitions:
                raise DockNotFound(f"partition {name!r} does not exist; create it (create_partition) before setting "
                                   "its policy version")
            if j is not None:
                j.set_version(name, v)
            out.samples = self.core.set_version(name, v)
            out.version = v
            if out.samples:
                logger.info("[controller] stale samples retired partition=%s version=%d samples=%d", name, v,
                            out.samples)
        elif op == "delete":
            idx = np.asarray(req.delete.indexes, dtype=np.int64)
            if j is not None and len(idx) and name in self.core.partitions:
                j.delete(name, idx)
            out.samples = self.core.delete(name, idx)
        elif op == "seal":
            if j is not None:
                j.seal(name)
            self.core.seal(name)
            logger.info("[controller] partition sealed partition=%s", name)
        elif op == "reserve":
            r = req.reserve
            gs = r.group_size or 1
            if j is not None:
                j.reserve(name, r.count, gs)
            idx = self.core.reserve(name, r.count, group_size=gs)
            out.indexes.extend(idx.tolist())
        elif op == "set_tags":
            tags = {t.name: list(t.values) for t in req.set_tags.tags}
            if j is not None:
                j.tags(name, list(req.set_tags.indexes), tags)
            self.core.set_tags(name, list(req.set_tags.indexes), tags)
        else:
            raise DockValueError(f"partition operation {op!r} is not supported by this controller (version "
                                 f"{__version__})")
        self._schedule_frees()
        self._wake(name)  # a delete, a seal or new tags can end or serve waiting gets
        self._pace_soon(name)  # ... and a delete or new options can let waiting puts in
        return out

    # -- checkpoints -------------------------------------------------------------------------
    async def save(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        """Write a partition to a directory every daemon can reach: its metadata (this controller)
        and one Arrow IPC file per warehouse holding its data (the warehouses, in parallel)."""
        name, path = req.partition, req.save.path
        _check_dir(path, self.checkpoint_root)
        meta = self.core.export_partition(name)
        part = self.core.partitions[name]
        n = part.size
        held = set()
        for loc in part.loc.values():
            held.update(np.unique(loc[:n][loc[:n] < 0xFFFE]).tolist())
        for wid in sorted(held):
            entry = self.members.get(wid)
            if entry is None or not entry.alive:
                raise DockDataLost(f"cannot save partition {name!r}: warehouse {wid}, which holds some of its data, "
                                   "is not reachable; save once it is back, or delete what it held")
        files = {wid: f"warehouse-{wid}.arrow" for wid in sorted(held)}
        replies = await asyncio.gather(*(self._dump(wid, pb.DumpRequest(partition=name, path=os.path.join(path, f)))
                                         for wid, f in files.items()))
        meta = {"format": "dockd-checkpoint", "version": 1, "dockd": __version__, "partition": meta,
                "files": [[wid, f] for wid, f in files.items()]}
        await self.loop.run_in_executor(None, _write_meta, path, meta)
        out = pb.PartitionReply(samples=n - part.deleted, nbytes=sum(r.nbytes for r in replies))
        logger.info("[controller] partition saved partition=%s path=%s samples=%d bytes=%d warehouses=%d", name, path,
                    out.samples, out.nbytes, len(files))
        return out

    async def load(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        """Restore a partition saved by `save`, under req.partition: each warehouse file goes to the
        warehouse of the same id if it is live, else to another live one."""
        name, path = req.partition, req.load.path
        _check_dir(path, self.checkpoint_root)
        meta = await self.loop.run_in_executor(None, _read_meta, path)
        if name in self.core.partitions or name in self._loading:
            raise DockValueError(f"partition {name!r} exists (or is being loaded); clear it or load the checkpoint "
                                 "under another name")
        if self.journal is not None:
            self.journal.room()
        self._loading.add(name)
        try:
            return await self._load(name, path, meta)
        finally:
            self._loading.discard(name)

    async def _load(self, name: str, path: str, meta: dict) -> pb.PartitionReply:
        live = sorted(e.id for e in self.members.entries.values() if e.alive)
        if meta["files"] and not live:
            raise DockValueError("no live warehouse to load the checkpoint into")
        targets, k = {}, 0
        for wid, _ in meta["files"]:
            if wid in live:
                targets[wid] = wid
            else:  # spread the files of warehouses that are not here over the live ones
                targets[wid] = live[k % len(live)]
                k += 1
        d = meta["partition"]
        limit = d["size"]
        try:
            replies = await asyncio.gather(*(self._dump(targets[wid], pb.DumpRequest(
                partition=name, path=os.path.join(path, f), load=True, limit=limit))
                for wid, f in meta["files"]))
        except BaseException:
            await self._free_everywhere(name)  # (a warehouse that ran out of room: nothing half-loaded stays)
            raise
        self.core.import_partition(d, name, targets)
        part = self.core.partitions[name]
        for (wid, _), r in zip(meta["files"], replies):
            part.nbytes[targets[wid]] = part.nbytes.get(targets[wid], 0) + r.nbytes
        if self.journal is not None:
            try:
                self.journal.loaded(name, self.core.export_partition(name))
            except DockStateFull:
                del self.core.partitions[name]  # not recorded: not loaded
                await self._free_everywhere(name)
                raise
        out = pb.PartitionReply(samples=limit - part.deleted, nbytes=sum(r.nbytes for r in replies))
        logger.info("[controller] partition loaded partition=%s path=%s samples=%d bytes=%d", name, path,
                    out.samples, out.nbytes)
        self._wake(name)
        return out

    async def _dump(self, wid: int, req: pb.DumpRequest) -> pb.DumpReply:
        entry = self.members.get(wid)
        if entry is None or not entry.alive:
            raise DockDataLost(f"warehouse {wid} is not reachable")
        if entry.local:
            return await self.local.dump(req)
        reply, _ = await entry.peer.request(pb.Frame(dump=req))
        return reply.dump_reply

    async def _free_everywhere(self, partition: str) -> None:
        """Free a partition on every live warehouse, in parallel. One that is away is told when it
        rejoins (its inventory shows a partition the dock no longer has); a wedged one must not
        hang the caller: it gets daemon_timeout."""
        remote = []
        for entry in self.members.entries.values():
            if not entry.alive:
                continue
            if entry.local:
                self.local.free(partition)
            else:
                remote.append(entry.peer.request(pb.Frame(free=pb.FreeRequest(partition=partition))))
        wait = [asyncio.ensure_future(asyncio.wait_for(r, self.daemon_timeout)) for r in remote]
        for res in await asyncio.gather(*wait, return_exceptions=True):
            if isinstance(res, BaseException):
                logger.warning("[controller] free failed on a warehouse partition=%s error=%s", partition, res)

    def _schedule_frees(self) -> None:
        if self.core.pending_frees and not self._frees_soon:
            self._frees_soon = True
            self.loop.call_soon(self._flush_frees)

    def _flush_frees(self) -> None:
        """Tell warehouses to free the samples deletes and retirement left (one request per warehouse
        and partition). A warehouse that is away frees them when it rejoins (its inventory shows them)."""
        self._frees_soon = False
        for partition, ws in self.core.take_frees().items():
            for wid, idx in ws.items():
                entry = self.members.get(wid)
                if entry is None or not entry.alive:
                    continue
                if entry.local:
                    self._freed(partition, wid, self.local.free(partition, idx))
                    continue
                fut = entry.peer.request(pb.Frame(free=pb.FreeRequest(partition=partition, indexes=idx.tolist())))
                fut.add_done_callback(lambda f, p=partition, w=wid: self._remote_freed(p, w, f))

    def _remote_freed(self, partition: str, wid: int, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            logger.warning("[controller] free of deleted samples failed warehouse=%d partition=%s error=%s", wid,
                           partition, None if fut.cancelled() else fut.exception())
            return
        reply, _ = fut.result()
        self._freed(partition, wid, reply.free_reply.nbytes)

    def _freed(self, partition: str, wid: int, nbytes: int) -> None:
        part = self.core.partitions.get(partition)
        if part is not None and wid in part.nbytes:
            part.nbytes[wid] = max(0, part.nbytes[wid] - nbytes)

    def locate(self, req: pb.LocateRequest) -> pb.Frame:
        locs = self.core.locate(req.partition, list(req.indexes), list(req.columns)).ravel().tolist()
        out = pb.Frame()
        out.locate_reply.locations.extend(locs)
        out.locate_reply.warehouses.extend(self.warehouse_infos(sorted(set(locs)), usage=False))
        return out

    def stats(self) -> pb.StatsReply:
        out = pb.StatsReply(warehouses=self.warehouse_infos(), waiting=sum(map(len, self.waiters.values())),
                            version=__version__)
        waiting: dict[tuple[str, str], int] = {}
        for part, ws in self.waiters.items():
            for w in ws:
                key = (part, w.frame.acquire.consumer)
                waiting[key] = waiting.get(key, 0) + 1
        for p in self.core.stats():
            ps = pb.PartitionStats(name=p["name"], samples=p["samples"], group_size=p["group_size"],
                                   recovered=p["recovered"], deleted=p["deleted"], sealed=p["sealed"],
                                   retire_when_consumed_by=p["retire_when_consumed_by"], tags=p["tags"],
                                   version=p["version"], max_staleness=p["max_staleness"] + 1,
                                   retire_stale=p["retire_stale"], max_pending=p["max_pending"], stale=p["stale"],
                                   stale_retired=p["stale_retired"], pending=p["pending"],
                                   paced=len(self.paced.get(p["name"], ())))
            for c, n in p["columns"].items():
                ps.columns.append(c)
                ps.column_ready.append(n)
            for name, c in p["consumers"].items():
                ps.consumers.append(pb.ConsumerStats(name=name, taken=c["taken"], leased=c["leased"], ready=c["ready"],
                                                     waiting=waiting.get((p["name"], name), 0), pending=c["pending"]))
            out.partitions.append(ps)
        return out

    def shutdown(self) -> None:
        self.closing = True
        for part in list(self.paced):
            self._fail_paced(part, DockClosed("the controller is shutting down"))
        for part, ws in list(self.waiters.items()):
            for w in list(ws):
                self._drop(part, w)
                w.peer.reply_error(w.frame, DockClosed("the controller is shutting down"))
        self.members.close()
        for timer in (self._expiry, self._sync_timer, self._full_retry):
            if timer is not None:
                timer.cancel()
        if self.journal is not None:
            self.journal.close()

    # -- waiting -----------------------------------------------------------------------------
    def _try(self, peer: Peer, r: pb.AcquireRequest) -> AcquireResult | None:
        sid = self.session(peer)
        if r.dp_size:
            return self._try_share(r, sid)
        again = self.core.leases.get(self.core.lease_tokens.get(r.token, 0)) if r.token else None
        if again is not None and again.owner not in (sid, b""):
            again = None  # another client's token: no replay for it (tokens are random, so this is an attack)
            r.token = 0
        if again is None and self.journal is not None:
            self.journal.room()
        res = self.core.acquire(
            r.partition, r.consumer, list(r.columns), r.count,
            groups=r.groups, allow_partial=r.allow_partial, shuffle=r.shuffle,
            seed=r.seed if r.has_seed else None, owner=sid, now=self.loop.time(), token=r.token,
            lease_timeout=min(r.lease_seconds, 7 * 86400.0) if r.lease_seconds > 0 else None,
            where=_where(r), order_by=r.order_by, near=r.near - 1 if r.near else None,
            max_staleness=r.max_staleness - 1 if r.max_staleness else None,
        )
        if again is not None:
            again.owner = sid  # the client that retried holds it (a lease restored from the journal may have had none)
        elif res is not None:
            self._handed_out(r.partition, res.indexes)
            if self.journal is not None:
                lease = self.core.leases[res.lease]
                try:
                    self.journal.grant(lease, lease.deadline - self.loop.time())
                except DockStateFull:
                    self.core.release(lease.id)  # not recorded: not granted
                    raise
            self._schedule_expiry()
        return res

    def _try_share(self, r: pb.AcquireRequest, sid: bytes) -> AcquireResult | None:
        """A rank-aware get (see Controller.share); a round to balance is weighed in the background."""
        if r.shuffle or r.allow_partial:
            raise DockValueError("a rank-aware get (dp_size or mp_group) hands out `count` samples per rank in order; "
                                 "shuffle and allow_partial do not apply (order_by and where do; a sealed partition "
                                 "ends with a smaller last step)")
        for name in r.balance_by:
            if name not in r.columns and not self._is_tag(r.partition, name):
                raise DockValueError(f"balance_by={name!r} is neither a tag of partition {r.partition!r} nor one of "
                                     f"the columns this get reads ({list(r.columns)})")
        if self.journal is not None:
            self.journal.room()
        res = self.core.share(
            r.partition, r.consumer, list(r.columns), r.count, dp_rank=r.dp_rank, dp_size=r.dp_size,
            mp_rank=r.mp_rank, mp_size=r.mp_size or 1, mp_group=r.mp_group, step=r.step if r.has_step else None, groups=r.groups,
            where=_where(r), order_by=r.order_by, balance=bool(r.balance_by), owner=sid, now=self.loop.time(),
            lease_timeout=min(r.lease_seconds, 7 * 86400.0) if r.lease_seconds > 0 else None,
            max_staleness=r.max_staleness - 1 if r.max_staleness else None,
        )
        if res is not None and not isinstance(res, Round) and res.lease:
            self._handed_out(r.partition, res.indexes)
        if isinstance(res, Round):
            asyncio.ensure_future(self._weigh(res, list(r.balance_by)))
            res = None
        self._journal_shares()
        return res

    def _handed_out(self, partition: str, idx: np.ndarray) -> None:
        """Samples were just leased: count their staleness; commits waiting for room may go in."""
        part = self.core.partitions.get(partition)
        if part is None:
            return
        if part.version or VERSION_TAG in part.tags:
            st = part.version - part.tag_values(VERSION_TAG, idx)
            counts = np.bincount(np.searchsorted(STALENESS_BUCKETS, st, side="left"),
                                 minlength=len(self.staleness_counts))
            for b in np.flatnonzero(counts).tolist():
                self.staleness_counts[b] += int(counts[b])
            self.staleness_sum += int(st.sum())
        if partition in self.paced:
            self._pace_soon(partition)

    def _is_tag(self, partition: str, name: str) -> bool:
        part = self.core.partitions.get(partition)
        return part is not None and name in part.tags

    def _journal_shares(self) -> None:
        """Record the shares made and given back since the last call. Shares whose grant cannot be
        recorded go back to the pool (as if they expired at once) and DockStateFull is raised."""
        shares, self.core.new_shares = self.core.new_shares, []
        dropped, self.core.dropped_shares = self.core.dropped_shares, []
        if self.journal is not None:
            for lid in dropped:
                self.journal.release(lid, applied=True)
            now = self.loop.time()
            for k, lease in enumerate(shares):
                try:
                    self.journal.grant(lease, lease.deadline - now)
                except DockStateFull:
                    for gone in shares[k:]:
                        self.core.release(gone.id)  # not recorded: not granted
                    raise
        if shares:
            self._schedule_expiry()

    async def _weigh(self, rnd: Round, names: list[str]) -> None:
        """Weigh a round's samples by `names` (tags, or columns measured where they are stored), split it
        among its ranks, and serve the ranks waiting for it. A failure gives the round's samples back and
        fails the gets waiting for it."""
        try:
            part = self.core.partitions.get(rnd.partition)
            if part is None:
                raise DockDataLost(f"partition {rnd.partition!r} was cleared while a balanced round was weighed")
            idx = rnd.indexes
            weights = np.zeros(len(idx), dtype=np.float64)
            for name in names:
                if name in part.tags:
                    weights += part.tags[name][idx]
                else:
                    weights += await self._measure(part, name, idx)
            if not np.isfinite(weights).all() or (weights < 0).any():
                raise DockValueError(f"balance_by={names} gave negative or non-finite weights; balance by "
                                     "non-negative numbers (lengths, token counts)")
            self.core.split_round(rnd, weights)
            self._journal_shares()
        except Exception as e:  # noqa: BLE001 - reported to the gets that wait for this round
            self.core.drop_round(rnd)
            logger.warning("[controller] balanced round failed partition=%s error=%s", rnd.partition, e)
            _, consumer, cols, groups, dp_size, *_ = rnd.key
            for w in list(self.waiters.get(rnd.partition, ())):
                a = w.frame.acquire
                if a.consumer == consumer and a.dp_size == dp_size and tuple(sorted(a.columns)) == cols:
                    self._drop(rnd.partition, w)
                    w.peer.reply_error(w.frame, e)
        self._wake(rnd.partition)

    async def _measure(self, part, column: str, idx: np.ndarray) -> np.ndarray:
        """Per sample of idx, the number in `column` (or a tensor's numel), asked of the warehouses holding it."""
        locs = part.loc[column][idx]
        out = np.empty(len(idx), dtype=np.float64)
        asks = []
        for wid in np.unique(locs).tolist():
            sel = np.flatnonzero(locs == wid)
            entry = self.members.get(wid)
            if entry is None or not entry.alive:
                raise DockDataLost(f"column {column!r} of samples {idx[sel][:8].tolist()} of partition {part.name!r} "
                                   f"is on warehouse {wid}, which is not reachable; cannot balance by it")
            if entry.local:
                out[sel] = self.local.measure(part.name, column, idx[sel])
            else:
                req = pb.MeasureRequest(partition=part.name, column=column, indexes=idx[sel].tolist())
                asks.append((sel, entry.peer.request(pb.Frame(measure=req))))
        for sel, fut in asks:
            reply, _ = await asyncio.wait_for(fut, self.daemon_timeout)
            out[sel] = reply.measure_reply.values
        return out

    def _reply_acquired(self, peer: Peer, frame: pb.Frame, r: pb.AcquireRequest, res: AcquireResult) -> None:
        locs = res.locations.ravel().tolist()
        out = pb.Frame()
        reply = out.acquire_reply  # filled in place: building a message and wrapping it would copy it
        reply.lease = res.lease
        if res.lease:
            reply.ticket = self.ticket(res.lease)
        reply.step = res.step
        reply.rank_weights.extend(res.weights)
        reply.indexes.extend(res.indexes.tolist())
        reply.locations.extend(locs)
        reply.warehouses.extend(self.warehouse_infos(sorted(set(locs)), usage=False))
        part = self.core.partitions.get(r.partition)
        reply.recovered = part is not None and part.recovered
        if r.inline and self.local is not None:
            cols, body, segs = self.local.inline(peer, r.partition, list(r.columns), res.indexes, res.locations)
            reply.inline.extend(cols)
            out.pins.extend(s.sid for s in segs)
            peer.reply(frame, out, body.buffers, body.size, segs)
            return
        peer.reply(frame, out)

    def _wake(self, partition: str) -> None:
        """Retry the gets waiting on a partition, in arrival order. Once one finds too few samples,
        the later ones of the same consumer and columns asking for as many or more are not tried:
        with many waiters a commit costs one failed try per kind of request, not one per waiter."""
        ws = self.waiters.get(partition)
        if not ws:
            return
        short: dict[tuple, int] = {}  # (consumer, columns, groups) -> smallest count found unmet
        for w in list(ws):
            r = w.frame.acquire
            # (a rank-aware or filtered get is tried on its own: its needs differ from its neighbours')
            key = (r.consumer, tuple(sorted(r.columns)), r.groups, r.max_staleness) \
                if not (r.dp_size or r.where or r.order_by) else w
            need = 1 if r.allow_partial else r.count
            if need >= short.get(key, 1 << 62):
                continue
            try:
                res = self._try(w.peer, r)
            except DockStateFull:  # the state dir is full: the gets stay parked, and are tried again soon
                self._retry_wake_later()
                return
            except DockError as e:
                self._drop(partition, w)
                w.peer.reply_error(w.frame, e)
                continue
            if res is not None:
                self._drop(partition, w)
                self._reply_acquired(w.peer, w.frame, r, res)
            else:
                short[key] = min(short.get(key, 1 << 62), need)

    def _retry_wake_later(self) -> None:
        if self._full_retry is None and not self.closing:
            self._full_retry = self.loop.call_later(1.0, self._retry_wake)

    def _retry_wake(self) -> None:
        self._full_retry = None
        self._wake_all()

    def _drop(self, partition: str, w: _Waiter) -> None:
        ws = self.waiters.get(partition)
        if ws and w in ws:
            ws.remove(w)
            w.peer.parked -= 1
            if not ws:
                del self.waiters[partition]
        if w.timer is not None:
            w.timer.cancel()

    def _timeout_error(self, r: pb.AcquireRequest) -> DockTimeout:
        ready = self.core.ready_count(r.partition, r.consumer, list(r.columns), r.groups)
        unit = "samples in whole groups" if r.groups else "samples"
        what = f"get(consumer={r.consumer!r}, partition={r.partition!r}, columns={list(r.columns)})"
        if r.dp_size:  # a rank-aware get waits for a whole step's batch, or for its share of one being weighed
            return DockTimeout(
                f"{what} of rank {r.dp_rank} of {r.dp_size} timed out after {r.timeout:g}s: a step needs "
                f"{r.count} x {r.dp_size} = {r.count * r.dp_size} {unit} ready at once, {ready} were."
                + self.core.why_not_ready(r.partition, list(r.columns))
                + " Put more samples per step, lower count, or give a longer timeout.",
                ready=ready,
            )
        return DockTimeout(
            f"{what} timed out after {r.timeout:g}s: {ready} of {r.count} {unit} were ready."
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
                self.journal.release(lease.id, applied=True)
        self.leases_expired += len(expired)
        if expired:
            logger.warning("[controller] leases expired unconfirmed count=%d; their samples return to the pool", len(expired))
        for part in {l.partition for l in expired}:
            self._wake(part)
        self._schedule_expiry()


def _where(r) -> dict[str, tuple[int, int]] | None:
    return {t.name: (t.lo, t.hi) for t in r.where} or None


_META = "partition.msgpack"


def _check_dir(path: str, root: str = "") -> None:
    if not path or not os.path.isabs(path):
        raise DockValueError(f"a checkpoint path is an absolute directory every daemon of the dock can reach, "
                             f"got {path!r}")
    if root:
        real, top = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, top]) != top:
            raise DockValueError(f"checkpoints of this dock live under {root} (--checkpoint-root); {path} is not "
                                 "below it")


def _regular(path: str) -> str:
    """`path`, if it names a regular file (a FIFO or a device would block or never end a read)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as e:
        raise DockValueError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise DockValueError(f"{path} is not a regular file; a checkpoint holds regular files only")
    return path


def _write_meta(path: str, meta: dict) -> None:
    import msgpack

    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, _META + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(meta, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, _META))


def _read_meta(path: str) -> dict:
    import msgpack

    _check_dir(path)
    try:
        with open(_regular(os.path.join(path, _META)), "rb") as f:
            meta = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        raise DockNotFound(f"{path} holds no dockd checkpoint ({_META} is missing); save one with "
                           "dock.save(partition, path)") from None
    if not isinstance(meta, dict) or meta.get("format") != "dockd-checkpoint":
        raise DockValueError(f"{os.path.join(path, _META)} is not a dockd checkpoint")
    if meta.get("version") != 1:
        raise DockValueError(f"checkpoint format version {meta.get('version')!r} in {path} is not supported by "
                             f"dockd {__version__}")
    for entry in meta.get("files") or ():  # file names inside the checkpoint directory, nothing else
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)
                and entry[1] == os.path.basename(entry[1]) and entry[1] not in ("", ".", "..")):
            raise DockValueError(f"{os.path.join(path, _META)} names a file outside its directory: {entry!r}")
    return meta
