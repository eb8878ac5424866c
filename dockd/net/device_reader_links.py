"""A client's ends of device links: cross-node device reads (see `dockd.net.device_link`).

One link per warehouse on another node, made on the first `get(device=...)`
that reads from a warehouse with a device tier, and kept until the Dock
closes. A fetch on a link holds the link's lock from its request until its
data has arrived, so transfers on one link never interleave. When the warehouse
does not know the link (it dropped it, or restarted) or refuses one, the
reply carries the device runs as bytes and nothing is lost; when a join or a
transfer fails, the link is dropped and the caller reads the bytes again
without it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dockd import codec
from dockd._lazy import lazy_torch
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockError, DockProtocolError
from dockd.net.device_link import READER, Link, backend_for, local_address

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_torch(globals())

logger = logging.getLogger(__name__)


class LinkFailed(DockError):
    """A device link's join or transfer failed; the fetch is to be read again as bytes."""


@dataclass
class _Mine:
    link: Link
    id: bytes = field(default_factory=lambda: os.urandom(16))
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReaderLinks:
    def __init__(self) -> None:
        self._links: dict[int, _Mine] = {}
        self._off: dict[int, str] = {}   # warehouse -> why it gets no link
        self._lock = threading.Lock()

    def fetch(self, wid: int, host: str, device: torch.device, req: pb.FetchRequest,
              call: Callable[[pb.Frame], tuple]) -> tuple[pb.Frame, np.ndarray, list[int], dict | None]:
        """`call(frame)` for a fetch whose device runs are to come over warehouse `wid`'s link:
        the reply, its body and descriptors, and the received device buffers (None: no link was used)."""
        while True:
            mine = self._get(wid, host, device)
            if mine is None:
                return (*call(pb.Frame(fetch=req)), None)
            with mine.lock:
                if self._links.get(wid) is mine:  # (not dropped while this fetch waited for it)
                    return self._fetch_on(wid, mine, req, call)

    def _fetch_on(self, wid: int, mine: _Mine, req: pb.FetchRequest, call) -> tuple:
        """One fetch on a link, its lock held."""
        link = mine.link
        req.link.CopyFrom(pb.DeviceLink(id=mine.id, backend=link.backend,
                                        rendezvous=b"" if link.joined else link.rendezvous))
        try:
            reply, body, fds = call(pb.Frame(fetch=req))
        except DockConnectionError:
            if not link.joined:  # the warehouse may have started joining: never offer that rendezvous again
                self.drop(wid, mine)
            raise
        r = reply.fetch_reply
        if r.link_unknown or r.link_refused:
            self.drop(wid, mine)
            if r.link_refused:
                self._off[wid] = r.link_refused
                logger.warning("[client] warehouse %d refused a device link (%s): its device-tier data "
                               "comes through host memory", wid, r.link_refused)
            return reply, body, fds, None
        try:
            if r.link_opened:
                link.join(link.rendezvous, READER)
            received = receive(r.columns, r.device_buffers, link) if r.device_buffers else None
        except DockError as e:
            self.drop(wid, mine)
            raise LinkFailed(f"device link to warehouse {wid}: {e}") from e
        return reply, body, fds, received

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
