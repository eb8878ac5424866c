"""Leases and their expiry: which samples are leased to whom until when, found by id and by
the acquire's retry token, in deadline order. The samples' side of a lease (the consumer's
state per sample) is the controller's; this is the book of leases."""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Callable

import numpy as np

from dockd import ids

_CLEARED_KEPT = 1 << 16  # ids of leases ended by a clear, remembered for their late confirms
_TAKEN_KEPT = 1 << 16  # ids of leases ended by their confirm, remembered for a re-sent one

RoundKey = tuple[str, str, tuple[str, ...], bool, int, int, int]
"""A rank-aware get's rounds: (partition, consumer, columns, groups, dp_size, mp_size, mp_group)."""


@dataclasses.dataclass(slots=True)
class Lease:
    id: int          # random: a lease id cannot be guessed
    partition: str
    consumer: str
    indexes: np.ndarray
    owner: bytes     # the session of the client that took it (b"": none, e.g. handed on or restored)
    deadline: float
    token: int = 0   # the acquire's retry token (0: none)
    # a rank-aware get's share: (round key, step, dp rank; -1 for the lease holding a round before
    # its split), the sessions reading it -> their model-parallel rank, and which of the `need`
    # model-parallel ranks confirmed it (a bit each)
    round: tuple[RoundKey, int, int] | None = None
    holders: dict[bytes, int] | None = None
    need: int = 1
    confirmed: int = 0
    rest: tuple[int, ...] = ()  # a lease split from one grant (its first): the ids of the others, in order


@dataclasses.dataclass(slots=True)
class AcquireResult:
    """What an acquire hands out: its lease (0: none to confirm), the samples, where their columns live."""

    lease: int
    indexes: np.ndarray
    locations: np.ndarray  # uint16, shape (len(columns), len(indexes))
    step: int = 0          # rank-aware gets: the step this share belongs to
    weights: list[float] = dataclasses.field(default_factory=list)  # ... and each rank's sum of balance weights
    leases: list[int] = dataclasses.field(default_factory=list)  # per_lease: every lease, in order of `indexes`
    seconds: float = 0.0   # seconds the lease(s) had left when granted (0: not said)


class LeaseTable:
    """The leases outstanding, by id; `tokens` maps an acquire's retry token to its lease, and
    `cleared` remembers leases that ended with their partition (a late confirm of one is no news),
    `taken` those their confirm ended (a confirm re-sent after a reconnect, when the first was
    applied but its answer lost, is no news either: its samples were not handed out again).

    Expiry order. Leases with the default timeout expire in grant order (one timeout, a monotonic
    clock), so they sit in a FIFO that a confirm leaves in O(1); leases with a deadline of their
    own (lease_timeout=, extend, restored) sit in a heap, stale entries skipped when they surface.
    Keeping every lease in a heap left a stale entry per confirmed lease for a whole timeout:
    ~10^5 tuples for the collector to walk.
    """

    def __init__(self, lease_ids: Callable[[], int] | None = None) -> None:
        self.leases: dict[int, Lease] = {}
        self.tokens: dict[int, int] = {}  # acquire token -> outstanding lease id
        self.cleared: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.taken: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.lease_ids = lease_ids or (lambda: ids.random_bits(62) + 1)
        self._fifo: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._deadlines: list[tuple[float, int]] = []

    def new_id(self) -> int:
        lease_id = self.lease_ids()
        while lease_id in self.leases:
            lease_id = self.lease_ids()
        return lease_id

    def add(self, lease: Lease, *, in_order: bool = False) -> None:
        """in_order: its deadline is now + the default timeout, so no earlier lease expires later."""
        self.leases[lease.id] = lease
        if in_order:
            self._fifo[lease.id] = None
        else:
            self._push_deadline(lease)
        if lease.token:
            self.tokens[lease.token] = lease.id

    def split(self, lease_id: int, per: int, ids: list[int] | None = None) -> list[Lease]:
        """Cut a lease just granted into leases of `per` samples each, in order (the last may hold
        fewer): the first keeps its id and token and names the others (`rest`), which get new ids
        (`ids`: these, a journal's replay) and the same owner and deadline. One slice per new lease;
        the samples' state does not change (all are leased)."""
        first = self.leases[lease_id]
        idx = first.indexes
        if len(idx) <= per:
            return [first]
        in_order = lease_id in self._fifo
        first.indexes = idx[:per].copy()
        out = [first]
        for k, at in enumerate(range(per, len(idx), per)):
            lease = Lease(self.new_id() if ids is None else ids[k], first.partition, first.consumer,
                          idx[at:at + per].copy(), first.owner, first.deadline)
            self.add(lease, in_order=in_order)
            out.append(lease)
        first.rest = tuple(lease.id for lease in out[1:])
        return out

    def batch(self, first: Lease) -> list[Lease]:
        """A lease and those split from the same grant still outstanding (see `split`), in order."""
        if not first.rest:
            return [first]
        leases = self.leases
        return [first, *(leases[lid] for lid in first.rest if lid in leases)]

    def in_order(self, lease_id: int) -> bool:
        return lease_id in self._fifo

    def pop(self, lease_id: int) -> Lease | None:
        """Take a lease out of the book (it ended); None if it is not there."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        self._fifo.pop(lease_id, None)
        if lease.token:
            self.tokens.pop(lease.token, None)
        return lease

    def confirmed(self, lease_id: int) -> None:
        """A lease ended by its confirm: remembered as taken."""
        self.taken[lease_id] = None
        if len(self.taken) > _TAKEN_KEPT:
            self.taken.popitem(last=False)

    def forget(self, lease: Lease) -> None:
        """A lease ended with its partition (a clear): out of the book, remembered as cleared."""
        self.pop(lease.id)
        self.cleared[lease.id] = None
        while len(self.cleared) > _CLEARED_KEPT:
            self.cleared.popitem(last=False)

    def extend(self, lease_id: int, deadline: float) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.deadline = deadline
            self._fifo.pop(lease_id, None)
            self._push_deadline(lease)
        return lease

    def _push_deadline(self, lease: Lease) -> None:
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))
        if len(self._deadlines) > 2 * (len(self.leases) - len(self._fifo)) + 1024:  # mostly stale: rebuild
            self._deadlines = [(l.deadline, l.id) for l in self.leases.values() if l.id not in self._fifo]
            heapq.heapify(self._deadlines)

    def _heap_top(self) -> tuple[float, int] | None:
        while self._deadlines:
            deadline, lid = self._deadlines[0]
            lease = self.leases.get(lid)
            if lease is not None and lease.deadline == deadline and lid not in self._fifo:
                return deadline, lid
            heapq.heappop(self._deadlines)  # stale: the lease ended or was extended
        return None

    def due(self, now: float) -> int | None:
        """A lease whose deadline passed (those of the FIFO first, in order), or None."""
        if self._fifo:
            lid = next(iter(self._fifo))
            if self.leases[lid].deadline <= now:
                return lid
        top = self._heap_top()
        return top[1] if top is not None and top[0] <= now else None

    def next_deadline(self) -> float | None:
        top = self._heap_top()
        first = self.leases[next(iter(self._fifo))].deadline if self._fifo else None
        if top is None:
            return first
        return top[0] if first is None else min(first, top[0])
