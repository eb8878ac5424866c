"""Rank-aware gets: the dp_size data-parallel ranks of one step share one global batch of
count * dp_size samples, chosen when the first of them asks, held under one lease, then split
into one share (lease) per rank, balanced by sample weights when asked (`dockd.balance`). A
share is confirmed once each of the mp_size model-parallel ranks reading it has confirmed it."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dockd.controller import selection, warehouses
from dockd.controller.catalog import Catalog
from dockd.controller.lease_table import AcquireResult, Lease, LeaseTable, RoundKey
from dockd.controller.partition import TAKEN, _Partition
from dockd.errors import DockDrained, DockValueError

ROUNDS_KEPT = 256  # per (partition, consumer, columns, ranks): finished rounds remembered for late ranks
_NO_SAMPLES = np.empty(0, dtype=np.int64)


@dataclasses.dataclass(slots=True, eq=False)
class Round:
    """One step of a rank-aware get: a global batch split into one share per data-parallel rank."""

    key: RoundKey     # (partition, consumer, columns, groups, dp_size, mp_size, mp_group)
    step: int
    indexes: np.ndarray  # the round's samples, before the split (in hand-out order)
    hold: int         # the lease holding them until the split (0 once split)
    shares: list[int] = dataclasses.field(default_factory=list)  # per rank: its lease (0: expired, or none)
    share_idx: list[np.ndarray] = dataclasses.field(default_factory=list)
    done: list[bool] = dataclasses.field(default_factory=list)   # per rank: confirmed by all its readers
    weights: list[float] = dataclasses.field(default_factory=list)  # per rank: sum of balance weights

    @property
    def partition(self) -> str:
        return self.key[0]


class Leaser(Protocol):
    """How rounds lease samples and give them back: `core.Controller`'s grant and release, which keep the
    consumer's side of a lease (its samples' state) with the book's."""

    lease_timeout: float

    def grant(self, lease_id: int, partition: str, consumer: str, indexes: np.ndarray, *, owner: bytes = b"",
              deadline: float, token: int = 0, in_order: bool = False) -> Lease: ...

    def release(self, lease_id: int) -> Lease | None: ...


class Rounds:
    """The rounds of a controller's rank-aware gets: by key and step; per (key, dp rank, mp rank)
    the first step it has not confirmed; per key the newest step forgotten (older ones cannot be
    asked for again). `new_shares` and `dropped_shares` collect the shares made and given back
    since the service last took them (to journal)."""

    def __init__(self, catalog: Catalog, book: LeaseTable, leaser: Leaser) -> None:
        self.catalog = catalog
        self.book = book
        self.leaser = leaser
        self.rounds: dict[RoundKey, collections.OrderedDict[int, Round]] = {}
        self.next_step: dict[tuple[RoundKey, int, int], int] = {}  # (key, dp rank, mp rank) -> step
        self.forgotten: dict[RoundKey, int] = {}
        self.new_shares: list[Lease] = []
        self.dropped_shares: list[int] = []

    def share(self, partition: str, consumer: str, columns: Sequence[str], count: int, *, dp_rank: int,
              dp_size: int, mp_rank: int, mp_size: int, mp_group: int, step: int | None, groups: bool,
              where: selection.Where | None, order_by: str, balance: bool, owner: bytes, now: float,
              lease_timeout: float | None, max_staleness: int | None) -> AcquireResult | Round | None:
        """See Controller.share."""
        selection.check_request(partition, consumer, columns, count)
        if not 0 <= dp_rank < dp_size or not 0 <= mp_rank < mp_size or mp_size > 64:
            raise DockValueError(f"need 0 <= dp_rank < dp_size and 0 <= mp_rank < mp_size <= 64, got dp_rank={dp_rank}, "
                                 f"dp_size={dp_size}, mp_rank={mp_rank}, mp_size={mp_size}")
        key: RoundKey = (partition, consumer, tuple(sorted(columns)), groups, dp_size, mp_size, mp_group)
        if step is None:
            step = self.next_step.get((key, dp_rank, mp_rank), 0)
        elif step <= self.forgotten.get(key, -1):
            raise DockValueError(f"step {step} of this rank-aware get is finished and no longer remembered "
                                 f"(steps up to {self.forgotten[key]} are); ask for a later step")
        part = self.catalog.partitions.get(partition)
        if part is None:
            return None
        where, order_by = selection.staleness_filter(part, max_staleness, where, order_by)
        rounds = self.rounds.get(key)
        rnd = rounds.get(step) if rounds is not None else None
        if rnd is None:
            rnd = self._form(part, key, step, columns, count, now=now, lease_timeout=lease_timeout,
                             where=where, order_by=order_by)
            if rnd is None:
                return None
            if balance:
                return rnd
            self.split(rnd, None)
        if rnd.hold:
            return None  # another rank formed it and it is being weighed
        cons = part.consumer(consumer)
        if rnd.done[dp_rank]:  # all its readers confirmed it: a late reader sees it again, nothing to confirm
            idx = rnd.share_idx[dp_rank]
            return AcquireResult(0, idx, part.locations(columns, idx), step, rnd.weights)
        lease = self.book.leases.get(rnd.shares[dp_rank])
        if lease is None:  # expired before all its readers confirmed: a fresh share, from the pool
            view = selection.view(part, consumer, columns, count, groups)
            if view is None:
                return None
            mask, _, sub, gs = view
            picked = selection.pick(part, consumer, mask, sub, count // gs, gs, columns, where=where,
                                    order_by=order_by)
            if picked is None and self._reclaim_later(key, step, dp_rank):
                picked = selection.pick(part, consumer, mask, sub, count // gs, gs, columns, where=where,
                                        order_by=order_by)
            if picked is None:
                return None
            lease = self.leaser.grant(self.book.new_id(), partition, consumer, picked,
                                      deadline=now + (lease_timeout or self.leaser.lease_timeout),
                                      in_order=lease_timeout is None)
            self._make_share(lease, rnd, dp_rank)
        if lease.holders is not None and owner and owner not in lease.holders:
            if not lease.holders:  # its first reader: the share's lease runs from now (it may be a late rank)
                deadline = now + (lease_timeout or self.leaser.lease_timeout)
                if deadline > lease.deadline:
                    self.book.extend(lease.id, deadline)
            lease.holders[owner] = mp_rank
        idx = lease.indexes
        locs = part.locations(columns, idx)
        if self.catalog.dead_warehouses:
            warehouses.check_lost(self.catalog, part, cons, columns, idx, locs)
        return AcquireResult(lease.id, idx, locs, step, rnd.weights)

    def _reclaim_later(self, key: RoundKey, step: int, rank: int) -> bool:
        """Give back this rank's unclaimed shares of later steps (other ranks ran ahead and formed
        them), so that its replacement share of `step` can be made from them instead of waiting
        for them to expire; those steps make the rank a fresh share when it gets there."""
        freed = False
        for st, rnd in self.rounds.get(key, {}).items():
            if st <= step or rnd.hold or not rnd.shares:
                continue
            lease = self.book.leases.get(rnd.shares[rank])
            if lease is not None and not lease.holders and not lease.confirmed:
                self.leaser.release(lease.id)
                self.dropped_shares.append(lease.id)
                freed = True
        return freed

    def _form(self, part: _Partition, key: RoundKey, step: int, columns: Sequence[str], count: int, *, now: float,
              lease_timeout: float | None, where: selection.Where | None, order_by: str) -> Round | None:
        _, consumer, _, groups, dp_size, *_ = key
        view = selection.view(part, consumer, columns, count, groups)
        if view is None:
            return None
        mask, cons, sub, gs = view
        want = count // gs * dp_size
        units, have = selection.choose(part, sub, want, gs, where=where, order_by=order_by)
        if have < want:
            if not selection.drained(part, cons, mask, where):
                return None
            units = units[: have // dp_size * dp_size]  # the end of a sealed partition: equal shares of what is left
            if not len(units):
                raise DockDrained(f"partition {part.name!r} is sealed and has fewer than {dp_size} "
                                  f"{'groups' if groups else 'samples'} left for consumer {consumer!r}: one each for "
                                  f"{dp_size} ranks")
        idx = (units[:, None] * gs + np.arange(gs)).ravel() if groups else units
        if self.catalog.dead_warehouses:
            warehouses.check_lost(self.catalog, part, cons, columns, idx, part.locations(columns, idx))
        hold = self.leaser.grant(self.book.new_id(), part.name, consumer, idx,
                                 deadline=now + (lease_timeout or self.leaser.lease_timeout),
                                 in_order=lease_timeout is None)
        rnd = Round(key, step, idx, hold.id)
        hold.round = (key, step, -1)
        rounds = self.rounds.setdefault(key, collections.OrderedDict())
        rounds[step] = rnd
        while len(rounds) > ROUNDS_KEPT:
            old, gone = rounds.popitem(last=False)
            self.forgotten[key] = max(self.forgotten.get(key, -1), old)
            for lid in gone.shares:
                lease = self.book.leases.get(lid)
                if lease is not None:
                    lease.round = None
        return rnd

    def split(self, rnd: Round, weights: np.ndarray | None) -> bool:
        """See Controller.split_round."""
        book = self.book
        hold = book.leases.get(rnd.hold)
        if hold is None:
            return False
        in_order = book.in_order(rnd.hold)
        book.pop(rnd.hold)
        key = rnd.key
        _, consumer, _, groups, dp_size, mp_size, *_ = key
        part = self.catalog.partitions[key[0]]
        gs = part.group_size if groups else 1
        n = len(rnd.indexes)
        if weights is None:
            units = np.arange(n // gs, dtype=np.int64)
            parts = [(u[:, None] * gs + np.arange(gs)).ravel() for u in np.array_split(units, dp_size)]
        else:
            from dockd.balance import balance

            w = np.asarray(weights, dtype=np.float64)
            parts = balance(w, dp_size, group_size=gs)
            rnd.weights = [float(w[p].sum()) for p in parts]
        # (a share each: _make_share fills shares and share_idx below)
        rnd.shares, rnd.share_idx, rnd.done = [0] * dp_size, [_NO_SAMPLES] * dp_size, [False] * dp_size
        for r, pos in enumerate(parts):
            lease = Lease(book.new_id(), part.name, consumer, rnd.indexes[pos], b"", hold.deadline)
            # (a weighed round's shares expire a few ms late at most: the FIFO stays ordered enough)
            book.add(lease, in_order=in_order)
            self._make_share(lease, rnd, r)
        rnd.hold = 0
        return True

    def _make_share(self, lease: Lease, rnd: Round, rank: int) -> None:
        lease.round, lease.holders, lease.need = (rnd.key, rnd.step, rank), {}, rnd.key[5]
        rnd.shares[rank], rnd.share_idx[rank] = lease.id, lease.indexes
        self.new_shares.append(lease)

    def drop(self, rnd: Round) -> None:
        """Give up a round that could not be weighed: its samples go back to the pool."""
        rounds = self.rounds.get(rnd.key)
        if rounds is not None and rounds.get(rnd.step) is rnd:
            del rounds[rnd.step]
        if rnd.hold:
            self.leaser.release(rnd.hold)

    def advance(self, lease: Lease, member: int) -> None:
        """A reader of a share confirmed it: its next default step is the one after."""
        if lease.round is None:  # its round was forgotten (ROUNDS_KEPT newer ones): no step to advance
            return
        key, step, rank = lease.round
        k = (key, rank, member)
        self.next_step[k] = max(self.next_step.get(k, 0), step + 1)

    def share_ended(self, lease: Lease, state: int) -> None:
        assert lease.round is not None  # (the controller calls this for a share's lease only)
        key, step, rank = lease.round
        rounds = self.rounds.get(key)
        rnd = rounds.get(step) if rounds is not None else None
        if rnd is None:
            return
        if rank < 0:  # the hold of a round not split yet: the round is void, its samples are back
            if rnd.hold == lease.id:
                del self.rounds[key][step]
            return
        if state == TAKEN and rnd.shares[rank] == lease.id:
            rnd.done[rank] = True
            for m in range(lease.need):
                if not lease.confirmed >> m & 1:
                    self.advance(lease, m)

    def forget_partition(self, partition: str, consumer: str | None = None) -> None:
        """Forget the rounds of a partition (given `consumer`: of that consumer only)."""
        def mine(key: RoundKey) -> bool:
            return key[0] == partition and (consumer is None or key[1] == consumer)

        for key in [k for k in self.rounds if mine(k)]:
            del self.rounds[key]
        for key in [k for k in self.forgotten if mine(k)]:
            del self.forgotten[key]
        for k in [k for k in self.next_step if mine(k[0])]:
            del self.next_step[k]

    def take_journal(self) -> tuple[list[Lease], list[int]]:
        """The shares made and given back since the last call."""
        shares, self.new_shares = self.new_shares, []
        dropped, self.dropped_shares = self.dropped_shares, []
        return shares, dropped
