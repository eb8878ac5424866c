"""The controller's side of `--replicas 2` on the wire (the records are in `replicas`).

    commit     a put's commit is answered with the warehouse its home copies it to (`target`),
               and its values are marked as having a copy on the way; the copy's own commit
               (`CommitRequest.replica`, from the warehouse that stored it) is journaled and recorded
    repair     every REPAIR_INTERVAL seconds: copies that did not arrive within COPY_DEADLINE
               are forgotten, and values with a live home and no replica are copied by their
               home (`ReplicateRequest`) to its target, at most MAX_REPAIRS requests at a time
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller import replica_map as replicas
from dockd.controller.clock import Timer, Timers
from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.controller.membership import Membership
from dockd.controller.warehouse_calls import LocalWarehouse
from dockd.errors import DockValueError
from dockd.logutil import Throttle

logger = logging.getLogger(__name__)

REPAIR_INTERVAL = 1.0
COPY_DEADLINE = 60.0  # seconds a put's copy may take before its values count as without a replica
MAX_REPAIRS = 4  # repair requests out at a time
REPAIR_SAMPLES = 4096  # samples per repair request
_failures = Throttle()  # (a repair that keeps failing, e.g. into a full warehouse, is retried every second)


class Replication:
    """`replicas` copies of each value (1 or 2), over `members`; the copies' commits are journaled in
    `journal` (None: none kept); a repair asked of `local` (the warehouse in this process) or of a
    warehouse over its link is given up after `daemon_timeout` seconds."""

    def __init__(self, core: Controller, members: Membership, journal: Journal | None, timers: Timers, *,
                 replicas: int, local: LocalWarehouse | None, daemon_timeout: float) -> None:
        if replicas not in (1, 2):
            raise DockValueError(f"--replicas is 1 (one copy of each value) or 2 (two warehouses), got {replicas}")
        self.core = core
        self.members = members
        self.journal = journal
        self.timers = timers
        self.local = local
        self.daemon_timeout = daemon_timeout
        self.replicas = replicas
        self._timer: Timer | None = None
        self._copies: list[tuple[float, str, list[str], np.ndarray]] = []  # (deadline, partition, columns, indexes)
        self._repairs: set[asyncio.Task] = set()
        self.repaired = 0  # values copied by repairs (for tests and logs)

    def start(self) -> None:
        if self.replicas > 1 and self._timer is None:
            self._timer = self.timers.call_later(REPAIR_INTERVAL, self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in self._repairs:
            task.cancel()

    # -- puts -----------------------------------------------------------------------------------
    def _joined(self) -> list[int]:
        return [e.id for e in self.members.entries.values() if e.state == "joined"]

    def target_of(self, req: pb.CommitRequest, idx: np.ndarray) -> pb.WarehouseInfo | None:
        """Where the warehouse that committed `req` copies it before answering its writer (None: no
        copy: one replica, a copy's own commit, or no other warehouse joined; a repair makes it later)."""
        if self.replicas < 2 or req.replica or req.partition not in self.core.partitions:
            return None
        wid = replicas.target(self._joined(), req.warehouse)
        if wid is None:
            return None
        idx = np.asarray(idx, dtype=np.int64)
        part = self.core.partitions[req.partition]
        replicas.mark_pending(part, req.columns, idx)
        self._copies.append((self.timers.clock() + COPY_DEADLINE, req.partition, req.columns[:], idx))
        return self.members.infos([wid], usage=False)[0]

    def commit(self, req: pb.CommitRequest) -> np.ndarray:
        """A warehouse holds a copy of written values, or (their own warehouse) could not make it;
        journaled ahead, like a commit (a failed copy replays to nothing: copies on their way are
        not journaled)."""
        if self.journal is not None and self.core.catalog.recall(req.warehouse, req.put_id) is None:
            self.journal.room()
            self.journal.replica(req.partition, req.columns, req.warehouse, list(req.indexes), req.nbytes, req.put_id)
        return self.core.commit_replica(req.partition, req.columns[:], warehouse=req.warehouse,
                                       indexes=list(req.indexes), nbytes=req.nbytes, put_id=req.put_id)

    def readable(self, partition: str, columns, idx: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """A get's locations (columns x samples), with values whose warehouse is away (rejoining, or not
        answering) but whose replica's is joined read from the replica."""
        away = [e.id for e in self.members.entries.values() if e.state in ("rejoining", "unresponsive")]
        if not away or not np.isin(locs, away).any():
            return locs
        part = self.core.partitions[partition]
        joined = self._joined()
        out = locs.copy()
        for row, c in enumerate(columns):
            rl = part.rloc.get(c)
            if rl is None:
                continue
            alt = rl[idx]
            swap = np.isin(out[row], away) & np.isin(alt, joined)
            out[row][swap] = alt[swap]
        return out

    def counts(self, partition: str) -> tuple[int, int]:
        return replicas.counts(self.core.partitions[partition])

    # -- repairs --------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._timer = self.timers.call_later(REPAIR_INTERVAL, self._tick)
        now = self.timers.clock()
        keep = []
        for copy in self._copies:
            deadline, partition, columns, idx = copy
            part = self.core.partitions.get(partition)
            if part is None:
                continue
            if deadline <= now:
                replicas.unmark(part, columns, idx)
            else:
                keep.append(copy)
        self._copies = keep
        if len(self._repairs) < MAX_REPAIRS:
            self._repair()

    def _repair(self) -> None:
        members = self.members
        joined = self._joined()
        live = {e.id for e in members.entries.values() if e.alive}
        for part in list(self.core.partitions.values()):
            for (home, col), idx in replicas.missing(part, self.core.dead_warehouses, live).items():
                wid = replicas.target(joined, home)
                if wid is None:
                    continue
                idx = idx[:REPAIR_SAMPLES]
                replicas.mark_pending(part, [col], idx)
                req = pb.ReplicateRequest(partition=part.name, indexes=idx.tolist(), columns=[col],
                                          target=members.infos([wid], usage=False)[0])
                task = asyncio.ensure_future(self._ask(home, req, idx))
                self._repairs.add(task)
                task.add_done_callback(self._repairs.discard)
                if len(self._repairs) >= MAX_REPAIRS:
                    return

    async def _ask(self, home: int, req: pb.ReplicateRequest, idx: np.ndarray) -> None:
        """Ask `home` to copy values to req.target; values whose copy failed are repaired again later."""
        try:
            entry = self.members.get(home)
            if entry is None or not entry.alive:
                raise DockValueError(f"warehouse {home} is not live")
            if entry.local:
                assert self.local is not None  # (a local member is the warehouse in this process)
                await asyncio.wait_for(self.local.replicate(req), self.daemon_timeout)
            else:
                assert entry.peer is not None
                await asyncio.wait_for(entry.peer.request(pb.Frame(replicate=req)), self.daemon_timeout)
            self.repaired += len(idx)
            logger.info("[controller] replicated partition=%s column=%s samples=%d from=%d to=%d", req.partition,
                        req.columns[0], len(idx), home, req.target.id)
        except Exception as e:  # noqa: BLE001 - a repair that failed is retried
            part = self.core.partitions.get(req.partition)
            if part is not None:
                replicas.unmark(part, req.columns, idx)
            _failures.log(logger, logging.WARNING, "[controller] replicating partition=%s samples=%d from warehouse %d "
                          "to %d failed: %s; retried", req.partition, len(idx), home, req.target.id, e)
