"""The put pipeline: one path for every put, whatever carries its bytes and wherever its controller is.

    admit    check the request's header (a malformed one spends no room) and reserve its
             room, waiting in the capacity queue while the warehouse is full
    receive  the body arrives in storage of ours (`Admission.allocate`), or a same-host
             writer's staged payload is copied in, or (bodiless) there is none. A writer
             that lends its staging buffer (`_lendable`) is answered before the bulk of
             its payload is copied in: only what the checks read is copied first. A put
             sent before its writer's copy (PutRequest.staging_pending) is checked
             meanwhile and goes on to its commit once the writer signals (`pending`)
    take     device runs (put(device="keep")) are copied into the device tier or spilled
    validate the put against its bytes, once (`_validate`): runs fit, msgpack values decode,
             explicit indexes' columns are unwritten here
    commit   through the committer (controller in this process, or over the link); with
             --commit-window a put of new samples that a block of indexes holds is stored (with a
             data dir: its file, keeping its commit, fsync'd) and answered first, and its commit
             goes with the link's next window (`_before_commit`; a restart sends again those of
             its files not recorded committed: `recover`)
    store    once the commit is answered; a put kept in memory only is answered first and
             stored right after, in the same turn of the loop (`_answer_first`)
    copy     (--replicas 2) to the warehouse the commit's answer names (`replica.Replicator`);
             then the writer is answered. A copy that fails leaves the values with one
             warehouse (the put is answered, and the controller's repair copies them later)

A put re-sent with a token already seen (the client lost the reply) is
answered with the first attempt's outcome and stores nothing. Stores cannot
fail after the checks but for writing a data dir file; a fetch that arrives
between commit and store waits for the store (see `commit.RemoteCommitter`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from dockd import limits, runcheck
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockAuthError, DockConnectionError, DockError, DockProtocolError
from dockd.logutil import Throttle
from dockd.net import memfd
from dockd.net.peer import Peer
from dockd.node.metrics import Metrics
from dockd.node.tasks import failed, spawn
from dockd.terms import CommitOutcome
from dockd.warehouse.admission import Admission
from dockd.warehouse.commit import Committer, commit_request
from dockd.warehouse.core import Warehouse
from dockd.warehouse.datadir import DataDir
from dockd.warehouse.device_put import take_device
from dockd.warehouse.pending import Signal
from dockd.warehouse.put_tokens import Tokens
from dockd.warehouse.putfile import Room
from dockd.warehouse.replica_copy import Replicator
from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)

COPY_OFF_LOOP = 64 << 20
"""A staged payload this big is copied in by a worker thread: into fresh pages (a warehouse's first
puts of a size) that takes ~1 s per GiB on a VM, long enough to miss heartbeats and probes; under it
the copy stays on the loop (at most ~50 ms into fresh pages, a few ms into warm ones)."""

WRITE_OFF_LOOP = 16 << 20
"""With a data dir, a put this big has its body written into its file and flushed to disk by a worker
thread before its commit (a 512 MiB put held the event loop for about 2 s on a VM's disk); the loop
then writes only the header. Smaller puts are written whole after the commit, on the loop."""

_copy_failures = Throttle()  # (every put fails its copy while the second warehouse is down or full)


@dataclasses.dataclass(slots=True, eq=False)
class _Put:
    """A received put on its way to the store."""

    peer: Peer
    frame: pb.Frame
    buf: object          # the body (pa.Buffer), None for a bodiless put
    seg: memfd.Segment | None
    size: int            # reserved host bytes: the body, and what device runs spilled after it
    dev: list            # device-tier copies
    spilled: int
    held: bool = False   # a replica of values this warehouse holds already (a repair that crossed the put's copy)
    room: Room | None = None  # with a data dir: the disk room taken for its file before the commit
    rest: Callable[[], None] | None = None  # a lent staging buffer: copies the rest of its payload in

    @property
    def dev_bytes(self) -> int:
        return sum(int(t.numel()) for t in self.dev)


class PutPipeline:
    """Puts, from admission to the writer's answer.

    Args:
        committer: commits a put's metadata (`commit.LocalCommitter` or `commit.RemoteCommitter`).
        wid: this node's warehouse id (for commits).
        check_warehouse: raises when this daemon runs no warehouse.
        replicator: copies puts to the warehouse holding their replica (--replicas 2).
        daemon: whether a connection is another daemon's (only daemons send replicas).
        data_dir: the warehouse's data dir (--data-dir), where each put takes room before its commit.
        check_partition: raises for a partition no put may name (a spread partition's own name, --shards:
            refused before anything is stored).
    """

    def __init__(self, *, warehouse: Warehouse, segments: Segments, admission: Admission, committer: Committer,
                 metrics: Metrics, wid: Callable[[], int], check_warehouse: Callable[[], None],
                 replicator: Replicator | None = None, daemon: Callable[[Peer], bool] = lambda peer: True,
                 data_dir: DataDir | None = None,
                 check_partition: Callable[[str], None] = lambda partition: None) -> None:
        self.warehouse = warehouse
        self.check_partition = check_partition
        self.data_dir = data_dir
        self.replicator = replicator
        self._daemon = daemon
        self.segments = segments
        self.admission = admission
        self.committer = committer
        self.metrics = metrics
        self._wid = wid
        self.check_warehouse = check_warehouse
        self.tokens = Tokens()

    # -- admit ---------------------------------------------------------------------------------
    def admit(self, peer: Peer, frame: pb.Frame, body_size: int) -> Awaitable[None] | None:
        """A put whose body is about to be read (Peer's admission): None to read it now, else a future
        that lets it in once it fits (or fails, and the body is dropped)."""
        try:
            limits.check(frame)
            self.check_warehouse()
            return self._admit(peer, frame.put, body_size, arriving=True)
        except DockError as e:
            return failed(e)

    def _admit(self, peer: Peer, req: pb.PutRequest, size: int, arriving: bool = False) -> asyncio.Future | None:
        """Check a put's header (a malformed one is refused before any room is spent on it) and
        reserve room for its `size` host bytes (`arriving`: a body yet to arrive over `peer`)."""
        if req.replica and not self._daemon(peer):
            raise DockAuthError("a replica put is a daemon-to-daemon message; this connection is a client's")
        runcheck.check_put(req)
        self.check_partition(req.partition)
        if req.replica and (not req.indexes or req.device_buffers or req.staging):
            raise DockProtocolError("a replica put names the indexes it copies and carries its values in its body")
        return self.admission.reserve(peer, size, req.timeout, arriving=arriving)

    # -- receive -------------------------------------------------------------------------------
    def on_put(self, peer: Peer, frame: pb.Frame, body, fds: list[int]) -> None:
        """A put request (its body, if it has one, received and admitted already)."""
        try:
            self.check_warehouse()
        except DockError:
            _close(fds)
            raise
        req = frame.put
        if isinstance(body, memfd.Segment):  # a body received into a segment of ours: complete, so seal it
            body.seal()
        staged = signal = None
        if req.staging:  # a same-host put: the payload waits in the writer's staging buffer
            if body is not None:
                raise DockProtocolError("a staged put carries no body")
            fd = fds[0] if fds else None  # (the buffer's descriptor, or with staging_eventfd its eventfd)
            staged = self.segments.staging(peer.pid, req.staging, None if req.staging_eventfd else fd, req.shm_size,
                                           fd if req.staging_eventfd else None)
            signal = self.segments.signal(peer.pid, req.staging) if req.staging_pending else None
            wait = self._admit(peer, req, req.shm_size)
        elif fds:
            _close(fds)
            raise DockProtocolError("a put passes a descriptor only to register a staging buffer")
        elif body is None:  # admit() only runs for frames with a body
            wait = self._admit(peer, req, 0)  # a put's bookkeeping counts: a full warehouse waits
        else:
            self._received(peer, frame, body)
            return
        first = self._lendable(req) if staged is not None else None
        # (a put sent before its writer's copy that is copied in whole waits for that copy in _when_admitted)
        if wait is not None or (staged is not None and (req.shm_size >= COPY_OFF_LOOP or signal and first is None)):
            spawn(self._when_admitted(wait, peer, frame, staged, signal))
            return
        if staged is None:
            self._received(peer, frame, None)
            return
        if first is None:
            self._received(peer, frame, self.admission.copy_in(staged, req.shm_size))
            return
        body, rest = self.admission.copy_in_later(staged, req.shm_size, first)
        self._received(peer, frame, body, rest, signal)  # (with `signal`: committed once the writer's copy is done)

    def _not_copied(self, peer: Peer, frame: pb.Frame, exc: BaseException | None) -> None:
        """A put whose writer's copy did not come (its connection closed: `exc` None; or its timeout ran out)."""
        self.admission.release(unreserve=frame.put.shm_size)
        if exc is not None:
            peer.reply_error(frame, exc)

    def _lendable(self, req: pb.PutRequest) -> list[tuple[int, int]] | None:
        """A staged put its writer lends the buffer of (PutRequest.lend_staging) and that is kept in
        memory only (no data dir to write first, no device runs, not a replica): the byte ranges its
        checks read (its msgpack values), copied in before them; the rest is copied right after the
        answer (`_answer_first`), before this loop reads another request. None: copied whole first."""
        if not req.lend_staging or req.replica or req.device_buffers or self.data_dir is not None:
            return None
        first = []
        for col in req.columns[:]:
            for run in col.runs[:]:
                if run.kind == pb.MSGPACK and run.nbytes:
                    if run.offset + run.nbytes > req.shm_size:
                        return None  # (refused by its checks, which read the whole copy)
                    first.append((run.offset, run.nbytes))
        return first

    async def _when_admitted(self, wait, peer: Peer, frame: pb.Frame, staged, signal: Signal | None) -> None:
        """A put that waits for room, or whose staged payload is big enough to be copied in off the loop
        (then, sent before its writer's copy, once that copy is done)."""
        try:
            if wait is not None:
                await wait
        except asyncio.CancelledError:  # its client went away while it waited for room
            return
        except Exception as e:
            peer.reply_error(frame, e)
            return
        size = frame.put.shm_size
        if signal is not None:
            try:
                await self.admission.pending.copied(peer, signal, frame.put.timeout)
            except (asyncio.CancelledError, DockError) as e:
                self._not_copied(peer, frame, None if isinstance(e, asyncio.CancelledError) else e)
                return
        try:
            if staged is None:
                body = None
            elif size >= COPY_OFF_LOOP:
                body = await self.admission.copy_in_off_loop(staged, size)
            else:
                body = self.admission.copy_in(staged, size)
            self._received(peer, frame, body)
        except Exception as e:
            peer.reply_error(frame, e)

    # -- take, check, commit -------------------------------------------------------------------
    def _received(self, peer: Peer, frame: pb.Frame, body, rest: Callable[[], None] | None = None,
                  signal: Signal | None = None) -> None:
        """A put whose size is reserved and whose bytes are ours (or, with `rest`, the bytes its checks
        read; `rest()` copies in the others once it is answered): check it and commit it (with `signal`,
        once its writer's copy into the staging buffer is done; dropped if that does not come)."""
        req = frame.put
        seg = body if isinstance(body, memfd.Segment) else None
        buf = seg.buffer if seg is not None else body
        size = buf.size if buf is not None else 0  # payload bytes (a segment's buffer excludes its padding)
        if req.token and self.tokens.again(peer, frame, lambda: self.admission.release(unreserve=size)):
            return
        dev, spilled = [], 0
        held = req.replica and self.warehouse.has(req.partition, [(c.name, req.indexes) for c in req.columns[:]])
        try:
            if req.device_buffers:
                buf, seg, size, dev, spilled = take_device(peer, req, buf, seg, size, self.warehouse, self.segments,
                                                           self.metrics)
            self._validate(req, buf, size, dev, held)
            keeper = self.data_dir
            # a full data dir fails the put here, before the controller records its values
            room = None if keeper is None or held else keeper.room(req.partition, req.columns, size,
                                                                    len(req.indexes) or req.new_count)
        except Exception as e:
            self.admission.release(unreserve=size, unreserve_device=sum(int(t.numel()) for t in dev))
            self.tokens.done(req.token, None, e)
            raise
        commit = commit_request(req, size, self._wid())
        put = _Put(peer, frame, buf, seg, size, dev, spilled, held, room, rest)
        if signal is not None:
            self.admission.pending.after(peer, signal, req.timeout, functools.partial(self._copied, put, commit),
                                         functools.partial(self._dropped, put))
            return
        if room is not None and size >= WRITE_OFF_LOOP:
            spawn(self._write_then_commit(put, commit))
            return
        self._commit(put, commit)

    def _copied(self, put: _Put, commit: pb.CommitRequest) -> None:
        """The writer's copy of a checked put is done: commit it."""
        try:
            self._commit(put, commit)
        except Exception as e:  # noqa: BLE001 - the put's answer
            self._drop(put)
            self._fail(put, e)

    def _dropped(self, put: _Put, exc: BaseException | None) -> None:
        """A checked put whose writer's copy did not come: nothing of it is kept, its re-sends are refused."""
        self._drop(put)
        if exc is not None:
            self._fail(put, exc)
        else:
            self.tokens.done(put.frame.put.token, None, DockConnectionError(
                f"the connection of {put.peer.name} closed before its put's tensors were copied; the put was dropped"))

    def _commit(self, put: _Put, commit: pb.CommitRequest) -> None:
        """Commit the put; a put of new samples that a block holds indexes for (--commit-window) is stored
        and answered first. Not replicas, device runs, explicit indexes or re-sent puts."""
        req = put.frame.put
        if not (req.indexes or req.replica or put.dev or req.resent):
            taken = self.committer.take(req.partition, req.new_count, req.group_size or 1)
            if taken is not None:
                self._before_commit(put, commit, *taken)
                return
        self.committer.commit(commit, req.timeout, put.peer, functools.partial(self._land, put))

    async def _write_then_commit(self, put: _Put, commit: pb.CommitRequest) -> None:
        """A big put to a warehouse with a data dir: its body goes to disk off the loop, then it is committed
        (or, given a block's indexes, its header written and it is answered)."""
        keeper = self.data_dir
        assert keeper is not None and put.room is not None  # (only puts that took room come here)
        try:
            await self.admission.in_worker(keeper.prewrite, put.room, put.buf)
        except Exception as e:  # noqa: BLE001 - the put's answer
            self._drop(put)
            self._fail(put, e)
            return
        self._commit(put, commit)

    def _before_commit(self, put: _Put, commit: pb.CommitRequest, block: int, idx: np.ndarray, put_id: int) -> None:
        """A put of new samples given indexes from a block (--commit-window): stored (with a data dir, its
        file written, keeping its commit, and fsync'd), answered, and its commit sent with the link's next
        window. A put that cannot be stored leaves a hole in the block."""
        out = idx.tolist()
        commit.indexes.extend(out)
        commit.block, commit.put_id, commit.new_count, commit.has_timeout = block, put_id, 0, False
        if put.room is not None:
            put.room.commit = commit
        try:
            self._file(put, idx)
        except Exception as e:  # noqa: BLE001 - the put's answer
            self._drop(put)
            self._fail(put, e)
            return
        self._answer(put, out, lent=put.rest is not None, uncommitted=True)
        self.metrics.puts_before_commit += 1
        if put.rest is not None:
            put.rest()
        file = put.room.file if put.room is not None else ""
        self.committer.commit_windowed(commit, functools.partial(self._settled, commit.partition, idx, file))

    def recover(self, uncommitted: list[tuple[str, pb.CommitRequest]]) -> None:
        """The puts answered before their commit that the data dir's files keep, their commit not known
        answered: committed again (with the first registration), their outcome taken as any such put's."""
        for file, commit in uncommitted:
            idx = np.asarray(commit.indexes, dtype=np.int64)
            self.committer.recover(commit, functools.partial(self._settled, commit.partition, idx, file))

    def _settled(self, partition: str, idx: np.ndarray, file: str, res: CommitOutcome) -> None:
        """The outcome of a put answered before its commit: its values are freed if the controller did not
        record them (its samples were cleared or deleted meanwhile, or it refused the commit); else its
        data dir `file` (if any) is recorded committed. (One the controller could not record for a full state
        dir never comes here: the link sends it again, ahead of those made since: `link_commits.hold`.)"""
        if res.error is None and not res.cleared:
            if file and self.data_dir is not None:
                self.data_dir.committed(file)
            return
        if res.error is not None:
            logger.error("[warehouse] the controller refused the commit of a put answered before it partition=%s "
                         "samples=%d: %s; its values are dropped", partition, len(idx), res.error)
        self.admission.free(partition, idx)

    def _validate(self, req: pb.PutRequest, buf, size: int, dev: list, held: bool = False) -> None:
        """The put against its bytes, once they are all ours (its header was checked at admission): its
        runs fit the body and device copies, its msgpack values decode, and (explicit indexes) its
        columns are unwritten here (a replica of values `held` here already is committed, not stored
        again)."""
        runcheck.check_body(req.columns, buf, size, [int(t.numel()) for t in dev])
        if req.indexes and not held:
            self.warehouse.check_absent(req.partition, req.indexes, (c.name for c in req.columns[:]))

    # -- store ---------------------------------------------------------------------------------
    def _land(self, put: _Put, res: CommitOutcome) -> None:
        """The commit's outcome: store the put (unless it failed, or was cleared since) and answer it."""
        req = put.frame.put
        if res.error is not None:
            self._drop(put)
            self._fail(put, res.error)
            return
        if self._answer_first(put, res):
            return
        rest = None  # (the rest of a lent staging buffer's payload: copied in before the put is copied on)
        try:
            # cleared after the controller applied it: answered, and gone as the clear says; or a put re-sent
            # here after its first warehouse went away, whose values a warehouse holds: answered, not stored
            if res.cleared or put.held or res.stored:
                self._drop(put)
            elif req.replica:  # stored whole; what the controller did not record (deleted meanwhile) is freed
                self.warehouse.store(req.partition, req.indexes, req.columns, put.buf, put.size, put.seg, 0,
                                     token=req.token, room=put.room)
                dropped = np.setdiff1d(np.asarray(req.indexes, dtype=np.int64),
                                       np.asarray(res.indexes, dtype=np.int64))
                if len(dropped):
                    self.admission.free(req.partition, dropped)
            else:
                self._file(put, res.indexes)  # (--data-dir: written first)
                rest = put.rest
        except Exception as e:  # noqa: BLE001 - the put's answer
            self._give_back_room(put)  # (unless its file was written, or removed on failing)
            self._fail(put, e)
            return
        out = res.listed()
        if res.replica is not None and not res.cleared and self.replicator is not None:
            if rest is not None:
                rest()
            spawn(self._copy_then_answer(put, out, res.replica))
            return
        self._answer(put, out)

    def _answer_first(self, put: _Put, res: CommitOutcome) -> bool:
        """A put kept in memory only (no data dir, no replica) whose commit applied: answered, then filed
        under its indexes and (a lent staging buffer) the rest of its payload copied in, so that its
        writer goes on meanwhile. Nothing reads it in between: this loop runs no other request until
        both are done, and the writer reuses a lent buffer only once a request it sent after this
        answer is answered. Such a store cannot fail after the checks and the commit (only writing a
        data dir file can), so the answer stands. False: not such a put (the caller stores it first)."""
        req = put.frame.put
        if (res.cleared or put.held or req.replica or self.data_dir is not None
                or res.stored or res.replica is not None):
            return False
        self._answer(put, res.listed(), lent=put.rest is not None)
        try:
            self._file(put, res.indexes)
        except Exception as e:  # noqa: BLE001 - answered already: a second answer would confuse its connection
            logger.error("[warehouse] an answered put could not be stored peer=%s partition=%s samples=%d; reads of "
                         "them will fail", put.peer.name, req.partition, len(res.indexes), exc_info=e)
            self._drop(put)
            return True
        if put.rest is not None:
            put.rest()
        return True

    def _file(self, put: _Put, indexes: np.ndarray | Sequence[int]) -> None:
        """File a put of new or existing samples under the indexes its commit gave (with a data dir,
        its file is written first, into the room taken for it)."""
        req = put.frame.put
        self.warehouse.store(req.partition, indexes, req.columns, put.buf, put.size, put.seg, group_size(req),
                             device=put.dev, token=req.token, room=put.room)

    async def _copy_then_answer(self, put: _Put, out: list[int], target: pb.WarehouseInfo) -> None:
        """Copy the stored put to `target`, then answer it. A copy that fails is reported to the controller
        first (its values have one holder: the controller repairs them), so that values whose copy is
        still on its way when this warehouse dies were never acknowledged (see controller.replicas)."""
        req = put.frame.put
        columns = [c.name for c in req.columns[:]]
        try:
            await self.replicator.copy(req.partition, out, columns, target)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - stored and committed: the controller's repair copies it later
            _copy_failures.log(logger, logging.WARNING, "[warehouse] copying a put to its replica on warehouse %d "
                               "(%s:%d) failed partition=%s samples=%d: %s; answered with one copy, the controller "
                               "repairs it", target.id, target.host, target.port, req.partition, len(out), e)
            report = pb.CommitRequest(partition=req.partition, indexes=out, columns=columns, warehouse=self._wid(),
                                      replica=True)
            done: asyncio.Future[CommitOutcome] = asyncio.get_running_loop().create_future()
            self.committer.commit(report, req.timeout, put.peer, done.set_result)
            res = await done
            if res.error is not None:
                self._fail(put, res.error)  # (its re-send is answered from what the controller holds: Catalog.stored)
                return
        self._answer(put, out)

    def _drop(self, put: _Put) -> None:
        """A put that is not stored: its room in memory, its segment and its disk room go back."""
        self.admission.release(unreserve=put.size, unreserve_device=put.dev_bytes, seg=put.seg)
        self._give_back_room(put)

    def _give_back_room(self, put: _Put) -> None:
        if put.room is not None:
            assert self.data_dir is not None  # (only a data dir takes room)
            self.data_dir.give_back(put.room)

    def _answer(self, put: _Put, out: list[int], lent: bool = False, uncommitted: bool = False) -> None:
        """Answer the put, then (in the same turn: nothing runs in between) its re-sends and the metrics."""
        try:
            put.peer.reply(put.frame, pb.Frame(put_reply=pb.PutReply(indexes=out, spilled_bytes=put.spilled,
                                                                     staging_lent=lent, uncommitted=uncommitted)))
        finally:
            self.tokens.done(put.frame.put.token, out)
            self.metrics.put(put.peer.passes_fds, len(out), put.size + put.dev_bytes)

    def _fail(self, put: _Put, exc: BaseException) -> None:
        if not isinstance(exc, (DockError, ValueError, TypeError)):
            logger.error("[warehouse] put failed peer=%s partition=%s", put.peer.name, put.frame.put.partition,
                         exc_info=exc)
        self.tokens.done(put.frame.put.token, None, exc)
        put.peer.reply_error(put.frame, exc)


def group_size(req: pb.PutRequest) -> int:
    """The group size a put tells its warehouse (0: a put of existing samples says nothing)."""
    return 0 if req.indexes else req.group_size or 1


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)

