"""Admission: whether a put's bytes may come in, and where they are received.

A put reserves its size in the warehouse before its body is read. While the
warehouse is full, puts wait in one FIFO queue (the daemon stops reading their
connections meanwhile, which pushes back on the writers through TCP) until room
is freed or their timeout passes (DockFull). A put that could never fit fails
at once; one whose client disconnects leaves the queue. With a spill tier
(`--spill-dir`) a put that finds no room spills stored puts to files first
(`Warehouse.reserve`); the head of the queue retries that every
`RETRY_S`, and DockFull comes only when nothing more could be spilled.

A body that travels in its frame holds its room from its admission until it has
arrived, as slowly as the sender likes down to `--min-rate`. So what bodies still
arriving may hold is bounded by who sends them (`Peer.identity`: a uid of this
host, or a remote host; not a connection, of which one sender may open many):
one identity's at most a quarter of `--capacity` (`SHARE`), everyone's at most
half (`ALL`), and a body bigger than that only when nothing else of its
identity (of anyone's) is arriving. A put over its identity's share waits,
passed over by the others' puts instead of holding them up, and each body let
in sends its identity's other waiting puts behind everyone else's. Puts whose
bytes are here already (a same-host writer's staged payload) hold nothing while
they wait, and only room decides for them.

Bodies are received into shared-memory segments when same-host readers may map
them, as long as the process's descriptor budget for stored segments lasts;
past it, into private memory (one more copy for same-host readers).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from dockd.errors import DockError, DockFull
from dockd.net import memfd, same_host
from dockd.net.peer import Peer
from dockd.warehouse import memory
from dockd.warehouse.core import Warehouse
from dockd.warehouse.pending import PendingCopies
from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)

SHARE = 4
"""One identity's bodies still arriving hold at most 1/SHARE of --capacity (one body of any size when it has
nothing else arriving): however many connections it opens, three quarters stay for the others."""
ALL = 2
"""Everyone's bodies still arriving hold at most 1/ALL of --capacity (one body of any size when nothing else
arrives): however many remote hosts send slowly, half stays for stored data and same-host puts."""
RETRY_S = 0.2
"""With a spill tier, the head of the queue retries spilling this often (a reader may have unpinned a segment)."""


class _Wait(NamedTuple):
    size: int
    fut: asyncio.Future  # resolves once admitted (or fails: DockFull)
    peer: Peer           # whose put
    who: tuple | None    # the identity whose body arrives once admitted; None: its bytes are here already


def describe(who: tuple) -> str:
    """An identity (`Peer.identity`) in words."""
    role, kind, value = who
    return f"{'a daemon' if role == 'daemon' else 'the client'} of {'uid' if kind == 'uid' else 'host'} {value}"


class Admission:
    """The capacity queue, reservations and their release (a free among them), and the destination
    of put bodies.

    Args:
        wid: this node's warehouse id, for error messages.
    """

    def __init__(self, warehouse: Warehouse, segments: Segments, wid: Callable[[], int]) -> None:
        self.warehouse = warehouse
        self.segments = segments
        self._wid = wid
        self.waiters: list[_Wait] = []
        self.arriving = 0  # bytes of admitted bodies still on their way in
        self.arriving_by: dict[tuple, int] = {}  # ... by identity
        self.shm_bodies = False  # whether big bodies go to shared memory (same-host readers map them)
        self.segment_budget = 0  # segments (descriptor + mapping each) this process may hold
        self._over_budget_warned = False
        self.on_clear: Callable[[str], None] = lambda partition: None  # a partition was freed whole
        self._retry: asyncio.TimerHandle | None = None  # with a spill tier: the queue's next try to spill
        self._copier: ThreadPoolExecutor | None = None  # big staged payloads are copied in here (copy_in_off_loop)
        self.pending = PendingCopies()  # staged puts waiting for their writer's copy (dropped with their connection)
        segments.on_lent = self._lent

    def _lent(self, delta: int) -> None:
        """Freed data a reader maps counts against the capacity until it is unmapped; then puts may go in."""
        self.warehouse.lent += delta
        if delta < 0 and self.waiters:
            self.admit_waiters()

    def use_segments(self, budget: int) -> None:
        """Receive big bodies into shared memory, at most `budget` stored segments."""
        self.shm_bodies = True
        self.segment_budget = budget
        self.segments.keep_count = max(4, budget // 8)  # idle segments hold descriptors too

    # -- room --------------------------------------------------------------------------------
    def reserve(self, peer: Peer, size: int, timeout: float, *, arriving: bool = False) -> asyncio.Future | None:
        """Reserve room for a put: None when done, else a future that resolves once it fits (or DockFull).
        `arriving`: its body is yet to arrive over `peer` (it counts against its identity's share until then)."""
        self.warehouse.check_fits(size)
        who = peer.identity if arriving else None
        if not self.waiters and self._within(who, size) and self.warehouse.reserve(size, queued=True):
            self._admitted(peer, who, size)
            return None
        w = _Wait(size, asyncio.get_running_loop().create_future(), peer, who)
        self.waiters.append(w)
        if len(self.waiters) > 1:  # those ahead may be passed over (over their share)
            self.admit_waiters()
            if w.fut.done():
                return None
        if timeout >= 0:
            asyncio.get_running_loop().call_later(timeout, self._timeout, w)
        return w.fut

    def _within(self, who: tuple | None, size: int) -> bool:
        return who is None or (self._within_share(who, size) and self._within_all(size))

    def _within_share(self, who: tuple, size: int) -> bool:
        mine = self.arriving_by.get(who, 0)
        return not mine or mine + size <= self.warehouse.capacity // SHARE

    def _within_all(self, size: int) -> bool:
        return not self.arriving or self.arriving + size <= self.warehouse.capacity // ALL

    def _admitted(self, peer: Peer, who: tuple | None, size: int) -> None:
        """A body let in: it counts as arriving until the peer says it is in (or will not come)."""
        if who is not None:
            self.arriving += size
            self.arriving_by[who] = self.arriving_by.get(who, 0) + size
            peer.on_body_done = functools.partial(self._arrived, who, size)

    def _arrived(self, who: tuple, size: int) -> None:
        self.arriving -= size
        left = self.arriving_by.pop(who) - size
        if left:
            self.arriving_by[who] = left
        if self.waiters:
            self.admit_waiters()

    def release(self, *, unreserve: int = 0, unreserve_device: int = 0, seg=None) -> None:
        """Give back room a failed put held (and its segment, to the pool), and let waiting puts in."""
        if seg is not None:
            self.segments.release(seg)
        if unreserve:
            self.warehouse.unreserve(unreserve)
        if unreserve_device:
            self.warehouse.device_unreserve(unreserve_device)
        self.admit_waiters()

    def free(self, partition: str, indexes=None) -> int:
        """Free a partition, or some of its samples; returns the bytes freed."""
        if indexes is not None:
            n, segs = self.warehouse.free_samples(partition, indexes)
            if n:
                logger.debug("[warehouse] samples freed partition=%s samples=%d bytes=%d", partition, len(indexes), n)
        else:
            segs = self.warehouse.segments_of(partition)
            n = self.warehouse.free(partition)
            self.on_clear(partition)
        for seg in segs:  # back to the pool once no reader maps them
            self.segments.release(seg)
        self.admit_waiters()
        return n

    def admit_waiters(self) -> None:
        """Let waiting puts in, in order, while there is room. A body over its identity's share is passed
        over; once one is over everyone's, the bodies after it wait too (puts whose bytes are here go on)."""
        i, held = 0, False
        while i < len(self.waiters):
            w = self.waiters[i]
            if w.fut.done():
                del self.waiters[i]
                continue
            if w.who is not None and not self._within_share(w.who, w.size):
                i += 1  # it waits for its own identity's bodies, not the others for it
                continue
            if w.who is not None and (held or not self._within_all(w.size)):
                held = True
                i += 1
                continue
            if not self.warehouse.reserve(w.size, queued=True):
                if self.warehouse.tier is not None and self._retry is None:  # (a pin may go, a file be freed)
                    self._retry = asyncio.get_running_loop().call_later(RETRY_S, self._retry_spill)
                break
            del self.waiters[i]
            self._admitted(w.peer, w.who, w.size)
            w.fut.set_result(None)
            if w.who is not None:  # its identity's other puts go behind everyone else's (round robin)
                rest = self.waiters[i:]
                self.waiters[i:] = [x for x in rest if x.who != w.who] + [x for x in rest if x.who == w.who]

    def _retry_spill(self) -> None:
        self._retry = None
        self.admit_waiters()

    def _timeout(self, w: _Wait) -> None:
        if w.fut.done():
            return
        size, who, cap = w.size, w.who, self.warehouse.capacity
        if who is not None and not self._within_share(who, size):
            msg = (f"warehouse {self._wid()}: a put of {size} bytes waited for the {self.arriving_by[who]} bytes of "
                   f"puts that {describe(who)} is still sending to arrive; the puts one client sends at once may hold "
                   f"at most a quarter of --capacity ({cap // SHARE} bytes) until their bodies are in. Send fewer or "
                   "smaller puts at once, or send them faster.")
        elif who is not None and not self._within_all(size):
            msg = (f"warehouse {self._wid()}: a put of {size} bytes waited for the {self.arriving} bytes of puts that "
                   f"clients are still sending to arrive; the puts still arriving may hold at most half of --capacity "
                   f"({cap // ALL} bytes). Retry; if it persists, some clients send far slower than they announce.")
        else:
            msg = self._full(size)
        w.fut.set_exception(DockFull(msg))
        self.admit_waiters()

    def _full(self, size: int) -> str:
        w = self.warehouse
        if w.tier is not None:
            return (f"warehouse {self._wid()} stayed full in memory and on disk: {size} bytes did not fit next to "
                    f"{w.used} stored in memory (and {w.meta} of bookkeeping), {w.reserved} in flight and {w.lent} "
                    f"of cleared data that same-host readers still map of "
                    f"--capacity {w.capacity}, and no more could be spilled: {w.tier.describe()}; {w.spilled} bytes "
                    "are spilled. Clear finished partitions, consume faster, or raise --capacity or --spill-capacity.")
        return (f"warehouse {self._wid()} stayed full: {size} bytes did not fit next to {w.used} stored (and "
                f"{w.meta} of their bookkeeping), {w.reserved} in flight and {w.lent} of cleared data that "
                f"same-host readers still map of {w.capacity} within the put timeout. Clear finished partitions, "
                "consume faster, drop tensors of cleared samples, raise --capacity, or give it a --spill-dir.")

    def lost(self, peer: Peer) -> None:
        """A connection ended: its waiting puts leave the queue, and those waiting for their writer's copy are dropped."""
        self.pending.lost(peer)
        if any(w.peer is peer for w in self.waiters):
            for w in self.waiters:
                if w.peer is peer and not w.fut.done():
                    w.fut.cancel()
            self.admit_waiters()

    def shutdown(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._copier is not None:
            self._copier.shutdown(wait=False)
        for w in self.waiters:
            if not w.fut.done():
                w.fut.set_exception(DockError("the warehouse is shutting down"))

    # -- where bodies go ------------------------------------------------------------------------
    def allocate(self, size: int):
        """Where a frame body is received: shared memory when big enough to be worth passing by descriptor."""
        if self.shm_bodies and size >= same_host.SHM_MIN_BODY and self.segment_room():
            return self.segments.take(size)
        return memory.allocate(size)

    def copy_in(self, staged, size: int):
        """Copy a staged payload into storage of ours: a warm pool segment (or private memory past
        the descriptor budget)."""
        dst, done = self._destination(size)
        memoryview(dst).cast("B")[:] = memoryview(staged)[:size]
        return done()

    def copy_in_later(self, staged, size: int, first: list[tuple[int, int]]):
        """`copy_in` in two steps: the byte ranges `first` ((offset, nbytes): the values the put's
        checks read) now, and the rest when the returned function is called. The body (returned with
        it) holds only `first` until then; the rest never overwrites those bytes, so what was checked
        is what is kept, whatever the writer does to its buffer meanwhile."""
        dst, done = self._destination(size)
        out, src = memoryview(dst).cast("B"), memoryview(staged)
        gaps, at = [], 0
        for off, n in sorted(first):
            out[off : off + n] = src[off : off + n]
            if off > at:
                gaps.append((at, off))
            at = max(at, off + n)
        if at < size:
            gaps.append((at, size))

        def rest() -> None:
            for lo, hi in gaps:
                out[lo:hi] = src[lo:hi]

        return done(), rest

    async def copy_in_off_loop(self, staged, size: int):
        """`copy_in` with the copy itself in a worker thread (it releases the GIL): a payload of
        hundreds of MiB into fresh pages takes seconds, during which the event loop keeps answering
        heartbeats, probes and other requests."""
        dst, done = self._destination(size)
        await self.in_worker(_copy, dst, staged, size)
        return done()

    async def in_worker(self, fn, *args):
        """`fn(*args)` in this warehouse's worker thread (big copies and writes that release the GIL)."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="dockd-copy-in")
        return await asyncio.get_running_loop().run_in_executor(self._copier, fn, *args)

    def _destination(self, size: int):
        """Where a copied-in payload goes, and what to call once it is there (it returns the body)."""
        if size >= same_host.SHM_MIN_BODY and self.segment_room():
            seg = self.segments.take(size)

            def sealed():
                seg.seal()
                return seg

            return seg.writable(), sealed
        buf = memory.allocate(size)
        return buf, lambda: buf

    def segment_room(self) -> bool:
        """Whether one more stored segment fits the descriptor budget (warns once when it does not)."""
        if memfd.Segment.live < self.segment_budget:
            return True
        if not self._over_budget_warned:
            self._over_budget_warned = True
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            logger.warning(
                "[shm] this warehouse holds %d shared-memory segments, the most its descriptor limit (%d) allows; "
                "further puts are copied into private memory (one more copy, and same-host reads of them are "
                "copies too). Raise the limit for full speed (ulimit -n, or LimitNOFILE= in a systemd unit).",
                memfd.Segment.live, soft,
            )
        return False


def _copy(dst, staged, size: int) -> None:
    """One payload copy; numpy releases the GIL for it."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8, count=size), np.frombuffer(staged, dtype=np.uint8, count=size))
