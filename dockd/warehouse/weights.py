"""The warehouse's side of model weights (`dockd.weights`): the relay, and reads of a version's buckets.

A version is published to one warehouse, its *origin* (the publisher's own), as ordinary puts. A
reader asks its own warehouse to hold the version (`WeightsWait`); a warehouse that does not hold
it joins the version's relay at the origin, which names a parent (`dockd.weights.relay.RelayPlan`:
the origin, or a warehouse that joined before), and asks that parent to forward the buckets. The
parent sends each bucket (`WeightsRelay` copy, over the daemons' links of `replica.Replicator`) as
soon as it holds it, a few in flight, so buckets flow down a chain or tree in a pipeline, and the
origin's link carries each byte about once however many warehouses read.

A relayed bucket is stored under the version's partition and sample index like the origin's own,
so readers fetch it from their warehouse with ordinary fetches (shared memory on the host, Mooncake
where it serves), and its room is taken from `--capacity` like a put's (a copy waits for room, up
to the relay's timeout). It is not committed: the controller knows the origin's copy only, and the
version's `clear` frees every copy on every warehouse. A parent that stops answering (its
connection drops, or no bucket arrives for `stall` seconds) is reported to the origin, which names
another; the buckets held already are not sent again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from dockd import runcheck
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockAuthError, DockConnectionError, DockError, DockNotFound, DockProtocolError, DockValueError
from dockd.net import memfd
from dockd.net.peer import Peer
from dockd.node.tasks import failed, reply_when_done, spawn
from dockd.warehouse.admission import Admission
from dockd.warehouse.core import Warehouse
from dockd.warehouse.replica_copy import Replicator, encode
from dockd.weights import versions as vt
from dockd.weights.relay import RelayPlan

logger = logging.getLogger(__name__)

COLUMN = "data"
WINDOW = 2           # buckets a parent has in flight to one child
MAX_SAMPLES = 1 << 20  # buckets of one version a request may name
MAX_RANGES = 1 << 20   # ranges of one read
MAX_READ = 1 << 32     # bytes one read answers with at most
MAX_FANOUT = 64
JOIN_TRIES = 4       # parents a warehouse tries before its relay fails


class _Copy:
    """A version this warehouse holds (or is pulling) as a relay copy."""

    def __init__(self, version: pb.WeightsVersion) -> None:
        self.version = version
        self.total = len(version.samples)
        self.held = 0
        self.depth = 0
        self.error: BaseException | None = None
        self.changed = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.started = time.monotonic()
        self.nbytes = 0

    def advance(self, held: int) -> None:
        self.held = max(self.held, held)
        self.changed.set()
        self.changed = asyncio.Event()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.changed.set()


class WeightsService:
    """Weights requests of one warehouse.

    Args:
        admission: room (a copy's body is admitted like a put's).
        replicator: the daemons' links to other warehouses.
        wid: this warehouse's id; info: how other warehouses reach it.
        daemon: whether a connection is another daemon's (the relay's requests are daemon-to-daemon).
        check_warehouse: raises when this daemon runs no warehouse.
        members: the dock's warehouses as its controller lists them, by id: a reader names the version's
            origin, and the relay reaches the address the controller gives for it, never one a client gave.
        timeout: seconds a copy may wait for room, and a join or forward request for its answer.
        stall: seconds without a bucket before a puller gives its parent up.
    """

    def __init__(self, *, warehouse: Warehouse, admission: Admission, replicator: Replicator, wid: Callable[[], int],
                 info: Callable[[], pb.WarehouseInfo], daemon: Callable[[Peer], bool], timeout: float,
                 members: Callable[[], Awaitable[dict[int, pb.WarehouseInfo]]],
                 check_warehouse: Callable[[], None] = lambda: None, stall: float = 60.0) -> None:
        self.warehouse = warehouse
        self.admission = admission
        self.replicator = replicator
        self._wid, self._info, self._daemon, self._check_warehouse = wid, info, daemon, check_warehouse
        self._members = members
        self.timeout, self.stall = timeout, stall
        # versions this warehouse is the origin of, being relayed: their plan, and how to reach who joined
        self.plans: dict[str, tuple[RelayPlan, dict[int, pb.WarehouseInfo]]] = {}
        self.copies: dict[str, _Copy] = {}      # versions this warehouse holds (or pulls) as relay copies
        self.forwarding: set[asyncio.Task] = set()
        self.relayed_in = 0   # bytes received as relay copies (a counter)
        self.relayed_out = 0  # bytes sent to other warehouses

    # -- the request table ------------------------------------------------------------------------
    def handlers(self) -> dict[str, Callable[[Peer, pb.Frame, object, list[int]], None]]:
        def checked(fn: Callable[[Peer, pb.Frame, object], None]) -> Callable[[Peer, pb.Frame, object, list[int]], None]:
            def handle(peer: Peer, frame: pb.Frame, body: object, fds: list[int]) -> None:
                self._check_warehouse()
                fn(peer, frame, body)
            return handle

        return {"weights_wait": checked(lambda peer, frame, body: self.on_wait(peer, frame)),
                "weights_read": checked(lambda peer, frame, body: self.on_read(peer, frame)),
                "weights_relay": checked(self.on_relay)}

    def admit(self, peer: Peer, frame: pb.Frame, body_size: int):
        """Room for a relayed bucket's body (Peer's admission), before it is read."""
        try:
            req = frame.weights_relay
            if req.WhichOneof("op") != "copy":
                raise DockProtocolError("only a weights copy carries a body")
            self._check_warehouse()
            self._check_daemon(peer)
            _check_version(req.version)
            return self.admission.reserve(peer, body_size, self.timeout)
        except DockError as e:
            return failed(e)

    def cleared(self, partition: str) -> None:
        """A partition was freed here: a relay of it ends (its pullers and forwarders fail, saying so)."""
        self.plans.pop(partition, None)
        c = self.copies.pop(partition, None)
        if c is not None:
            if c.task is not None:
                c.task.cancel()
            c.fail(DockNotFound(f"{partition} was retired (cleared) while it was relayed"))

    def close(self) -> None:
        for c in self.copies.values():
            if c.task is not None:
                c.task.cancel()
        for t in list(self.forwarding):
            t.cancel()

    # -- readers ----------------------------------------------------------------------------------
    def on_wait(self, peer: Peer, frame: pb.Frame) -> None:
        req = frame.weights_wait
        v = req.version
        _check_version(v)
        total = len(v.samples)
        if self._wid() == v.origin.id or self._holds_all(v):
            if not self._holds_all(v):
                raise DockNotFound(f"{v.partition} is not held by its origin, warehouse {v.origin.id} (retired?)")
            c = self.copies.get(v.partition)
            depth = c.depth if c is not None else 0
            peer.reply(frame, pb.Frame(weights_wait_reply=pb.WeightsWaitReply(held=total, depth=depth)))
            return
        c = self._copy(v)
        spawn(reply_when_done(peer, frame, self._wait(c, req.held, req.timeout), "weights_wait_reply"))

    async def _wait(self, c: _Copy, held: int, timeout: float) -> pb.WeightsWaitReply:
        deadline = time.monotonic() + max(0.0, timeout)
        while c.error is None and c.held <= held and c.held < c.total:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(asyncio.shield(c.changed.wait()), left)
            except asyncio.TimeoutError:
                break
        if c.error is not None:
            if self.copies.get(c.version.partition) is c:  # (a later wait starts again)
                del self.copies[c.version.partition]
            raise c.error
        return pb.WeightsWaitReply(held=c.held, depth=c.depth)

    def on_read(self, peer: Peer, frame: pb.Frame) -> None:
        """Byte ranges of buckets held here, back to back in the reply's body."""
        req = frame.weights_read
        n = len(req.samples)
        if not req.partition.startswith(vt.PREFIX) or n > MAX_RANGES or \
                not (len(req.offsets) == len(req.lengths) == n) or len(req.counts) not in (0, n) or \
                len(req.strides) not in (0, n):
            raise DockValueError("a weights read names a version's partition and, per range, its bucket, offset and "
                                 f"length (and optionally count and stride), at most {MAX_RANGES} ranges")
        buckets: dict[int, memoryview] = {}
        parts: list[memoryview] = []
        total = 0
        for i in range(n):
            s = int(req.samples[i])
            mv = buckets.get(s)
            if mv is None:
                mv = buckets[s] = self._bucket(req.partition, s)
            off, length = int(req.offsets[i]), int(req.lengths[i])
            count = int(req.counts[i]) if req.counts else 1
            stride = int(req.strides[i]) if req.strides else length
            count = max(count, 1)
            end = off + (count - 1) * stride + length
            if length < 0 or stride < length or end > len(mv):
                raise DockValueError(f"range {i} ({count} x {length} bytes from {off}, stride {stride}) is outside "
                                     f"bucket {s} of {req.partition} ({len(mv)} bytes)")
            if count == 1 or stride == length:
                parts.append(mv[off:end])
            else:
                src = np.frombuffer(mv, dtype=np.uint8)
                rows = np.lib.stride_tricks.as_strided(src[off:], shape=(count, length), strides=(stride, 1))
                parts.append(np.ascontiguousarray(rows).data.cast("B"))
            total += count * length
            if total > MAX_READ:
                raise DockValueError(f"a weights read asks for more than {MAX_READ} bytes; split it")
        peer.reply(frame, pb.Frame(weights_read_reply=pb.WeightsReadReply(nbytes=total)), parts, total)

    def _bucket(self, partition: str, sample: int) -> memoryview:
        (_, slices), = self.warehouse.fetch(partition, [(COLUMN, [sample])])
        (batch, r0, r1), = slices
        lo, hi = batch.span(r0, r1)
        return memoryview(batch.host(lo, hi - lo)).cast("B")

    # -- the relay --------------------------------------------------------------------------------
    def on_relay(self, peer: Peer, frame: pb.Frame, body) -> None:
        req = frame.weights_relay
        op = req.WhichOneof("op")
        if op == "copy":
            self._on_copy(peer, frame, body)
            return
        self._check_daemon(peer)
        _check_version(req.version)
        if op == "join":
            peer.reply(frame, pb.Frame(weights_relay_reply=self._join(req)))
        elif op == "forward":
            task = asyncio.ensure_future(reply_when_done(peer, frame, self._forward(req), "weights_relay_reply"))
            self.forwarding.add(task)
            task.add_done_callback(self.forwarding.discard)
        else:
            raise DockValueError("a weights relay request is a join, a forward or a copy")

    def _join(self, req: pb.WeightsRelay) -> pb.WeightsRelayReply:
        v = req.version
        if self._wid() != v.origin.id:
            raise DockValueError(f"warehouse {self._wid()} is not the origin of {v.partition} (warehouse {v.origin.id} is)")
        if not self._holds_all(v):
            raise DockNotFound(f"{v.partition} is not held here (retired?)")
        got = self.plans.get(v.partition)
        if got is None:
            got = self.plans[v.partition] = (RelayPlan(v.origin.id, min(MAX_FANOUT, max(1, v.fanout))),
                                             {v.origin.id: self._info()})
        plan, infos = got
        wid = req.join.id
        infos[wid] = req.join
        parent = plan.join(wid, req.failed_parent - 1 if req.failed_parent else None)
        depth = plan.depth(wid)
        logger.info("[weights] relay of %s: warehouse %d pulls from warehouse %d (depth %d)", v.partition, wid, parent,
                    depth)
        return pb.WeightsRelayReply(parent=infos[parent], depth=depth)

    async def _forward(self, req: pb.WeightsRelay) -> pb.WeightsRelayReply:
        """Send the buckets of req.version to req.forward as this warehouse holds them."""
        v, child = req.version, req.forward
        peer = await self.replicator.link(child)
        copy = self.copies.get(v.partition)
        inflight: collections.deque[asyncio.Future] = collections.deque()
        head = pb.WeightsVersion(partition=v.partition, samples=v.samples, origin=v.origin, fanout=v.fanout)
        for b in range(req.start, len(v.samples)):
            if copy is not None:
                while copy.held <= b:
                    if copy.error is not None:
                        raise copy.error
                    await copy.changed.wait()
            elif not self._holds_all(v):
                raise DockNotFound(f"{v.partition} is not held here (retired?)")
            found = self.warehouse.fetch(v.partition, [(COLUMN, [int(v.samples[b])])])
            cols, body = encode(found)
            frame = pb.Frame(weights_relay=pb.WeightsRelay(version=head, copy=b, columns=cols))
            inflight.append(asyncio.ensure_future(peer.request(frame, body.buffers, body.size)))
            self.relayed_out += body.size
            if len(inflight) >= WINDOW:
                await asyncio.wait_for(inflight.popleft(), self.timeout)
        for fut in inflight:
            await asyncio.wait_for(fut, self.timeout)
        return pb.WeightsRelayReply()

    def _on_copy(self, peer: Peer, frame: pb.Frame, body) -> None:
        req = frame.weights_relay
        seg = body if isinstance(body, memfd.Segment) else None
        if seg is not None:
            seg.seal()
        buf = seg.buffer if seg is not None else body
        size = buf.size if buf is not None else 0
        try:
            self._check_daemon(peer)
            v = req.version
            c = self.copies.get(v.partition)
            if c is None or c.error is not None:
                raise DockNotFound(f"this warehouse is not pulling {v.partition} (retired, or its relay failed)")
            b = req.copy
            if b >= c.total or int(v.samples[b]) != int(c.version.samples[b]):
                raise DockValueError(f"bucket {b} of {v.partition} does not match the version being pulled")
            if runcheck.check_columns(req.columns, size, []) != 1 or [x.name for x in req.columns] != [COLUMN]:
                raise DockValueError(f"a weights copy holds one bucket in column {COLUMN!r}")
            sample = int(v.samples[b])
            if self.warehouse.has(v.partition, [(COLUMN, [sample])]):
                self.admission.release(unreserve=size, seg=seg)  # (sent again by a new parent)
            else:
                self.warehouse.store(v.partition, [sample], req.columns, buf, size, seg)
                self.relayed_in += size
                c.nbytes += size
        except Exception:
            self.admission.release(unreserve=size, seg=seg)
            raise
        held = c.held
        while held < c.total and self.warehouse.has(v.partition, [(COLUMN, [int(c.version.samples[held])])]):
            held += 1
        c.advance(held)
        peer.reply(frame, pb.Frame(weights_relay_reply=pb.WeightsRelayReply()))
        if held == c.total:
            took = time.monotonic() - c.started
            logger.info("[weights] holds %s: %d buckets, %d bytes relayed in %.2fs (depth %d)", v.partition, c.total,
                        c.nbytes, took, c.depth)

    def _copy(self, v: pb.WeightsVersion) -> _Copy:
        """The copy of `v` here, its pull started if need be."""
        c = self.copies.get(v.partition)
        if c is not None:
            return c
        c = self.copies[v.partition] = _Copy(v)
        c.task = asyncio.ensure_future(self._pull(c))
        return c

    async def _pull(self, c: _Copy) -> None:
        v = c.version
        failed_parent: int | None = None
        last: BaseException | None = None
        try:
            trusted = (await self._members()).get(v.origin.id)
            if trusted is None:
                raise DockNotFound(f"warehouse {v.origin.id}, named as the origin of {v.partition}, is not in the dock")
        except Exception as e:  # noqa: BLE001 - the relay fails, saying why
            c.fail(e)
            return
        for _ in range(JOIN_TRIES):
            try:
                origin = await self.replicator.link(trusted)
                join = pb.WeightsRelay(version=v, join=self._info(),
                                       failed_parent=0 if failed_parent is None else failed_parent + 1)
                reply, _ = await asyncio.wait_for(origin.request(pb.Frame(weights_relay=join)), self.timeout)
            except Exception as e:  # noqa: BLE001 - the origin is gone: nothing to relay from
                c.fail(e if isinstance(e, DockError) else DockConnectionError(
                    f"cannot reach the origin of {v.partition}, warehouse {trusted.id} at {trusted.host}:"
                    f"{trusted.port}: {e or 'timed out'}"))
                return
            parent = reply.weights_relay_reply.parent
            c.depth = reply.weights_relay_reply.depth
            try:
                await self._from(c, parent)
            except (DockConnectionError, ConnectionError, asyncio.TimeoutError, _Stalled) as e:
                last = e
                failed_parent = parent.id
                logger.warning("[weights] relay of %s: parent warehouse %d (%s:%d) stopped answering (%s); asking "
                               "the origin for another", v.partition, parent.id, parent.host, parent.port, e or "timeout")
                continue
            except Exception as e:  # noqa: BLE001 - e.g. no room here: the relay fails, saying why
                c.fail(e)
                return
            if c.held == c.total:
                return
            failed_parent = parent.id
        c.fail(DockConnectionError(f"relaying {v.partition} failed after {JOIN_TRIES} parents: {last}"))

    async def _from(self, c: _Copy, parent: pb.WarehouseInfo) -> None:
        """Have `parent` forward the buckets not held yet; gives up on it after `stall` seconds without one."""
        peer = await self.replicator.link(parent)
        fwd = pb.WeightsRelay(version=c.version, forward=self._info(), start=c.held)
        fut = asyncio.ensure_future(peer.request(pb.Frame(weights_relay=fwd)))
        try:
            while True:
                held = c.held
                done, _ = await asyncio.wait({fut}, timeout=self.stall)
                if done:
                    fut.result()
                    return
                if c.held == held:
                    raise _Stalled(f"no bucket for {self.stall:g}s")
        finally:
            if not fut.done():
                fut.cancel()

    # -- helpers ----------------------------------------------------------------------------------
    def _holds_all(self, v: pb.WeightsVersion) -> bool:
        return self.warehouse.has(v.partition, [(COLUMN, v.samples[:])])

    def _check_daemon(self, peer: Peer) -> None:
        if not self._daemon(peer):
            raise DockAuthError("a weights relay request is a daemon-to-daemon message; this connection is a client's")


class _Stalled(Exception):
    pass


def _check_version(v: pb.WeightsVersion) -> None:
    if not v.partition.startswith(vt.PREFIX) or len(v.partition) > 256:
        raise DockValueError(f"{v.partition!r} is not a weights version's partition (dockd.weights/<model>/v<N>)")
    if not 0 < len(v.samples) <= MAX_SAMPLES or min(v.samples) < 0:
        raise DockValueError(f"a weights version names 1..{MAX_SAMPLES} buckets by sample index, got {len(v.samples)}")
    if not v.origin.host or not v.origin.port:
        raise DockValueError("a weights version names its origin warehouse (id, host and port)")
