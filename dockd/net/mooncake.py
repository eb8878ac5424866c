"""Mooncake Transfer Engine: frames over TCP, fetched bytes pulled by the reader's engine.

A fetch asks the warehouse for a Mooncake answer (`FetchRequest.mooncake`). A warehouse running an
engine (`dockd serve --transport mooncake|auto`, `dockd.net.mooncake_server`) answers with the runs'
metadata and, instead of body bytes, the remote address and length of each span of its registered
segments that the runs use; this client reads those spans with one batch transfer of its own engine
into a receive buffer taken from a pool registered with the engine once (not per call), then names
the answer's loan (`FetchRequest.mooncake_done`, one-way on the same connection) so the warehouse
unpins those segments. Small runs and data outside registered segments still come in the body.
The values are zero-copy views of the receive buffer; it goes back to the pool when they are gone.

Modes (`dockd.connect(transport=...)` / `DOCKD_TRANSPORT`):

- `"mooncake"` (required): every remote read uses the engine. A client whose engine cannot start,
  or a warehouse that answers without it (it runs no engine), raises EngineUnavailable naming what
  is missing; nothing falls back to TCP quietly.
- `"auto"`: used for warehouses on other hosts where the package is installed; a warehouse without
  an engine, or an engine that does not start here, makes reads from it plain TCP, logged once with why.

Puts still carry their bytes in the TCP stream (`TcpTransport.send_put`). Device-tier reads that
name a device go over device links as with `device_link`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError
from dockd.net.device_transport import DeviceLinkTransport
from dockd.net.mooncake_server import EngineUnavailable, address_of, load_engine_class, start_engine
from dockd.net.transport import Context, Endpoint, Reply, Transport, is_local

logger = logging.getLogger(__name__)

ALIGN = 4096  # each span starts page-aligned in the receive buffer (run offsets keep their 64-byte alignment)


def _size_class(n: int) -> int:
    """Receive buffer size for `n` bytes: whole pages (2 MiB units from 2 MiB), 4 classes per doubling."""
    n = max(n, ALIGN)
    step = max(2 << 20 if n >= 2 << 20 else ALIGN, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


class _Owner:
    """Keeps a receive buffer lent out while any value views it (numpy array interface)."""

    __array_interface__: dict[str, Any]


class ReceivePool:
    """Receive buffers registered with the engine once each, reused by size class. Idle buffers
    past `budget` bytes are unregistered and freed when they come back."""

    def __init__(self, engine: Any, budget: int) -> None:
        self.engine = engine
        self.budget = budget
        self._idle: dict[int, list[tuple[mmap.mmap, int]]] = {}
        self.idle_bytes = 0
        self.lent_bytes = 0
        self.registered = 0  # buffers registered so far (each once)
        self._lock = threading.Lock()
        self._warned = False

    def take(self, n: int) -> tuple[mmap.mmap, int, int]:
        """(buffer, its address, its size) of at least `n` bytes."""
        size = _size_class(n)
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                mm, addr = idle.pop()
                self.idle_bytes -= size
                self.lent_bytes += size
                return mm, addr, size
            self.lent_bytes += size
            over = self.lent_bytes + self.idle_bytes > self.budget
        if over and not self._warned:
            self._warned = True
            logger.warning("[mooncake] receive buffers in use pass DOCKD_RECV_POOL_BYTES (%d bytes): values read "
                           "earlier are still held; registering more", self.budget)
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        addr = address_of(np.frombuffer(mm, dtype=np.uint8))
        rc = self.engine.register_memory(addr, size)
        if rc != 0:
            with self._lock:
                self.lent_bytes -= size
            mm.close()
            raise DockConnectionError(f"the Mooncake engine refused to register a {size}-byte receive buffer ({rc})")
        self.registered += 1
        return mm, addr, size

    def give(self, mm: mmap.mmap, addr: int, size: int) -> None:
        with self._lock:
            self.lent_bytes -= size
            if self.idle_bytes + size <= self.budget:
                self._idle.setdefault(size, []).append((mm, addr))
                self.idle_bytes += size
                return
        if self.engine is not None:
            self.engine.unregister_memory(addr)
        # (the mmap is freed with its last reference: the numpy views are gone by now)

    def forked(self) -> None:
        """In a forked child: the engine is the parent's and runs no thread here. Buffers still in use
        are dropped when they come back, and nothing is unregistered with it."""
        self._lock = threading.Lock()
        self.engine, self.budget = None, 0
        self._idle.clear()
        self.idle_bytes = 0


class ClientEngine:
    """This process's Transfer Engine and receive pool (shared by its Docks)."""

    def __init__(self, engine: Any, session: str, protocol: str, budget: int) -> None:
        self.engine = engine
        self.session = session
        self.protocol = protocol
        self.pool = ReceivePool(engine, budget)
        self.reads = 0
        self.read_bytes = 0

    def read(self, session: str, spans: Sequence[pb.RemoteSegment]) -> dict[int, tuple[Any, int]]:
        """Read the spans of the warehouse engine `session` into one pooled buffer with one batch
        transfer; {k: (view, run offset the view starts at)} for span k (1-based)."""
        offs, off = [], 0
        for s in spans:
            offs.append(off)
            off += -(-s.nbytes // ALIGN) * ALIGN
        mm, addr, size = self.pool.take(off)
        try:
            rc = self.engine.batch_transfer_sync_read(session, [addr + o for o in offs], [s.address for s in spans],
                                                      [s.nbytes for s in spans])
        except Exception as e:  # noqa: BLE001 - the engine's error, as a failed read
            rc, why = -1, str(e)
        else:
            why = f"status {rc}"
        if rc != 0:
            self.pool.give(mm, addr, size)
            raise DockConnectionError(f"the Mooncake read of {len(spans)} spans ({off} bytes) from {session} failed "
                                      f"({why})")
        self.reads += 1
        self.read_bytes += sum(s.nbytes for s in spans)
        owner = _Owner()
        owner.__array_interface__ = {"data": (addr, False), "shape": (size,), "typestr": "|u1", "version": 3}
        weakref.finalize(owner, self.pool.give, mm, addr, size).atexit = False
        whole = np.asarray(owner)
        return {k: (whole[o : o + s.nbytes], s.offset) for k, (o, s) in enumerate(zip(offs, spans), 1)}


_ENGINE: ClientEngine | None = None
_ENGINE_ERROR: EngineUnavailable | None = None
_LOCK = threading.Lock()
_INHERITED: list[ClientEngine] = []  # a forked child's copy of its parent's engine (see _no_engine_in_child)


def _no_engine_in_child() -> None:
    """A forked child inherits the parent's engine object but none of its threads (a read with it
    waited for the transfer timeout, 30 s, and failed), and an engine started anew in a fork of a
    process that ran one hung. So in such a child the engine is unavailable: reads go over TCP,
    and transport='mooncake' fails saying why."""
    global _ENGINE, _ENGINE_ERROR, _LOCK
    _LOCK = threading.Lock()
    if _ENGINE is not None:
        _ENGINE.pool.forked()
        _INHERITED.append(_ENGINE)  # never destroyed here: its destructor waits for threads the child has not
        _ENGINE = None
        _ENGINE_ERROR = EngineUnavailable(
            "this process is a fork of one that ran the Mooncake engine, which does not run in a fork; start "
            "worker processes with the spawn method (a DataLoader's multiprocessing_context='spawn') to read with it")


os.register_at_fork(after_in_child=_no_engine_in_child)


def client_engine(hostname: str, protocol: str, budget: int) -> ClientEngine:
    """This process's engine, started on first use (EngineUnavailable when it cannot start)."""
    global _ENGINE, _ENGINE_ERROR
    with _LOCK:
        if _ENGINE is not None:
            if _ENGINE.protocol != protocol:
                raise EngineUnavailable(f"a warehouse's Mooncake engine speaks {protocol!r}, this client's "
                                        f"{_ENGINE.protocol!r} (one protocol per dock)")
            return _ENGINE
        if _ENGINE_ERROR is not None:
            raise _ENGINE_ERROR
        try:
            engine, session = start_engine(hostname, protocol)
        except EngineUnavailable as e:
            _ENGINE_ERROR = e
            raise
        _ENGINE = ClientEngine(engine, session, protocol, budget)
        logger.info("[client] Mooncake engine started session=%s protocol=%s receive_pool_budget=%d", session,
                    protocol, budget)
        return _ENGINE


@functools.lru_cache(maxsize=1)
def installed() -> bool:
    """Whether the engine's package is there (no import: cheap)."""
    return importlib.util.find_spec("mooncake") is not None


class MooncakeTransport(DeviceLinkTransport):
    name = "mooncake"
    auto = True
    fallback = False  # (unlike the TCP transports it builds on)
    priority = 50  # after same-host shared memory, before TCP

    def __init__(self, endpoint: Endpoint, ctx: Context) -> None:
        super().__init__(endpoint, ctx)
        self.declined = ""  # auto: why reads from this warehouse go over TCP instead ("": they do not)
        self.served = False  # a read came over the engine
        self._required = ctx.config.transport == "mooncake"

    @classmethod
    def applies(cls, endpoint: Endpoint, ctx: Context) -> bool:
        if endpoint.warehouse is None:  # the controller's pool: frames only
            return False
        # auto: other hosts only (on this one shared memory, or TCP over loopback, is as fast)
        return ctx.config.transport == "mooncake" or (installed() and not is_local(endpoint.host))

    @property
    def effective(self) -> str:
        """How reads from this warehouse travel: "mooncake", or "tcp" where it declined (auto)."""
        return "tcp" if self.declined else "mooncake"

    def _decline(self, why: str) -> None:
        self.declined = why
        logger.info("[client] warehouse %s at %s: reads over TCP, not Mooncake (%s)", self.endpoint.warehouse,
                    self.describe(), why)

    def _required_error(self, why: str) -> EngineUnavailable:
        return EngineUnavailable(
            f"transport='mooncake' is required (dockd.connect(transport=...) or DOCKD_TRANSPORT), but reads from "
            f"warehouse {self.endpoint.warehouse} at {self.describe()} cannot use it: {why}. Start that warehouse "
            "with `dockd serve --transport mooncake`, install the engine here (pip install mooncake-transfer-engine-non-cuda), "
            "or use transport='auto'"
        )

    def fetch(self, pool, wid: int, req: pb.FetchRequest, device, timeout: float | None) -> Reply:
        if device is not None and self.ctx.device_tier(wid):  # device-tier reads: the device link
            return super().fetch(pool, wid, req, device, timeout)
        if self.declined:
            return Transport.fetch(self, pool, wid, req, device, timeout)
        try:
            load_engine_class()
            if _ENGINE_ERROR is not None:  # (it did not start, or cannot here: no request that asks for it)
                raise _ENGINE_ERROR
        except EngineUnavailable as e:
            if self._required:
                raise self._required_error(str(e)) from None
            self._decline(str(e))
            return Transport.fetch(self, pool, wid, req, device, timeout)
        req.mooncake = True
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = pool.get(timeout)
        try:
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            frame, body, fds = conn.call(pb.Frame(fetch=req), timeout=left, stall=timeout)
            r = frame.fetch_reply
            if not r.remote_segments:
                if r.mooncake_refused:
                    if self._required:
                        raise self._required_error(f"the warehouse says: {r.mooncake_refused}")
                    self._decline(f"the warehouse says: {r.mooncake_refused}")
                return Reply(frame, body, fds)
            try:
                try:
                    eng = client_engine(conn.sock.getsockname()[0], r.mooncake_protocol or "tcp",
                                        self.ctx.config.recv_pool_bytes)
                except EngineUnavailable as e:
                    if self._required:
                        raise self._required_error(str(e)) from None
                    self._decline(str(e))
                    raise DockConnectionError(f"this client's Mooncake engine did not start ({e})") from None
                received = eng.read(r.mooncake_session, r.remote_segments)
            finally:  # read (or given up): the warehouse may unpin those segments
                conn.post(pb.Frame(oneway=True, fetch=pb.FetchRequest(mooncake_done=[r.mooncake_loan])))
            if not self.served:
                self.served = True
                logger.info("[client] warehouse %s at %s: reads over Mooncake (session %s, protocol %s)", wid,
                            self.describe(), r.mooncake_session, eng.protocol)
            return Reply(frame, body, fds, received)
        finally:
            pool.put(conn)


def stats() -> dict[str, Any]:
    """This process's engine figures (empty: none started)."""
    if _ENGINE is None:
        return {}
    p = _ENGINE.pool
    return {"session": _ENGINE.session, "protocol": _ENGINE.protocol, "reads": _ENGINE.reads,
            "read_bytes": _ENGINE.read_bytes, "receive_buffers_registered": p.registered,
            "receive_idle_bytes": p.idle_bytes, "receive_lent_bytes": p.lent_bytes}
