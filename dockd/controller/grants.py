"""Acquires on the wire: a get's try (a lease granted, journaled ahead, its expiry timed), a
rank-aware get's share (a round to balance weighed in the background), the reply (with the
columns the co-hosted warehouse holds inline), and the staleness of what is handed out."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.controller import selection
from dockd.controller.clock import Timers
from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.controller.lease_table import AcquireResult
from dockd.controller.membership import Membership
from dockd.controller.pacing import Pacer
from dockd.controller.partition import VERSION_TAG
from dockd.controller.replica_service import Replication
from dockd.controller.rounds import Round
from dockd.controller.sessions import Leasing
from dockd.controller.waiters import Waiters
from dockd.controller.warehouse_calls import LocalWarehouse, WarehouseCalls
from dockd.errors import DockDataLost, DockStateFull, DockValueError
from dockd.net import wire
from dockd.net.peer import Peer

logger = logging.getLogger(__name__)

#: Upper bounds of the staleness histogram's buckets (trainer version minus a handed-out sample's version).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


PACKED_MIN = 32
"""A reply of more locations than this appends them, and its inline columns, serialized apart (fewer:
setting them in the frame costs less)."""
_ACQUIRE_REPLY = pb.Frame.DESCRIPTOR.fields_by_name["acquire_reply"].number
_LOCATIONS = pb.AcquireReply.DESCRIPTOR.fields_by_name["locations"].number
_INLINE = pb.AcquireReply.DESCRIPTOR.fields_by_name["inline"].number


def _tail(infos: bytes, parts: list[bytes]) -> bytes:
    """What follows an acquire reply's frame: the warehouses' infos and the reply's fields serialized apart."""
    return infos + wire.field(_ACQUIRE_REPLY, b"".join(parts)) if parts else infos


def where_of(r) -> dict[str, tuple[int, int]] | None:
    where = r.where[:]  # ([:]: see dockd.net.wire)
    return {t.name: (t.lo, t.hi) for t in where} if where else None


def _lease_seconds(seconds: float) -> float | None:
    return min(seconds, 7 * 86400.0) if seconds > 0 else None


class Acquiring:
    """The gets of one controller: leases granted to `leasing`'s sessions and journaled in `journal`
    (None: none kept), the gets `waiting` on a balanced round failed or woken once it is weighed
    (columns measured by the warehouses: `calls`), puts `pacer` holds let in by what is handed out,
    and the reply: locations (read from replicas where their home is away: `replication`), the
    warehouses' addresses (`members`), columns the warehouse in this process (`local`) holds inline."""

    def __init__(self, core: Controller, journal: Journal | None, timers: Timers, *, leasing: Leasing,
                 waiting: Waiters, pacer: Pacer, calls: WarehouseCalls, replication: Replication,
                 members: Membership, local: LocalWarehouse | None) -> None:
        self.core = core
        self.journal = journal
        self.timers = timers
        self.leasing = leasing
        self.waiting = waiting
        self.pacer = pacer
        self.calls = calls
        self.replication = replication
        self.members = members
        self.local = local
        # per bucket of STALENESS_BUCKETS (and past the last), samples handed out; their sum
        self.staleness_counts = [0] * (len(STALENESS_BUCKETS) + 1)
        self.staleness_sum = 0

    def attempt(self, peer: Peer, r: pb.AcquireRequest, a: limits.Acquire | None = None) -> AcquireResult | None:
        """Try a get once: what it gets, or None to wait. `a`: its fields, where they were read already."""
        core = self.core
        sid = self.leasing.session(peer)
        if a is None:
            a = limits.Acquire(r)
        if a.dp_size:
            return self._share(r, sid)
        token, partition = a.token, a.partition
        again = core.leases.get(core.lease_tokens.get(token, 0)) if token else None
        if again is not None and again.owner not in (sid, b""):
            again = None  # another client's token: no replay for it (tokens are random, so this is an attack)
            r.token = a.token = token = 0
        if again is None and self.journal is not None:
            self.journal.room()
        near, staleness = a.near, a.max_staleness
        res = core.acquire(
            partition, a.consumer, a.columns, a.count,
            groups=a.groups, allow_partial=a.allow_partial, shuffle=a.shuffle,
            seed=r.seed if a.shuffle and r.has_seed else None, owner=sid, now=self.timers.clock(), token=token,
            lease_timeout=_lease_seconds(a.lease_seconds), where=where_of(a), order_by=a.order_by,
            near=near - 1 if near else None, max_staleness=staleness - 1 if staleness else None,
        )
        if again is not None:  # the client that retried holds it (a lease restored from the journal may have had none)
            for lease in core.book.batch(again):
                lease.owner = sid
        elif res is not None:
            self._handed_out(partition, res.indexes)
            per = a.per_lease
            if per and a.groups:  # (whole groups in each lease)
                gs = core.partitions[partition].group_size
                per = max(gs, per // gs * gs)
            self._grant(res, per)
        return res

    def _grant(self, res: AcquireResult, per_lease: int) -> None:
        """A lease just granted: cut into leases of `per_lease` samples (a client taking several gets'
        worth at once), journaled ahead of the answer (one record for them all), and its expiry timed."""
        core = self.core
        lease = core.leases[res.lease]
        res.seconds = lease.deadline - self.timers.clock()
        granted = lease.indexes  # (the split leases hold slices of it, in order)
        leases = core.book.split(res.lease, per_lease) if per_lease else [lease]
        if len(leases) > 1:
            res.leases = [l.id for l in leases]
        if self.journal is not None:
            try:
                if len(leases) == 1:
                    self.journal.grant(lease, res.seconds)
                else:
                    self.journal.grants(leases, granted, res.seconds, per_lease)
            except DockStateFull:
                for l in leases:
                    core.release(l.id)  # not recorded: not granted
                raise
        self.leasing.schedule_expiry()

    def near_ready(self, r: pb.AcquireRequest) -> dict[int, int]:
        """Warehouse id -> samples ready for get `r` with all its columns there (staleness bound and
        where applied): how Waiters.wake finds the waiting gets it can serve from their own node."""
        part = self.core.partitions.get(r.partition)
        if part is None or len(part.nbytes) < 2:  # (data on one warehouse: nothing to prefer)
            return {}
        v = selection.view(part, r.consumer, r.columns[:], r.count, r.groups)
        if v is None:
            return {}
        where, _ = selection.staleness_filter(part, r.max_staleness - 1 if r.max_staleness else None, where_of(r),
                                              r.order_by)
        return selection.ready_by_warehouse(part, v[2], v[3], r.columns[:], where)

    def _share(self, r: pb.AcquireRequest, sid: bytes) -> AcquireResult | None:
        """A rank-aware get (see Controller.share); a round to balance is weighed in the background."""
        if r.shuffle or r.allow_partial:
            raise DockValueError("a rank-aware get (dp_size or mp_group) hands out `count` samples per rank in order; "
                                 "shuffle and allow_partial do not apply (order_by and where do; a sealed partition "
                                 "ends with a smaller last step)")
        for name in r.balance_by:
            if name not in r.columns and not self._is_tag(r.partition, name):
                raise DockValueError(f"balance_by={name!r} is neither a tag of partition {r.partition!r} nor one of "
                                     f"the columns this get reads ({r.columns[:]})")
        if self.journal is not None:
            self.journal.room()
        res = self.core.share(
            r.partition, r.consumer, r.columns[:], r.count, dp_rank=r.dp_rank, dp_size=r.dp_size,
            mp_rank=r.mp_rank, mp_size=r.mp_size or 1, mp_group=r.mp_group, step=r.step if r.has_step else None,
            groups=r.groups, where=where_of(r), order_by=r.order_by, balance=bool(r.balance_by), owner=sid,
            now=self.timers.clock(), lease_timeout=_lease_seconds(r.lease_seconds),
            max_staleness=r.max_staleness - 1 if r.max_staleness else None,
        )
        if res is not None and not isinstance(res, Round) and res.lease:
            self._handed_out(r.partition, res.indexes)
        if isinstance(res, Round):
            asyncio.ensure_future(self._weigh(res, list(r.balance_by)))
            res = None
        self.journal_shares()
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
        if partition in self.pacer.paced:
            self.pacer.soon(partition)

    def _is_tag(self, partition: str, name: str) -> bool:
        part = self.core.partitions.get(partition)
        return part is not None and name in part.tags

    def journal_shares(self) -> None:
        """Record the shares made and given back since the last call. Shares whose grant cannot be
        recorded go back to the pool (as if they expired at once) and DockStateFull is raised."""
        shares, dropped = self.core.ranks.take_journal()
        if self.journal is not None:
            for lid in dropped:
                self.journal.release(lid, applied=True)
            now = self.timers.clock()
            for k, lease in enumerate(shares):
                try:
                    self.journal.grant(lease, lease.deadline - now)
                except DockStateFull:
                    for gone in shares[k:]:
                        self.core.release(gone.id)  # not recorded: not granted
                    raise
        if shares:
            self.leasing.schedule_expiry()

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
                    weights += await self.calls.measure(part, name, idx)
            if not np.isfinite(weights).all() or (weights < 0).any():
                raise DockValueError(f"balance_by={names} gave negative or non-finite weights; balance by "
                                     "non-negative numbers (lengths, token counts)")
            self.core.split_round(rnd, weights)
            self.journal_shares()
        except Exception as e:  # noqa: BLE001 - reported to the gets that wait for this round
            self.core.drop_round(rnd)
            logger.warning("[controller] balanced round failed partition=%s error=%s", rnd.partition, e)
            _, consumer, cols, groups, dp_size, *_ = rnd.key
            self.waiting.fail(rnd.partition, e, lambda a: a.consumer == consumer and a.dp_size == dp_size
                             and tuple(sorted(a.columns)) == cols)
        self.waiting.wake(rnd.partition)

    def reply(self, peer: Peer, frame: pb.Frame, r: pb.AcquireRequest, res: AcquireResult,
              a: limits.Acquire | None = None) -> None:
        """Answer get `r` (`a`: its fields, where they were read already) with what it got."""
        if a is None:
            a = limits.Acquire(r)
        partition, columns = a.partition, a.columns
        if self.replication.replicas > 1 and len(res.indexes):  # (values whose warehouse is away: from their replica)
            res.locations = self.replication.readable(partition, columns, res.indexes, res.locations)
        flat = res.locations.ravel()
        out = pb.Frame()
        reply = out.acquire_reply  # filled in place: building a message and wrapping it would copy it
        reply.lease = res.lease  # (fields left at their defaults are not set: a small get's reply is set field by field)
        if res.leases:
            reply.leases.extend(res.leases)
            first = self.core.leases.get(res.lease)  # (whole, as all but the last: the client cuts the reply so)
            if first is not None:
                reply.per_lease = len(first.indexes)
        reply.lease_seconds = res.seconds
        if res.lease:
            reply.ticket = self.leasing.ticket(res.lease)
        if res.step:
            reply.step = res.step
        if res.weights:
            reply.rank_weights.extend(res.weights)
        reply.indexes.extend(res.indexes.tolist())
        # a big reply's fields serialized apart, appended to the frame as the warehouses' infos are (see
        # acquire_infos and wire.field): its locations packed, its inline columns
        parts: list[bytes] = []
        big = len(flat) > PACKED_MIN
        lo, hi = (int(flat.min()), int(flat.max())) if big else (0, 0)
        if big and hi < 128:  # (one byte each)
            infos = self.members.acquire_infos([lo] if lo == hi else np.unique(flat).tolist())
            parts.append(wire.field(_LOCATIONS, flat.astype(np.uint8).tobytes()))
        else:
            locs = flat.tolist()
            reply.locations.extend(locs)
            infos = self.members.acquire_infos(sorted(set(locs)))
        part = self.core.partitions.get(partition)
        if part is not None and part.recovered:
            reply.recovered = True
        if a.inline and self.local is not None:
            cols, body, segs, shared = self.local.inline(peer, partition, columns, res.indexes, res.locations,
                                                        a.device)
            if big:
                parts += [wire.field(_INLINE, c.SerializeToString()) for c in cols]
            elif cols:
                reply.inline.extend(cols)
            if shared:
                reply.device_buffers.extend(shared)
            if segs:
                out.pins.extend(s.sid for s in segs)
            peer.reply(frame, out, body.buffers, body.size, segs, tail=_tail(infos, parts))
            return
        peer.reply(frame, out, tail=_tail(infos, parts))
