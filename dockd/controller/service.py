"""The controller on the wire: waiting acquires, leases tied to connections, the
journal. All decisions are made by `core.Controller`; this layer only holds
waiters and timers, records decisions in the journal (with a state dir), and
turns results into frames. Its parts (attribute: module), each given the parts it
uses when it is made, none the service:

    waiting: waiters          gets waiting for data, woken when their partition changes, timed out
    pacer: pacing             puts waiting for a partition's consumers (max_pending)
    leasing: sessions         client sessions, tickets, confirm / release / extend, lease expiry
    acquiring: grants         a get's try, a rank-aware get's share and its balancing, the reply
    ops: partition_ops        create, seal, delete, tags, list, drop a consumer, clear
    checkpoints: checkpoint   save and load of partitions
    calls: warehouse_calls    frees, measures and checkpoint files asked of the warehouses
    members: membership       warehouses joining, rejoining, probed and declared lost
    replication: replica_service  --replicas 2: where each put's copy goes, repairs of missing copies
    blocking: block_service   blocks of new indexes granted to warehouses, block commits, a seal's handshake
    syncing: syncing          the journal's fsyncs and snapshots (with a state dir)

Every timer runs on the service's `clock` (`clock.Timers`), so tests can move time by hand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from dockd import limits, owners
from dockd._proto import dockd_pb2 as pb
from dockd._version import __version__
from dockd.controller import commit_runs
from dockd.controller.agreement import Ownership
from dockd.controller.block_service import Blocking
from dockd.controller.checkpoint import Checkpoints
from dockd.controller.clock import Clock, Timers
from dockd.controller.core import Controller
from dockd.controller.grants import STALENESS_BUCKETS, Acquiring
from dockd.controller.journal import Journal, ahead
from dockd.controller.lease_table import AcquireResult
from dockd.controller.membership import Membership
from dockd.controller.pacing import Pacer
from dockd.controller.partition_ops import PartitionOps
from dockd.controller.replica_service import Replication
from dockd.controller.sessions import Leasing, ticket_key
from dockd.controller.syncing import Syncing
from dockd.controller.waiters import Waiters
from dockd.controller.warehouse_calls import LocalWarehouse, WarehouseCalls
from dockd.errors import DockClosed, DockError, DockFull, DockValueError, to_status
from dockd.net import auth
from dockd.net.peer import Peer
from dockd.terms import CommitOutcome

__all__ = ["STALENESS_BUCKETS", "ControllerService", "LocalWarehouse"]

logger = logging.getLogger(__name__)


class _HoldsCore(Protocol):
    core: Controller


class ControllerService:
    """The controller of one dock.

    Args:
        core: the pure controller (a fresh one, or none to rebuild from `state_dir`).
        local: the warehouse hosted in this process (see LocalWarehouse), or None for a controller without one.
        state_dir: journal decisions there and rebuild from it on start (None: keep nothing).
        controllers, own: the dock's controllers and this one's index among them, when there are
            several; each owns the partitions `dockd.owners.owner_index` gives it and refuses requests
            about the others'.
        shards: the dock's spread partitions (--shards): a request naming one's own name is refused.
        warehouse_grace: seconds a warehouse whose connection dropped has to rejoin.
        replicas: 2 keeps every put's values on two warehouses (see `replication`); 1: on one.
        clock: the time lease deadlines, timeouts and grace go by (a test's may be moved by hand;
            it then calls `timers.run_due()`).
    """

    def __init__(self, core: Controller, *, local: LocalWarehouse | None = None,
                 state_dir: str | None = None, warehouse_grace: float = 15.0, fsync_interval: float = 0.05,
                 daemon_timeout: float = 30.0, checkpoint_root: str = "", clock: Clock = time.monotonic,
                 controllers: tuple[str, ...] = (), own: int = 0, replicas: int = 1,
                 shards: Mapping[str, int] | None = None) -> None:
        self.controllers = controllers  # several controllers: all of them, in the dock's order (dockd.owners)
        self.own = own  # ... and this one's place among them
        self.check_owner = Ownership(controllers, own, shards).check  # (refuses the others' partitions, spread names)
        self.core = core
        self.clock = clock
        self.timers = Timers(clock)
        self.journal = Journal(state_dir, fsync_interval=fsync_interval) if state_dir else None
        self.members = Membership(core, self.journal, grace=warehouse_grace, on_change=self.wake_all,
                                  timers=self.timers, numbering=(own, len(controllers)) if controllers else (0, 1))
        self.waiting = Waiters(core, self.timers, retry_all=self.wake_all)
        self.pacer = Pacer(core, self.members, self.timers, apply=self.apply_commit)
        self.calls = WarehouseCalls(core, self.members, local, self.timers, daemon_timeout=daemon_timeout)
        self.leasing = Leasing(core, self.journal, self.timers, waiting=self.waiting, pacer=self.pacer,
                               calls=self.calls)
        self.replication = Replication(core, self.members, self.journal, self.timers, replicas=replicas, local=local,
                                       daemon_timeout=daemon_timeout)
        self.acquiring = Acquiring(core, self.journal, self.timers, leasing=self.leasing, waiting=self.waiting,
                                   pacer=self.pacer, calls=self.calls, replication=self.replication,
                                   members=self.members, local=local)
        self.waiting.gets = self.acquiring  # (it wakes waiting gets itself: given once it is made)
        self.checkpoints = Checkpoints(core, self.members, self.journal, self.calls, root=checkpoint_root,
                                       wake=self.waiting.wake)
        self.ops = PartitionOps(core, self.journal, waiting=self.waiting, pacer=self.pacer, calls=self.calls,
                                loading=self.checkpoints.loading)
        self.blocking = Blocking(core, self.journal, self.members, waiting=self.waiting,
                                 loading=self.checkpoints.loading, daemon_timeout=daemon_timeout,
                                 replicas=replicas)
        self.syncing = None if self.journal is None else Syncing(
            self.journal, self.timers, resumed=self.wake_all,
            snapshot=lambda: (self.core, {e.id: e.record() for e in self.members.entries.values()}))
        self.closing = False

    # -- what the daemon's metrics read ----------------------------------------------------------
    @property
    def waiters(self) -> dict:
        """partition -> the gets waiting on it."""
        return self.waiting.by_partition

    @property
    def parked(self) -> int:
        """Gets waiting for data, of all connections."""
        return self.waiting.count

    @property
    def paced(self) -> dict:
        """partition -> the puts waiting for its consumers (max_pending)."""
        return self.pacer.paced

    def waiting_by_consumer(self) -> dict[tuple[str, str], int]:
        """(partition, consumer) -> gets waiting for data (the partition may not exist yet)."""
        return self.waiting.by_consumer()

    @property
    def paced_total(self) -> int:
        return self.pacer.total

    @property
    def leases_expired(self) -> int:
        return self.leasing.expired

    @property
    def staleness_counts(self) -> list[int]:
        return self.acquiring.staleness_counts

    @property
    def staleness_sum(self) -> int:
        return self.acquiring.staleness_sum

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def start(self) -> None:
        """Rebuild from the state dir, if any (in the event loop, before serving)."""
        if self.journal is None:
            self.replication.start()
            return
        self.journal.lock()  # (one controller per state dir: a second one refuses to start)
        core, records = self.journal.load(lease_timeout=self.core.lease_timeout, now=self.clock())
        core.max_samples = self.core.max_samples
        self._adopt(core)
        self.leasing.set_ticket_key(ticket_key(self.journal.dir))
        self.members.restore(records)
        self.leasing.schedule_expiry()
        self.replication.start()
        assert self.syncing is not None
        self.syncing.arm()

    def _adopt(self, core: Controller) -> None:
        """The controller rebuilt from the state dir replaces the fresh one, in every part holding it
        (before serving: nothing was decided on the fresh one)."""
        self.core = core
        parts: list[_HoldsCore] = [self.members, self.waiting, self.pacer, self.calls, self.leasing,
                                   self.replication, self.acquiring, self.checkpoints, self.ops, self.blocking]
        for part in parts:
            part.core = core

    # -- membership -------------------------------------------------------------------------
    def register(self, peer: Peer | None, req: pb.RegisterWarehouse) -> pb.RegisterReply:
        if self.controllers:  # another controller's partitions in a rejoin inventory are not this one's to adopt
            n = len(self.controllers)
            mine = [p for p in req.inventory if owners.owner_index(p.name, n) == self.own]
            if len(mine) != len(req.inventory):
                del req.inventory[:]
                req.inventory.extend(mine)
        cleared = self.calls.cleared_meanwhile(req)  # (held from before a clear it missed: dropped, not adopted)
        was = self.members.get(req.id)
        same = was is not None and was.instance == req.instance
        reply = self.members.register(peer, req, self.apply_commit)
        reply.drop.extend(cleared)
        self.blocking.registered(reply.id, req, same and was is self.members.get(reply.id))
        reply.blocks = self.blocking.grants
        return reply

    def block(self, peer: Peer | None, req: pb.BlockRequest) -> pb.BlockReply:  # (see block_service)
        self.check_owner(req.partition)
        return self.blocking.grant(peer, req)

    def warehouse_infos(self, ids=None, *, usage: bool = True) -> list[pb.WarehouseInfo]:
        return self.members.infos(ids, usage=usage)

    def leave(self, peer: Peer, req: pb.LeaveRequest) -> None:
        self.members.leave(peer, req.id)

    def on_authed(self, peer: Peer) -> None:
        """A client connection joins its session as soon as it is authenticated, not at its first lease
        request: a client that replaces the connection its leases were taken over (a reconnect, a better
        transport) never leaves its session without a connection, which would give its leases back."""
        if peer.role == auth.CLIENT:
            self.leasing.session(peer)

    def on_lost(self, peer: Peer) -> None:
        if self.closing:  # the controller is stopping: what it recorded stands for the next start
            return
        released = self.leasing.peer_lost(peer)
        self.waiting.drop_peer(peer)
        self.pacer.drop_peer(peer)
        self.members.connection_lost(peer)
        for part in {lease.partition for lease in released}:
            self.waiting.wake(part)

    def wake_all(self) -> None:
        """Something changed for every partition (a warehouse lost or back, the journal writable again)."""
        self.calls.schedule_frees()
        self.waiting.wake_every()

    # -- requests ---------------------------------------------------------------------------
    def commit(self, req: pb.CommitRequest, then=None, peer: Peer | None = None,
               woken: set[str] | None = None) -> CommitOutcome | None:
        """Apply a commit; returns its outcome. With `then`, a commit of new samples to a partition
        that has max_pending samples pending waits (up to req.timeout): None is returned and `then`
        gets the outcome (the error in it, if it failed) when it is applied, from inside the event loop. With `woken`,
        the gets waiting on the partition are left for the caller to `wake` (see apply_commit)."""
        self.check_owner(req.partition)
        if then is not None and self.pacer.must_wait(req):
            return self.pacer.park(req, then, peer)
        out = self.apply_commit(req, woken)
        if req.block and not out.cleared:
            self.blocking.passed([(req.block, req.warehouse, req.partition)])
        return out

    def wake(self, partitions: set[str]) -> None:
        """Retry the gets waiting on these partitions."""
        for partition in partitions:
            self.waiting.wake(partition)

    def commit_batch(self, batch: pb.CommitBatch) -> pb.CommitBatchReply:
        """Apply a warehouse's coalesced commits in order: consecutive ones of new samples to one
        partition as one run (`commit_runs`), the others each on its own. One that fails has its error
        in its result; one that would wait for its partition's consumers (max_pending) is not applied
        and says so (`wait`), and its warehouse sends it again alone. Waiting gets are tried once per
        partition, after the last commit."""
        reply = pb.CommitBatchReply()
        woken: set[str] = set()
        for run in commit_runs.runs(self, batch.commits):
            if len(run) > 1 and commit_runs.apply_run(self, run, reply, woken):
                continue
            for req in run:
                out = reply.results.add()
                try:
                    self.check_owner(req.partition)
                    if self.pacer.must_wait(req) and req.put_id not in self.core.put_keys.get(req.warehouse, ()):
                        out.wait = True
                        continue
                    self.commit_reply(req, self.apply_commit(req, woken), out)
                except Exception as e:  # noqa: BLE001 - this commit's answer; the others stand
                    if not isinstance(e, DockError):
                        logger.error("[controller] commit failed partition=%s warehouse=%d", req.partition,
                                     req.warehouse, exc_info=e)
                    to_status(e, out.status)
        self.blocking.written_out(batch.commits, reply.results)
        for partition in woken:
            self.waiting.wake(partition)
        return reply

    def commit_reply(self, req: pb.CommitRequest, res: CommitOutcome, out: pb.CommitReply) -> None:
        """Fill a commit's answer: its indexes, and where to copy the put (--replicas 2)."""
        out.indexes.extend(res.listed())
        if res.stored:
            out.stored = True
        elif res.cleared:
            out.cleared = True
        elif self.replication.replicas > 1:
            target = self.replication.target_of(req, np.asarray(res.indexes))
            if target is not None:
                out.replica.CopyFrom(target)

    def apply_commit(self, req: pb.CommitRequest, woken: set[str] | None = None) -> CommitOutcome:
        """Apply one commit and wake the gets waiting on its partition (or, given `woken`, add the
        partition there for the caller to wake)."""
        wid = req.warehouse
        entry = self.members.get(wid)
        if entry is None or not entry.alive:
            raise DockValueError(f"warehouse {wid} is not a live member of this dock")
        if req.replica:
            return CommitOutcome(self.replication.commit(req))
        partition, core, journal = req.partition, self.core, self.journal
        indexes = list(req.indexes) if req.indexes else None
        gs = req.group_size or 1
        if partition in self.checkpoints.loading:
            raise DockValueError(f"partition {partition!r} is being loaded from a checkpoint; put to it once "
                                 "the load returned")
        tags = {t.name: list(t.values) for t in req.tags} or None if req.tags else None
        put_id, token = req.put_id, req.token
        applied = put_id and put_id in core.put_keys.get(wid, ())  # (re-sent: answered again)
        if req.block and not applied:
            out = self.blocking.commit(req, woken)
            if out is not None:  # (cleared, or answered again)
                return out
        away: list[int] | tuple[()] = ()
        if token in core.catalog.tokens and not applied:
            # a put re-sent to this warehouse (its writer's token seen before): values held by a warehouse that does
            # not answer now count as not held, since it may have gone away between their commit and storing them
            away = self.members.away(but=wid)
            stored = core.catalog.stored(partition, token, away)
            if stored is not None:  # a put re-sent to this warehouse whose values another one holds: nothing to apply
                return CommitOutcome(stored, stored=True)
        columns = req.columns[:]
        with ahead(journal):
            if journal is not None and not applied:  # written ahead: a commit the journal cannot take is not applied
                journal.room(adds=not req.block)  # (a block commit's samples were added by its grant)
                journal.commit(partition, columns, wid, indexes, req.new_count, gs, req.nbytes, put_id, tags, token,
                               away)
            idx = core.commit(partition, columns, warehouse=wid, indexes=indexes, new_count=req.new_count,
                              group_size=gs, nbytes=req.nbytes, put_id=put_id, tags=tags, token=token, away=away)
        if partition in self.waiting.by_partition:
            if woken is None:
                self.waiting.wake(partition)
            else:
                woken.add(partition)
        return CommitOutcome(idx)

    def acquire(self, peer: Peer, frame: pb.Frame) -> None:
        """An acquire: its bounds checked (`limits.acquire`, which reads its fields once for the whole path),
        tried, answered or parked."""
        r = frame.acquire
        a = limits.acquire(r)
        self.check_owner(a.partition)
        confirms = a.confirms  # (the client's previous gets, riding on this one)
        if confirms and self.journal is None and not a.dp_size:
            res = _attempt_before(self, peer, a, confirms)
            if res is not None:
                self.acquiring.reply(peer, frame, r, res, a)
                _confirm_after(self.leasing, peer, confirms)
                return
        else:
            try:  # the confirms it carries are journaled with its grant, in one write before the answer
                self.leasing.confirm(peer, confirms, (), hold=True)
                res = self._attempt(peer, a)
            finally:
                if self.journal is not None:
                    self.journal.flush()
            if res is not None:
                self.acquiring.reply(peer, frame, r, res, a)
                return
        if a.timeout == 0:
            raise self.waiting.timeout_error(r)
        self.waiting.park(peer, frame)

    def _attempt(self, peer: Peer, a: limits.Acquire) -> AcquireResult | None:
        if a.allow_partial:
            cells = max(len(a.columns), 1) * max(a.dp_size, 1)
            if a.count * cells > limits.MAX_CELLS:  # "what is ready, up to a lot": up to what a reply holds
                part = self.core.partitions.get(a.partition)
                unit = part.group_size if part is not None and a.groups else 1
                a.count = a.r.count = max(unit, limits.MAX_CELLS // cells // unit * unit)
        Controller.validate_acquire(a.partition, a.consumer, a.columns, a.count, a.groups)
        if self.closing:
            raise DockClosed("the controller is shutting down")
        return self.acquiring.attempt(peer, a.r, a)

    def confirm(self, peer: Peer, req: pb.ConfirmRequest) -> pb.ConfirmReply:
        out = pb.ConfirmReply()
        self.leasing.confirm(peer, req.leases, req.tickets, out)
        return out

    def extend(self, peer: Peer, req: pb.ExtendRequest) -> pb.ExtendReply:
        return self.leasing.extend(peer, req)

    def release(self, peer: Peer, req: pb.ReleaseRequest) -> int:
        return self.leasing.release(peer, req)

    async def clear(self, req: pb.ClearRequest) -> int:
        self.check_owner(req.partition)
        return await self.ops.clear(req.partition)

    def partition(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        """Operations on a partition's samples: create (options), delete, seal, reserve, set tags,
        set the policy version, drop a consumer, list (see partition_ops)."""
        if not req.partition:
            raise DockValueError("partition must be a non-empty string")
        self.check_owner(req.partition)
        if req.WhichOneof("op") == "seal":
            self.blocking.check_closed(req.partition)  # (open blocks: sealed by `seal`, which takes them back)
        return self.ops.apply(req)

    async def seal(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        """Seal a partition; with blocks of its indexes open on warehouses, once they gave them back
        (see block_service). A seal that cannot reach an owner fails naming it."""
        self.check_owner(req.partition)
        return await self.blocking.seal(req.partition, lambda: self.ops.apply(req))

    async def save(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        self.check_owner(req.partition)
        return await self.checkpoints.save(req)

    async def load(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        self.check_owner(req.partition)
        return await self.checkpoints.load(req)

    def locate(self, req: pb.LocateRequest) -> pb.Frame:
        self.check_owner(req.partition)
        locs = self.core.locate(req.partition, list(req.indexes), list(req.columns)).ravel().tolist()
        out = pb.Frame()
        out.locate_reply.locations.extend(locs)
        out.locate_reply.warehouses.extend(self.warehouse_infos(sorted(set(locs)), usage=False))
        return out

    def stats(self) -> pb.StatsReply:
        out = pb.StatsReply(warehouses=self.warehouse_infos(), waiting=self.parked, version=__version__)
        waiting = self.waiting.by_consumer()
        for p in self.core.stats():
            ps = pb.PartitionStats(name=p["name"], samples=p["samples"], group_size=p["group_size"],
                                   recovered=p["recovered"], deleted=p["deleted"], sealed=p["sealed"],
                                   retire_when_consumed_by=p["retire_when_consumed_by"], tags=p["tags"],
                                   version=p["version"], max_staleness=p["max_staleness"] + 1,
                                   retire_stale=p["retire_stale"], max_pending=p["max_pending"], stale=p["stale"],
                                   stale_retired=p["stale_retired"], pending=p["pending"],
                                   paced=len(self.paced.get(p["name"], ())))
            if self.replication.replicas > 1:
                ps.replicated, ps.under_replicated = self.replication.counts(p["name"])
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
        self.pacer.close(DockClosed("the controller is shutting down"))
        self.waiting.close(DockClosed("the controller is shutting down"))
        self.members.close()
        self.replication.close()
        self.leasing.close()
        if self.syncing is not None:
            self.syncing.close()
        if self.journal is not None:
            self.journal.close()


def _attempt_before(svc: ControllerService, peer: Peer, a: limits.Acquire, confirms: list[int]) -> AcquireResult | None:
    """Try an acquire before the confirms it carries, which are then applied after its answer (nothing is
    journaled: without a state dir there is no record to write ahead of it). What it is handed is what it
    would have been handed after them: a confirm ends a lease, it makes nothing eligible. Where they could
    matter the get is answered as if they came first: a get that would wait (the last lease of a sealed
    partition ends with them: DockDrained) or one refused for the leases outstanding (they end some) is
    tried again after them, and one that fails has them applied before it raises."""
    try:
        res = svc._attempt(peer, a)
    except DockFull:
        res = None
    except BaseException:
        svc.leasing.confirm(peer, confirms, ())
        raise
    if res is None:
        svc.leasing.confirm(peer, confirms, ())
        confirms.clear()
        res = svc._attempt(peer, a)
    return res


def _confirm_after(leasing: Leasing, peer: Peer, confirms: list[int]) -> None:
    """Apply an answered acquire's confirms; unknown and refused ones are logged, as for any acquire's. A
    failure here is a bug: logged, never a second answer to the acquire."""
    if not confirms:
        return
    try:
        leasing.confirm(peer, confirms, ())
    except Exception:
        logger.exception("[controller] the confirms an answered acquire carried failed peer=%s leases=%d",
                         peer.name, len(confirms))
