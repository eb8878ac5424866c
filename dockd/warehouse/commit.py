"""Committers: how a put's metadata reaches the controller before its values are stored.

A put is committed first and stored after: the controller checks that explicit
indexes exist (and that their columns are unwritten) before any memory is spent
on them, so a put naming index 2**40 is refused without growing the index maps.
The put pipeline hands a `pb.CommitRequest` to its committer and gets the
outcome back through one callback, `then(outcome)` (a `dockd.terms.CommitOutcome`:
the indexes, or the error; whether the values are held already, where to copy
them, whether the partition was cleared since):

- `LocalCommitter`: the controller runs in this process. The commit is applied
  at once, or (new samples of a partition with `max_pending` samples pending)
  parked by the controller and answered later (paced).
- `RemoteCommitter`: over this warehouse's `ControllerLink`. Between the commit
  and its answer the put is in flight: a fetch of its partition that arrives
  first (the controller made the put visible before its reply reached us)
  waits for it to land; a clear that the link delivered after the commit's
  answer marks it `cleared`, so it is answered but not stored.

With --commit-window a remote committer also answers puts before their commit:
`take` gives a put of new samples indexes from a block the warehouse holds (None:
none now), the put is stored and answered, and `commit_windowed` sends its commit
with the link's next window. `flush` returns once those commits are applied (a
writer's read-your-writes), `return_blocks` gives a partition's blocks back (a
seal's handshake). Only a put that the controller then refuses (its samples were
cleared or deleted meanwhile) reaches its `then`, which frees what was stored.
With a data dir such a put's file keeps its commit; a restart hands the commits
not known answered to `recover`, and they go with the first registration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError
from dockd.net.peer import Peer
from dockd.node.tasks import spawn
from dockd.terms import CommitOutcome

logger = logging.getLogger(__name__)

#: Where a committer hands a commit's outcome.
Then = Callable[[CommitOutcome], None]


def commit_request(req: pb.PutRequest, nbytes: int, wid: int) -> pb.CommitRequest:
    """The commit of put `req` of `nbytes` payload bytes by warehouse `wid`: of a put as received, or of
    one read back from its data dir file (`readback`), whose runs hold its indexes, tags and token."""
    commit = pb.CommitRequest(
        partition=req.partition, indexes=req.indexes, new_count=req.new_count, group_size=req.group_size or 1,
        columns=[c.name for c in req.columns[:]], warehouse=wid, nbytes=nbytes, tags=req.tags,
        replica=req.replica, token=0 if req.replica else req.token,
    )
    if not req.indexes:  # new samples may wait for the partition's consumers (max_pending), as long as the put may
        commit.has_timeout, commit.timeout = True, req.timeout
    return commit


class Committer(Protocol):
    def commit(self, req: pb.CommitRequest, limit: float, peer: Peer, then: Then) -> None:
        """Commit a put's metadata (waiting up to `limit` seconds for an absent controller); `then` gets
        the outcome, at once or later from inside the event loop."""

    def in_flight(self, partition: str) -> bool:
        """Whether puts of `partition` are committed and not stored yet."""

    async def landed(self, partition: str, ready: Callable[[], bool]) -> None:
        """Return once `ready()` or no put of `partition` is in flight."""

    def cleared(self, partition: str) -> None:
        """`partition` was freed whole: puts applied before the clear must not land after it."""

    def take(self, partition: str, count: int, group_size: int) -> tuple[int, np.ndarray, int] | None:
        """(block id, indexes, put id of its commit) for a put of new samples answered before its commit;
        None: commit it first."""

    def commit_windowed(self, req: pb.CommitRequest, then: Then) -> None:
        """Commit an answered put with the next window; `then` gets its outcome (an error, `cleared`, or
        applied), unless its partition was cleared here since."""

    def recover(self, req: pb.CommitRequest, then: Then) -> None:
        """`commit_windowed` for a put answered before its commit by the last process on this data dir:
        sent with the first registration to its controller."""

    async def flush(self, partition: str) -> None:
        """Return once the commits of the puts answered before their commit (of `partition`; "": all) are applied."""

    async def return_blocks(self, partition: str) -> list[int]:
        """Take no more indexes from the partition's blocks, flush their commits; the blocks' ids."""


class LocalCommitter:
    """Commits to the controller hosted in this process (stored in the same turn of the loop)."""

    def __init__(self, controller) -> None:  # a dockd.controller.service.ControllerService
        self.controller = controller

    def commit(self, req: pb.CommitRequest, limit: float, peer: Peer, then: Then) -> None:
        # the gets waiting on the partition are retried once `then` stored the put here: they get its values
        # inline (one round trip), where retried inside the commit they found none and fetched them after
        woken: set[str] = set()
        try:
            res = self.controller.commit(req, lambda res: then(self._copy_to(req, res)), peer,
                                         woken)  # (None: paced)
        except Exception as e:  # noqa: BLE001 - the put's answer
            then(CommitOutcome(error=e))
            return
        try:
            if res is not None:
                then(self._copy_to(req, res))
        finally:
            self.controller.wake(woken)

    def _copy_to(self, req: pb.CommitRequest, res: CommitOutcome) -> CommitOutcome:
        """The outcome, with the warehouse to copy the put to (--replicas 2), if any."""
        if res.error is not None or res.stored:
            return res
        target = self.controller.replication.target_of(req, np.asarray(res.indexes))
        return res if target is None else dataclasses.replace(res, replica=target)

    def in_flight(self, partition: str) -> bool:
        return False

    async def landed(self, partition: str, ready: Callable[[], bool]) -> None:
        return

    def take(self, partition: str, count: int, group_size: int) -> tuple[int, np.ndarray, int] | None:
        return None  # (a commit in this process costs no round trip)

    def commit_windowed(self, req: pb.CommitRequest, then: Then) -> None:
        raise AssertionError("take() gives no blocks: nothing is committed in a window here")

    def recover(self, req: pb.CommitRequest, then: Then) -> None:
        # (a file of a process that joined a controller of another process: judged as any block commit)
        self.commit(req, -1, None, then)  # type: ignore[arg-type]

    async def flush(self, partition: str) -> None:
        return

    async def return_blocks(self, partition: str) -> list[int]:
        return []

    def cleared(self, partition: str) -> None:
        return


class RemoteCommitter:
    """Commits over the link to a controller in another process."""

    def __init__(self, link) -> None:  # a dockd.node.controller_link.ControllerLink
        self._link = link
        self._recovered: list[tuple[pb.CommitRequest, Then]] = []  # (see recover) waiting for the link
        self._pending: dict[str, int] = {}  # partition -> puts committed, not stored yet
        # partition -> [put id, cleared] of its puts waiting on the controller
        self._committing: dict[str, list[list]] = {}
        self._landing: list[asyncio.Future] = []  # fetches waiting for a put to land
        # partition -> [cleared here] of its answered puts whose windowed commit is not answered yet
        self._windowed: dict[str, list[list[bool]]] = {}

    @property
    def link(self):
        return self._link

    @link.setter
    def link(self, link) -> None:
        """The link is made (before it starts): the recovered commits go into its pending ones."""
        self._link = link
        if link is not None:
            waiting, self._recovered = self._recovered, []
            for req, then in waiting:
                self.commit_windowed(req, then)

    def recover(self, req: pb.CommitRequest, then: Then) -> None:
        if self._link is None:
            self._recovered.append((req, then))
        else:
            self.commit_windowed(req, then)

    def given_up(self) -> list[tuple[pb.CommitRequest, Then]]:
        """The recovered commits still waiting for a link (this committer is being replaced)."""
        waiting, self._recovered = self._recovered, []
        return waiting

    def commit(self, req: pb.CommitRequest, limit: float, peer: Peer, then: Then) -> None:
        partition = req.partition
        self._pending[partition] = self._pending.get(partition, 0) + 1
        answer = self.link.commit(req, limit)
        entry = [req.put_id, False]
        committing = self._committing.setdefault(partition, [])
        committing.append(entry)
        answer.add_done_callback(lambda f: self._answered(f, partition, entry, committing, then))

    def _answered(self, f: asyncio.Future, partition: str, entry: list, committing: list, then: Then) -> None:
        committing.remove(entry)
        if not committing and self._committing.get(partition) is committing:
            del self._committing[partition]
        try:
            if f.cancelled():
                then(CommitOutcome(error=DockConnectionError("commit cancelled")))
            else:  # (the link resolves every commit with its outcome, failures included)
                then(dataclasses.replace(f.result(), cleared=True) if entry[1] else f.result())
        finally:
            self._pending[partition] -= 1
            if not self._pending[partition]:
                del self._pending[partition]
            landing, self._landing = self._landing, []
            for fut in landing:
                if not fut.done():
                    fut.set_result(None)

    def in_flight(self, partition: str) -> bool:
        return partition in self._pending

    async def landed(self, partition: str, ready: Callable[[], bool]) -> None:
        while partition in self._pending and not ready():
            fut = asyncio.get_running_loop().create_future()
            self._landing.append(fut)
            await fut

    def cleared(self, partition: str) -> None:
        for entry in self._committing.get(partition, ()):
            # A put whose commit was answered before this free (the link delivers both in order)
            # was applied before the clear: it must not land after it.
            entry[1] = entry[1] or self.link.answered(entry[0])
        for gone in self._windowed.get(partition, ()):
            gone[0] = True  # (freed with the partition: its outcome frees nothing, its indexes may be reused)
        if self.link is not None:
            self.link.blocks.drop(partition)

    def take(self, partition: str, count: int, group_size: int) -> tuple[int, np.ndarray, int] | None:
        """Indexes from a block of the link's, and the put id of their commit (None: no block holds them
        now); asks for the next block ahead, in the background."""
        link = self.link
        if link is None or not link.grants or not link.joined.is_set():
            return None
        got = link.blocks.take(partition, count, group_size)
        want = link.blocks.wants(partition, count, group_size)
        if want:
            spawn(self._ask_block(partition, want, group_size))
        return None if got is None else (*got, link.next_put_id())

    async def _ask_block(self, partition: str, count: int, group_size: int) -> None:
        link = self.link
        try:
            if link.peer is None:
                raise DockConnectionError("not connected")
            frame = pb.Frame(block=pb.BlockRequest(partition=partition, count=count, group_size=group_size))
            reply, _ = await asyncio.wait_for(link.peer.request(frame), link.grace)
        except Exception as e:  # noqa: BLE001 - the next put asks again; meanwhile puts are answered after their commit
            link.blocks.failed(partition)
            logger.debug("[warehouse] no block of indexes for partition=%s: %s", partition, e)
            return
        r = reply.block_reply
        if not r.block:
            logger.debug("[warehouse] the controller grants no block for partition=%s now: %s", partition, r.why)
        link.blocks.granted(partition, r.block, r.start, r.count, group_size)

    def commit_windowed(self, req: pb.CommitRequest, then: Then) -> None:
        partition = req.partition
        gone = [False]
        entries = self._windowed.setdefault(partition, [])
        entries.append(gone)

        def answered(f: asyncio.Future) -> None:
            entries.remove(gone)
            if not entries and self._windowed.get(partition) is entries:
                del self._windowed[partition]
            if f.cancelled():
                return
            res = f.result()
            if res.cleared:  # (the controller dropped its block: the rest of it is no longer ours to hand out)
                self.link.blocks.forget(req.block)
            if not gone[0]:
                then(res)

        self.link.commit_windowed(req).add_done_callback(answered)

    async def flush(self, partition: str) -> None:
        link = self.link
        futs = [] if link is None else link.windowed(partition)
        if not futs:
            return
        _, waiting = await asyncio.wait(futs, timeout=link.grace)
        if waiting:
            raise DockConnectionError(
                f"{len(waiting)} commits of puts this warehouse answered before their commit did not reach the "
                f"controller at {link.address} within {link.grace:g}s; they are kept and sent once it is back")

    async def return_blocks(self, partition: str) -> list[int]:
        if self.link is None:
            return []
        ids = self.link.blocks.drop(partition)
        await self.flush(partition)
        return ids


class RoutingCommitter:
    """Several controllers: each put commits to the controller that owns its partition
    (`dockd.owners`), through that controller's committer (local or over its link)."""

    def __init__(self, committers: list[LocalCommitter | RemoteCommitter]) -> None:
        self._committers: list[LocalCommitter | RemoteCommitter] = []
        self.committers = committers

    @property
    def committers(self) -> list[LocalCommitter | RemoteCommitter]:
        return self._committers

    @committers.setter
    def committers(self, committers: list[LocalCommitter | RemoteCommitter]) -> None:
        """(Re)placed once the node knows the dock's controllers: recovered commits still waiting in a
        committer replaced go to the one that owns their partition now."""
        old, self._committers = self._committers, committers
        for c in old:
            if isinstance(c, RemoteCommitter) and c not in committers:
                for req, then in c.given_up():
                    self.recover(req, then)

    def of(self, partition: str) -> LocalCommitter | RemoteCommitter:
        return self.committers[owners.owner_index(partition, len(self.committers))]

    def commit(self, req: pb.CommitRequest, limit: float, peer: Peer, then: Then) -> None:
        self.of(req.partition).commit(req, limit, peer, then)

    def in_flight(self, partition: str) -> bool:
        return self.of(partition).in_flight(partition)

    async def landed(self, partition: str, ready: Callable[[], bool]) -> None:
        await self.of(partition).landed(partition, ready)

    def cleared(self, partition: str) -> None:
        self.of(partition).cleared(partition)

    def take(self, partition: str, count: int, group_size: int) -> tuple[int, np.ndarray, int] | None:
        return self.of(partition).take(partition, count, group_size)

    def commit_windowed(self, req: pb.CommitRequest, then: Then) -> None:
        self.of(req.partition).commit_windowed(req, then)

    def recover(self, req: pb.CommitRequest, then: Then) -> None:
        self.of(req.partition).recover(req, then)

    async def flush(self, partition: str) -> None:
        if partition:
            await self.of(partition).flush(partition)
        else:
            await asyncio.gather(*(c.flush("") for c in self.committers))

    async def return_blocks(self, partition: str) -> list[int]:
        return await self.of(partition).return_blocks(partition)
