"""Metadata controller: which samples exist, which columns are ready, where they live,
which consumer has taken them. Pure Python + numpy, no I/O, no clocks of its own.

Per partition the controller keeps flat numpy arrays indexed by sample index:

    ready      uint64   one bit per column (up to 64 columns per partition)
    loc[col]   uint16   warehouse id holding that column of the sample
    state[c]   uint8    per consumer: FREE, LEASED, TAKEN or LOST

    gone       bool     deleted (by delete or retirement): never handed out again
    tags[name] int64    per-sample integer tags (e.g. a rollout's age)

and, per consumer and requested column set (a *subscription*), an `_Eligible`
bitmap of the samples (or whole groups) that request could take right now,
with a count per block of 1024. An acquire walks the non-empty blocks in
order, so its cost grows with the batch size and n/1024, not with the
partition (at 10^6 samples that is under a thousand counters to skip).
Eligibility is kept exact on every commit, lease, confirm and release, so the
number of ready samples is always known without a scan. A get that filters
or orders by tags scans the eligible bitmap instead (O(n)).

Rank-aware gets form *rounds*: the dp_size data-parallel ranks of one step
share one global batch of count * dp_size samples, chosen when the first of
them asks, held under one lease, then split into one share (lease) per rank,
balanced by sample weights when asked (`dockd.balance`). A share is confirmed
once each of the mp_size model-parallel ranks reading it has confirmed it.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from dockd import limits
from dockd.errors import DockDataLost, DockDrained, DockFull, DockNotFound, DockValueError

_CLEARED_KEPT = 1 << 16  # ids of leases ended by a clear, remembered for their late confirms

logger = logging.getLogger(__name__)

FREE, LEASED, TAKEN, LOST = 0, 1, 2, 3
NO_WAREHOUSE = 0xFFFF
LOST_WAREHOUSE = 0xFFFE  # a (sample, column) whose warehouse rejoined without it
MAX_COLUMNS = 64
MAX_TAGS = 16
VERSION_TAG = "version"  # the reserved tag holding each sample's policy version (put(version=...))
INT64_MAX = (1 << 63) - 1
ROUNDS_KEPT = 256  # per (partition, consumer, columns, ranks): finished rounds remembered for late ranks
PUT_KEYS_KEPT = 4096  # per warehouse: recent commits remembered so a re-sent one is applied once
_BLOCK_SHIFT = 10


class _Eligible:
    """A bitmap of units (samples or groups) with a population count per block."""

    __slots__ = ("bits", "blocks", "total")

    def __init__(self, capacity: int) -> None:
        self.bits = np.zeros(capacity, dtype=bool)
        self.blocks = np.zeros((capacity >> _BLOCK_SHIFT) + 1, dtype=np.int64)
        self.total = 0

    def grow(self, capacity: int) -> None:
        if capacity <= len(self.bits):
            return
        bits = np.zeros(capacity, dtype=bool)
        bits[: len(self.bits)] = self.bits
        blocks = np.zeros((capacity >> _BLOCK_SHIFT) + 1, dtype=np.int64)
        blocks[: len(self.blocks)] = self.blocks
        self.bits, self.blocks = bits, blocks

    def _count(self, units: np.ndarray, delta: int) -> None:
        if len(units) <= 8:  # np.add.at costs more than a few scalar updates
            for b in (units >> _BLOCK_SHIFT).tolist():
                self.blocks[b] += delta
        else:
            np.add.at(self.blocks, units >> _BLOCK_SHIFT, delta)
        self.total += delta * len(units)

    def set(self, units: np.ndarray) -> None:
        new = units[~self.bits[units]]
        if len(new):
            self.bits[new] = True
            self._count(new, 1)

    def clear(self, units: np.ndarray) -> None:
        old = units[self.bits[units]]
        if len(old):
            self.bits[old] = False
            self._count(old, -1)

    def first(self, n: int) -> np.ndarray:
        """The n smallest set units (fewer if fewer are set)."""
        out: list[np.ndarray] = []
        need = n
        if self.total == 0:
            return np.empty(0, dtype=np.int64)
        for b in np.flatnonzero(self.blocks):
            lo = int(b) << _BLOCK_SHIFT
            found = np.flatnonzero(self.bits[lo : lo + (1 << _BLOCK_SHIFT)]) + lo
            out.append(found[:need])
            need -= len(out[-1])
            if need <= 0:
                break
        return out[0] if len(out) == 1 else np.concatenate(out)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n distinct set units drawn uniformly at random, in draw order."""
        n = min(n, self.total)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        ranks = rng.choice(self.total, size=n, replace=False)
        nz = np.flatnonzero(self.blocks)
        cum = np.cumsum(self.blocks[nz])
        which = np.searchsorted(cum, ranks, side="right")
        out = np.empty(n, dtype=np.int64)
        for k, (w, r) in enumerate(zip(which, ranks)):
            lo = int(nz[w]) << _BLOCK_SHIFT
            within = int(r) - (int(cum[w - 1]) if w else 0)
            out[k] = lo + np.flatnonzero(self.bits[lo : lo + (1 << _BLOCK_SHIFT)])[within]
        return out


@dataclasses.dataclass(slots=True)
class _Sub:
    mask: int
    groups: bool
    eligible: _Eligible
    rng: np.random.Generator | None = None


class _Consumer:
    __slots__ = ("state", "subs", "taken", "leased")

    def __init__(self, capacity: int) -> None:
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.subs: dict[tuple[int, bool], _Sub] = {}
        self.taken = 0
        self.leased = 0


class _Partition:
    def __init__(self, name: str, group_size: int) -> None:
        self.name = name
        self.group_size = group_size
        self.size = 0
        self.capacity = 1024
        self.ready = np.zeros(self.capacity, dtype=np.uint64)
        self.columns: dict[str, int] = {}
        self.loc: dict[str, np.ndarray] = {}
        self.consumers: dict[str, _Consumer] = {}
        self.nbytes: dict[int, int] = {}
        self.recovered = False  # rebuilt from warehouse inventories: consumer progress before it is unknown
        self.gone = np.zeros(self.capacity, dtype=bool)
        self.deleted = 0
        self.tags: dict[str, np.ndarray] = {}
        self.sealed = False
        self.retire: tuple[str, ...] = ()
        # asynchronous RL: the trainer's policy version, the staleness gets allow by default (-1: no
        # bound), whether set_version deletes what it makes stale, and how many samples may wait
        # for the partition's consumers before puts of new ones wait (0: no bound)
        self.version = 0
        self.max_staleness = -1
        self.retire_stale = False
        self.max_pending = 0
        self.stale_retired = 0

    # -- layout ---------------------------------------------------------------
    def reserve(self, n: int) -> None:
        need = self.size + n
        if need <= self.capacity:
            return
        cap = self.capacity
        while cap < need:
            cap *= 2
        self.ready = _grown(self.ready, cap)
        self.gone = _grown(self.gone, cap)
        for name, arr in self.tags.items():
            self.tags[name] = _grown(arr, cap)
        for col, arr in self.loc.items():
            self.loc[col] = _grown(arr, cap, fill=NO_WAREHOUSE)
        for cons in self.consumers.values():
            cons.state = _grown(cons.state, cap)
            for sub in cons.subs.values():
                sub.eligible.grow(cap // self.group_size if sub.groups else cap)
        self.capacity = cap

    def ready_for(self, cons: _Consumer) -> int:
        """Samples `cons` could take now: the most of any column set it has asked for."""
        return max((s.eligible.total * (self.group_size if s.groups else 1) for s in cons.subs.values()), default=0)

    def tag(self, name: str, *, create: bool = False) -> np.ndarray:
        arr = self.tags.get(name)
        if arr is None:
            if not create:
                raise DockValueError(f"partition {self.name!r} has no tag {name!r}; its tags: {sorted(self.tags)}")
            if len(self.tags) >= MAX_TAGS:
                raise DockValueError(f"partition {self.name!r} already has {MAX_TAGS} tags; cannot add {name!r}")
            if not isinstance(name, str) or not name.isidentifier():
                raise DockValueError(f"a tag name is an identifier such as 'age', got {name!r}")
            arr = self.tags[name] = np.zeros(self.capacity, dtype=np.int64)
        return arr

    def tag_values(self, name: str, idx: np.ndarray) -> np.ndarray:
        """A tag's values for samples idx; the version tag reads 0 until a put sets one."""
        if name == VERSION_TAG and name not in self.tags:
            return np.zeros(len(idx), dtype=np.int64)
        return self.tag(name)[idx]

    def consumers_of(self) -> list[_Consumer | None]:
        """The consumers pacing and staleness wait for: those named by retire_when_consumed_by
        (None for one that never asked), else every consumer that asked for samples."""
        if self.retire:
            return [self.consumers.get(c) for c in self.retire]
        return list(self.consumers.values())

    def live(self) -> np.ndarray:
        """Per sample: not deleted, and at least one column written."""
        n = self.size
        return ~self.gone[:n] & (self.ready[:n] != 0)

    def waiting_mask(self) -> np.ndarray:
        """Per sample: live and not yet handed out (leased or taken) to every one of its consumers
        (with no consumer yet: every live sample)."""
        n = self.size
        mask = self.live()
        conss = self.consumers_of()
        if conss and all(c is not None for c in conss):
            free = np.zeros(n, dtype=bool)
            for c in conss:
                free |= c.state[:n] == FREE
            mask &= free
        return mask

    def pending(self) -> int:
        """Samples not yet handed to all its consumers: what max_pending bounds."""
        return int(np.count_nonzero(self.waiting_mask())) if self.size else 0

    def stale_mask(self) -> np.ndarray:
        """Per sample: waiting for a consumer but staler than max_staleness allows."""
        n = self.size
        if self.max_staleness < 0 or not n:
            return np.zeros(n, dtype=bool)
        versions = self.tag_values(VERSION_TAG, np.arange(n, dtype=np.int64))
        return self.waiting_mask() & (versions < self.version - self.max_staleness)

    def bit(self, column: str) -> int:
        b = self.columns.get(column)
        if b is None:
            if len(self.columns) >= MAX_COLUMNS:
                raise DockValueError(
                    f"partition {self.name!r} already has {MAX_COLUMNS} columns; "
                    f"cannot add {column!r}. Pack related values into one column or use another partition."
                )
            b = self.columns[column] = len(self.columns)
            self.loc[column] = np.full(self.capacity, NO_WAREHOUSE, dtype=np.uint16)
        return b

    def mask_of(self, columns: Iterable[str]) -> int | None:
        """The bit mask of known columns, or None if any column is unknown."""
        mask = 0
        for c in columns:
            b = self.columns.get(c)
            if b is None:
                return None
            mask |= 1 << b
        return mask

    # -- eligibility ------------------------------------------------------------
    def _sample_ok(self, cons: _Consumer, mask: int, idx: np.ndarray) -> np.ndarray:
        m = np.uint64(mask)
        return ((self.ready[idx] & m) == m) & (cons.state[idx] == FREE)

    def refresh(self, cons: _Consumer, idx: np.ndarray, subs: Iterable[_Sub] | None = None) -> None:
        """Recompute eligibility of samples idx (and their groups) in the given subscriptions."""
        for sub in cons.subs.values() if subs is None else subs:
            if sub.groups:
                gs = self.group_size
                groups = np.unique(idx // gs)
                members = (groups[:, None] * gs + np.arange(gs)).ravel()
                ok = self._sample_ok(cons, sub.mask, members).reshape(len(groups), gs).all(axis=1)
                sub.eligible.set(groups[ok])
                sub.eligible.clear(groups[~ok])
            else:
                ok = self._sample_ok(cons, sub.mask, idx)
                sub.eligible.set(idx[ok])
                sub.eligible.clear(idx[~ok])

    def taken_out(self, cons: _Consumer, idx: np.ndarray) -> None:
        """Samples idx just left the pool of `cons`: no subscription of it may offer them (or their groups)."""
        for sub in cons.subs.values():
            sub.eligible.clear(np.unique(idx // self.group_size) if sub.groups else idx)

    def subscription(self, cons: _Consumer, mask: int, groups: bool) -> _Sub:
        sub = cons.subs.get((mask, groups))
        if sub is None:
            units = self.capacity // self.group_size if groups else self.capacity
            sub = cons.subs[(mask, groups)] = _Sub(mask, groups, _Eligible(units))
            if self.size:
                self.refresh(cons, np.arange(self.size, dtype=np.int64), [sub])
        return sub

    def consumer(self, name: str) -> _Consumer:
        cons = self.consumers.get(name)
        if cons is None:
            if len(self.consumers) >= limits.MAX_CONSUMERS:
                raise DockValueError(
                    f"partition {self.name!r} has {len(self.consumers)} consumers, the most it takes; a consumer is a "
                    "pipeline stage (reference, reward, actor_train), and the workers of one stage share its name")
            cons = self.consumers[name] = _Consumer(self.capacity)
        return cons


def _check_tags(tags: Mapping[str, Sequence[int]], n: int) -> None:
    """Tag values: one for all n samples, or one each."""
    for name, values in tags.items():
        k = len(values)
        if k not in (1, n):
            raise DockValueError(f"tag {name!r} has {k} values for {n} samples; give one value, or one per sample")
        if name == VERSION_TAG and k and min(values) < 0:
            raise DockValueError(f"a policy version is an int >= 0, got {min(values)}")


def _export(p: _Partition) -> dict:
    n = p.size
    return {
        "name": p.name, "group_size": p.group_size, "size": n, "recovered": p.recovered,
        "ready": p.ready[:n].tobytes(), "columns": list(p.columns),
        "loc": [p.loc[c][:n].tobytes() for c in p.columns],
        "nbytes": [[w, b] for w, b in p.nbytes.items()],
        "consumers": [[name, c.state[:n].tobytes(), c.taken] for name, c in p.consumers.items()],
        "gone": p.gone[:n].tobytes(), "deleted": p.deleted, "sealed": p.sealed, "retire": list(p.retire),
        "tags": [[name, arr[:n].tobytes()] for name, arr in p.tags.items()],
        "async": [p.version, p.max_staleness, p.retire_stale, p.max_pending, p.stale_retired],
    }


def _import(d: dict) -> _Partition:
    p = _Partition(d["name"], d["group_size"])
    p.recovered = d["recovered"]
    n = d["size"]
    p.reserve(n)
    p.size = n
    p.ready[:n] = np.frombuffer(d["ready"], dtype=np.uint64)
    for col, raw in zip(d["columns"], d["loc"]):
        p.bit(col)
        p.loc[col][:n] = np.frombuffer(raw, dtype=np.uint16)
    p.nbytes = {w: b for w, b in d["nbytes"]}
    if "gone" in d:
        p.gone[:n] = np.frombuffer(d["gone"], dtype=bool)
        p.deleted, p.sealed, p.retire = d["deleted"], d["sealed"], tuple(d["retire"])
        for name, raw in d["tags"]:
            p.tag(name, create=True)[:n] = np.frombuffer(raw, dtype=np.int64)
    if "async" in d:
        p.version, p.max_staleness, p.retire_stale, p.max_pending, p.stale_retired = d["async"]
    for name, state, taken in d["consumers"]:
        cons = p.consumer(name)
        cons.state[:n] = np.frombuffer(state, dtype=np.uint8)
        cons.state[:n][cons.state[:n] == LEASED] = FREE  # leases are restored by the caller, or end here
        cons.taken = taken
    return p


def _grown(arr: np.ndarray, cap: int, fill: int = 0) -> np.ndarray:
    out = np.full(cap, fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


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
    round: tuple | None = None
    holders: dict[bytes, int] | None = None
    need: int = 1
    confirmed: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class Round:
    """One step of a rank-aware get: a global batch split into one share per data-parallel rank."""

    key: tuple        # (partition, consumer, columns, groups, dp_size, mp_size, mp_group)
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


@dataclasses.dataclass(slots=True)
class Inventory:
    """What a warehouse holds of one partition: sorted sample indexes per column."""

    group_size: int
    nbytes: int
    columns: dict[str, np.ndarray]


@dataclasses.dataclass(slots=True)
class AcquireResult:
    lease: int
    indexes: np.ndarray
    locations: np.ndarray  # uint16, shape (len(columns), len(indexes))
    step: int = 0          # rank-aware gets: the step this share belongs to
    weights: list[float] = dataclasses.field(default_factory=list)  # ... and each rank's sum of balance weights


class Controller:
    """All metadata of one dock. Methods are synchronous and never block.

    Args:
        lease_timeout: seconds an acquired-but-unconfirmed lease lives before
            its samples return to the pool (`expire_leases`).
    """

    def __init__(self, *, lease_timeout: float = 120.0, lease_ids: Callable[[], int] | None = None,
                 max_samples: int = limits.MAX_DOCK_SAMPLES) -> None:
        if lease_timeout <= 0:
            raise DockValueError(f"lease_timeout must be > 0 seconds, got {lease_timeout}")
        self.lease_timeout = lease_timeout
        self.max_samples = max_samples  # samples of all partitions together (their metadata lives here)
        self._samples: int | None = None  # ... how many there are (None: count again)
        self.partitions: dict[str, _Partition] = {}
        self.leases: dict[int, Lease] = {}
        # leases that ended with their partition (clear): a late confirm of one is no news
        self.cleared_leases: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Expiry order. Leases with the default timeout expire in grant order (one timeout, a
        # monotonic clock), so they sit in a FIFO that a confirm leaves in O(1); leases with a
        # deadline of their own (lease_timeout=, extend, restored) sit in a heap, stale entries
        # skipped when they surface. Keeping every lease in a heap left a stale entry per
        # confirmed lease for a whole timeout: ~10^5 tuples for the collector to walk.
        self._fifo: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._deadlines: list[tuple[float, int]] = []
        self._lease_ids = lease_ids or (lambda: secrets.randbits(62) + 1)
        self.lease_tokens: dict[int, int] = {}  # acquire token -> outstanding lease id
        self.dead_warehouses: set[int] = set()
        # per warehouse, put_id -> indexes of its recent commits (a re-sent commit is answered, not re-applied)
        self.put_keys: dict[int, collections.OrderedDict[int, np.ndarray]] = {}
        # rank-aware gets: rounds by key and step; per (key, dp rank, mp rank) the first step it has
        # not confirmed; per key the newest step forgotten (older ones cannot be asked for again)
        self.rounds: dict[tuple, collections.OrderedDict[int, Round]] = {}
        self.next_step: dict[tuple, int] = {}
        self.forgotten: dict[tuple, int] = {}
        # deleted samples whose data a warehouse still holds: partition -> warehouse -> index arrays
        # (the service sends the frees; replaying a journal refills it, and a second free is harmless)
        self.pending_frees: dict[str, dict[int, list[np.ndarray]]] = {}
        self.new_shares: list[Lease] = []  # shares made since the service last took them (to journal)
        self.dropped_shares: list[int] = []  # ... and shares given back to the pool (to journal as released)

    # -- writes -------------------------------------------------------------------
    def commit(
        self,
        partition: str,
        columns: Sequence[str],
        *,
        warehouse: int,
        indexes: Sequence[int] | np.ndarray | None = None,
        new_count: int = 0,
        group_size: int = 1,
        nbytes: int = 0,
        put_id: int = 0,
        tags: Mapping[str, Sequence[int]] | None = None,
    ) -> np.ndarray:
        """Record that `warehouse` now holds `columns` of some samples; returns their indexes.

        With `indexes` None, allocates `new_count` new samples (groups of
        `group_size` consecutive indexes). Otherwise the samples must exist and
        none of `columns` may already be written for them. A commit whose
        (warehouse, put_id) was applied recently is not applied again: the
        indexes it got are returned (a warehouse re-sends commits whose reply it
        lost to a controller restart). `tags`: per-sample integer tags (one value for all, or one each).
        """
        if put_id:
            done = self.put_keys.get(warehouse, {}).get(put_id)
            if done is not None:
                return done
        if tags:
            _check_tags(tags, new_count if indexes is None else len(indexes))
        idx = self._commit(partition, columns, warehouse, indexes, new_count, group_size, nbytes)
        if tags:
            self._set_tags(self.partitions[partition], idx, tags)
        if put_id:
            keys = self.put_keys.setdefault(warehouse, collections.OrderedDict())
            keys[put_id] = idx
            if len(keys) > PUT_KEYS_KEPT:
                keys.popitem(last=False)
        return idx

    def _commit(self, partition, columns, warehouse, indexes, new_count, group_size, nbytes) -> np.ndarray:
        if not partition:
            raise DockValueError("partition must be a non-empty string")
        if not columns:
            raise DockValueError("a put needs at least one column")
        if len(set(columns)) != len(columns):
            raise DockValueError(f"duplicate column names in {list(columns)}")
        part = self.partitions.get(partition)
        if indexes is None:
            part = self._for_new(partition, new_count, group_size)
            bits = [part.bit(c) for c in columns]
            idx = self._allocate(part, new_count)
        else:
            if part is None:
                raise DockNotFound(f"partition {partition!r} does not exist; put new samples first (without indexes)")
            idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
            if len(idx) == 0:
                raise DockValueError("indexes is empty")
            bad = idx[(idx < 0) | (idx >= part.size)]
            if len(bad):
                raise DockNotFound(
                    f"sample indexes {bad[:8].tolist()} do not exist in partition {partition!r} "
                    f"(it holds indexes 0..{part.size - 1})"
                )
            if len(np.unique(idx)) != len(idx):
                raise DockValueError("indexes contain duplicates; each sample can appear once per put")
            if part.deleted:
                gone = idx[part.gone[idx]]
                if len(gone):
                    raise DockNotFound(f"samples {gone[:8].tolist()} of partition {partition!r} were deleted")
            bits = [part.bit(c) for c in columns]
            for c, b in zip(columns, bits):
                dup = idx[(part.ready[idx] >> np.uint64(b)) & np.uint64(1) == 1]
                if len(dup):
                    raise DockValueError(
                        f"column {c!r} is already written for samples {dup[:8].tolist()} of partition "
                        f"{partition!r}; a sample's column is written once"
                    )
        newbits = 0
        for c, b in zip(columns, bits):
            newbits |= 1 << b
            part.loc[c][idx] = warehouse
        part.ready[idx] |= np.uint64(newbits)
        part.nbytes[warehouse] = part.nbytes.get(warehouse, 0) + nbytes
        for cons in part.consumers.values():
            subs = [s for s in cons.subs.values() if s.mask & newbits]
            if subs:
                part.refresh(cons, idx, subs)
        return idx

    def _for_new(self, partition: str, count: int, group_size: int) -> _Partition:
        """The partition new samples go to (made if need be), after checking they may."""
        if group_size < 1:
            raise DockValueError(f"group_size must be >= 1, got {group_size}")
        if count < 1 or count % group_size:
            raise DockValueError(
                f"a put of new samples needs a positive multiple of group_size={group_size} values, got {count}"
            )
        part = self.partitions.get(partition)
        total = self._sample_count()
        if total + count > self.max_samples:
            raise DockFull(f"the dock holds {total} samples and takes at most {self.max_samples} (--max-samples: the "
                           "controller keeps metadata for each); clear or delete finished samples first")
        if part is None:
            part = self._new_partition(partition, group_size)
        elif part.group_size != group_size:
            raise DockValueError(
                f"partition {partition!r} holds groups of {part.group_size}; new samples must use "
                f"group_size={part.group_size}, got {group_size}. Use another partition for another group size."
            )
        if part.sealed:
            raise DockValueError(f"partition {partition!r} is sealed: it takes no new samples (columns of its "
                                 "existing samples can still be written)")
        return part

    def _allocate(self, part: _Partition, count: int) -> np.ndarray:
        part.reserve(count)
        idx = np.arange(part.size, part.size + count, dtype=np.int64)
        part.size += count
        if self._samples is not None:
            self._samples += count
        return idx

    def _sample_count(self) -> int:
        if self._samples is None:
            self._samples = sum(p.size for p in self.partitions.values())
        return self._samples

    def _check_partitions(self) -> None:
        if len(self.partitions) >= limits.MAX_PARTITIONS:
            raise DockFull(f"the dock holds {len(self.partitions)} partitions, the most it takes; clear finished "
                           "ones (a partition is a step or a stream, not a sample)")

    def _new_partition(self, name: str, group_size: int) -> _Partition:
        """A partition made at a client's request (within the dock's bound on partitions)."""
        self._check_partitions()
        part = self.partitions[name] = _Partition(name, group_size)
        return part

    # -- partitions and their samples -----------------------------------------------------
    def _part(self, partition: str) -> _Partition:
        part = self.partitions.get(partition)
        if part is None:
            raise DockNotFound(f"partition {partition!r} does not exist (already cleared, or never written)")
        return part

    @staticmethod
    def _existing(part: _Partition, indexes) -> np.ndarray:
        idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
        bad = idx[(idx < 0) | (idx >= part.size)]
        if len(bad):
            raise DockNotFound(f"sample indexes {bad[:8].tolist()} do not exist in partition {part.name!r} "
                               f"(it holds indexes 0..{part.size - 1})")
        return idx

    def create_partition(self, partition: str, *, group_size: int = 1, retire: Sequence[str] = (),
                         max_staleness: int = -1, retire_stale: bool = False, max_pending: int = 0) -> None:
        """Make a partition (or set the options of an existing one with the same group size).
        retire: consumers that must all have confirmed a sample before it is deleted by itself.
        max_staleness: gets hand out only samples whose version is >= the trainer's version minus
        this (-1: no bound); retire_stale: set_version deletes the samples it makes too stale;
        max_pending: puts of new samples wait while this many are not yet taken (0: no bound)."""
        if max_staleness < -1 or max_pending < 0:
            raise DockValueError(f"max_staleness and max_pending are ints >= 0, got {max_staleness}, {max_pending}")
        if retire_stale and max_staleness < 0:
            raise DockValueError("retire_stale needs max_staleness: it deletes samples staler than that")
        if not partition:
            raise DockValueError("partition must be a non-empty string")
        if group_size < 1:
            raise DockValueError(f"group_size must be >= 1, got {group_size}")
        if any(not c for c in retire) or len(set(retire)) != len(retire):
            raise DockValueError(f"retire_when_consumed_by names distinct non-empty consumers, got {list(retire)}")
        part = self.partitions.get(partition)
        if part is None:
            part = self._new_partition(partition, group_size)
        elif part.group_size != group_size:
            raise DockValueError(f"partition {partition!r} already holds groups of {part.group_size}, "
                                 f"not {group_size}")
        part.retire = tuple(retire)
        part.max_staleness, part.retire_stale, part.max_pending = max_staleness, retire_stale, max_pending
        if part.retire:  # samples every named consumer already took go now
            self._retire(part, np.arange(part.size, dtype=np.int64))
        if part.retire_stale:
            self._retire_stale(part)

    def set_version(self, partition: str, version: int) -> int:
        """The trainer's current policy version; returns how many samples it made stale and
        deleted (retire_stale)."""
        if not 0 <= version <= INT64_MAX:
            raise DockValueError(f"a policy version is an int >= 0, got {version}")
        part = self._part(partition)
        part.version = version
        return self._retire_stale(part) if part.retire_stale else 0

    def _retire_stale(self, part: _Partition) -> int:
        n = self._delete(part, np.flatnonzero(part.stale_mask()))
        part.stale_retired += n
        return n

    def staleness_filter(self, part: _Partition, max_staleness: int | None, where, order_by: str):
        """A get's where and order_by with the staleness bound applied (the request's, else the
        partition's): versions >= version - bound, oldest version first unless it orders itself."""
        bound = part.max_staleness if max_staleness is None else max_staleness
        if bound < 0:
            return where, order_by
        lo = part.version - bound
        where = dict(where or {})
        old = where.get(VERSION_TAG)
        where[VERSION_TAG] = (max(lo, old[0]), old[1]) if old else (lo, INT64_MAX)
        return where, order_by or VERSION_TAG

    def must_wait(self, partition: str, new_count: int) -> bool:
        """Whether a commit of new samples waits: the partition has max_pending and that many
        samples wait for its consumers."""
        part = self.partitions.get(partition)
        return bool(new_count and part is not None and part.max_pending and part.pending() >= part.max_pending)

    def list_samples(self, partition: str, *, consumer: str = "", where=None, limit: int = 1000,
                     start: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Samples (not deleted, a column written; not yet handed to `consumer` if given) whose tags
        lie in `where`, smallest indexes from `start` first, at most `limit`; with their tags. Takes
        nothing."""
        part = self._part(partition)
        n = part.size
        mask = part.live()
        cons = part.consumers.get(consumer) if consumer else None
        if cons is not None:
            mask &= cons.state[:n] == FREE
        mask[: min(start, n)] = False
        idx = np.flatnonzero(mask)
        if where:
            idx = idx[self._where(part, idx, where)]
        idx = idx[:limit]
        tags = {name: arr[idx] for name, arr in part.tags.items()}
        return idx, tags

    def reserve(self, partition: str, count: int, *, group_size: int = 1) -> np.ndarray:
        """New samples with no column written yet (a rollout fills them later, by index)."""
        return self._allocate(self._for_new(partition, count, group_size), count)

    def seal(self, partition: str) -> None:
        """No new samples from now on; gets that then cannot be met end (DockDrained)."""
        part = self.partitions.get(partition)
        if part is None:
            part = self._new_partition(partition, 1)
        part.sealed = True

    def set_tags(self, partition: str, indexes, tags: Mapping[str, Sequence[int]]) -> None:
        part = self._part(partition)
        idx = self._existing(part, indexes)
        _check_tags(tags, len(idx))
        self._set_tags(part, idx, tags)

    @staticmethod
    def _set_tags(part: _Partition, idx: np.ndarray, tags: Mapping[str, Sequence[int]]) -> None:
        for name, values in tags.items():
            part.tag(name, create=True)[idx] = np.asarray(values, dtype=np.int64)

    def delete(self, partition: str, indexes) -> int:
        """Delete samples: all their columns are freed (the frees wait in pending_frees) and no
        consumer gets them again. Returns how many were not deleted already."""
        part = self._part(partition)
        return self._delete(part, np.unique(self._existing(part, indexes)))

    def _delete(self, part: _Partition, idx: np.ndarray) -> int:
        idx = idx[~part.gone[idx]]
        if not len(idx):
            return 0
        frees = self.pending_frees.setdefault(part.name, {})
        for loc in part.loc.values():
            where = loc[idx]
            held = where < LOST_WAREHOUSE
            for w in np.unique(where[held]).tolist():
                frees.setdefault(w, []).append(idx[where == w])
            loc[idx] = NO_WAREHOUSE
        if not frees:
            del self.pending_frees[part.name]
        part.gone[idx] = True
        part.ready[idx] = 0
        part.deleted += len(idx)
        for cons in part.consumers.values():
            part.refresh(cons, idx)
        return len(idx)

    def _retire(self, part: _Partition, idx: np.ndarray) -> None:
        """Delete the samples of idx that every consumer named by the partition has taken."""
        conss = [part.consumers.get(c) for c in part.retire]
        if any(c is None for c in conss):
            return
        ok = np.ones(len(idx), dtype=bool)
        for cons in conss:
            ok &= cons.state[idx] == TAKEN
        if ok.any():
            self._delete(part, idx[ok])

    def take_frees(self) -> dict[str, dict[int, np.ndarray]]:
        """The frees deletes left for warehouses: partition -> warehouse -> sample indexes."""
        out = {p: {w: np.unique(np.concatenate(a)) for w, a in ws.items()} for p, ws in self.pending_frees.items()}
        self.pending_frees = {}
        return out

    # -- reads --------------------------------------------------------------------
    def acquire(
        self,
        partition: str,
        consumer: str,
        columns: Sequence[str],
        count: int,
        *,
        groups: bool = False,
        allow_partial: bool = False,
        shuffle: bool = False,
        seed: int | None = None,
        owner: bytes = b"",
        now: float = 0.0,
        token: int = 0,
        lease_timeout: float | None = None,
        where: Mapping[str, tuple[int, int]] | None = None,
        order_by: str = "",
        near: int | None = None,
        max_staleness: int | None = None,
    ) -> AcquireResult | None:
        """Lease up to `count` samples ready in `columns` for `consumer`, or None to wait.

        Returns None when fewer than `count` are ready (or none, with
        allow_partial). Once the partition is sealed and nothing more can come
        for this request, returns what is left, or raises DockDrained when
        nothing is. Raises DockDataLost when chosen samples live on a dead
        warehouse; those are then marked lost for this consumer. An acquire
        whose `token` names a lease still outstanding gets that lease again (a
        client retrying after a lost reply), not a second one. `where` keeps
        samples whose tags lie in [lo, hi]; `order_by` hands out the smallest
        values of a tag first ("-tag": the largest); a group goes by its first
        sample's tags. `near`: samples whose requested columns are all on this
        warehouse go first (then the rest, in the usual order). `max_staleness`:
        only samples whose version tag is >= the partition's version minus it,
        oldest version first (None: the partition's max_staleness, if any).
        """
        self.validate_acquire(partition, consumer, columns, count, groups)
        if token:
            again = self.lease_tokens.get(token)
            if again is not None:
                lease = self.leases[again]
                part = self.partitions[lease.partition]
                locs = np.stack([part.loc[c][lease.indexes] for c in columns]) if all(
                    c in part.loc for c in columns) else np.full((len(columns), len(lease.indexes)), NO_WAREHOUSE, np.uint16)
                return AcquireResult(lease.id, lease.indexes, locs)
        part = self.partitions.get(partition)
        view = self._view(part, consumer, columns, count, groups) if part is not None else None
        if view is None:
            return None
        mask, cons, sub, gs = view
        where, order_by = self.staleness_filter(part, max_staleness, where, order_by)
        idx = self._pick(part, consumer, mask, sub, count // gs, gs, columns, partial=allow_partial, shuffle=shuffle,
                         seed=seed, where=where, order_by=order_by, near=near)
        if idx is None:
            return None
        locs = np.stack([part.loc[c][idx] for c in columns])
        if self.dead_warehouses:
            self._check_lost(part, cons, columns, idx, locs)
        lease = self.grant(self._new_lease_id(), partition, consumer, idx, owner=owner,
                           deadline=now + (lease_timeout or self.lease_timeout), token=token,
                           in_order=lease_timeout is None)
        return AcquireResult(lease.id, idx, locs)

    @staticmethod
    def _view(part: _Partition, consumer: str, columns: Sequence[str], count: int, groups: bool):
        """What a get of `columns` sees of a partition: (column mask, the consumer, its
        subscription, samples per unit), or None while one of the columns does not exist yet."""
        if groups and count % part.group_size:
            raise DockValueError(
                f"groups=True needs count to be a multiple of the group size {part.group_size} "
                f"of partition {part.name!r}, got {count}"
            )
        mask = part.mask_of(columns)
        if mask is None:
            return None
        cons = part.consumer(consumer)
        return mask, cons, part.subscription(cons, mask, groups), part.group_size if groups else 1

    def _pick(self, part: _Partition, consumer: str, mask: int, sub: _Sub, want: int, gs: int,
              columns: Sequence[str], *, partial: bool = False, where=None, **choose) -> np.ndarray | None:
        """The sample indexes of up to `want` units to hand out; None to wait. Fewer than `want`
        only with `partial` or at the end of a sealed partition; DockDrained when nothing is left."""
        units, have = self._choose(part, sub, want, gs, where=where, columns=columns, **choose)
        if have == 0 or (have < want and not partial):
            if not self._drained(part, part.consumers[consumer], mask, where):
                return None
            if have == 0:
                raise DockDrained(f"partition {part.name!r} is sealed and has nothing left for consumer "
                                  f"{consumer!r} (columns {list(columns)})")
        return (units[:, None] * gs + np.arange(gs)).ravel() if gs > 1 else units

    def _new_lease_id(self) -> int:
        lease_id = self._lease_ids()
        while lease_id in self.leases:
            lease_id = self._lease_ids()
        return lease_id

    def _choose(self, part: _Partition, sub: _Sub, want: int, gs: int, *, shuffle: bool = False,
                seed: int | None = None, where=None, order_by: str = "", near: int | None = None,
                columns: Sequence[str] = ()) -> tuple[np.ndarray, int]:
        """Up to `want` units (samples, or groups of gs) `sub` could take, in hand-out order, and
        how many it could take in all."""
        # (fewer eligible than wanted: all of them go anyway; data on one warehouse: nothing to prefer)
        if near is not None and sub.eligible.total > want and len(part.nbytes) > 1:
            if not where and not order_by and not shuffle:
                return self._near_first(part, sub, want, gs, near, columns), sub.eligible.total
            units, have = self._choose(part, sub, sub.eligible.total, gs, shuffle=shuffle, seed=seed, where=where,
                                       order_by=order_by)
            local = self._on(part, units * gs, near, columns)
            return np.concatenate([units[local], units[~local]])[:want], have
        if not where and not order_by:
            have = sub.eligible.total
            n = min(want, have)
            if shuffle:
                if sub.rng is None:
                    sub.rng = np.random.default_rng(seed)
                return sub.eligible.sample(n, sub.rng), have
            return sub.eligible.first(n), have
        units = np.flatnonzero(sub.eligible.bits)
        if where:
            units = units[self._where(part, units * gs, where)]
        if order_by:
            desc = order_by.startswith("-")
            key = part.tag_values(order_by.lstrip("-"), units * gs)
            units = units[np.argsort(-key if desc else key, kind="stable")]
        elif shuffle:
            if sub.rng is None:
                sub.rng = np.random.default_rng(seed)
            units = sub.rng.permutation(units)
        return units[:want], len(units)

    @staticmethod
    def _on(part: _Partition, idx: np.ndarray, wid: int, columns: Sequence[str]) -> np.ndarray:
        """Which of idx have every one of `columns` on warehouse `wid` (a group goes by its first
        sample: a group is put in one piece)."""
        ok = np.ones(len(idx), dtype=bool)
        for c in columns:
            ok &= part.loc[c][idx] == wid
        return ok

    def _near_first(self, part: _Partition, sub: _Sub, want: int, gs: int, near: int,
                    columns: Sequence[str]) -> np.ndarray:
        """`want` eligible units, those held on `near` first (in index order), then the first others.
        Scans the bitmap in chunks and stops once enough local units are found."""
        bits, step, need, got = sub.eligible.bits, 1 << 16, want, []
        for start in range(0, len(bits), step):
            u = np.flatnonzero(bits[start:start + step])
            if not len(u):
                continue
            u += start
            sel = u[self._on(part, u * gs, near, columns)][:need]
            got.append(sel)
            need -= len(sel)
            if not need:
                break
        local = np.concatenate(got) if got else np.empty(0, dtype=np.int64)
        if need:
            rest = sub.eligible.first(want + len(local))
            local = np.concatenate([local, rest[~np.isin(rest, local)][:need]])
        return local

    @staticmethod
    def _where(part: _Partition, idx: np.ndarray, where: Mapping[str, tuple[int, int]]) -> np.ndarray:
        ok = np.ones(len(idx), dtype=bool)
        for name, (lo, hi) in where.items():
            vals = part.tag_values(name, idx)
            ok &= (vals >= lo) & (vals <= hi)
        return ok

    def _drained(self, part: _Partition, cons: _Consumer, mask: int, where=None) -> bool:
        """Whether nothing more can become eligible for `cons` and these columns: the partition is
        sealed, none of the consumer's samples is leased (it could come back), and every sample
        still free for it is either deleted or ready already."""
        if not part.sealed:
            return False
        n = part.size
        state = cons.state[:n]
        if cons.leased and (state == LEASED).any():
            return False
        m = np.uint64(mask)
        pending = ~part.gone[:n] & (state == FREE) & ((part.ready[:n] & m) != m)
        if where and pending.any():
            pending &= self._where(part, np.arange(n, dtype=np.int64), where)
        return not pending.any()

    # -- rank-aware gets --------------------------------------------------------------------
    def share(self, partition: str, consumer: str, columns: Sequence[str], count: int, *, dp_rank: int, dp_size: int,
              mp_rank: int = 0, mp_size: int = 1, mp_group: int = 0, step: int | None = None, groups: bool = False,
              where=None,
              order_by: str = "", balance: bool = False, owner: bytes = b"", now: float = 0.0,
              lease_timeout: float | None = None, max_staleness: int | None = None) -> AcquireResult | Round | None:
        """Rank `dp_rank`'s share of one step of a rank-aware get (its step and the ranks' weights in it).

        The dp_size ranks of a step share one global batch of count * dp_size
        samples (whole groups with groups=True), formed when the first of them
        asks. Without `balance` it is split by position; with it, the new Round
        is returned instead (its samples held) for the caller to weigh and
        `split_round`. Returns None to wait (too few samples ready, or the
        round is being weighed). `step` None: the first step this (dp_rank,
        mp_rank) has not confirmed, so a rank asking again before it confirms
        gets the same share. The mp_size ranks of one model-parallel group get
        the same share, which is taken once each of them confirmed it. A share
        that expired unconfirmed (its rank died) is replaced by a fresh one
        when its rank asks again; the other ranks' shares are not affected.
        """
        self.validate_acquire(partition, consumer, columns, count, groups)
        if not 0 <= dp_rank < dp_size or not 0 <= mp_rank < mp_size or mp_size > 64:
            raise DockValueError(f"need 0 <= dp_rank < dp_size and 0 <= mp_rank < mp_size <= 64, got dp_rank={dp_rank}, "
                                 f"dp_size={dp_size}, mp_rank={mp_rank}, mp_size={mp_size}")
        key = (partition, consumer, tuple(sorted(columns)), groups, dp_size, mp_size, mp_group)
        if step is None:
            step = self.next_step.get((key, dp_rank, mp_rank), 0)
        elif step <= self.forgotten.get(key, -1):
            raise DockValueError(f"step {step} of this rank-aware get is finished and no longer remembered "
                                 f"(steps up to {self.forgotten[key]} are); ask for a later step")
        part = self.partitions.get(partition)
        if part is None:
            return None
        where, order_by = self.staleness_filter(part, max_staleness, where, order_by)
        rounds = self.rounds.get(key)
        rnd = rounds.get(step) if rounds is not None else None
        if rnd is None:
            rnd = self._form_round(part, key, step, columns, count, now=now, lease_timeout=lease_timeout,
                                   where=where, order_by=order_by)
            if rnd is None:
                return None
            if balance:
                return rnd
            self.split_round(rnd, None)
        if rnd.hold:
            return None  # another rank formed it and it is being weighed
        cons = part.consumer(consumer)
        if rnd.done[dp_rank]:  # all its readers confirmed it: a late reader sees it again, nothing to confirm
            idx = rnd.share_idx[dp_rank]
            return AcquireResult(0, idx, np.stack([part.loc[c][idx] for c in columns]), step, rnd.weights)
        lease = self.leases.get(rnd.shares[dp_rank])
        if lease is None:  # expired before all its readers confirmed: a fresh share, from the pool
            view = self._view(part, consumer, columns, count, groups)
            if view is None:
                return None
            mask, _, sub, gs = view
            idx = self._pick(part, consumer, mask, sub, count // gs, gs, columns, where=where, order_by=order_by)
            if idx is None and self._reclaim_later(key, step, dp_rank):
                idx = self._pick(part, consumer, mask, sub, count // gs, gs, columns, where=where, order_by=order_by)
            if idx is None:
                return None
            lease = self.grant(self._new_lease_id(), partition, consumer, idx,
                               deadline=now + (lease_timeout or self.lease_timeout), in_order=lease_timeout is None)
            self._make_share(lease, rnd, dp_rank)
        if lease.holders is not None and owner and owner not in lease.holders:
            if not lease.holders:  # its first reader: the share's lease runs from now (it may be a late rank)
                deadline = now + (lease_timeout or self.lease_timeout)
                if deadline > lease.deadline:
                    self.extend(lease.id, deadline)
            lease.holders[owner] = mp_rank
        idx = lease.indexes
        locs = np.stack([part.loc[c][idx] for c in columns])
        if self.dead_warehouses:
            self._check_lost(part, cons, columns, idx, locs)
        return AcquireResult(lease.id, idx, locs, step, rnd.weights)

    def _reclaim_later(self, key: tuple, step: int, rank: int) -> bool:
        """Give back this rank's unclaimed shares of later steps (other ranks ran ahead and formed
        them), so that its replacement share of `step` can be made from them instead of waiting
        for them to expire; those steps make the rank a fresh share when it gets there."""
        freed = False
        for st, rnd in self.rounds.get(key, {}).items():
            if st <= step or rnd.hold or not rnd.shares:
                continue
            lease = self.leases.get(rnd.shares[rank])
            if lease is not None and not lease.holders and not lease.confirmed:
                self.release(lease.id)
                self.dropped_shares.append(lease.id)
                freed = True
        return freed

    def _form_round(self, part: _Partition, key: tuple, step: int, columns, count: int, *, now: float,
                    lease_timeout: float | None, where, order_by: str) -> Round | None:
        _, consumer, _, groups, dp_size, *_ = key
        view = self._view(part, consumer, columns, count, groups)
        if view is None:
            return None
        mask, cons, sub, gs = view
        want = count // gs * dp_size
        units, have = self._choose(part, sub, want, gs, where=where, order_by=order_by)
        if have < want:
            if not self._drained(part, cons, mask, where):
                return None
            units = units[: have // dp_size * dp_size]  # the end of a sealed partition: equal shares of what is left
            if not len(units):
                raise DockDrained(f"partition {part.name!r} is sealed and has fewer than {dp_size} "
                                  f"{'groups' if groups else 'samples'} left for consumer {consumer!r}: one each for "
                                  f"{dp_size} ranks")
        idx = (units[:, None] * gs + np.arange(gs)).ravel() if groups else units
        if self.dead_warehouses:
            self._check_lost(part, cons, columns, idx, np.stack([part.loc[c][idx] for c in columns]))
        hold = self.grant(self._new_lease_id(), part.name, consumer, idx,
                          deadline=now + (lease_timeout or self.lease_timeout), in_order=lease_timeout is None)
        rnd = Round(key, step, idx, hold.id)
        hold.round = (key, step, -1)
        rounds = self.rounds.setdefault(key, collections.OrderedDict())
        rounds[step] = rnd
        while len(rounds) > ROUNDS_KEPT:
            old, gone = rounds.popitem(last=False)
            self.forgotten[key] = max(self.forgotten.get(key, -1), old)
            for lid in gone.shares:
                lease = self.leases.get(lid)
                if lease is not None:
                    lease.round = None
        return rnd

    def split_round(self, rnd: Round, weights: np.ndarray | None) -> bool:
        """Split a formed round among its ranks: by position, or balancing `weights` (one per
        sample of rnd.indexes). False if its samples went back meanwhile (its hold expired)."""
        hold = self.leases.pop(rnd.hold, None)
        if hold is None:
            return False
        in_order = self._fifo.pop(hold.id, False) is None  # (the FIFO maps lease ids to None)
        key = rnd.key
        _, consumer, _, groups, dp_size, mp_size, *_ = key
        part = self.partitions[key[0]]
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
        rnd.shares, rnd.share_idx, rnd.done = [0] * dp_size, [None] * dp_size, [False] * dp_size
        for r, pos in enumerate(parts):
            lease = Lease(self._new_lease_id(), part.name, consumer, rnd.indexes[pos], b"", hold.deadline)
            self.leases[lease.id] = lease
            if in_order:  # (a weighed round's shares expire a few ms late at most: the FIFO stays ordered enough)
                self._fifo[lease.id] = None
            else:
                self._push_deadline(lease)
            self._make_share(lease, rnd, r)
        rnd.hold = 0
        return True

    def _make_share(self, lease: Lease, rnd: Round, rank: int) -> None:
        lease.round, lease.holders, lease.need = (rnd.key, rnd.step, rank), {}, rnd.key[5]
        rnd.shares[rank], rnd.share_idx[rank] = lease.id, lease.indexes
        self.new_shares.append(lease)

    def drop_round(self, rnd: Round) -> None:
        """Give up a round that could not be weighed: its samples go back to the pool."""
        rounds = self.rounds.get(rnd.key)
        if rounds is not None and rounds.get(rnd.step) is rnd:
            del rounds[rnd.step]
        if rnd.hold:
            self.release(rnd.hold)

    def grant(self, lease_id: int, partition: str, consumer: str, indexes: np.ndarray, *, owner: bytes = b"",
              deadline: float, token: int = 0, in_order: bool = False) -> Lease:
        """Lease `indexes` to `consumer` (acquire's last step; also how a journal replays a lease).
        in_order: the deadline is now + the default timeout, so no earlier lease expires later."""
        part = self.partitions[partition]
        cons = part.consumer(consumer)
        idx = np.asarray(indexes, dtype=np.int64)
        cons.state[idx] = LEASED
        cons.leased += len(idx)
        part.taken_out(cons, idx)
        lease = Lease(lease_id, partition, consumer, idx, owner, deadline, token)
        self.leases[lease.id] = lease
        if in_order:
            self._fifo[lease.id] = None
        else:
            self._push_deadline(lease)
        if token:
            self.lease_tokens[token] = lease.id
        return lease

    def _check_lost(self, part: _Partition, cons: _Consumer, columns, idx, locs) -> None:
        dead = np.isin(locs, np.fromiter(self.dead_warehouses, dtype=np.uint16))
        if not dead.any():
            return
        lost_samples = dead.any(axis=0)
        lost_idx = idx[lost_samples]
        lost_cols = [c for c, row in zip(columns, dead) if row.any()]
        cons.state[lost_idx] = LOST
        part.taken_out(cons, lost_idx)
        raise DockDataLost(
            f"{len(lost_idx)} samples of partition {part.name!r} are lost: columns {lost_cols} lived on "
            f"warehouse(s) {sorted(set(locs[dead].tolist()))}, which left the dock. Indexes: "
            f"{lost_idx[:16].tolist()}{' ...' if len(lost_idx) > 16 else ''}. Re-put them or skip them.",
            indexes=lost_idx.tolist(),
            columns=lost_cols,
        )

    def locate(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> np.ndarray:
        """Warehouse ids (len(columns) x len(indexes)) holding written values; takes nothing."""
        part = self.partitions.get(partition)
        if part is None:
            raise DockNotFound(f"partition {partition!r} does not exist")
        if not columns:
            raise DockValueError("columns must name at least one column")
        idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
        bad = idx[(idx < 0) | (idx >= part.size)]
        if len(bad):
            raise DockNotFound(f"sample indexes {bad[:8].tolist()} do not exist in partition {partition!r}")
        rows = []
        for c in columns:
            b = part.columns.get(c)
            missing = idx if b is None else idx[(part.ready[idx] >> np.uint64(b)) & np.uint64(1) == 0]
            if len(missing):
                raise DockNotFound(
                    f"column {c!r} is not written for samples {missing[:8].tolist()} of partition {partition!r}"
                )
            rows.append(part.loc[c][idx])
        locs = np.stack(rows) if rows else np.empty((0, len(idx)), dtype=np.uint16)
        if self.dead_warehouses:
            dead = np.isin(locs, np.fromiter(self.dead_warehouses, dtype=np.uint16))
            if dead.any():
                raise DockDataLost(
                    f"samples {idx[dead.any(axis=0)][:16].tolist()} of partition {partition!r} lived on a warehouse "
                    "that left the dock",
                    indexes=idx[dead.any(axis=0)].tolist(),
                    columns=[c for c, row in zip(columns, dead) if row.any()],
                )
        return locs

    @staticmethod
    def validate_acquire(partition: str, consumer: str, columns: Sequence[str], count: int, groups: bool) -> None:
        if not partition:
            raise DockValueError("partition must be a non-empty string")
        if not consumer:
            raise DockValueError("consumer must be a non-empty string, e.g. 'actor_train'")
        if not columns:
            raise DockValueError("columns must name at least one column")
        if count < 1:
            raise DockValueError(f"count must be >= 1, got {count}")

    def ready_count(self, partition: str, consumer: str, columns: Sequence[str], groups: bool = False) -> int:
        """How many samples `consumer` could take right now (whole groups only with groups=True)."""
        part = self.partitions.get(partition)
        if part is None:
            return 0
        mask = part.mask_of(columns)
        if mask is None:
            return 0
        sub = part.subscription(part.consumer(consumer), mask, groups)
        return sub.eligible.total * (part.group_size if groups else 1)

    def why_not_ready(self, partition: str, columns: Sequence[str]) -> str:
        """A hint for timeout messages: unknown partition or columns."""
        part = self.partitions.get(partition)
        if part is None:
            return f" Partition {partition!r} does not exist yet (nothing was put in it)."
        missing = [c for c in columns if c not in part.columns]
        if missing:
            return f" No sample of partition {partition!r} has column(s) {missing} yet; known: {sorted(part.columns)}."
        return ""

    # -- leases -------------------------------------------------------------------
    def confirm(self, lease_id: int, member: int | None = None) -> bool:
        """The fetch of a lease succeeded: its samples are taken for good. Returns whether the lease
        ended: a share read by several model-parallel ranks ends once each of them confirmed it
        (`member`: which one this is; None: all of them, e.g. a confirm by ticket)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        if lease.need > 1 and member is not None:
            lease.confirmed |= 1 << member
            self._advance(lease, member)
            if lease.confirmed.bit_count() < lease.need:
                return False
        return self._end_lease(lease_id, TAKEN) is not None

    def _advance(self, lease: Lease, member: int) -> None:
        """A reader of a share confirmed it: its next default step is the one after."""
        key, step, rank = lease.round
        k = (key, rank, member)
        self.next_step[k] = max(self.next_step.get(k, 0), step + 1)

    def release(self, lease_id: int) -> Lease | None:
        """Give a lease's samples back to the pool; returns the lease (None if unknown)."""
        return self._end_lease(lease_id, FREE)

    def _end_lease(self, lease_id: int, state: int) -> Lease | None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        self._fifo.pop(lease_id, None)
        if lease.token:
            self.lease_tokens.pop(lease.token, None)
        part = self.partitions.get(lease.partition)
        if part is not None:
            cons = part.consumers[lease.consumer]
            sel = lease.indexes[cons.state[lease.indexes] == LEASED]
            cons.state[sel] = state
            cons.leased -= len(sel)
            if state == TAKEN:
                cons.taken += len(sel)
                if part.retire and lease.consumer in part.retire:
                    self._retire(part, sel)
            else:
                part.refresh(cons, sel)
        if lease.round is not None:
            self._share_ended(lease, state)
        return lease

    def _share_ended(self, lease: Lease, state: int) -> None:
        key, step, rank = lease.round
        rnd = self.rounds.get(key, {}).get(step)
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
                    self._advance(lease, m)

    def release_owner(self, owner: bytes) -> list[Lease]:
        """Release every lease held by a client (session) that went away."""
        if not owner:
            return []
        return [self.release(lid) for lid in [l.id for l in self.leases.values() if l.owner == owner]]

    def extend(self, lease_id: int, deadline: float) -> Lease | None:
        """Move a lease's deadline (a consumer still working on it); None if it is gone."""
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

    def expire_leases(self, now: float) -> list[Lease]:
        """Release leases whose deadline passed."""
        out = []
        while self._fifo:
            lid = next(iter(self._fifo))
            if self.leases[lid].deadline > now:
                break
            out.append(self.release(lid))
        while (top := self._heap_top()) is not None and top[0] <= now:
            out.append(self.release(top[1]))
        return out

    def next_lease_deadline(self) -> float | None:
        top = self._heap_top()
        first = self.leases[next(iter(self._fifo))].deadline if self._fifo else None
        if top is None:
            return first
        return top[0] if first is None else min(first, top[0])

    # -- partitions and warehouses ------------------------------------------------------
    def clear(self, partition: str) -> int:
        """Forget a partition; returns how many samples it held."""
        part = self.partitions.pop(partition, None)
        if part is None:
            raise DockNotFound(f"partition {partition!r} does not exist (already cleared, or never written)")
        self._samples = None
        self.pending_frees.pop(partition, None)  # (a clear frees everything)
        for key in [k for k in self.rounds if k[0] == partition]:
            del self.rounds[key]
            self.forgotten.pop(key, None)
        for k in [k for k in self.next_step if k[0][0] == partition]:
            del self.next_step[k]
        for lease in [l for l in self.leases.values() if l.partition == partition]:
            del self.leases[lease.id]
            self._fifo.pop(lease.id, None)
            if lease.token:
                self.lease_tokens.pop(lease.token, None)
            self.cleared_leases[lease.id] = None
        while len(self.cleared_leases) > _CLEARED_KEPT:
            self.cleared_leases.popitem(last=False)
        return part.size

    def warehouse_lost(self, warehouse: int) -> None:
        self.dead_warehouses.add(warehouse)
        self.put_keys.pop(warehouse, None)
        for part in self.partitions.values():
            part.nbytes.pop(warehouse, None)

    def rejoin(self, warehouse: int, inventory: Mapping[str, Inventory], *, known: bool) -> list[str]:
        """Reconcile what a rejoining warehouse holds with what this controller records.

        `known`: the controller remembers this warehouse (a journal, or it never
        went away). Then the records win: (sample, column)s recorded on the
        warehouse that it no longer holds become lost (DockDataLost when met),
        and partitions it holds that the dock no longer has are returned, for
        the warehouse to free. Otherwise (a restart without a state dir) the
        inventory is the truth: partitions are rebuilt from it, marked
        `recovered` (consumer progress before the restart is unknown); a value
        that another warehouse already holds under the same index stays there,
        and the rejoining one's copy is ignored (logged).
        """
        self.dead_warehouses.discard(warehouse)
        drop = []
        if known:
            for name, part in self.partitions.items():
                held = inventory.get(name)
                for col, loc in part.loc.items():
                    mine = np.flatnonzero(loc[: part.size] == warehouse)
                    if held is not None and col in held.columns:
                        mine = mine[~np.isin(mine, held.columns[col], assume_unique=True)]
                    if len(mine):
                        loc[mine] = LOST_WAREHOUSE
                        self.dead_warehouses.add(LOST_WAREHOUSE)
                        logger.warning("[controller] warehouse %d rejoined without %d values of column %r of "
                                       "partition %r; they are lost", warehouse, len(mine), col, name)
                if held is not None:
                    part.nbytes[warehouse] = held.nbytes
                    if part.deleted:  # samples deleted while it was away: it frees them now
                        ix = [np.asarray(v, dtype=np.int64) for v in held.columns.values()]
                        stale = np.unique(np.concatenate(ix)) if ix else np.empty(0, dtype=np.int64)
                        stale = stale[stale < part.size]
                        stale = stale[part.gone[stale]]
                        if len(stale):
                            self.pending_frees.setdefault(name, {}).setdefault(warehouse, []).append(stale)
                else:
                    part.nbytes.pop(warehouse, None)
            drop = [name for name in inventory if name not in self.partitions]
            return drop
        self._samples = None
        for name, held in inventory.items():
            part = self.partitions.get(name)
            if part is None:
                part = self.partitions[name] = _Partition(name, held.group_size or 1)
            elif part.group_size != (held.group_size or 1):
                logger.error("[controller] warehouse %d holds partition %r with groups of %d, but the dock has groups "
                             "of %d; its copy is ignored", warehouse, name, held.group_size, part.group_size)
                continue
            part.recovered = True
            top = max((int(ix[-1]) + 1 for ix in held.columns.values() if len(ix)), default=0)
            top = -(-top // part.group_size) * part.group_size
            if top > part.size:
                part.reserve(top - part.size)
                part.size = top
            newbits, conflicts, changed = 0, 0, []
            for col, ix in held.columns.items():
                b = part.bit(col)
                ix = np.asarray(ix, dtype=np.int64)
                taken = (part.ready[ix] >> np.uint64(b)) & np.uint64(1) == 1
                conflicts += int(taken.sum())
                ix = ix[~taken]
                part.loc[col][ix] = warehouse
                part.ready[ix] |= np.uint64(1 << b)
                newbits |= 1 << b
                changed.append(ix)
            part.nbytes[warehouse] = part.nbytes.get(warehouse, 0) + held.nbytes
            if conflicts:
                logger.error("[controller] warehouse %d holds %d values of partition %r under indexes that were "
                             "written again after the controller restarted without a state dir; its copies are "
                             "ignored", warehouse, conflicts, name)
            if changed:
                idx = np.unique(np.concatenate(changed))
                for cons in part.consumers.values():
                    subs = [s for s in cons.subs.values() if s.mask & newbits]
                    if subs:
                        part.refresh(cons, idx, subs)
        return drop

    def warehouse_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for part in self.partitions.values():
            for w, n in part.nbytes.items():
                out[w] = out.get(w, 0) + n
        return out

    def stats(self) -> list[dict]:
        out = []
        for part in self.partitions.values():
            n = part.size
            ready = part.ready[:n]
            live = part.live()
            out.append(
                {
                    "name": part.name,
                    "samples": n,
                    "group_size": part.group_size,
                    "columns": {
                        c: int(np.count_nonzero((ready >> np.uint64(b)) & np.uint64(1))) for c, b in part.columns.items()
                    },
                    "consumers": {name: {"taken": c.taken, "leased": c.leased, "ready": part.ready_for(c),
                                         "pending": int(np.count_nonzero(live & (c.state[:n] == FREE)))}
                                  for name, c in part.consumers.items()},
                    "recovered": part.recovered,
                    "deleted": part.deleted,
                    "sealed": part.sealed,
                    "retire_when_consumed_by": list(part.retire),
                    "tags": sorted(part.tags),
                    "version": part.version,
                    "max_staleness": part.max_staleness,
                    "retire_stale": part.retire_stale,
                    "max_pending": part.max_pending,
                    "pending": part.pending(),
                    "stale": int(np.count_nonzero(part.stale_mask())),
                    "stale_retired": part.stale_retired,
                }
            )
        return out

    # -- persistence (used by the journal; plain dicts of bytes, no pickle) -------------------
    def snapshot(self, wall_offset: float) -> dict:
        """Everything needed to rebuild this controller. Lease deadlines are stored on the
        wall clock (`deadline + wall_offset`) so another process can restore them."""
        return {
            "version": 2,
            "lease_timeout": self.lease_timeout,
            "dead": sorted(self.dead_warehouses),
            "partitions": [_export(p) for p in self.partitions.values()],
            "leases": [[l.id, l.partition, l.consumer, l.indexes.tobytes(), l.deadline + wall_offset, l.token, l.owner]
                       for l in self.leases.values()],
            "put_keys": [[w, [[k, v.tobytes()] for k, v in keys.items()]] for w, keys in self.put_keys.items()],
        }

    @classmethod
    def restore(cls, snap: dict, *, wall_offset: float, lease_timeout: float | None = None) -> Controller:
        """The controller a snapshot describes; lease deadlines are moved onto this process's clock."""
        if snap.get("version") not in (1, 2):
            raise DockValueError(f"controller snapshot version {snap.get('version')!r} is not supported")
        c = cls(lease_timeout=lease_timeout or snap["lease_timeout"])
        c.dead_warehouses = set(snap["dead"])
        for d in snap["partitions"]:
            p = _import(d)
            c.partitions[p.name] = p
        for lid, part, consumer, raw, deadline, token, owner in snap["leases"]:
            c.grant(lid, part, consumer, np.frombuffer(raw, dtype=np.int64).copy(), deadline=deadline - wall_offset,
                    token=token, owner=owner)
        for w, keys in snap["put_keys"]:
            c.put_keys[w] = collections.OrderedDict((k, np.frombuffer(v, dtype=np.int64).copy()) for k, v in keys)
        return c

    # -- checkpoints ----------------------------------------------------------------------------
    def export_partition(self, partition: str) -> dict:
        """One partition's metadata for a checkpoint (leased samples count as not taken)."""
        return _export(self._part(partition))

    def import_partition(self, d: dict, name: str, warehouses: Mapping[int, int]) -> None:
        """Make partition `name` from an exported one whose data the warehouses now hold under new
        ids (`warehouses`: old id -> new id)."""
        if name in self.partitions:
            raise DockValueError(f"partition {name!r} exists; clear it or load the checkpoint under another name")
        p = _import(dict(d, name=name, nbytes=[]))
        n = p.size
        self._check_partitions()
        if self._sample_count() + n > self.max_samples:
            raise DockFull(f"the checkpoint's {n} samples do not fit next to the dock's {self._sample_count()} "
                           f"(--max-samples {self.max_samples})")
        self._samples = None
        for col, loc in p.loc.items():
            held = loc[:n]
            new = held.copy()
            for old, wid in warehouses.items():
                new[held == old] = wid
            loc[:n] = new
        self.partitions[name] = p

    def metadata_bytes(self, partition: str) -> int:
        """Bytes of metadata the controller holds for a partition (all arrays)."""
        part = self.partitions[partition]
        total = part.ready.nbytes + part.gone.nbytes + sum(a.nbytes for a in part.loc.values())
        total += sum(a.nbytes for a in part.tags.values())
        for cons in part.consumers.values():
            total += cons.state.nbytes
            for sub in cons.subs.values():
                total += sub.eligible.bits.nbytes + sub.eligible.blocks.nbytes
        return total
