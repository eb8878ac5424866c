"""Warehouse membership on the controller: join, rejoin with an inventory, loss.

A warehouse is identified by its id and by `instance`, a random number its
process draws at start: the same id and instance after a reconnect is the
same process with the same data; a new instance at the same address is a
new process, and whatever the old one held is gone.

    joined     connected and registered
    rejoining  its connection dropped (or the controller restarted and knows it
               from the journal): its data is still served to clients that
               fetch from it, and it has `grace` seconds to come back
    lost       it did not come back in time, or its address now refuses
               connections or answers as another process: its samples are
               lost (DockDataLost when a consumer meets them)
    left       it shut down on purpose

When a connection drops the controller probes the warehouse's address once:
a refused connection (the process is gone) or another instance answering
retires it at once; otherwise it waits for the rejoin up to `grace`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from dockd import wire
from dockd._proto import dockd_pb2 as pb
from dockd.controller.core import Controller, Inventory
from dockd.errors import DockError, DockValueError, to_status
from dockd.peer import Peer

logger = logging.getLogger(__name__)

MAX_WAREHOUSES = 0xFFF0  # ids above are reserved markers (core.LOST_WAREHOUSE, core.NO_WAREHOUSE)
PROBE_TIMEOUT = 2.0


@dataclasses.dataclass(slots=True, eq=False)
class WarehouseEntry:
    id: int
    host: str
    port: int
    capacity: int
    unix: str = ""
    instance: int = 0
    state: str = "joined"
    peer: Peer | None = None  # its connection; None while away, and for the one hosted in this process
    local: bool = False
    timer: asyncio.TimerHandle | None = None

    @property
    def alive(self) -> bool:
        return self.state == "joined"

    @property
    def reachable(self) -> bool:
        """Its data can still be read: joined, or away but not given up on."""
        return self.state in ("joined", "rejoining")

    def info(self, used: int = 0) -> pb.WarehouseInfo:
        return pb.WarehouseInfo(id=self.id, host=self.host, port=self.port, alive=self.alive, capacity=self.capacity,
                                used=used, unix=self.unix, state=self.state)

    def record(self) -> dict:
        return {"id": self.id, "host": self.host, "port": self.port, "capacity": self.capacity, "unix": self.unix,
                "instance": self.instance, "state": self.state}


def inventory_of(req: pb.RegisterWarehouse) -> dict[str, Inventory]:
    """The wire inventory as index arrays (runs expanded)."""
    out = {}
    for p in req.inventory:
        cols = {}
        for c in p.columns:
            runs = np.asarray(c.runs, dtype=np.int64)
            if len(runs) % 2 or (runs[1::2] < runs[0::2]).any() or (runs < 0).any():
                raise DockValueError(f"inventory of partition {p.name!r} column {c.name!r} has malformed runs")
            cols[c.name] = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs.reshape(-1, 2)]) if len(runs) \
                else np.empty(0, np.int64)
        out[p.name] = Inventory(p.group_size or 1, p.nbytes, cols)
    return out


class Membership:
    """The warehouses of one dock. `on_change` is called when samples became lost or
    reachable again (waiting acquires are retried); `journal` may be None."""

    def __init__(self, core: Controller, journal, *, grace: float, on_change: Callable[[], None]) -> None:
        self.core = core
        self.journal = journal
        self.grace = grace
        self.on_change = on_change
        self.entries: dict[int, WarehouseEntry] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def get(self, wid: int) -> WarehouseEntry | None:
        return self.entries.get(wid)

    def infos(self, ids=None, *, usage: bool = True) -> list[pb.WarehouseInfo]:
        used = self.core.warehouse_bytes() if usage else {}
        ids = self.entries.keys() if ids is None else [i for i in ids if i in self.entries]
        return [self.entries[i].info(used.get(i, 0)) for i in ids]

    def _save(self, entry: WarehouseEntry) -> None:
        if self.journal is not None:
            self.journal.warehouse(entry.record())

    # -- restart --------------------------------------------------------------------------
    def restore(self, records: dict[int, dict]) -> None:
        """Warehouses known from the journal: each gets `grace` seconds to rejoin."""
        for wid, r in records.items():
            entry = WarehouseEntry(wid, r["host"], r["port"], r["capacity"], r["unix"], r["instance"], r["state"])
            self.entries[wid] = entry
            if entry.state in ("joined", "rejoining"):
                self._away(entry, "the controller restarted")

    # -- joining ----------------------------------------------------------------------------
    def register(self, peer: Peer | None, req: pb.RegisterWarehouse, commit: Callable[[pb.CommitRequest], np.ndarray]
                 ) -> pb.RegisterReply:
        """A warehouse joins, or rejoins with what it holds and the commits it is still waiting on."""
        for e in list(self.entries.values()):
            if e.reachable and (e.host, e.port) == (req.host, req.port) and e.instance != req.instance:
                self.retire(e, "a new process took over its address")
        entry = self.entries.get(req.id) if req.rejoin else None
        known = entry is not None and entry.instance == req.instance
        if not known:
            if req.rejoin and entry is None and req.id < MAX_WAREHOUSES:
                wid = req.id  # a controller without a journal: keep the id clients know it by
            else:
                wid = max(self.entries, default=-1) + 1
                if wid >= MAX_WAREHOUSES:
                    raise DockValueError(f"too many warehouses registered (limit {MAX_WAREHOUSES})")
            entry = self.entries[wid] = WarehouseEntry(wid, req.host, req.port, req.capacity, req.unix, req.instance)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        was = entry.state
        entry.host, entry.port, entry.capacity, entry.unix = req.host, req.port, req.capacity, req.unix
        entry.state, entry.peer, entry.local = "joined", peer, peer is None
        self._save(entry)
        reply = pb.RegisterReply(id=entry.id)
        if req.rejoin:
            reply.drop.extend(self._reconcile(entry, req, known, commit, reply))
            logger.info("[controller] warehouse rejoined id=%d address=%s:%d was=%s known=%s partitions=%d pending=%d",
                        entry.id, entry.host, entry.port, was if known else "unknown", known, len(req.inventory),
                        len(req.pending))
            self.on_change()
        else:
            logger.info("[controller] warehouse joined id=%d address=%s:%d capacity=%d", entry.id, entry.host, entry.port,
                        entry.capacity)
        return reply

    def _reconcile(self, entry: WarehouseEntry, req: pb.RegisterWarehouse, known: bool, commit, reply) -> list[str]:
        inventory = inventory_of(req)
        keys = self.core.put_keys.get(entry.id, {}) if known else {}
        for c in req.pending:
            done = keys.get(c.put_id) if c.put_id else None
            if done is None:
                continue
            # applied before the restart: the warehouse is about to store it, count it as held
            held = inventory.setdefault(c.partition, Inventory(c.group_size or 1, 0, {}))
            held.nbytes += c.nbytes
            for name in c.columns:
                prev = held.columns.get(name)
                held.columns[name] = done if prev is None else np.union1d(prev, done)
        drop = self.core.rejoin(entry.id, inventory, known=known)
        if self.journal is not None:
            self.journal.rejoin(entry.id, inventory, known)
        for c in req.pending:
            c.warehouse = entry.id
            out = reply.pending.add()
            try:
                out.indexes.extend(commit(c).tolist())  # a re-sent commit gets its first answer back
            except DockError as e:
                to_status(e, out.status)
        return drop

    # -- leaving ------------------------------------------------------------------------------
    def leave(self, peer: Peer, wid: int) -> None:
        entry = self.entries.get(wid)
        if entry is not None and entry.peer is peer and entry.alive:
            self.retire(entry, "it shut down", on_purpose=True)

    def connection_lost(self, peer: Peer) -> None:
        for entry in self.entries.values():
            if entry.peer is peer and entry.alive:
                entry.peer = None
                self._away(entry, "its connection closed")

    def _away(self, entry: WarehouseEntry, why: str) -> None:
        entry.state = "rejoining"
        self._save(entry)
        logger.warning("[controller] warehouse away id=%d address=%s:%d reason=%r; waiting up to %gs for it to rejoin",
                       entry.id, entry.host, entry.port, why, self.grace)
        entry.timer = self.loop.call_later(self.grace, self._give_up, entry)
        task = asyncio.ensure_future(self._probe(entry))
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)

    def _give_up(self, entry: WarehouseEntry) -> None:
        entry.timer = None
        if entry.state == "rejoining":
            self.retire(entry, f"it did not rejoin within {self.grace:g}s")

    async def _probe(self, entry: WarehouseEntry) -> None:
        """Tell a dead warehouse from an unreachable one: refused, or another process answering, is dead."""
        instance = await probe_instance(entry.host, entry.port)
        if entry.state != "rejoining":
            return
        if instance == 0:
            self.retire(entry, "its address refuses connections")
        elif instance is not None and instance != entry.instance:
            self.retire(entry, "another process answers at its address")

    def retire(self, entry: WarehouseEntry, why: str, *, on_purpose: bool = False) -> None:
        """A warehouse is gone: its samples become lost for every consumer that meets them."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.state = "left" if on_purpose else "lost"
        entry.peer = None
        held = self.core.warehouse_bytes().get(entry.id, 0)
        self.core.warehouse_lost(entry.id)
        if self.journal is not None:
            self.journal.lost(entry.id)
            self._save(entry)
        level = logging.WARNING if held and not on_purpose else logging.INFO
        logger.log(level, "[controller] warehouse %s id=%d address=%s:%d bytes=%d reason=%r",
                   entry.state, entry.id, entry.host, entry.port, held, why)
        self.on_change()

    def close(self) -> None:
        for entry in self.entries.values():
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None


_tasks: set[asyncio.Task] = set()


async def probe_instance(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> int | None:
    """The instance of the dockd daemon at host:port; 0 if the connection is refused,
    None if it cannot be told (timeout, not a dockd daemon)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return 0
    except (OSError, asyncio.TimeoutError):
        return None
    try:  # every daemon opens a connection with its challenge, which names its instance
        prefix = await asyncio.wait_for(reader.readexactly(wire.PREFIX.size), timeout)
        hlen, blen = wire.parse_prefix(prefix, 0, 0)
        if hlen > 4096:
            return None
        frame = wire.parse_header(await asyncio.wait_for(reader.readexactly(hlen), timeout))
        return frame.challenge.instance or None
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, DockError):
        return None
    finally:
        writer.close()
