"""Same host: frames over the daemon's Unix socket, payloads in sealed shared memory.

Both ends of the transport: `ShmTransport` is the client's, `UnixTransport`
(with `peer_cred` and the descriptor passing) the daemon's. Payloads travel
as memfd segments (`dockd.net.memfd`) whose descriptors are passed over an
abstract Unix socket (SCM_RIGHTS); nothing has a name, so nothing can leak.

- put: the client copies its tensors into one of a few *staging* memfds it
  keeps warm (`dockd.net.staging`; registered with the warehouse once: the
  descriptor passes once, sealed against shrinking), and names it; the
  warehouse copies the payload into a segment of its own, taken warm from its
  pool, and seals that segment against future writes. Two copies into warm
  memory run several times faster than one copy into fresh pages (the kernel
  hands out fresh shared pages at about 1 GB/s on the development VM). The
  writer lends the buffer: the warehouse may answer before it copies the bulk
  out, and copies it before it reads another request; the writer reuses the
  buffer only once a later put is answered (`dockd.warehouse.put`). A put
  with per-sample tensors (`codec.Joined` parts) or several tensor runs is
  sent before its tensors are copied in (`PutRequest.staging_pending`,
  `codec.Body.late`: its other bytes, the msgpack values the warehouse
  checks, are there already): the copy runs right after the send
  (`ShmTransport.idle`), while the warehouse admits and checks the put, and
  ends with a signal on the buffer's eventfd, which the warehouse waits for
  before it commits (`dockd.warehouse.pending`).
- get: the warehouse passes the descriptors of the segments holding the values
  with the reply; the client maps them copy-on-write (MAP_PRIVATE), so the
  returned tensors are zero-copy views that the caller may still write to: a
  write copies the touched page, never the warehouse's data. Each descriptor
  lent *pins* its segment for the reader's process until the reader reports
  the mapping gone (the unpin rides on the next request) or the process exits;
  only an unpinned segment whose data was cleared goes back to the pool to be
  filled again (`dockd.warehouse.segments`). A mapping whose values are all
  gone is unmapped (and its segment unpinned) by the next call while it waits
  for its reply (`ShmTransport.idle`), or by the flusher: not by the code that
  dropped the last value, which is most often about to make that call (a get's
  loop rebinding its batch). Unmapping 1 MiB costs ~30 us on a 2-core VM. With
  `DOCKD_KEEP_MAPPINGS` bytes a process (ClientConfig.keep_mappings, 64 MiB by
  default), a mapping none of whose pages was written is kept
  instead (its segment unpinned all the same) and maps that segment again when
  a later reply passes it, without the page faults of a fresh mapping
  (`dockd.net.reply_maps`).
- device-tier data is shared by IPC handle (same node) and copied once,
  device to device (`dockd.net.device_share`).

`UnixTransport` gives a `Peer` the asyncio-transport surface it expects over a
non-blocking Unix socket driven by `loop.add_reader`, plus descriptor passing,
which asyncio transports lack.
"""

from __future__ import annotations

import array
import collections
import functools
import logging
import os
import resource
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockProtocolError
from dockd.net import device_share, memfd, wire
from dockd.net.reply_maps import Ident, ReplyMaps
from dockd.net.staging import StagedPut, Staging
from dockd.net.transport import Context, Endpoint, Put, Reply, Request, Transport, is_local

logger = logging.getLogger(__name__)

SHM_MIN_BODY = 256 << 10   # puts at least this big go through a memfd
SHM_MIN_VALUE = 64 << 10   # runs of stored values at least this big are passed by descriptor ...
SHM_COPY_REPLY = 256 << 10  # ... in a reply with more bytes of them than this (fewer: copied, which costs less)
SEND_BUFFER = 1 << 20      # the daemon's send buffer per same-host connection (the kernel doubles it)
MAX_FDS = 253              # SCM_MAX_FD
_ANC = socket.CMSG_SPACE(MAX_FDS * 4) if hasattr(socket, "CMSG_SPACE") else 0
MSG_CTRUNC = int(socket.MSG_CTRUNC)
"""As a plain int: `flags & socket.MSG_CTRUNC` runs the enum's Python `__rand__` (an IntFlag on the
right of an int), ~7,500 instructions, 8 % of what the daemon spends on an empty request."""


def available() -> bool:
    """The probe: Linux with memfd_create and SCM_RIGHTS."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "SCM_RIGHTS")


def unix_name(port: int) -> str:
    """Abstract-namespace socket name of the daemon on `port` (no file to clean up)."""
    return f"dockd-{os.getpid()}-{port}"


def unix_address(name: str) -> str:
    return "\0" + name


def peer_cred(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def recv_fds(anc) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


def fds_ancillary(fds) -> list:
    """SCM_RIGHTS data for descriptors given as ints or objects with fileno() (kept alive by the caller)."""
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [f if isinstance(f, int) else f.fileno() for f in fds]))]


# -- the client's end ------------------------------------------------------------------------------
class ShmTransport(Transport):
    """The client's end: frames over the daemon's Unix socket, large puts staged, values mapped."""

    name = "shm"
    auto = True
    priority = 100
    passes_fds = True

    def __init__(self, endpoint: Endpoint, ctx: Context) -> None:
        super().__init__(endpoint, ctx)
        self.spin_s = ctx.config.spin_s
        self.staging = Staging()  # same-host puts write here
        self._unpins: collections.deque[int] = collections.deque()  # segments of this daemon we no longer map, to tell it
        self._released: list[tuple[np.ndarray, tuple[int, Ident] | None]] = []  # mappings whose values are
        # gone, for `idle` to unmap (or keep: with the segment id and identity of one that `maps` gave)
        self.maps = ReplyMaps(ctx.config.keep_mappings)
        self._closed = False  # (then no call comes: a mapping is unmapped once its values are gone)
        self._copies = threading.local()  # .put: this thread's put sent before its copy (`idle` copies it)

    @classmethod
    def applies(cls, endpoint: Endpoint, ctx: Context) -> bool:
        return bool(endpoint.unix) and available() and is_local(endpoint.host)

    @property
    def socket_name(self) -> str:
        return self.endpoint.unix

    # -- frames --------------------------------------------------------------------------------
    def describe(self) -> str:
        # errors name the address the user knows, never the internal socket name
        return f"{self.endpoint.host}:{self.endpoint.port} (same-host socket)"

    def open(self, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(unix_address(self.endpoint.unix))
        except BaseException:
            sock.close()
            raise
        return sock

    def recv_into(self, sock: socket.socket, mv: memoryview, fds: collections.deque[int]) -> int:
        n, anc, flags, _ = sock.recvmsg_into([mv], _ANC, socket.MSG_DONTWAIT)
        if anc:
            fds.extend(recv_fds(anc))
        if flags & MSG_CTRUNC:  # the reply's segments are lost; the stream is out of step
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            err = DockConnectionError(
                f"the kernel dropped shared-memory descriptors sent by dockd at {self.describe()}: this process "
                f"is at its open-file limit ({soft}). Raise it (ulimit -n) or close files it no longer needs."
            )
            # a limit of this process, not a daemon that went away: re-sending would fail again
            err.retry = False
            raise err
        return n

    # -- payloads ------------------------------------------------------------------------------
    def put_request(self, put: Put) -> Request:
        """Device columns go by handle (same node). A large body is copied into a warm staging buffer
        (the one copy here) and named; the warehouse copies it into its own storage, before or (a lent
        buffer: see `dockd.net.staging`) right after it answers."""
        req, body = put.req, put.body
        mark = self.staging.mark()
        if body.size < SHM_MIN_BODY:
            return Request(pb.Frame(put=req), body.buffers, body.size, timeout=put.answer_s, watch=put.alive,
                           answer=functools.partial(_answered, self.staging, mark))
        buf = self.staging.take(body.size)
        # (tensors to copy after the send, into a buffer the warehouse has: see the module docstring)
        pending = body.late and buf.efd >= 0 and buf.registered
        try:
            assert buf.view is not None  # a buffer is dropped only after it is given back
            if pending:
                buf.ready()
            body.write_into(memoryview(buf.view), late=not pending)  # type: ignore[arg-type]  # numpy declares __buffer__ only for Python 3.12+
        except BaseException:
            self.staging.drop(buf)
            raise
        req.staging, req.shm_size, req.lend_staging, req.staging_pending = buf.id, body.size, True, pending
        return StagedPut(self.staging, buf, mark, put, self._copies if pending else None).request()

    def fetch_request(self, wid: int, req: pb.FetchRequest, device, timeout: float | None) -> Request:
        req.device = device is not None  # device-tier data by handle: we share the node's memory
        return super().fetch_request(wid, req, device, timeout)

    def buffers(self, columns: Sequence[pb.ColumnData], reply: Reply, *, device=None,
                shared: Sequence[pb.DeviceBuffer] = ()) -> dict[int, tuple[Any, int]]:
        """The body, each passed segment mapped once (the range its runs span; its descriptor closed)
        and device-tier buffers copied onto `device`. The values keep a mapping, and so the memory,
        alive; when it goes the segment is unpinned (`pins` names the passed segments), so the
        warehouse may fill it again; one passed but not mapped is unpinned at once."""
        fds, pins = reply.fds, reply.frame.pins[:]  # (a list: see dockd.net.wire)
        buffers: dict[int, tuple[Any, int]] = {0: (reply.body, 0)}
        mapped: set[int] = set()
        try:
            if fds:
                for k, (lo, hi) in codec.spans(columns, "segment").items():
                    if not 0 < k <= len(fds):
                        raise DockProtocolError(f"a run refers to descriptor {k} of {len(fds)} passed")
                    sid = pins[k - 1] if k <= len(pins) else 0
                    whole = self.maps.map(fds[k - 1], sid, hi)
                    if whole is not None:  # (the segment whole, maybe from a mapping kept: unpinned by `idle`)
                        buffers[k] = (self._lend(whole[0], (sid, whole[1])), 0)
                    else:
                        on_free = functools.partial(self.unpin, sid) if sid else None
                        mm, delta = memfd.map_private(fds[k - 1], lo, hi, on_free=on_free)
                        buffers[k] = (self._lend(mm), lo - delta)
                    mapped.add(k)
        finally:
            for fd in fds:
                os.close(fd)
            for k, sid in enumerate(pins, 1):
                if k not in mapped:
                    self.unpin(sid)
        if shared:
            buffers.update(_copy_shared(columns, shared, device))
        if reply.received:
            buffers.update(reply.received)
        return buffers

    def _lend(self, mm: np.ndarray, kept: tuple[int, Ident] | None = None) -> np.ndarray:
        """`mm` as the values view it: when the last of them is gone, `mm` (so the mapping) is kept for
        `idle` to drop, or with `kept` (segment id, identity) to offer to `maps` and unpin."""
        if not mm.size:
            return mm
        owner = _Lent()
        owner.__array_interface__ = mm.__array_interface__
        weakref.finalize(owner, self._release, mm, kept).atexit = False  # (the exit unmaps)
        return np.asarray(owner)

    def _release(self, mm: np.ndarray, kept: tuple[int, Ident] | None = None) -> None:
        """The values of mapping `mm` are gone (runs in a finalizer): unmapped by the next `idle`."""
        self._released.append((mm, kept))
        if self._closed:  # (checked after the append: close() sets it before its own idle)
            self.idle()
        else:
            self.ctx.wake()  # (the flusher's idle, should no call come)

    def idle(self) -> None:
        """Copy the tensors of the put this thread just sent (if it went before its copy), then unmap
        the mappings whose values are gone (their unpins then queued): a connection runs this right
        after it sends a request, where it costs the call nothing, and the flusher runs it."""
        staged = getattr(self._copies, "put", None)
        if staged is not None:
            self._copies.put = None
            staged.copy()
        while self._released:
            try:
                mm, kept = self._released.pop()  # (the last reference: unmapped here, unless `maps` keeps it)
            except IndexError:  # (another thread took the last one)
                break
            if kept is not None:
                self.maps.keep(kept[0], kept[1], mm)
                del mm
                self.unpin(kept[0])

    def unpin(self, sid: int) -> None:
        """A zero-copy mapping of the daemon's segment `sid` is gone (runs in a finalizer): queue the
        unpin (it rides on the next request to that daemon, or the flusher sends it). Takes no lock: a
        finalizer runs inside whatever allocation its thread makes, a critical section of that thread's too."""
        self._unpins.append(sid)
        self.ctx.wake()

    def take_unpins(self) -> list[int]:
        out: list[int] = []
        while self._unpins:  # (most requests: none to report; one queued meanwhile goes with the next, or the flusher)
            try:
                out.append(self._unpins.popleft())  # (each taken once, whichever thread takes it)
            except IndexError:
                break
        return out

    def matches(self, endpoint: Endpoint) -> bool:
        return super().matches(endpoint) and endpoint.unix == self.endpoint.unix

    def close(self) -> None:
        self.maps.clear()  # (and keeps none from now on: a `_release` that finds us closed waits for no lock)
        self._closed = True
        self.idle()
        self.staging.close()


class _Lent:
    """The owner of the array a reply's values view (`ShmTransport._lend`)."""

    __slots__ = ("__array_interface__", "__weakref__")
    __array_interface__: dict[str, Any]


def _answered(staging: Staging, mark: int, reply: Reply) -> pb.Frame:
    """A put that went in its frame is answered: the buffers lent before it was sent are free."""
    staging.answered(mark)
    return reply.frame


def _copy_shared(columns: Sequence[pb.ColumnData], shared: Sequence[pb.DeviceBuffer], device) -> dict[int, tuple]:
    """Device-tier bytes a fetch reply shares (warehouse memory): each buffer's span that the runs
    use, copied once onto `device` and unmapped at once. Keys as codec.buffer_key gives them."""
    import torch

    out: dict[int, tuple] = {}
    copies = []
    for k, (lo, hi) in codec.spans(columns, "device_buffer").items():
        if not 0 < k <= len(shared):
            raise DockProtocolError(f"a run refers to device buffer {k} of {len(shared)} shared")
        src = device_share.open_buffer(shared[k - 1])
        if hi > src.numel():
            raise DockProtocolError(f"device runs end at byte {hi} of a {src.numel()}-byte device buffer")
        dst = torch.empty(hi - lo, dtype=torch.uint8, device=device)
        dst.copy_(src[lo:hi])
        copies.append(dst)
        out[-k] = (dst, lo)
        del src
    for dst in copies:
        device_share.synchronize(dst)
    return out


# -- the daemon's end ------------------------------------------------------------------------------
def _widen_send_buffer(sock: socket.socket) -> None:
    """Let a reply of SHM_COPY_REPLY bytes (and its header) go in one write: with the default send
    buffer (net.core.wmem_default, 208 KiB here) a 256 KiB reply went in two, the second after the
    event loop's wait for the socket to drain. The kernel caps the size at net.core.wmem_max."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    except OSError as e:  # (a limit of the host: replies then go in more writes)
        logger.debug("[shm] cannot widen a connection's send buffer: %s", e)


class UnixTransport:
    """Just enough of asyncio.Transport for a Peer, over a Unix socket with descriptor passing."""

    def __init__(self, loop, sock: socket.socket, protocol) -> None:
        self.loop = loop
        self.sock = sock
        self.protocol = protocol
        self.passes_fds = True
        sock.setblocking(False)
        _widen_send_buffer(sock)
        self._closing = False
        self._reading = True
        self._out: collections.deque[tuple[list, list]] = collections.deque()  # (buffers, fds) waiting to be written
        loop.add_reader(sock.fileno(), self._on_readable)
        protocol.connection_made(self)

    def get_extra_info(self, name, default=None):
        return "unix" if name == "peername" else default

    def is_closing(self) -> bool:
        return self._closing

    def pause_reading(self) -> None:
        if self._reading and not self._closing:
            self._reading = False
            self.loop.remove_reader(self.sock.fileno())

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._reading = True
            self.loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            buf = self.protocol.get_buffer(-1)
            n, anc, flags, _ = self.sock.recvmsg_into([buf], _ANC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(e)
            return
        fds = recv_fds(anc)
        if fds:
            self.protocol.fds_received(fds)
        if flags & MSG_CTRUNC:
            logger.warning("[shm] descriptors were truncated by the kernel; closing the connection")
            self._lost(OSError("ancillary data truncated"))
            return
        if n == 0:
            self._lost(None)
            return
        self.protocol.buffer_updated(n)

    def writelines(self, buffers, fds=()) -> None:
        if self._closing:
            return
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        if self._out:  # keep order behind what is already waiting
            self._out.append((bufs, list(fds)))
            return
        self._send(bufs, list(fds))

    def _send(self, bufs: list, fds: list) -> bool:
        """Write bufs (descriptors ride on the first byte); False if the rest was queued."""
        anc = fds_ancillary(fds)
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:wire.IOV_MAX], anc)
            except (BlockingIOError, InterruptedError):
                self._out.appendleft((bufs, fds if anc else []))
                self.loop.add_writer(self.sock.fileno(), self._on_writable)
                return False
            except OSError as e:
                self._lost(e)
                return False
            anc = []
            wire.consume(bufs, sent)
        return True

    def _on_writable(self) -> None:
        self.loop.remove_writer(self.sock.fileno())
        while self._out and not self._closing:
            bufs, fds = self._out.popleft()
            if not self._send(bufs, fds):
                return

    def close(self) -> None:
        self._lost(None)

    def _lost(self, exc) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
        except (ValueError, OSError):
            pass
        self.sock.close()
        self.loop.call_soon(self.protocol.connection_lost, exc)
