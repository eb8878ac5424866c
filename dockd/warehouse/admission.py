"""Admission: whether a put's bytes may come in, and where they are received.

A put reserves its size in the warehouse before its body is read. While the
warehouse is full, puts wait in one FIFO queue (the daemon stops reading their
connections meanwhile, which pushes back on the writers through TCP) until room
is freed or their timeout passes (DockFull). A put that could never fit fails
at once; one whose client disconnects leaves the queue. With a spill tier
(`--spill-dir`) a put that finds no room spills stored puts to files first
(`Warehouse.reserve`); the head of the queue retries that every
`spill.RETRY_S`, and DockFull comes only when nothing more could be spilled.

Bodies are received into shared-memory segments when same-host readers may map
them, as long as the process's descriptor budget for stored segments lasts;
past it, into private memory (one more copy for same-host readers).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dockd import shm
from dockd.errors import DockError, DockFull
from dockd.peer import Peer
from dockd.warehouse import memory
from dockd.warehouse.core import Warehouse
from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)


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
        self.waiters: list[tuple[int, asyncio.Future, Peer]] = []  # (bytes, admitted, whose put)
        self.shm_bodies = False  # whether big bodies go to shared memory (same-host readers map them)
        self.segment_budget = 0  # segments (descriptor + mapping each) this process may hold
        self._over_budget_warned = False
        self.on_clear: Callable[[str], None] = lambda partition: None  # a partition was freed whole
        self._retry: asyncio.TimerHandle | None = None  # with a spill tier: the queue's next try to spill
        self._copier: ThreadPoolExecutor | None = None  # big staged payloads are copied in here (copy_in_off_loop)
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
    def reserve(self, peer: Peer, size: int, timeout: float) -> asyncio.Future | None:
        """Reserve room for a put: None when done, else a future that resolves once it fits (or DockFull)."""
        self.warehouse.check_fits(size)
        if not self.waiters and self.warehouse.reserve(size, queued=True):
            return None
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append((size, fut, peer))
        if timeout >= 0:
            asyncio.get_running_loop().call_later(timeout, self._timeout, fut, size)
        return fut

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
        while self.waiters:
            size, fut, _ = self.waiters[0]
            if fut.done():
                self.waiters.pop(0)
                continue
            if not self.warehouse.reserve(size, queued=True):
                if self.warehouse.tier is not None and self._retry is None:  # (a pin may go, a file be freed)
                    from dockd.warehouse.spill import RETRY_S

                    self._retry = asyncio.get_running_loop().call_later(RETRY_S, self._retry_spill)
                break
            self.waiters.pop(0)
            fut.set_result(None)

    def _retry_spill(self) -> None:
        self._retry = None
        self.admit_waiters()

    def _timeout(self, fut: asyncio.Future, size: int) -> None:
        if fut.done():
            return
        w = self.warehouse
        if w.tier is not None:
            msg = (f"warehouse {self._wid()} stayed full in memory and on disk: {size} bytes did not fit next to "
                   f"{w.used} stored in memory (and {w.meta} of bookkeeping), {w.reserved} in flight and {w.lent} "
                   f"of cleared data that same-host readers still map of "
                   f"--capacity {w.capacity}, and no more could be spilled: {w.tier.describe()}; {w.spilled} bytes "
                   "are spilled. Clear finished partitions, consume faster, or raise --capacity or --spill-capacity.")
        else:
            msg = (f"warehouse {self._wid()} stayed full: {size} bytes did not fit next to {w.used} stored (and "
                   f"{w.meta} of their bookkeeping), {w.reserved} in flight and {w.lent} of cleared data that "
                   f"same-host readers still map of {w.capacity} within the put timeout. Clear finished partitions, "
                   "consume faster, drop tensors of cleared samples, raise --capacity, or give it a --spill-dir.")
        fut.set_exception(DockFull(msg))
        self.admit_waiters()

    def lost(self, peer: Peer) -> None:
        """A connection ended: its waiting puts leave the queue."""
        if any(p is peer for _, _, p in self.waiters):
            for _, fut, p in self.waiters:
                if p is peer and not fut.done():
                    fut.cancel()
            self.admit_waiters()

    def shutdown(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._copier is not None:
            self._copier.shutdown(wait=False)
        for _, fut, _ in self.waiters:
            if not fut.done():
                fut.set_exception(DockError("the warehouse is shutting down"))

    # -- where bodies go ------------------------------------------------------------------------
    def allocate(self, size: int):
        """Where a frame body is received: shared memory when big enough to be worth passing by descriptor."""
        if self.shm_bodies and size >= shm.SHM_MIN_BODY and self.segment_room():
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
        if size >= shm.SHM_MIN_BODY and self.segment_room():
            seg = self.segments.take(size)

            def sealed():
                seg.seal()
                return seg

            return seg.writable(), sealed
        buf = memory.allocate(size)
        return buf, lambda: buf

    def segment_room(self) -> bool:
        """Whether one more stored segment fits the descriptor budget (warns once when it does not)."""
        if shm.Segment.live < self.segment_budget:
            return True
        if not self._over_budget_warned:
            self._over_budget_warned = True
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            logger.warning(
                "[shm] this warehouse holds %d shared-memory segments, the most its descriptor limit (%d) allows; "
                "further puts are copied into private memory (one more copy, and same-host reads of them are "
                "copies too). Raise the limit for full speed (ulimit -n, or LimitNOFILE= in a systemd unit).",
                shm.Segment.live, soft,
            )
        return False


def _copy(dst, staged, size: int) -> None:
    """One payload copy; numpy releases the GIL for it."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8, count=size), np.frombuffer(staged, dtype=np.uint8, count=size))
