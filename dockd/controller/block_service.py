"""The controller's side of blocks of indexes on the wire (`--commit-window`; the registry and the catalog's
part are `blocks`): a warehouse's `BlockRequest` granted or refused, a block commit judged before it is
applied, a seal's handshake with the owners of the partition's open blocks, and the blocks a rejoining
warehouse no longer names.

Grants: only with a state dir (a granted block outlives a restart) and one copy of each put (not
`--replicas 2`), to a live member over its link, for a partition that is not sealed or sealing, has no
`max_pending` (those puts are paced at their commit) and is not being loaded; `count` a positive
multiple of the partition's group size, within `--max-samples`.
A refusal that may pass ("not now") is `BlockReply(block=0, why=...)`; a malformed request raises.

A seal of a partition with open blocks sends each owner `Frame(return_blocks=ReturnBlocks(partition))`
over its link (within `RETURN_TIMEOUT` seconds) and expects `Frame(return_blocks_reply=ReturnBlocksReply
(blocks=[ids]))` once the commits of those blocks are applied; then every block that owner holds of the
partition is dropped (its unwritten samples deleted: holes) and the partition sealed. An owner that is
away or does not answer fails the seal, naming it; nothing of that owner is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.controller import blocks
from dockd.controller.block_drops import drop_blocks
from dockd.controller.core import Controller
from dockd.controller.journal import Journal, ahead
from dockd.errors import DockConnectionError, DockFull, DockStateFull, DockValueError
from dockd.net.peer import Peer
from dockd.terms import CommitOutcome

if TYPE_CHECKING:
    from dockd.controller.membership import Membership
    from dockd.controller.waiters import Waiters

logger = logging.getLogger(__name__)

RETURN_TIMEOUT = 10.0
"""Seconds a seal waits for an owner to give its blocks back (at most the daemon timeout)."""

T = TypeVar("T")


class Blocking:
    """Grants, block commits and seals' handshakes of one controller. `loading`: the partitions a
    checkpoint's load is filling."""

    def __init__(self, core: Controller, journal: Journal | None, members: Membership, *, waiting: Waiters,
                 loading: set[str], daemon_timeout: float, replicas: int = 1) -> None:
        self.core = core
        self.journal = journal
        self.replicas = replicas
        self.members = members
        self.waiting = waiting
        self.loading = loading
        self.timeout = min(RETURN_TIMEOUT, daemon_timeout)
        self.sealing: dict[str, asyncio.Future] = {}  # partition -> done when its seal's handshake ends

    # -- grants ---------------------------------------------------------------------------------
    @property
    def grants(self) -> bool:
        """Whether this controller grants blocks at all (`RegisterReply.blocks`)."""
        return self.journal is not None and self.replicas == 1

    def grant(self, peer: Peer | None, req: pb.BlockRequest) -> pb.BlockReply:
        """A block of new indexes for the warehouse on connection `peer` (see the module docstring)."""
        partition, count, gs = req.partition, req.count, req.group_size or 1
        if not partition:
            raise DockValueError("a block request names its partition")
        if count < 1 or count % gs or count > limits.MAX_SAMPLES:
            raise DockValueError(f"a block of indexes is a positive multiple of group_size={gs} samples, at most "
                                 f"{limits.MAX_SAMPLES}; got {count}")
        owner = next((e for e in self.members.entries.values() if e.peer is peer and e.alive), None)
        if owner is None or peer is None:
            raise DockValueError("a block of indexes is granted to a warehouse over its link, once it has joined")
        why = self._not_now(partition)
        if why:
            return pb.BlockReply(why=why)
        part = self.core.partitions.get(partition)
        start = part.size if part is not None else 0
        journal = self.journal
        assert journal is not None  # (_not_now: no grants without one)
        try:
            with ahead(journal):
                journal.room()
                journal.block(self.core.blocks.next_id, partition, owner.id, start, count, gs)
                block = self.core.grant_block(partition, owner.id, count, gs)
        except (DockFull, DockStateFull) as e:
            return pb.BlockReply(why=str(e))
        logger.debug("[controller] block granted block=%d partition=%s warehouse=%d indexes=%d..%d", block.id,
                     partition, owner.id, block.start, block.stop - 1)
        return pb.BlockReply(block=block.id, start=block.start, count=block.count)

    def _not_now(self, partition: str) -> str:
        """Why no block of `partition` is granted now ("" when one may be)."""
        part = self.core.partitions.get(partition)
        if self.journal is None:
            return "the controller keeps no state dir (--state-dir): a block would not outlive its restart"
        if self.replicas > 1:
            return "the dock keeps a copy of every put (--replicas 2): a put is answered once its copy is made"
        if partition in self.sealing:
            return f"partition {partition!r} is being sealed"
        if part is not None and part.sealed:
            return f"partition {partition!r} is sealed: it takes no new samples"
        if part is not None and part.max_pending:
            return f"partition {partition!r} paces puts (max_pending={part.max_pending}) at their commit"
        if partition in self.loading:
            return f"partition {partition!r} is being loaded from a checkpoint"
        return ""

    # -- block commits ----------------------------------------------------------------------------
    def commit(self, req: pb.CommitRequest, woken: set[str] | None) -> CommitOutcome | None:
        """A block commit whose put id was not applied before: None when its columns are to be written (as
        any commit of existing samples), else its answer (cleared: nothing recorded, and the samples of it not
        deleted yet are deleted when its block is still there; or the indexes a re-send got before)."""
        verdict, idx = blocks.judge(self.core.catalog, self.core.blocks, req.block, req.warehouse, req.partition,
                                    req.indexes, req.token, req.columns)
        if verdict == blocks.APPLY:
            return None
        if verdict == blocks.AGAIN:
            return CommitOutcome(idx)
        if len(idx):
            with ahead(self.journal):
                if self.journal is not None:
                    self.journal.delete(req.partition, idx)
                self.core.delete(req.partition, idx)
            if woken is None:
                self.waiting.wake(req.partition)
            else:
                woken.add(req.partition)
        logger.info("[controller] block commit cleared block=%d partition=%s warehouse=%d samples=%d deleted=%d",
                    req.block, req.partition, req.warehouse, len(req.indexes), len(idx))
        return CommitOutcome(cleared=True)

    def written_out(self, commits, results) -> None:
        """After a batch of commits is applied: drop the blocks it wrote to that have no sample left unwritten.
        Nothing of them is to delete, their owner hands out no more of them, and a re-send of one of their
        commits is judged applied (`blocks.judge`): kept, they would only grow the registry (and each
        snapshot) with a stream that is never sealed. A block with a hole (a put that did not fit its rest,
        or failed to store) goes once its owner commits to a later block (`passed`)."""
        named = {c.block for c in commits}
        named.discard(0)
        get, partitions = self.core.blocks.by_id.get, self.core.partitions
        done = [b.id for bid in sorted(named)
                if (b := get(bid)) is not None and blocks.written_out(partitions.get(b.partition), b)]
        if done:
            drop_blocks(self.core, self.journal, done, "written in full", quiet=True)
        self.passed([(c.block, c.warehouse, c.partition) for c, r in zip(commits, results)
                     if c.block and r.status.code == pb.OK and not r.wait and not r.cleared])

    def passed(self, applied) -> None:
        """After block commits were applied (each as its block, warehouse and partition): drop the blocks their
        owners moved past (`blocks.passed`): what is left unwritten of them is holes. Only applied ones: a
        commit refused (a full state dir) goes again, ahead of its owner's later ones (`link_commits.hold`)."""
        ids = blocks.passed(self.core.blocks, applied)
        if ids:
            self._wake(drop_blocks(self.core, self.journal, ids, "its owner commits to a later block", quiet=True))

    # -- membership -----------------------------------------------------------------------------
    def registered(self, wid: int, req: pb.RegisterWarehouse, same_instance: bool) -> None:
        """After a registration (its pending commits applied): a rejoin of the same process keeps the blocks
        it names and drops its others; any other drops every block its id held."""
        held = self.core.blocks.of_owner(wid)
        keep = set(req.blocks) if req.rejoin and same_instance else set()
        gone = [b.id for b in held if b.id not in keep]
        if gone:
            self._wake(drop_blocks(self.core, self.journal, gone, f"warehouse {wid} registered without them"))

    def _wake(self, partitions: set[str]) -> None:
        for partition in partitions:
            self.waiting.wake(partition)

    # -- seal's handshake -------------------------------------------------------------------------
    def check_closed(self, partition: str) -> None:
        """Raise unless the partition has no block open (nor a seal taking them back)."""
        if partition in self.sealing or self.core.blocks.of_partition(partition):
            raise DockValueError(f"partition {partition!r} has blocks of indexes open on warehouses: a seal "
                                 "takes them back first (ControllerService.seal)")

    async def seal(self, partition: str, then: Callable[[], T]) -> T:
        """Take back the open blocks of `partition` from their owners, then `then()` (the seal itself).
        Seals of one partition go one at a time."""
        while (busy := self.sealing.get(partition)) is not None:
            await asyncio.shield(busy)
        if not self.core.blocks.of_partition(partition):
            return then()
        done = asyncio.get_running_loop().create_future()
        self.sealing[partition] = done
        try:
            await self._take_back(partition)
            return then()
        finally:
            del self.sealing[partition]
            done.set_result(None)

    async def _take_back(self, partition: str) -> None:
        owners = sorted({b.owner for b in self.core.blocks.of_partition(partition)})
        asks: list[tuple[int, asyncio.Future]] = []
        failed: list[str] = []
        for wid in owners:
            entry = self.members.get(wid)
            if entry is None or not entry.alive or entry.peer is None:
                state = entry.state if entry is not None else "unknown"
                failed.append(self._owner(wid, partition, f"it is {state}, not connected"))
                continue
            ask = entry.peer.request(pb.Frame(return_blocks=pb.ReturnBlocks(partition=partition)))
            asks.append((wid, asyncio.ensure_future(asyncio.wait_for(ask, self.timeout))))
        answers = await asyncio.gather(*(fut for _, fut in asks), return_exceptions=True)
        for (wid, _), res in zip(asks, answers):
            if isinstance(res, BaseException):
                why = f"it did not answer within {self.timeout:g}s" if isinstance(res, asyncio.TimeoutError) \
                    else f"it answered {type(res).__name__}: {res}"
                failed.append(self._owner(wid, partition, why))
                continue
            # (it stopped taking from every block of the partition, the used-up ones it no longer lists too:
            # ReturnBlocks is per partition, so all that owner's blocks of it go)
            held = [b.id for b in self.core.blocks.of_owner(wid, partition)]
            drop_blocks(self.core, self.journal, held, f"partition {partition!r} is being sealed")
        if failed:
            raise DockConnectionError(
                f"cannot seal partition {partition!r}: {'; '.join(failed)}. Its puts answered before their commit "
                "may still be on their way: bring that warehouse back (its link rejoins by itself) and seal again, "
                "or restart it (on its --data-dir it sends the commits its files keep first; without one its blocks "
                "are dropped, and its puts not committed with them)")

    def _owner(self, wid: int, partition: str, why: str) -> str:
        entry = self.members.get(wid)
        where = f"{entry.host}:{entry.port}" if entry is not None else "an unknown address"
        ids = [b.id for b in self.core.blocks.of_owner(wid, partition)]
        return f"warehouse {wid} at {where} holds block(s) {ids} of its indexes and {why}"

