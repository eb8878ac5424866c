"""Pacing of puts (max_pending): a commit of new samples to a partition that has max_pending
samples waiting for its consumers waits, in order, until they take some or its timeout passes
(DockFull). Its warehouse holds the put's data meanwhile; the commit's answer goes to `then`."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from dockd._proto import dockd_pb2 as pb
from dockd.controller.clock import Timer, Timers, seconds
from dockd.controller.core import Controller
from dockd.controller.membership import Membership
from dockd.errors import DockFull, DockStateFull, DockValueError
from dockd.net.peer import Peer
from dockd.terms import CommitOutcome


@dataclasses.dataclass(slots=True, eq=False)
class Paced:
    """A commit of new samples waiting because its partition has max_pending samples pending."""
    req: pb.CommitRequest
    then: Callable[[CommitOutcome], None]
    peer: Peer | None
    timer: Timer | None = None


class Pacer:
    """The commits waiting for their partitions' consumers. `apply` applies a commit (and wakes the
    gets waiting for it): a commit let in, or one re-sent that was applied already."""

    def __init__(self, core: Controller, members: Membership, timers: Timers, *,
                 apply: Callable[[pb.CommitRequest], CommitOutcome]) -> None:
        self.core = core
        self.members = members
        self.timers = timers
        self.apply = apply
        self.paced: dict[str, list[Paced]] = {}  # partition -> commits waiting for max_pending, in order
        self._due: set[str] = set()
        self.total = 0  # commits that had to wait for max_pending

    def must_wait(self, req: pb.CommitRequest) -> bool:
        return bool(req.has_timeout and req.new_count and not req.indexes and (
            req.partition in self.paced or self.core.must_wait(req.partition, req.new_count)))

    def park(self, req: pb.CommitRequest, then, peer: Peer | None) -> CommitOutcome | None:
        if req.put_id and req.put_id in self.core.put_keys.get(req.warehouse, ()):
            return self.apply(req)  # re-sent: answered again
        entry = self.members.get(req.warehouse)
        if entry is None or not entry.alive:
            raise DockValueError(f"warehouse {req.warehouse} is not a live member of this dock")
        if req.timeout == 0:
            raise self.full_error(req.partition, 0)
        p = Paced(req, then, peer)
        self.paced.setdefault(req.partition, []).append(p)
        self.total += 1
        if peer is not None:
            peer.parked += 1
        if req.timeout > 0:
            p.timer = self.timers.call_later(req.timeout, self._expired, req.partition, p)
        return None

    def full_error(self, partition: str, timeout: float) -> DockFull:
        part = self.core.partitions.get(partition)
        pending, limit = (part.pending(), part.max_pending) if part is not None else (0, 0)
        behind = part.most_behind() if part is not None else None
        who = (f" Consumer {behind[0]!r} is the furthest behind ({behind[1]} not yet handed to it); if nobody runs "
               f"it any more, dock.drop_consumer({partition!r}, {behind[0]!r}) lets the puts in."
               if behind is not None and behind[1] else "")
        return DockFull(f"partition {partition!r} is full of pending samples: {pending} wait for its consumers "
                        f"(max_pending={limit}), and this put waited {seconds(timeout)} for them to take some. "
                        "Consume faster, raise max_pending (create_partition), or give the put a longer timeout; "
                        "the put was not stored." + who)

    def _expired(self, partition: str, p: Paced) -> None:
        p.timer = None
        self.unpace(partition, p)
        p.then(CommitOutcome(error=self.full_error(partition, p.req.timeout)))

    def unpace(self, partition: str, p: Paced) -> None:
        ps = self.paced.get(partition)
        if ps and p in ps:
            ps.remove(p)
            if p.peer is not None:
                p.peer.parked -= 1
            if not ps:
                del self.paced[partition]
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None

    def soon(self, partition: str) -> None:
        """Let waiting commits of a partition in once the current request is done (never from
        inside a wake: applying a commit wakes gets itself)."""
        if partition in self.paced and partition not in self._due:
            if not self._due:
                asyncio.get_running_loop().call_soon(self._run)
            self._due.add(partition)

    def _run(self) -> None:
        due, self._due = self._due, set()
        core = self.core
        for partition in due:
            ps = self.paced.get(partition)
            while ps and not core.must_wait(partition, ps[0].req.new_count):
                p = ps[0]
                self.unpace(partition, p)
                res: CommitOutcome
                try:
                    res = self.apply(p.req)
                except DockStateFull:
                    self.paced.setdefault(partition, []).insert(0, p)  # (it waits on; tried again soon)
                    if p.peer is not None:
                        p.peer.parked += 1
                    self.timers.call_later(1.0, self.soon, partition)
                    break
                except Exception as e:  # noqa: BLE001 - the put's answer
                    res = CommitOutcome(error=e)
                p.then(res)
                ps = self.paced.get(partition)

    def fail(self, partition: str, exc: BaseException) -> None:
        for p in list(self.paced.get(partition, ())):
            self.unpace(partition, p)
            p.then(CommitOutcome(error=exc))

    def drop_peer(self, peer: Peer) -> None:
        """A connection closed (a warehouse re-sends its unanswered commits when it rejoins)."""
        for part, ps in list(self.paced.items()):
            for p in [p for p in ps if p.peer is peer]:
                self.unpace(part, p)

    def close(self, exc: BaseException) -> None:
        for part in list(self.paced):
            self.fail(part, exc)
