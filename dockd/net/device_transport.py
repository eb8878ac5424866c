"""TCP plus device links: device-tier data from a warehouse on another node, device to device.

Both ends of the transport: `DeviceLinkTransport` with `ReaderLinks` is the reader's,
`WarehouseLinks` the warehouse's; one link is a `dockd.net.device_link.Link` (NCCL on CUDA, HCCL
on NPUs, gloo for the CPU stand-in).

Frames go over TCP as with `tcp`. A fetch for a get that names a device (`get(device="cuda:0")`),
from a warehouse with a device tier, goes through this client's device link to that warehouse: the
reply's device runs arrive on the link into fresh device memory (`Reply.received`), the rest in the
body. Without a device, or from a warehouse without a device tier, a fetch is a plain TCP one.

The reader keeps one link per warehouse on another node, made on the first `get(device=...)` that
reads from a warehouse with a device tier, until the Dock closes. A fetch on a link holds the link's
lock from its request until its data has arrived, so transfers on one link never interleave. When the
warehouse does not know the link (it dropped it, or restarted) or refuses one, the reply carries the
device runs as bytes and nothing is lost; when a join or a transfer fails, the link is dropped and the
caller reads the bytes again without it.

The warehouse opens a link for a fetch that carries a rendezvous, keeps it while the connection that
opened it lasts, and drops it on that connection's end, on any failure of its join or a transfer (the
reader then opens a new one), or at shutdown. Each link has one worker thread: its join and its sends
run there in request order, off the event loop, so a slow or dead reader stalls its own link only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dockd import codec, limits
from dockd._lazy import lazy_torch
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockError, DockProtocolError
from dockd.net import device_share
from dockd.net.device_link import BACKENDS, HOLDER, READER, Link, backend_for, local_address
from dockd.net.tcp import TcpTransport
from dockd.net.transport import Context, Endpoint, Reply, Request

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_torch(globals())

logger = logging.getLogger(__name__)


# -- the reader's end -------------------------------------------------------------------------------
class DeviceLinkTransport(TcpTransport):
    """The reader's end: frames over TCP; a fetch for a device goes on the warehouse's link (`ReaderLinks`)."""

    name = "tcp"  # (frames are TCP; the link is per fetch)
    priority = 10

    @classmethod
    def applies(cls, endpoint: Endpoint, ctx: Context) -> bool:
        return endpoint.warehouse is not None and ctx.links is not None

    def fetch_request(self, wid: int, req: pb.FetchRequest, device, timeout: float | None) -> Request:
        if device is None or not self.ctx.device_tier(wid):
            return super().fetch_request(wid, req, device, timeout)
        if device.type != "cpu" and device.index is None:  # a link is bound to one device
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        assert self.ctx.links is not None  # applies() chose this transport only where there are links
        return self.ctx.links.request(wid, self.endpoint.host, device, req, timeout)


class LinkFailed(DockError):
    """A device link's join or transfer failed; the fetch is to be read again as bytes."""


@dataclass
class _Mine:
    link: Link
    id: bytes = field(default_factory=lambda: os.urandom(16))
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReaderLinks:
    """A client's links, one per warehouse on another node (see the module docstring)."""

    def __init__(self) -> None:
        self._links: dict[int, _Mine] = {}
        self._off: dict[int, str] = {}   # warehouse -> why it gets no link
        self._lock = threading.Lock()

    def request(self, wid: int, host: str, device: torch.device, req: pb.FetchRequest,
                timeout: float | None) -> Request:
        """The fetch `req` with its device runs to come over warehouse `wid`'s link, into its answer's
        `Reply.received` (None: no link was used). The link's lock is held from here until the answer
        is in (the request's `answer` or `failed` step), so transfers on one link never interleave."""
        while True:
            mine = self._get(wid, host, device)
            if mine is None:
                return Request(pb.Frame(fetch=req), timeout=timeout, stall=timeout)
            mine.lock.acquire()
            if self._links.get(wid) is mine:  # (not dropped while this fetch waited for it)
                try:
                    return self._on_link(wid, mine, req, timeout)
                except BaseException:
                    mine.lock.release()
                    raise
            mine.lock.release()

    def _on_link(self, wid: int, mine: _Mine, req: pb.FetchRequest, timeout: float | None) -> Request:
        """One fetch on a link whose lock is held: released once its answer is in."""
        link = mine.link
        req.link.CopyFrom(pb.DeviceLink(id=mine.id, backend=link.backend,
                                        rendezvous=b"" if link.joined else link.rendezvous))

        def answer(reply: Reply) -> Reply:
            try:
                reply.received = self._received(wid, mine, reply.frame.fetch_reply)
            finally:
                mine.lock.release()
            return reply

        def failed(exc: BaseException) -> None:
            try:
                if isinstance(exc, DockConnectionError) and not link.joined:
                    self.drop(wid, mine)  # the warehouse may have started joining: never offer that rendezvous again
            finally:
                mine.lock.release()

        return Request(pb.Frame(fetch=req), timeout=timeout, stall=timeout, answer=answer, failed=failed)

    def _received(self, wid: int, mine: _Mine, r: pb.FetchReply) -> dict | None:
        """The device buffers a fetch's answer sent over the link (None: none, or the link was not used)."""
        link = mine.link
        if r.link_unknown or r.link_refused:
            self.drop(wid, mine)
            if r.link_refused:
                self._off[wid] = r.link_refused
                logger.warning("[client] warehouse %d refused a device link (%s): its device-tier data "
                               "comes through host memory", wid, r.link_refused)
            return None
        try:
            if r.link_opened:
                link.join(link.rendezvous, READER)
            return receive(r.columns, r.device_buffers, link) if r.device_buffers else None
        except DockError as e:
            self.drop(wid, mine)
            raise LinkFailed(f"device link to warehouse {wid}: {e}") from e

    def _get(self, wid: int, host: str, device: torch.device) -> _Mine | None:
        with self._lock:
            if wid in self._off:
                return None
            mine = self._links.get(wid)
            if mine is not None and mine.link.device == device:
                return mine
        if mine is not None:
            self.drop(wid, mine)
        try:
            link = Link.offer(backend_for(device), device, local_address(host))
        except DockError as e:  # no collective library, or no link for this device type
            self._off[wid] = str(e)
            logger.warning("[client] no device link to warehouse %d (%s): device-tier data comes through host "
                           "memory", wid, e)
            return None
        with self._lock:
            mine = self._links.setdefault(wid, _Mine(link))
        if mine.link is not link:
            link.close()
        return mine

    def drop(self, wid: int, mine: _Mine | None = None) -> None:
        with self._lock:
            cur = self._links.get(wid)
            if cur is None or (mine is not None and cur is not mine):
                return
            del self._links[wid]
        cur.link.close()

    def close(self) -> None:
        for wid in list(self._links):
            self.drop(wid)


def receive(columns: Sequence[pb.ColumnData], descs: Sequence[pb.DeviceBuffer], link: Link) -> dict[int, tuple]:
    """Each device buffer's used span, received over `link` in buffer order (as the warehouse sends
    them), into fresh memory on the link's device. Keys as codec.buffer_key gives them."""
    out: dict[int, tuple] = {}
    dsts = []
    for k, (lo, hi) in sorted(codec.spans(columns, "device_buffer").items()):
        if not 0 < k <= len(descs) or descs[k - 1].type != link.backend:
            raise DockProtocolError(f"a run refers to device buffer {k}, not one of the {len(descs)} "
                                    f"{link.backend} buffers of the reply")
        if hi > descs[k - 1].nbytes:
            raise DockProtocolError(f"device runs end at byte {hi} of a {descs[k - 1].nbytes}-byte device buffer")
        dst = torch.empty(hi - lo, dtype=torch.uint8, device=link.device)
        dsts.append(dst)
        out[-k] = (dst, lo)
    link.recv(dsts)
    return out


# -- the warehouse's end ---------------------------------------------------------------------------
@dataclass
class _Held:
    owner: object  # the connection (Peer) that opened the link
    link: Link
    worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="dockd-link"))


class WarehouseLinks:
    """A warehouse's links, one per reader connection that opened one (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._held: dict[bytes, _Held] = {}
        self._loop = loop

    def __len__(self) -> int:
        return len(self._held)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that link work reports back to (the daemon's, once it runs)."""
        self._loop = loop

    def open(self, owner, want: pb.DeviceLink, devices: list[torch.device], reply: pb.FetchReply) -> Link | None:
        """The link a fetch asks for, opening it (and setting reply.link_opened) when it is new and the
        request carries a rendezvous; None, with reply.link_unknown or reply.link_refused set, when its
        device runs are to go as bytes instead. `devices`: the devices the fetch's device runs are on."""
        held = self._held.get(want.id)
        if held is not None:
            if held.link.backend != want.backend:
                reply.link_refused = f"link is a {held.link.backend} link, not {want.backend}"
                return None
            return held.link
        if not want.rendezvous:
            reply.link_unknown = True
            return None
        device = next((d for d in devices if BACKENDS.get(d.type) == want.backend), None)
        why = ""
        if want.backend == "gloo" and not device_share.cpu_stand_in():
            why = "gloo links are the device tier's CPU stand-in; this warehouse runs without DOCKD_CPU_DEVICE_TIER=1"
        elif device is None:
            why = f"this fetch's device-tier data is on {sorted({str(d) for d in devices})}, not on {want.backend} devices"
        elif len(self._held) >= limits.MAX_LINKS:
            why = f"this warehouse has {len(self._held)} device links open, the most it keeps"
        else:
            try:
                link = Link(want.backend, device)
            except DockError as e:  # the library is missing, or the backend is unknown
                why = str(e)
        if why:
            reply.link_refused = why
            logger.warning("[warehouse] device link refused: %s", why)
            return None
        held = self._held[bytes(want.id)] = _Held(owner, link)
        reply.link_opened = True
        self._run(bytes(want.id), held, link.join, bytes(want.rendezvous), HOLDER)
        logger.info("[warehouse] device link opened backend=%s device=%s links=%d", link.backend, device, len(self))
        return link

    def send(self, link_id: bytes, tensors: list[torch.Tensor]) -> None:
        """Send `tensors` over the link, after the work already queued on it (the references keep their
        memory alive until then, even if their samples are freed meanwhile)."""
        held = self._held.get(link_id)
        if held is not None:
            self._run(link_id, held, held.link.send, tensors)

    def _run(self, link_id: bytes, held: _Held, fn, *args) -> None:
        fut = held.worker.submit(fn, *args)

        def done(f) -> None:
            if not f.cancelled() and f.exception() is not None:
                why = f.exception()
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self.drop, link_id, held, why)
                else:
                    self.drop(link_id, held, why)

        fut.add_done_callback(done)

    def drop(self, link_id: bytes, held: _Held | None = None, why: BaseException | str = "") -> None:
        """Forget a link and free it after the work queued on it (`held`: only if it is still that one)."""
        cur = self._held.get(link_id)
        if cur is None or (held is not None and cur is not held):
            return
        del self._held[link_id]
        if why:
            logger.warning("[warehouse] device link dropped (%s): %s", cur.link.backend, why)
        cur.worker.submit(cur.link.close)
        cur.worker.shutdown(wait=False)

    def lost(self, owner) -> None:
        """The connection `owner` ended: drop the links it opened."""
        for link_id in [k for k, h in self._held.items() if h.owner is owner]:
            self.drop(link_id)

    def close(self) -> None:
        for link_id in list(self._held):
            self.drop(link_id)
