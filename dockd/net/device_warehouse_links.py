"""The warehouse's ends of device links (cross-node device reads, see `dockd.net.device_link`).

A link is opened by a fetch that carries a rendezvous, kept while the connection
that opened it lasts, and dropped on that connection's end, on any failure of
its join or a transfer (the reader then opens a new one), or at shutdown. Each
link has one worker thread: its join and its sends run there in request order,
off the event loop, so a slow or dead reader stalls its own link only.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockError
from dockd.net import device_share
from dockd.net.device_link import BACKENDS, HOLDER, Link

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    owner: object  # the connection (Peer) that opened the link
    link: Link
    worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="dockd-link"))


class Links:
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

