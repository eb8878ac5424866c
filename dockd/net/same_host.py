"""Same host: frames over the daemon's Unix socket, payloads in sealed shared memory.

A put copies its body into a warm staging memfd (`dockd.net.staging`) and
names it; the warehouse copies it out before it answers. A fetch's large
values come as memfd segments passed with the reply (SCM_RIGHTS), mapped
copy-on-write: the values are views of the warehouse's memory, and each
mapping *pins* its segment until it is gone (the unpin rides on the next
request). Device-tier data is shared by IPC handle (same node) and copied
once, device to device. See `dockd.net.shm` for the daemon's side.
"""

from __future__ import annotations

import functools
import os
import resource
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockError, DockProtocolError, StagingUnknown
from dockd.net import device_share, shm
from dockd.net.staging import Staging
from dockd.net.transport import Context, Endpoint, Put, Reply, Transport, is_local


class ShmTransport(Transport):
    name = "shm"
    auto = True
    priority = 100
    passes_fds = True

    def __init__(self, endpoint: Endpoint, ctx: Context) -> None:
        super().__init__(endpoint, ctx)
        self.spin_s = ctx.config.spin_s
        self.staging = Staging()  # same-host puts write here
        self._unpins: list[int] = []  # segments of this daemon we no longer map, to tell it
        self._lock = threading.Lock()

    @classmethod
    def applies(cls, endpoint: Endpoint, ctx: Context) -> bool:
        return bool(endpoint.unix) and shm.available() and is_local(endpoint.host)

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
            sock.connect(shm.unix_address(self.endpoint.unix))
        except BaseException:
            sock.close()
            raise
        return sock

    def recv_into(self, sock: socket.socket, mv: memoryview, fds: deque[int]) -> int:
        n, anc, flags, _ = sock.recvmsg_into([mv], shm._ANC, socket.MSG_DONTWAIT)
        if anc:
            fds.extend(shm.recv_fds(anc))
        if flags & shm.MSG_CTRUNC:  # the reply's segments are lost; the stream is out of step
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
    def send_put(self, pool, put: Put) -> pb.Frame:
        """Device columns go by handle (same node). A large body is copied into a warm staging buffer
        (the one copy here) and named; the warehouse copies it into its own storage, before or (a lent
        buffer: see `dockd.net.staging`) right after it answers."""

        req, body = put.req, put.body
        mark = self.staging.mark()
        if body.size < shm.SHM_MIN_BODY:
            reply, _, _ = pool.call(pb.Frame(put=req), body.buffers, body.size, timeout=put.answer_s,
                                    alive=put.alive(pool))
            self.staging.answered(mark)
            return reply
        buf = self.staging.take(body.size)
        done = lent = False
        try:
            assert buf.view is not None  # a buffer is dropped only after it is given back
            body.write_into(memoryview(buf.view))  # type: ignore[arg-type]  # numpy declares __buffer__ only for Python 3.12+
            req.staging, req.shm_size, req.lend_staging = buf.id, body.size, True
            for attempt in (0, 1):
                try:
                    reply, _, _ = pool.call(pb.Frame(put=req), fds=[] if buf.registered else [buf.fd],
                                            timeout=put.answer_s, alive=put.alive(pool))
                    break
                except StagingUnknown:  # the warehouse dropped our registration (many buffers, a restart)
                    if attempt:
                        raise
                    buf.registered = False
            buf.registered = True
            done, lent = True, reply.put_reply.staging_lent
        except DockError as e:
            done = not isinstance(e, DockConnectionError)  # (an answer, if an error: the warehouse is done with it)
            raise
        finally:
            # a put without an answer (a silent warehouse, a dropped connection) may still be taken in
            # when the warehouse resumes: its buffer is dropped, never refilled by another put under it
            if not done:
                self.staging.drop(buf)
            elif lent:
                self.staging.lend(buf)
            else:
                self.staging.give(buf)
            if done:
                self.staging.answered(mark)
        return reply

    def fetch(self, pool, wid: int, req: pb.FetchRequest, device, timeout: float | None) -> Reply:
        req.device = device is not None  # device-tier data by handle: we share the node's memory
        return super().fetch(pool, wid, req, device, timeout)

    def buffers(self, columns: Sequence[pb.ColumnData], reply: Reply, *, device=None,
                shared: Sequence[pb.DeviceBuffer] = ()) -> dict[int, tuple[Any, int]]:
        """The body, each passed segment mapped once (the range its runs span; its descriptor closed)
        and device-tier buffers copied onto `device`. The values keep a mapping, and so the memory,
        alive; when it goes the segment is unpinned (`pins` names the passed segments), so the
        warehouse may fill it again; one passed but not mapped is unpinned at once."""
        fds, pins = reply.fds, reply.frame.pins
        buffers: dict[int, tuple[Any, int]] = {0: (reply.body, 0)}
        mapped: set[int] = set()
        try:
            if fds:
                for k, (lo, hi) in codec.spans(columns, "segment").items():
                    if not 0 < k <= len(fds):
                        raise DockProtocolError(f"a run refers to descriptor {k} of {len(fds)} passed")
                    sid = pins[k - 1] if k <= len(pins) else 0
                    on_free = functools.partial(self.unpin, sid) if sid else None
                    mm, delta = shm.map_private(fds[k - 1], lo, hi, on_free=on_free)
                    buffers[k] = (mm, lo - delta)
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

    def unpin(self, sid: int) -> None:
        """A zero-copy mapping of the daemon's segment `sid` is gone (runs in a finalizer): queue the
        unpin (it rides on the next request to that daemon, or the flusher sends it)."""
        with self._lock:
            self._unpins.append(sid)
        self.ctx.wake()

    def take_unpins(self) -> list[int]:
        with self._lock:
            out, self._unpins = self._unpins, []
        return out

    def matches(self, endpoint: Endpoint) -> bool:
        return super().matches(endpoint) and endpoint.unix == self.endpoint.unix

    def close(self) -> None:
        self.staging.close()


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
