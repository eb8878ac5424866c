"""Metadata controller: which samples exist, which columns are ready, where they live,
which consumer has taken them. Pure Python + numpy, no I/O, no clocks of its own.

`Controller` is the dock's metadata, composed of:

    catalog     the partitions and their samples: commits, options, deletes, tags (`catalog`),
                each partition's arrays and eligibility bitmaps (`partition`)
    selection   which eligible samples a get hands out, in which order (`selection`)
    book        the leases outstanding and their expiry order (`leases`)
    ranks       rank-aware gets: rounds split into one share per rank (`rounds`)

with where values live and warehouses that leave and rejoin in `warehouses`, and the
snapshot format of the journal in `persist`. This class ties them together: an acquire
chooses samples (selection) and leases them (book, and the consumer's state in the
partition); a confirm, a release or an expiry ends a lease on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from dockd import limits
from dockd.controller import blocks, persist, reads, selection, warehouses
from dockd.controller import replica_map as replicas
from dockd.controller.catalog import Catalog
from dockd.controller.catalog_runs import commit_run, write_run
from dockd.controller.lease_table import AcquireResult, Lease, LeaseTable
from dockd.controller.partition import FEW, FREE, LEASED, LOST_WAREHOUSE, NO_WAREHOUSE, TAKEN
from dockd.controller.rounds import Round, Rounds
from dockd.controller.warehouses import Inventory
from dockd.errors import DockFull, DockValueError

# (the tests import these from here)
__all__ = ["AcquireResult", "Controller", "Inventory", "Round", "FREE", "LEASED", "TAKEN", "LOST_WAREHOUSE"]


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
        self.catalog = Catalog(max_samples)
        self.book = LeaseTable(lease_ids)
        self.ranks = Rounds(self.catalog, self.book, self)
        self.blocks = blocks.Blocks()  # blocks of new indexes granted to warehouses (--commit-window)
        # the parts' state, by the names the service, the journal and the tests know it by
        self.partitions = self.catalog.partitions
        self.dead_warehouses = self.catalog.dead_warehouses
        self.put_keys = self.catalog.put_keys
        self.leases = self.book.leases
        self.lease_tokens = self.book.tokens
        self.cleared_leases = self.book.cleared
        self.rounds = self.ranks.rounds

    @property
    def max_samples(self) -> int:
        return self.catalog.max_samples

    @max_samples.setter
    def max_samples(self, n: int) -> None:
        self.catalog.max_samples = n

    @property
    def pending_frees(self) -> dict[str, dict[int, list[np.ndarray]]]:
        return self.catalog.pending_frees

    # -- partitions and their samples (see Catalog) ------------------------------------------
    def commit(self, partition: str, columns: Sequence[str], *, warehouse: int,
               indexes: Sequence[int] | np.ndarray | None = None, new_count: int = 0,
               group_size: int = 1, nbytes: int = 0, put_id: int = 0,
               tags: Mapping[str, Sequence[int]] | None = None, token: int = 0,
               away: Collection[int] = ()) -> np.ndarray:
        return self.catalog.commit(partition, columns, warehouse=warehouse, indexes=indexes, new_count=new_count,
                                   group_size=group_size, nbytes=nbytes, put_id=put_id, tags=tags, token=token,
                                   away=away)

    def commit_run(self, partition: str, columns: Sequence[str], *, warehouse: int, group_size: int,
                   counts: Sequence[int], nbytes: int, put_ids: Sequence[int], tokens: Sequence[int]) -> list[range]:
        return commit_run(self.catalog, partition, columns, warehouse=warehouse, group_size=group_size,
                          counts=counts, nbytes=nbytes, put_ids=put_ids, tokens=tokens)

    def write_run(self, partition: str, columns: Sequence[str], *, warehouse: int, indexes: Sequence[np.ndarray],
                  nbytes: int, put_ids: Sequence[int], tokens: Sequence[int]) -> None:
        write_run(self.catalog, partition, columns, warehouse=warehouse, indexes=indexes, nbytes=nbytes,
                  put_ids=put_ids, tokens=tokens)

    def commit_replica(self, partition: str, columns: Sequence[str], *, warehouse: int,
                       indexes: Sequence[int] | np.ndarray, nbytes: int = 0, put_id: int = 0) -> np.ndarray:
        return replicas.commit_replica(self.catalog, partition, columns, warehouse=warehouse, indexes=indexes,
                                       nbytes=nbytes, put_id=put_id)

    def create_partition(self, partition: str, **options: Any) -> None:
        self.catalog.create_partition(partition, **options)

    def set_version(self, partition: str, version: int) -> int:
        return self.catalog.set_version(partition, version)

    def must_wait(self, partition: str, new_count: int) -> bool:
        return self.catalog.must_wait(partition, new_count)

    def list_samples(self, partition: str, **kw: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return reads.list_samples(self.catalog, partition, **kw)

    def reserve(self, partition: str, count: int, *, group_size: int = 1) -> np.ndarray:
        return self.catalog.reserve(partition, count, group_size=group_size)

    def seal(self, partition: str) -> None:
        self.catalog.seal(partition)

    def grant_block(self, partition: str, owner: int, count: int, group_size: int, block_id: int = 0) -> blocks.Block:
        """Reserve `count` new samples as a block of indexes owned by warehouse `owner` (see `blocks`)."""
        return blocks.grant(self.catalog, self.blocks, partition, owner, count, group_size, block_id)

    def drop_blocks(self, ids: Sequence[int]) -> tuple[list[blocks.Block], int]:
        """Drop blocks, deleting their samples no column was written for (see `blocks.drop`)."""
        return blocks.drop(self.catalog, self.blocks, ids)

    def set_tags(self, partition: str, indexes: Sequence[int] | np.ndarray, tags: Mapping[str, Sequence[int]]) -> None:
        self.catalog.set_tags(partition, indexes, tags)

    def delete(self, partition: str, indexes: Sequence[int] | np.ndarray) -> int:
        return self.catalog.delete(partition, indexes)

    def take_frees(self) -> dict[str, dict[int, np.ndarray]]:
        return self.catalog.take_frees()

    def ready_count(self, partition: str, consumer: str, columns: Sequence[str], groups: bool = False) -> int:
        return reads.ready_count(self.catalog, partition, consumer, columns, groups)

    def why_not_ready(self, partition: str, columns: Sequence[str]) -> str:
        return reads.why_not_ready(self.catalog, partition, columns)

    def locate(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> np.ndarray:
        return warehouses.locate(self.catalog, partition, indexes, columns)

    def warehouse_lost(self, warehouse: int) -> dict[str, dict[str, np.ndarray]]:
        """Values of `warehouse` with a replica move there, those whose copy was on its way become
        unwritten (returned, for the journal), the rest are lost."""
        return warehouses.warehouse_lost(self.catalog, warehouse)

    def unwrite(self, values: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        replicas.unwrite(self.catalog, values)

    def rejoin(self, warehouse: int, inventory: Mapping[str, Inventory], *, known: bool | str,
               lost: Mapping[str, Inventory] | bool | None = None) -> list[str]:
        return warehouses.rejoin(self.catalog, warehouse, inventory, known=known, lost=lost)

    def warehouse_bytes(self) -> dict[int, int]:
        return self.catalog.warehouse_bytes()

    def stats(self) -> list[dict]:
        return [p.stats() for p in self.partitions.values()]

    def metadata_bytes(self, partition: str) -> int:
        """Bytes of metadata the controller holds for a partition (all arrays)."""
        return self.partitions[partition].metadata_bytes()

    @staticmethod
    def validate_acquire(partition: str, consumer: str, columns: Sequence[str], count: int, groups: bool) -> None:
        selection.check_request(partition, consumer, columns, count)

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
        selection.check_request(partition, consumer, columns, count)
        if token:
            again = self.lease_tokens.get(token)
            if again is not None:  # (every lease of its grant still outstanding, when it was split: see book.split)
                leases = self.book.batch(self.leases[again])
                held_idx = leases[0].indexes if len(leases) == 1 else np.concatenate([l.indexes for l in leases])
                held = self.partitions[leases[0].partition]
                locs = held.locations(columns, held_idx) if all(c in held.loc for c in columns) else \
                    np.full((len(columns), len(held_idx)), NO_WAREHOUSE, np.uint16)
                return AcquireResult(again, held_idx, locs, leases=[l.id for l in leases] if leases[0].rest else [],
                                     seconds=max(leases[0].deadline - now, 0.0) if leases[0].rest else 0.0)
        part = self.partitions.get(partition)
        if part is None:
            return None
        self.lease_room()
        view = selection.view(part, consumer, columns, count, groups)
        if view is None:
            return None
        mask, cons, sub, gs = view
        where, order_by = selection.staleness_filter(part, max_staleness, where, order_by)
        idx = selection.pick(part, consumer, mask, sub, count // gs, gs, columns, partial=allow_partial, shuffle=shuffle,
                              seed=seed, where=where, order_by=order_by, near=near)
        if idx is None:
            return None
        locs = part.locations(columns, idx)
        if self.dead_warehouses:
            warehouses.check_lost(self.catalog, part, cons, columns, idx, locs)
        lease = self.grant(self.book.new_id(), partition, consumer, idx, owner=owner,
                           deadline=now + (lease_timeout or self.lease_timeout), token=token,
                           in_order=lease_timeout is None)
        return AcquireResult(lease.id, idx, locs)

    def grant(self, lease_id: int, partition: str, consumer: str, indexes: np.ndarray, *, owner: bytes = b"",
              deadline: float, token: int = 0, in_order: bool = False) -> Lease:
        """Lease `indexes` to `consumer` (acquire's last step; also how a journal replays a lease).
        in_order: the deadline is now + the default timeout, so no earlier lease expires later."""
        part = self.partitions[partition]
        cons = part.consumer(consumer)
        idx = indexes if isinstance(indexes, np.ndarray) and indexes.dtype == np.int64 else \
            np.asarray(indexes, dtype=np.int64)
        if idx.base is not None:  # a slice of a scan (a block's 1024 units, a partition's eligible samples): the
            idx = idx.copy()      # lease keeps its own indexes, not the whole scan for as long as it lives
        if len(idx) <= FEW:
            st = cons.state
            for i in idx.tolist():
                st[i] = LEASED
        else:
            cons.state[idx] = LEASED
        cons.leased += len(idx)
        part.taken_out(cons, idx)
        lease = Lease(lease_id, partition, consumer, idx, owner, deadline, token)
        self.book.add(lease, in_order=in_order)
        return lease

    # -- rank-aware gets (see Rounds) ----------------------------------------------------------
    def share(self, partition: str, consumer: str, columns: Sequence[str], count: int, *, dp_rank: int, dp_size: int,
              mp_rank: int = 0, mp_size: int = 1, mp_group: int = 0, step: int | None = None, groups: bool = False,
              where: selection.Where | None = None,
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
        self.lease_room()
        return self.ranks.share(partition, consumer, columns, count, dp_rank=dp_rank, dp_size=dp_size,
                                mp_rank=mp_rank, mp_size=mp_size, mp_group=mp_group, step=step, groups=groups,
                                where=where, order_by=order_by, balance=balance, owner=owner, now=now,
                                lease_timeout=lease_timeout, max_staleness=max_staleness)

    def lease_room(self) -> None:
        """Refuse a new lease while MAX_OPEN_LEASES are outstanding (each costs the controller ~0.5 KiB for
        as long as it lives: up to its lease_timeout, which a get may set to a week)."""
        if len(self.leases) >= limits.MAX_OPEN_LEASES:
            raise DockFull(f"the dock has {len(self.leases)} leases outstanding, the most it keeps; confirm or release "
                           "leases (a get confirms its own) or let them expire before taking more")

    def split_round(self, rnd: Round, weights: np.ndarray | None) -> bool:
        """Split a formed round among its ranks: by position, or balancing `weights` (one per
        sample of rnd.indexes). False if its samples went back meanwhile (its hold expired)."""
        return self.ranks.split(rnd, weights)

    def drop_round(self, rnd: Round) -> None:
        """Give up a round that could not be weighed: its samples go back to the pool."""
        self.ranks.drop(rnd)

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
            self.ranks.advance(lease, member)
            if lease.confirmed.bit_count() < lease.need:
                return False
        return self._end_lease(lease_id, TAKEN) is not None

    def release(self, lease_id: int) -> Lease | None:
        """Give a lease's samples back to the pool; returns the lease (None if unknown)."""
        return self._end_lease(lease_id, FREE)

    def _end_lease(self, lease_id: int, state: int) -> Lease | None:
        lease = self.book.pop(lease_id)
        if lease is None:
            return None
        if state == TAKEN:
            self.book.confirmed(lease_id)
        part = self.partitions.get(lease.partition)
        if part is not None:
            cons, idx = part.consumers[lease.consumer], lease.indexes
            st = cons.state
            if len(idx) <= FEW:  # (a small get's lease: scalar reads cost less than three numpy calls)
                held = [i for i in idx.tolist() if st.item(i) == LEASED]
                for i in held:
                    st[i] = state
                sel = idx if len(held) == len(idx) else np.array(held, dtype=np.int64)
            else:
                sel = idx[st[idx] == LEASED]
                st[sel] = state
            cons.leased -= len(sel)
            if state == TAKEN:
                cons.taken += len(sel)
                if part.retire and lease.consumer in part.retire:
                    self.catalog.retire(part, sel)
            else:
                part.refresh(cons, sel)
        if lease.round is not None:
            self.ranks.share_ended(lease, state)
        return lease

    def release_owner(self, owner: bytes) -> list[Lease]:
        """Release every lease held by a client (session) that went away."""
        if not owner:
            return []
        return [self._release_held(lid) for lid in [l.id for l in self.leases.values() if l.owner == owner]]

    def extend(self, lease_id: int, deadline: float) -> Lease | None:
        """Move a lease's deadline (a consumer still working on it); None if it is gone."""
        return self.book.extend(lease_id, deadline)

    def expire_leases(self, now: float) -> list[Lease]:
        """Release leases whose deadline passed."""
        out = []
        while (lid := self.book.due(now)) is not None:
            out.append(self._release_held(lid))
        return out

    def _release_held(self, lease_id: int) -> Lease:
        """Release a lease the book holds (so there is one to return)."""
        lease = self._end_lease(lease_id, FREE)
        assert lease is not None
        return lease

    def next_lease_deadline(self) -> float | None:
        return self.book.next_deadline()

    def clear(self, partition: str) -> int:
        """Forget a partition; returns how many samples it held."""
        part = self.catalog.forget(partition)
        self.ranks.forget_partition(partition)
        self.blocks.forget_partition(partition)
        for lease in [l for l in self.leases.values() if l.partition == partition]:
            self.book.forget(lease)
        return part.size

    def drop_consumer(self, partition: str, consumer: str) -> list[Lease] | None:
        """Forget a consumer of a partition: what it took, its leases (ended, their samples taken by
        nobody; a late confirm of one is refused) and its rank-aware rounds. Returns its leases, or
        None if the partition had no such consumer. Samples it held pending no longer hold puts back
        (max_pending), unless retire_when_consumed_by names it. A later get under the name is a
        fresh consumer: it sees every sample of the partition not deleted, those the old one took
        included."""
        part = self.catalog.part(partition)
        if part.drop(consumer) is None:
            return None
        self.ranks.forget_partition(partition, consumer)
        leases = [l for l in self.leases.values() if l.partition == partition and l.consumer == consumer]
        for lease in leases:
            self.book.pop(lease.id)
        return leases

    # -- persistence (used by the journal; see persist) -----------------------------------------
    def snapshot(self, wall_offset: float) -> dict:
        """Everything needed to rebuild this controller. Lease deadlines are stored on the
        wall clock (`deadline + wall_offset`) so another process can restore them."""
        return {**persist.snapshot(self.catalog, self.leases.values(), self.lease_timeout, wall_offset),
                "blocks": self.blocks.export()}

    @classmethod
    def restore(cls, snap: dict, *, wall_offset: float, lease_timeout: float | None = None) -> Controller:
        """The controller a snapshot describes; lease deadlines are moved onto this process's clock."""
        persist.check_version(snap)
        c = cls(lease_timeout=lease_timeout or snap["lease_timeout"])
        persist.restore(c.catalog, c.grant, snap, wall_offset=wall_offset)
        c.blocks.load(snap.get("blocks"))  # (older snapshots: none)
        return c

    def export_partition(self, partition: str) -> dict:
        """One partition's metadata for a checkpoint (leased samples count as not taken)."""
        return persist.export_partition(self.catalog.part(partition))

    def import_partition(self, d: dict, name: str, warehouses: Mapping[int, int]) -> None:
        """Make partition `name` from an exported one whose data the warehouses now hold under new
        ids (`warehouses`: old id -> new id)."""
        if name in self.partitions:
            raise DockValueError(f"partition {name!r} exists; clear it or load the checkpoint under another name")
        p = persist.import_partition(dict(d, name=name, nbytes=[]))
        p.rloc.clear()  # (the checkpoint's values come back once; --replicas 2 copies them again)
        n = p.size
        for loc in p.loc.values():
            held = loc[:n]
            new = held.copy()
            for old, wid in warehouses.items():
                new[held == old] = wid
            loc[:n] = new
        self.catalog.add(p)
