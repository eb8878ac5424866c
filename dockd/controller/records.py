"""The journal's records: what each holds, how decisions are packed into them (`RecordWriter`), how
they lie in a journal file (`read`), and how a record replays onto a controller (`apply`).
`dockd.controller.journal` writes them and reads them back.

Records (the first element names the kind):

    W  warehouse entry (id, host, port, unix, capacity, instance, state)
    C  commit          (partition, columns, warehouse, indexes | None, new_count, group_size, nbytes, put_id[, tags
                       [, writer token[, warehouses not answering when a put with that token was re-sent]]])
    M  a run of commits of new samples applied as one (partition, columns, warehouse, group_size, each one's
       new_count, their nbytes, each one's put_id, each one's writer token or 0): see controller.commit_runs
    I  a run of commits of columns of existing samples applied as one (partition, columns, warehouse, each
       one's indexes, their nbytes, each one's put_id, each one's writer token or 0)
    A  replica commit  (partition, columns, warehouse, indexes, nbytes, put_id): it holds a copy (--replicas 2)
    G  lease granted   (id, partition, consumer, indexes, seconds left, token, owner session)
    B  a grant split into leases of `per` samples each (the first's id, partition, consumer, all their
       indexes, seconds left, token, owner session, per, the other leases' ids): one record for them all
    E  lease extended  (id, seconds left)
    F  leases confirmed (ids)
    R  lease released  (id): given back, expired, or its client went away
    X  partition cleared
    L  warehouse lost  (id[, {partition: {column: indexes}} of its values unwritten, their copy on its way])
    J  warehouse rejoined (id, inventory, known[, lost: what its data dir dropped as damaged, or True])
    P  partition created or its options set (partition, group_size, retire_when_consumed_by[,
       max_staleness, retire_stale, max_pending])
    D  samples deleted (partition, indexes)
    S  partition sealed
    V  samples reserved (partition, count, group_size)
    T  tags set        (partition, indexes, {name: values})
    K  partition loaded from a checkpoint (partition, its exported metadata)
    Y  the trainer's policy version set (partition, version)
    U  consumer dropped (partition, consumer): its progress and leases forgotten
    N  a block of new indexes granted (id, partition, owner warehouse, start, count, group_size): its samples
       reserved and the block registered, in one record (see controller.blocks)
    H  blocks dropped (ids): their samples with no column written deleted (holes), the blocks forgotten

A rank-aware get's shares are journaled as plain leases (G) when a round is
split; the lease holding a round before its split, and which rank holds which
share, are not recorded: after a restart a rank's next get forms a new round
while unconfirmed old shares expire back to the pool.
"""

from __future__ import annotations

import logging
import pathlib
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import numpy as np

from dockd.controller.core import Controller
from dockd.controller.lease_table import Lease
from dockd.controller.persist import import_partition
from dockd.controller.warehouses import Inventory
from dockd.errors import DockError

logger = logging.getLogger(__name__)

_FEW_IDX = 8  # (see pack_idx)
HEAD = struct.Struct("<II")
"""A record in a journal file: `u32 length | u32 crc32` of its msgpack body, then the body."""


def pack_idx(idx) -> bytes | list[int]:
    """Indexes compactly: [start, n] for a consecutive run, else raw int64 bytes (native order). A few
    indexes (a small get's lease, a one-sample commit) are read as Python ints: three numpy calls on a
    tiny array cost a grant record more than the rest of it."""
    if len(idx) <= _FEW_IDX:
        xs = idx.tolist() if isinstance(idx, np.ndarray) else [int(x) for x in idx]
        if xs and xs[-1] - xs[0] == len(xs) - 1 and all(b - a == 1 for a, b in zip(xs, xs[1:])):
            return [xs[0], len(xs)]
        return struct.pack(f"={len(xs)}q", *xs)
    a = np.asarray(idx, dtype=np.int64)
    if len(a) and a[-1] - a[0] == len(a) - 1 and (len(a) < 3 or bool((np.diff(a) == 1).all())):
        return [int(a[0]), len(a)]
    return a.tobytes()


def unpack_idx(raw) -> np.ndarray:
    if isinstance(raw, list):
        return np.arange(raw[0], raw[0] + raw[1], dtype=np.int64)
    return np.frombuffer(raw, dtype=np.int64).copy()


def pack_tags(tags) -> dict:
    return {name: np.asarray(v, dtype=np.int64).tobytes() for name, v in tags.items()}


def unpack_tags(raw: dict) -> dict:
    return {name: np.frombuffer(v, dtype=np.int64).copy() for name, v in raw.items()}


def pack_inventory(inv: Mapping[str, Inventory]) -> dict:
    return {name: [h.group_size, h.nbytes, {c: np.asarray(ix, np.int64).tobytes() for c, ix in h.columns.items()}]
            for name, h in inv.items()}


def unpack_inventory(raw: dict) -> dict[str, Inventory]:
    return {name: Inventory(gs, nb, {c: np.frombuffer(b, dtype=np.int64).copy() for c, b in cols.items()})
            for name, (gs, nb, cols) in raw.items()}


def read(log: pathlib.Path) -> Iterator[tuple[list, int]]:
    """The whole records of a journal file, each with the offset where it ends."""
    data = log.read_bytes()
    pos = 0
    while pos + HEAD.size <= len(data):
        n, crc = HEAD.unpack_from(data, pos)
        body = data[pos + HEAD.size : pos + HEAD.size + n]
        if len(body) < n or zlib.crc32(body) != crc:
            break
        pos += HEAD.size + n
        yield msgpack.unpackb(body, raw=False, strict_map_key=False), pos
    if pos < len(data):
        logger.warning("[journal] cut a torn record at the end of %s offset=%d bytes=%d", log, pos, len(data) - pos)


class JournalError(DockError):
    """The state dir cannot be used (unreadable, or written by an incompatible version)."""


_LEGACY_WALL = 1e8  # a lease time above this was written as a wall-clock deadline (older dockd)
# records written before the request they record was applied: one the controller then refused
# replays to the same refusal, which replay skips
_AHEAD = frozenset("CMIAPDSVTXEFRYUN")


def _deadline(core: Controller, left: float, now: float) -> float:
    """A restored lease's deadline: now + the seconds it had left when recorded (an older
    dockd's wall-clock deadline: a fresh lease timeout)."""
    return now + (core.lease_timeout if left > _LEGACY_WALL else left)


def apply(core: Controller, warehouses: dict[int, dict], rec: list, now: float) -> bool:
    """Replay one record onto a controller and its warehouse registry (lease deadlines on the
    clock whose reading is `now`). False: a request recorded ahead that the controller refused."""
    if rec[0] not in _AHEAD:
        _apply(core, warehouses, rec, now)
        return True
    try:
        _apply(core, warehouses, rec, now)
    except DockError:
        return False
    except Exception as e:  # noqa: BLE001 - it failed the same way when it was made
        logger.warning("[journal] a %s record replays to %s: %s (the request failed the same way)", rec[0],
                       type(e).__name__, e)
        return False
    return True


def _apply(core: Controller, warehouses: dict[int, dict], rec: list, now: float) -> None:
    kind = rec[0]
    if kind == "C":
        _, part, cols, wid, idx, new_count, gs, nbytes, put_id, *more = rec
        core.commit(part, cols, warehouse=wid, indexes=None if idx is None else unpack_idx(idx), new_count=new_count,
                    group_size=gs, nbytes=nbytes, put_id=put_id, tags=unpack_tags(more[0]) if more else None,
                    token=more[1] if len(more) > 1 else 0, away=more[2] if len(more) > 2 else ())
    elif kind == "M":
        _, part, cols, wid, gs, counts, nbytes, put_ids, tokens = rec
        core.commit_run(part, cols, warehouse=wid, group_size=gs, counts=counts, nbytes=nbytes, put_ids=put_ids,
                        tokens=tokens)
    elif kind == "I":
        _, part, cols, wid, idxs, nbytes, put_ids, tokens = rec
        core.write_run(part, cols, warehouse=wid, indexes=[unpack_idx(x) for x in idxs], nbytes=nbytes,
                       put_ids=put_ids, tokens=tokens)
    elif kind == "A":
        _, part, cols, wid, idx, nbytes, put_id = rec
        core.commit_replica(part, cols, warehouse=wid, indexes=unpack_idx(idx), nbytes=nbytes, put_id=put_id)
    elif kind == "P":
        core.create_partition(rec[1], group_size=rec[2], retire=rec[3], **dict(zip(
            ("max_staleness", "retire_stale", "max_pending"), rec[4:])))
    elif kind == "Y":
        core.set_version(rec[1], rec[2])
    elif kind == "D":
        core.partitions.get(rec[1]) and core.delete(rec[1], unpack_idx(rec[2]))
    elif kind == "S":
        core.seal(rec[1])
    elif kind == "V":
        core.reserve(rec[1], rec[2], group_size=rec[3])
    elif kind == "N":
        _, bid, part, owner, _start, count, gs = rec  # (replayed in order, the reserve starts there again)
        core.grant_block(part, owner, count, gs, bid)
    elif kind == "H":
        core.drop_blocks(rec[1])
    elif kind == "K":
        core.catalog.adopt(import_partition(rec[2]))  # (exported under its name, rec[1])
    elif kind == "T":
        core.set_tags(rec[1], unpack_idx(rec[2]), unpack_tags(rec[3]))
    elif kind == "G":
        _, lid, part, consumer, idx, left, token, owner = rec
        core.grant(lid, part, consumer, unpack_idx(idx), deadline=_deadline(core, left, now), token=token, owner=owner)
    elif kind == "B":
        _, lid, part, consumer, idx, left, token, owner, per, ids = rec
        core.grant(lid, part, consumer, unpack_idx(idx), deadline=_deadline(core, left, now), token=token, owner=owner)
        core.book.split(lid, per, ids)
    elif kind == "E":
        core.extend(rec[1], _deadline(core, rec[2], now))
    elif kind == "F":
        for lid in rec[1]:
            core.confirm(lid)
    elif kind == "R":
        core.release(rec[1])
    elif kind == "X":
        core.partitions.get(rec[1]) and core.clear(rec[1])
    elif kind == "U":
        core.drop_consumer(rec[1], rec[2])
    elif kind == "W":
        warehouses[int(rec[1]["id"])] = rec[1]
    elif kind == "L":
        if len(rec) > 2:  # (its copies on their way were not journaled: what they left unwritten was)
            core.unwrite({p: {c: unpack_idx(ix) for c, ix in cols.items()} for p, cols in rec[2].items()})
        core.warehouse_lost(rec[1])
        if rec[1] in warehouses:
            warehouses[rec[1]]["state"] = "lost"
    elif kind == "J":
        lost = rec[4] if len(rec) > 4 else None
        core.rejoin(rec[1], unpack_inventory(rec[2]), known=rec[3],
                    lost=unpack_inventory(lost) if isinstance(lost, dict) else lost)
    else:
        raise JournalError(f"unknown journal record kind {kind!r}: written by a newer dockd?")


class RecordWriter:
    """The records a controller's decisions are written as, one method per kind (the journal's
    `append` writes them). Requests' records raise DockStateFull when they cannot be written;
    records of what the controller already did on its own (warehouses, expiries, shares) never raise."""

    def append(self, rec: list, *, applied: bool = False, hold: bool = False) -> bool:
        raise NotImplementedError

    def warehouse(self, entry: dict) -> None:
        self.append(["W", entry], applied=True)

    def commit(self, partition, columns, warehouse, indexes, new_count, group_size, nbytes, put_id,
               tags=None, token: int = 0, away=()) -> None:
        rec = ["C", partition, list(columns), warehouse, None if indexes is None else pack_idx(indexes),
               new_count, group_size, nbytes, put_id]
        if tags or token:
            rec.append(pack_tags(tags or {}))
        if token:
            rec.append(token)
            if away:
                rec.append(sorted(away))
        self.append(rec)

    def commit_run(self, partition: str, columns: list[str], warehouse: int, group_size: int, counts: list[int],
                   nbytes: int, put_ids: list[int], tokens: list[int]) -> None:
        self.append(["M", partition, columns, warehouse, group_size, counts, nbytes, put_ids, tokens])

    def write_run(self, partition: str, columns: list[str], warehouse: int, indexes: list[list[int]], nbytes: int,
                  put_ids: list[int], tokens: list[int]) -> None:
        """`indexes`: each commit's, as a list of ints (one sample's, the common case: [i, 1] as `pack_idx` packs it)."""
        self.append(["I", partition, columns, warehouse, [[ix[0], 1] if len(ix) == 1 else pack_idx(ix) for ix in indexes],
                     nbytes, put_ids, tokens])

    def replica(self, partition, columns, warehouse, indexes, nbytes, put_id) -> None:
        self.append(["A", partition, list(columns), warehouse, pack_idx(indexes), nbytes, put_id])

    def create(self, partition: str, group_size: int, retire, max_staleness: int = -1, retire_stale: bool = False,
               max_pending: int = 0) -> None:
        rec = ["P", partition, group_size, list(retire)]
        if max_staleness >= 0 or max_pending:
            rec += [max_staleness, retire_stale, max_pending]
        self.append(rec)

    def set_version(self, partition: str, version: int) -> None:
        self.append(["Y", partition, version])

    def delete(self, partition: str, indexes) -> None:
        self.append(["D", partition, pack_idx(indexes)])

    def seal(self, partition: str) -> None:
        self.append(["S", partition])

    def reserve(self, partition: str, count: int, group_size: int) -> None:
        self.append(["V", partition, count, group_size])

    def block(self, block_id: int, partition: str, owner: int, start: int, count: int, group_size: int) -> None:
        self.append(["N", block_id, partition, owner, start, count, group_size])

    def blocks_dropped(self, ids: list[int], *, hold: bool = False) -> None:
        """Blocks dropped (their unwritten samples deleted): a decision already applied. `hold`: written with
        the next record (blocks written in full: a replay that misses it only keeps them a while longer)."""
        self.append(["H", ids], applied=True, hold=hold)

    def loaded(self, partition: str, exported: dict) -> None:
        self.append(["K", partition, exported])

    def tags(self, partition: str, indexes, tags) -> None:
        self.append(["T", partition, pack_idx(indexes), pack_tags(tags)])

    def grant(self, lease: Lease, seconds_left: float, *, applied: bool = False) -> bool:
        """A lease and the seconds it has left (its deadline minus now, on the loop's clock)."""
        return self.append(["G", lease.id, lease.partition, lease.consumer, pack_idx(lease.indexes),
                            float(seconds_left), lease.token, lease.owner], applied=applied)

    def grants(self, leases: list[Lease], indexes: np.ndarray, seconds_left: float, per: int) -> None:
        """Leases split from one grant of `indexes` (`LeaseTable.split`: the first, then the rest, of `per` samples
        each, in the grant's order)."""
        first = leases[0]
        self.append(["B", first.id, first.partition, first.consumer, pack_idx(indexes), float(seconds_left),
                     first.token, first.owner, per, [l.id for l in leases[1:]]])

    def extend(self, lease_id: int, seconds_left: float) -> None:
        self.append(["E", lease_id, float(seconds_left)])

    def confirm(self, ids: list[int], *, hold: bool = False) -> None:
        self.append(["F", ids], hold=hold)

    def release(self, lease_id: int, *, applied: bool = False) -> bool:
        return self.append(["R", lease_id], applied=applied)

    def clear(self, partition: str) -> None:
        self.append(["X", partition])

    def lost(self, wid: int, unwritten: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        rec: list = ["L", wid]
        if unwritten:
            rec.append({p: {c: pack_idx(ix) for c, ix in cols.items()} for p, cols in unwritten.items()})
        self.append(rec, applied=True)

    def rejoin(self, wid: int, inventory: Mapping[str, Inventory], known: bool | str,
               lost: Mapping[str, Inventory] | bool | None = None) -> None:
        rec = ["J", wid, pack_inventory(inventory), known]
        if lost:  # (values of files it dropped as damaged; True: every value it lacks)
            rec.append(True if lost is True else pack_inventory(lost))
        self.append(rec, applied=True)
