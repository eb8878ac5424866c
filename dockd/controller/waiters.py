"""Gets waiting for data. A blocked acquire is parked per partition and retried when a commit,
a release or a lost warehouse changes that partition; its timeout is a timer on the service's
clock, never a poll. A waiting get that asked for its own warehouse's samples first (near) is
served from them ahead of earlier gets of other nodes when they cover it (at most PASS_OVER
times per earlier get), so the samples a node commits go to that node's readers, not across links."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.controller import reads
from dockd.controller.clock import Timer, Timers, seconds
from dockd.controller.core import Controller
from dockd.controller.lease_table import AcquireResult
from dockd.errors import DockError, DockStateFull, DockTimeout, DockValueError
from dockd.net.peer import Peer

#: How many times a waiting get may see a later near get of the same consumer served before it
#: (from that get's own warehouse); then it goes first again, so no get starves behind local ones.
PASS_OVER = 16


@dataclasses.dataclass(slots=True, eq=False)
class Waiter:
    peer: Peer
    frame: pb.Frame
    timer: Timer | None = None
    passed_over: int = 0  # later near gets served before this one (see PASS_OVER)


class Gets(Protocol):
    """How a waiting get is tried again and answered (grants.Acquiring)."""

    def attempt(self, peer: Peer, r: pb.AcquireRequest) -> AcquireResult | None: ...

    def reply(self, peer: Peer, frame: pb.Frame, r: pb.AcquireRequest, res: AcquireResult) -> None: ...

    def near_ready(self, r: pb.AcquireRequest) -> dict[int, int]: ...


class Waiters:
    """The parked gets of a controller, by partition, in arrival order. Timeouts are `timers`;
    `retry_all` tries every waiting get again (after the state dir was full); `gets` (set once the
    service has made it: it wakes these waiters itself) tries and answers one."""

    gets: Gets

    def __init__(self, core: Controller, timers: Timers, *, retry_all: Callable[[], None]) -> None:
        self.core = core
        self.timers = timers
        self.retry_all = retry_all
        self.by_partition: dict[str, list[Waiter]] = {}
        self._full_retry: Timer | None = None  # waiting gets tried again once the state dir has room
        self._closed = False

    @property
    def count(self) -> int:
        """Gets waiting for data, of all connections."""
        return sum(map(len, self.by_partition.values()))

    def park(self, peer: Peer, frame: pb.Frame) -> None:
        """Park a get that found too few samples, until its timeout (none: until served)."""
        r = frame.acquire
        if peer.parked >= limits.MAX_PARKED or self.count >= limits.MAX_PARKED_DOCK:
            raise DockValueError(
                f"{peer.parked} gets of this connection and {self.count} of all wait for data already (at most "
                f"{limits.MAX_PARKED} and {limits.MAX_PARKED_DOCK}); wait for some to finish before asking for more")
        w = Waiter(peer, frame)
        self.by_partition.setdefault(r.partition, []).append(w)
        peer.parked += 1  # a blocked get: its connection is busy, not idle
        if r.timeout > 0:
            w.timer = self.timers.call_later(r.timeout, self._expire, r.partition, w)

    def wake(self, partition: str) -> None:
        """Retry the gets waiting on a partition, in arrival order. Once one finds too few samples,
        the later ones of the same consumer and columns asking for as many or more are not tried:
        with many waiters a commit costs one failed try per kind of request, not one per waiter."""
        ws = self.by_partition.get(partition)
        if not ws:
            return
        if any(w.frame.acquire.near for w in ws) and not self._wake_near(partition, list(ws)):
            return
        short: dict[tuple | Waiter, int] = {}  # (consumer, columns, groups) -> smallest count found unmet
        for w in list(self.by_partition.get(partition, ())):
            r = w.frame.acquire
            # (a rank-aware or filtered get is tried on its own: its needs differ from its neighbours')
            key = (r.consumer, tuple(sorted(r.columns)), r.groups, r.max_staleness) \
                if not (r.dp_size or r.where or r.order_by) else w
            need = 1 if r.allow_partial else r.count
            if need >= short.get(key, 1 << 62):
                continue
            served = self._try(partition, w)
            if served is None:
                return
            if not served:
                short[key] = min(short.get(key, 1 << 62), need)

    def _wake_near(self, partition: str, ws: list[Waiter]) -> bool:
        """The first pass of wake: each waiting near get whose own warehouse holds enough ready samples
        is tried before the earlier gets of the same consumer (they take what is left in the second
        pass, or wait for the next commit). False: stop waking (the state dir is full)."""
        acq = self.gets
        ready: dict[tuple | Waiter, dict[int, int]] = {}  # per kind of request: warehouse -> samples ready
        earlier: dict[str, list[Waiter]] = {}  # consumer -> its gets seen so far and still waiting
        held: set[str] = set()  # consumers with an earlier get passed over PASS_OVER times: no more passing
        for w in ws:
            r = w.frame.acquire
            if r.near and not r.dp_size and r.consumer not in held:
                key = (r.consumer, tuple(sorted(r.columns)), r.groups, r.max_staleness) if not r.where else w
                if key not in ready:
                    try:
                        ready[key] = acq.near_ready(r)
                    except DockError:
                        ready[key] = {}  # the second pass answers it with the error
                if ready[key].get(r.near - 1, 0) >= (1 if r.allow_partial else r.count):
                    served = self._try(partition, w)
                    if served is None:
                        return False
                    if served:
                        for v in earlier.get(r.consumer, ()):
                            v.passed_over += 1
                            if v.passed_over >= PASS_OVER:
                                held.add(r.consumer)
                        for k in [k for k in ready if isinstance(k, Waiter) or k[0] == r.consumer]:
                            del ready[k]  # what this consumer could take has changed
                        continue
            earlier.setdefault(r.consumer, []).append(w)
            if w.passed_over >= PASS_OVER:
                held.add(r.consumer)
        return True

    def _try(self, partition: str, w: Waiter) -> bool | None:
        """Try a waiting get once: True when answered (served or failed), False when it still waits,
        None when the state dir is full (every get stays parked and is tried again soon)."""
        acq = self.gets
        try:
            res = acq.attempt(w.peer, w.frame.acquire)
        except DockStateFull:
            self._retry_later()
            return None
        except DockError as e:
            self.drop(partition, w)
            w.peer.reply_error(w.frame, e)
            return True
        if res is None:
            return False
        self.drop(partition, w)
        acq.reply(w.peer, w.frame, w.frame.acquire, res)
        return True

    def wake_every(self) -> None:
        for part in list(self.by_partition):
            self.wake(part)

    def _retry_later(self) -> None:
        if self._full_retry is None and not self._closed:
            self._full_retry = self.timers.call_later(1.0, self._retry)

    def _retry(self) -> None:
        self._full_retry = None
        self.retry_all()

    def drop(self, partition: str, w: Waiter) -> None:
        ws = self.by_partition.get(partition)
        if ws and w in ws:
            ws.remove(w)
            w.peer.parked -= 1
            if not ws:
                del self.by_partition[partition]
        if w.timer is not None:
            w.timer.cancel()

    def fail(self, partition: str, exc: BaseException, which=None) -> None:
        """Answer the gets waiting on a partition (those `which` accepts) with an error."""
        for w in list(self.by_partition.get(partition, ())):
            if which is None or which(w.frame.acquire):
                self.drop(partition, w)
                w.peer.reply_error(w.frame, exc)

    def drop_peer(self, peer: Peer) -> None:
        """A connection closed: its gets stop waiting (nobody to answer)."""
        for part, ws in list(self.by_partition.items()):  # drop deletes emptied partitions
            for w in [w for w in ws if w.peer is peer]:
                self.drop(part, w)

    def by_consumer(self) -> dict[tuple[str, str], int]:
        """(partition, consumer) -> gets waiting."""
        out: dict[tuple[str, str], int] = {}
        for part, ws in self.by_partition.items():
            for w in ws:
                key = (part, w.frame.acquire.consumer)
                out[key] = out.get(key, 0) + 1
        return out

    def close(self, exc: BaseException) -> None:
        self._closed = True
        for part in list(self.by_partition):
            self.fail(part, exc)
        if self._full_retry is not None:
            self._full_retry.cancel()
            self._full_retry = None

    def _expire(self, partition: str, w: Waiter) -> None:
        w.timer = None
        self.drop(partition, w)
        w.peer.reply_error(w.frame, self.timeout_error(w.frame.acquire))

    def timeout_error(self, r: pb.AcquireRequest) -> DockTimeout:
        core = self.core
        ready = core.ready_count(r.partition, r.consumer, r.columns[:], r.groups)
        unit = "samples in whole groups" if r.groups else "samples"
        what = f"get(consumer={r.consumer!r}, partition={r.partition!r}, columns={r.columns[:]})"
        after = seconds(r.timeout)
        if r.dp_size:  # a rank-aware get waits for a whole step's batch, or for its share of one being weighed
            return DockTimeout(
                f"{what} of rank {r.dp_rank} of {r.dp_size} timed out after {after}: a step needs "
                f"{r.count} x {r.dp_size} = {r.count * r.dp_size} {unit} ready at once, {ready} were."
                + core.why_not_ready(r.partition, r.columns[:])
                + " Put more samples per step, lower count, or give a longer timeout.",
                ready=ready,
            )
        head = f"{what} timed out after {after}: {ready} of {r.count} {unit} were ready"
        taken = reads.all_taken(core.catalog, r.partition, r.consumer) if not ready else None
        if taken is not None:
            deleted = core.partitions[r.partition].deleted
            return DockTimeout(
                f"{head}: consumer {r.consumer!r} has already taken all {taken} samples of partition "
                f"{r.partition!r}" + (f" that were not deleted ({deleted} were)" if deleted else "")
                + ", and none is left for it or pending (each consumer gets each sample once per partition). Put "
                "more samples, read the next partition, or read them again under another consumer name.",
                ready=ready,
            )
        return DockTimeout(
            f"{head}." + core.why_not_ready(r.partition, r.columns[:])
            + " Pass allow_partial=True to take what is ready, or a longer timeout.",
            ready=ready,
        )
