"""The controller's state dir: a snapshot plus an append-only journal of decisions.

    STATE_DIR/
      snapshot-<gen>.msgpack   the whole controller at one moment (Controller.snapshot)
      journal-<gen>.log        every decision made since that snapshot, in order

A record is `u32 length | u32 crc32 | msgpack list`. Recovery loads the
newest snapshot and replays its journal through the same pure `Controller`
methods that made the decisions, so the rebuilt state is the state that was
lost. A torn last record (the process was killed mid-write) is cut off.

Durability: every record is written (one `write(2)`) before the reply that
depends on it leaves the controller, so a controller killed with SIGKILL
loses nothing; `fsync` runs in batches every `fsync_interval` seconds, so a
crash of the whole machine can lose the decisions of that last interval.
When the journal grows past `compact_bytes` a new snapshot replaces it.

Records (the first element names the kind):

    W  warehouse entry (id, host, port, unix, capacity, instance, state)
    C  commit          (partition, columns, warehouse, indexes | None, new_count, group_size, nbytes, put_id[, tags])
    G  lease granted   (id, partition, consumer, indexes, wall-clock deadline, token, owner session)
    E  lease extended  (id, wall-clock deadline)
    F  leases confirmed (ids)
    R  lease released  (id): given back, expired, or its client went away
    X  partition cleared
    L  warehouse lost  (id)
    J  warehouse rejoined (id, inventory, known)
    P  partition created or its options set (partition, group_size, retire_when_consumed_by)
    D  samples deleted (partition, indexes)
    S  partition sealed
    V  samples reserved (partition, count, group_size)
    T  tags set        (partition, indexes, {name: values})
    K  partition loaded from a checkpoint (partition, its exported metadata)

A rank-aware get's shares are journaled as plain leases (G) when a round is
split; the lease holding a round before its split, and which rank holds which
share, are not recorded: after a restart a rank's next get forms a new round
while unconfirmed old shares expire back to the pool.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import struct
import time
import zlib
from collections.abc import Iterator, Mapping

import msgpack
import numpy as np

from dockd.controller.core import Controller, Inventory, _import
from dockd.errors import DockError

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")
_SNAP = re.compile(r"snapshot-(\d+)\.msgpack$")


def _pack_idx(idx) -> bytes | list[int]:
    """Indexes compactly: [start, n] for a consecutive run, else raw int64 bytes."""
    a = np.asarray(idx, dtype=np.int64)
    if len(a) and a[-1] - a[0] == len(a) - 1 and (len(a) < 3 or bool((np.diff(a) == 1).all())):
        return [int(a[0]), len(a)]
    return a.tobytes()


def _unpack_idx(raw) -> np.ndarray:
    if isinstance(raw, list):
        return np.arange(raw[0], raw[0] + raw[1], dtype=np.int64)
    return np.frombuffer(raw, dtype=np.int64).copy()


def _pack_tags(tags) -> dict:
    return {name: np.asarray(v, dtype=np.int64).tobytes() for name, v in tags.items()}


def _unpack_tags(raw: dict) -> dict:
    return {name: np.frombuffer(v, dtype=np.int64).copy() for name, v in raw.items()}


def _pack_inventory(inv: Mapping[str, Inventory]) -> dict:
    return {name: [h.group_size, h.nbytes, {c: np.asarray(ix, np.int64).tobytes() for c, ix in h.columns.items()}]
            for name, h in inv.items()}


def _unpack_inventory(raw: dict) -> dict[str, Inventory]:
    return {name: Inventory(gs, nb, {c: np.frombuffer(b, dtype=np.int64).copy() for c, b in cols.items()})
            for name, (gs, nb, cols) in raw.items()}


class JournalError(DockError):
    """The state dir cannot be used (unreadable, or written by an incompatible version)."""


class Journal:
    """Records the controller's decisions in a state dir and rebuilds them on restart."""

    def __init__(self, path: str | os.PathLike, *, fsync_interval: float = 0.05, compact_bytes: int = 64 << 20) -> None:
        self.dir = pathlib.Path(path)
        self.fsync_interval = fsync_interval
        self.compact_bytes = compact_bytes
        self.gen = 0
        self._fd = -1
        self.size = 0
        self.dirty = False
        self.records = 0

    # -- recovery ------------------------------------------------------------------------
    def load(self, *, lease_timeout: float, now: float) -> tuple[Controller, dict[int, dict]]:
        """Rebuild the controller (deadlines on the clock whose current reading is `now`) and
        its warehouse registry from the state dir; then start a fresh snapshot + journal."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot create the state dir {self.dir}: {e}") from None
        wall_offset = time.time() - now
        gens = sorted(int(m.group(1)) for f in self.dir.iterdir() if (m := _SNAP.match(f.name)))
        core, warehouses = Controller(lease_timeout=lease_timeout), {}
        if gens:
            self.gen = gens[-1]
            snap_path = self.dir / f"snapshot-{self.gen}.msgpack"
            try:
                snap = msgpack.unpackb(snap_path.read_bytes(), raw=False, strict_map_key=False)
                core = Controller.restore(snap["controller"], wall_offset=wall_offset, lease_timeout=lease_timeout)
            except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                raise JournalError(f"cannot read the controller snapshot {snap_path}: {e}. Move the state dir "
                                   "away to start empty.") from None
            warehouses = {int(w["id"]): w for w in snap["warehouses"]}
        log = self.dir / f"journal-{self.gen}.log"
        replayed = 0
        if log.exists():
            for rec in self._read(log):
                apply(core, warehouses, rec, wall_offset)
                replayed += 1
        if gens or replayed:
            logger.info("[journal] recovered state_dir=%s snapshot=%d records=%d partitions=%d leases=%d",
                        self.dir, self.gen, replayed, len(core.partitions), len(core.leases))
        self.compact(core, warehouses, now=now)
        return core, warehouses

    @staticmethod
    def _read(log: pathlib.Path) -> Iterator[list]:
        data = log.read_bytes()
        pos = 0
        while pos + _HEAD.size <= len(data):
            n, crc = _HEAD.unpack_from(data, pos)
            body = data[pos + _HEAD.size : pos + _HEAD.size + n]
            if len(body) < n or zlib.crc32(body) != crc:
                break
            yield msgpack.unpackb(body, raw=False, strict_map_key=False)
            pos += _HEAD.size + n
        if pos < len(data):
            logger.warning("[journal] cut a torn record at the end of %s offset=%d bytes=%d", log, pos, len(data) - pos)

    # -- writing ---------------------------------------------------------------------------
    def append(self, rec: list) -> None:
        body = msgpack.packb(rec, use_bin_type=True)
        os.write(self._fd, _HEAD.pack(len(body), zlib.crc32(body)) + body)
        self.size += _HEAD.size + len(body)
        self.records += 1
        self.dirty = True

    def secret(self) -> bytes:
        """The controller's key for lease tickets, kept in the state dir so tickets outlive a restart."""
        path = self.dir / "lease-secret"
        try:
            raw = path.read_bytes()
            if len(raw) == 32:
                return raw
        except OSError:
            pass
        raw = os.urandom(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        return raw

    def sync(self) -> None:
        """fsync what was written (called from a worker thread every fsync_interval)."""
        if self.dirty and self._fd >= 0:
            self.dirty = False
            os.fsync(self._fd)

    def needs_compaction(self) -> bool:
        return self.size > self.compact_bytes

    def compact(self, core: Controller, warehouses: Mapping[int, dict], *, now: float) -> None:
        """Write a new snapshot and start an empty journal after it; drop the older files."""
        gen = self.gen + 1
        snap = {"controller": core.snapshot(time.time() - now), "warehouses": list(warehouses.values())}
        tmp = self.dir / f"snapshot-{gen}.tmp"
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(snap, use_bin_type=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / f"snapshot-{gen}.msgpack")
        fd = os.open(self.dir / f"journal-{gen}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename and the new journal are durable before the old files go
        finally:
            os.close(dfd)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.gen, self.size, self.dirty = fd, gen, 0, False
        for f in self.dir.iterdir():
            m = re.match(r"(?:snapshot|journal)-(\d+)\.(?:msgpack|log|tmp)$", f.name)
            if m and int(m.group(1)) < gen:
                f.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    # -- the records a service writes ------------------------------------------------------
    def warehouse(self, entry: dict) -> None:
        self.append(["W", entry])

    def commit(self, partition, columns, warehouse, indexes, new_count, group_size, nbytes, put_id,
               tags=None) -> None:
        rec = ["C", partition, list(columns), warehouse, None if indexes is None else _pack_idx(indexes),
               new_count, group_size, nbytes, put_id]
        if tags:
            rec.append(_pack_tags(tags))
        self.append(rec)

    def create(self, partition: str, group_size: int, retire) -> None:
        self.append(["P", partition, group_size, list(retire)])

    def delete(self, partition: str, indexes) -> None:
        self.append(["D", partition, _pack_idx(indexes)])

    def seal(self, partition: str) -> None:
        self.append(["S", partition])

    def reserve(self, partition: str, count: int, group_size: int) -> None:
        self.append(["V", partition, count, group_size])

    def loaded(self, partition: str, exported: dict) -> None:
        self.append(["K", partition, exported])

    def tags(self, partition: str, indexes, tags) -> None:
        self.append(["T", partition, _pack_idx(indexes), _pack_tags(tags)])

    def grant(self, lease, wall_deadline: float) -> None:
        self.append(["G", lease.id, lease.partition, lease.consumer, _pack_idx(lease.indexes), wall_deadline, lease.token,
                     lease.owner])

    def extend(self, lease_id: int, wall_deadline: float) -> None:
        self.append(["E", lease_id, wall_deadline])

    def confirm(self, ids: list[int]) -> None:
        self.append(["F", ids])

    def release(self, lease_id: int) -> None:
        self.append(["R", lease_id])

    def clear(self, partition: str) -> None:
        self.append(["X", partition])

    def lost(self, wid: int) -> None:
        self.append(["L", wid])

    def rejoin(self, wid: int, inventory: Mapping[str, Inventory], known: bool) -> None:
        self.append(["J", wid, _pack_inventory(inventory), known])


def apply(core: Controller, warehouses: dict[int, dict], rec: list, wall_offset: float) -> None:
    """Replay one record onto a controller and its warehouse registry."""
    kind = rec[0]
    if kind == "C":
        _, part, cols, wid, idx, new_count, gs, nbytes, put_id, *tags = rec
        core.commit(part, cols, warehouse=wid, indexes=None if idx is None else _unpack_idx(idx), new_count=new_count,
                    group_size=gs, nbytes=nbytes, put_id=put_id, tags=_unpack_tags(tags[0]) if tags else None)
    elif kind == "P":
        core.create_partition(rec[1], group_size=rec[2], retire=rec[3])
    elif kind == "D":
        core.partitions.get(rec[1]) and core.delete(rec[1], _unpack_idx(rec[2]))
    elif kind == "S":
        core.seal(rec[1])
    elif kind == "V":
        core.reserve(rec[1], rec[2], group_size=rec[3])
    elif kind == "K":
        core.partitions[rec[1]] = _import(rec[2])
    elif kind == "T":
        core.set_tags(rec[1], _unpack_idx(rec[2]), _unpack_tags(rec[3]))
    elif kind == "G":
        _, lid, part, consumer, idx, wall_deadline, token, owner = rec
        core.grant(lid, part, consumer, _unpack_idx(idx), deadline=wall_deadline - wall_offset, token=token, owner=owner)
    elif kind == "E":
        core.extend(rec[1], rec[2] - wall_offset)
    elif kind == "F":
        for lid in rec[1]:
            core.confirm(lid)
    elif kind == "R":
        core.release(rec[1])
    elif kind == "X":
        core.partitions.get(rec[1]) and core.clear(rec[1])
    elif kind == "W":
        warehouses[int(rec[1]["id"])] = rec[1]
    elif kind == "L":
        core.warehouse_lost(rec[1])
        if rec[1] in warehouses:
            warehouses[rec[1]]["state"] = "lost"
    elif kind == "J":
        core.rejoin(rec[1], _unpack_inventory(rec[2]), known=rec[3])
    else:
        raise JournalError(f"unknown journal record kind {kind!r}: written by a newer dockd?")
