"""Mooncake Transfer Engine: frames over TCP, fetched bytes pulled by the reader's engine.

Both ends of the transport: `MooncakeTransport` is the reader's, `WarehouseEngine` (with `start`,
`attach` and the loans) the warehouse's; the engine itself is bound in `dockd.net.mooncake_engine`.

A fetch asks the warehouse for a Mooncake answer (`FetchRequest.mooncake`). A warehouse running an
engine answers with the runs' metadata and, instead of body bytes, the remote address and length of
each span of its registered segments that the runs use; the reader reads those spans with one batch
transfer of its own engine into a receive buffer taken from a pool registered with the engine once
(not per call), then names the answer's loan (`FetchRequest.mooncake_done`, one-way on the same
connection) so the warehouse unpins those segments. Small runs and data outside registered segments
still come in the body. The values are zero-copy views of the receive buffer; it goes back to the pool
when they are gone. Until the reader names it, the loan pins those segments (a cleared segment is not
refilled under a read); a loan whose connection closed, or that is older than `LOAN_TIMEOUT_S`, is
given back.

The warehouse: `dockd serve --transport mooncake|auto|socket` (`NodeConfig.transport`):

- `mooncake` (required): the engine must start, or the daemon refuses to start, naming what is
  missing (the Python package, a system library such as libibverbs, the engine's own error).
- `auto`: the engine is used where it starts; the daemon logs which transport it chose and why.
- `socket`: no engine; remote readers get their bytes in the frames' bodies over the TCP stream.

With the engine running, every storage segment (`dockd.warehouse.segments`) is registered with it
once, when the segment is created; a warm segment taken again from the pool is already registered,
and the registration goes when the segment does. The engine runs in P2P-handshake mode (no metadata
server): its session is "host:port" of its handshake listener, sent in each Mooncake answer. Its
protocol is "tcp" unless `--mooncake-protocol` says "rdma" (RDMA NICs). The engine authenticates
nobody: see docs/cluster.md.

The reader (`dockd.connect(transport=...)` / `DOCKD_TRANSPORT`):

- `"mooncake"` (required): every remote read uses the engine. A client whose engine cannot start,
  or a warehouse that answers without it (it runs no engine), raises EngineUnavailable naming what
  is missing; nothing falls back to TCP quietly.
- `"auto"`: used for warehouses on other hosts where the package is installed; a warehouse without
  an engine, or an engine that does not start here, makes reads from it plain TCP, logged once with why.

Puts still carry their bytes in the TCP stream (as `TcpTransport` sends them). Device-tier reads that
name a device go over device links as with `device_transport`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import socket
import threading
import time
import weakref
from typing import Any

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockValueError
from dockd.net.device_transport import DeviceLinkTransport
from dockd.net.mooncake_engine import (
    EngineUnavailable,
    address_of,
    client_engine,
    engine_host,
    installed,
    start_engine,
    usable,
)
from dockd.net.transport import Context, Endpoint, Reply, Request, Transport, is_local

logger = logging.getLogger(__name__)

LOAN_TIMEOUT_S = 300.0
"""Seconds a Mooncake answer's segments stay pinned for a reader that never says it read them."""

MODES = ("auto", "socket", "mooncake")
PROTOCOLS = ("tcp", "rdma")


# -- the reader's end -------------------------------------------------------------------------------
class MooncakeTransport(DeviceLinkTransport):
    """The reader's end: frames over TCP, a fetch's large runs read by this client's engine."""

    name = "mooncake"
    auto = True
    fallback = False  # (unlike the TCP transports it builds on)
    priority = 50  # after same-host shared memory, before TCP

    def __init__(self, endpoint: Endpoint, ctx: Context) -> None:
        super().__init__(endpoint, ctx)
        self.declined = ""  # auto: why reads from this warehouse go over TCP instead ("": they do not)
        self.served = False  # a read came over the engine
        self._required = ctx.config.transport == "mooncake"
        self.local_host = ""  # this host's address on its connections to the warehouse

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

    def open(self, timeout: float) -> socket.socket:
        sock = super().open(timeout)
        self.local_host = sock.getsockname()[0]  # (where this client's engine listens, started on first read)
        return sock

    def fetch_request(self, wid: int, req: pb.FetchRequest, device, timeout: float | None) -> Request:
        if device is not None and self.ctx.device_tier(wid):  # device-tier reads: the device link
            return super().fetch_request(wid, req, device, timeout)
        if self.declined:
            return Transport.fetch_request(self, wid, req, device, timeout)
        try:
            usable()  # (it did not start, or cannot here: no request that asks for it)
        except EngineUnavailable as e:
            if self._required:
                raise self._required_error(str(e)) from None
            self._decline(str(e))
            return Transport.fetch_request(self, wid, req, device, timeout)
        req.mooncake = True
        return Request(pb.Frame(fetch=req), timeout=timeout, stall=timeout, answer=functools.partial(self._read, wid),
                       then=_read_done)

    def _read(self, wid: int, reply: Reply) -> Reply:
        """A Mooncake answer: the spans it names read with this client's engine (the warehouse is told
        they were read, or given up, by `_read_done`, on the same connection)."""
        r = reply.frame.fetch_reply
        if not r.remote_segments:
            if r.mooncake_refused:
                if self._required:
                    raise self._required_error(f"the warehouse says: {r.mooncake_refused}")
                self._decline(f"the warehouse says: {r.mooncake_refused}")
            return reply
        try:
            eng = client_engine(self.local_host, r.mooncake_protocol or "tcp", self.ctx.config.recv_pool_bytes)
        except EngineUnavailable as e:
            if self._required:
                raise self._required_error(str(e)) from None
            self._decline(str(e))
            raise DockConnectionError(f"this client's Mooncake engine did not start ({e})") from None
        reply.received = eng.read(r.mooncake_session, r.remote_segments)
        if not self.served:
            self.served = True
            logger.info("[client] warehouse %s at %s: reads over Mooncake (session %s, protocol %s)", wid,
                        self.describe(), r.mooncake_session, eng.protocol)
        return reply


def _read_done(frame: pb.Frame) -> pb.Frame | None:
    """A Mooncake answer read (or given up): the one-way frame that lets the warehouse unpin its segments."""
    r = frame.fetch_reply
    if not r.remote_segments:
        return None
    return pb.Frame(oneway=True, fetch=pb.FetchRequest(mooncake_done=[r.mooncake_loan]))


# -- the warehouse's end ---------------------------------------------------------------------------
class Loan:
    __slots__ = ("peer", "segs", "since")

    def __init__(self, peer, segs: list, since: float) -> None:
        self.peer = peer
        self.segs = segs
        self.since = since


class WarehouseEngine:
    """This warehouse's engine: segment registrations and the loans of Mooncake answers."""

    def __init__(self, engine: Any, session: str, protocol: str) -> None:
        self.engine = engine
        self.session = session
        self.protocol = protocol
        self._registered: dict[int, int] = {}  # segment id -> registered address
        self._lock = threading.Lock()  # (registrations go away in finalizers, on any thread)
        self._loans: dict[int, Loan] = {}
        self._ids = itertools.count(1)
        self.registrations = 0
        self.failed = 0
        self._warned = False

    # -- registration ------------------------------------------------------------------------------
    def register(self, seg) -> None:
        """Register a new segment's memory once (its registration is dropped when the segment goes)."""
        if seg.size <= 0:
            return
        addr = address_of(seg.map)
        rc = self.engine.register_memory(addr, seg.size)
        if rc != 0:
            self.failed += 1
            if not self._warned:
                self._warned = True
                logger.warning("[mooncake] registering a %d-byte segment failed (%d); its values go to remote "
                               "readers as bytes in the TCP stream", seg.size, rc)
            return
        with self._lock:
            self._registered[seg.sid] = addr
        self.registrations += 1
        weakref.finalize(seg, self._unregister, seg.sid, addr).atexit = False

    def _unregister(self, sid: int, addr: int) -> None:
        with self._lock:
            self._registered.pop(sid, None)
        with contextlib.suppress(Exception):  # a finalizer: nothing to raise to
            self.engine.unregister_memory(addr)

    def remote(self, seg) -> int | None:
        """The registered address of a segment (None: it is not registered)."""
        with self._lock:
            return self._registered.get(seg.sid)

    # -- loans -------------------------------------------------------------------------------------
    def lend(self, peer, segs: list, segments) -> int:
        """Pin `segs` for a Mooncake answer to `peer` until it names the loan read (or goes)."""
        self.sweep(segments)
        loan = next(self._ids)
        segments.hold(segs)
        self._loans[loan] = Loan(peer, segs, time.monotonic())
        return loan

    def done(self, peer, loans, segments) -> None:
        """`peer` read these loans: unpin their segments (only its own loans)."""
        for lid in loans:
            loan = self._loans.get(lid)
            if loan is not None and loan.peer is peer:
                del self._loans[lid]
                segments.unhold(loan.segs)
        self.sweep(segments)

    def sweep(self, segments) -> None:
        """Give back loans whose reader's connection closed or that are older than LOAN_TIMEOUT_S."""
        if not self._loans:
            return
        now = time.monotonic()
        stale = [lid for lid, loan in self._loans.items()
                 if getattr(loan.peer, "closed", False) or now - loan.since > LOAN_TIMEOUT_S]
        for lid in stale:
            segments.unhold(self._loans.pop(lid).segs)

    @property
    def loans(self) -> int:
        return len(self._loans)


_ENGINE: WarehouseEngine | None = None
_CHOSEN = "socket"
_WHY = "not started"


def start(mode: str, host: str, advertise: str = "", protocol: str = "tcp", device: str = "") -> str:
    """Start this daemon's engine as `mode` asks (see the module docstring); returns the transport it
    serves remote readers with ("mooncake" or "socket"). `mode="mooncake"` raises EngineUnavailable
    when the engine cannot start. Called once per daemon process, before the node starts."""
    global _ENGINE, _CHOSEN, _WHY
    if mode not in MODES:
        raise DockValueError(f"transport {mode!r}: use one of {', '.join(MODES)}")
    if protocol not in PROTOCOLS:
        raise DockValueError(f"mooncake protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if mode == "socket":
        _ENGINE, _CHOSEN, _WHY = None, "socket", "--transport socket"
        logger.info("[mooncake] transport=socket (--transport socket)")
        return _CHOSEN
    hostname = engine_host(host, advertise)
    try:
        engine, session = start_engine(hostname, protocol, device)
    except EngineUnavailable as e:
        if mode == "mooncake":
            raise EngineUnavailable(f"--transport mooncake: {e}") from None
        _ENGINE, _CHOSEN, _WHY = None, "socket", str(e)
        logger.info("[mooncake] transport=socket: --transport auto found no usable Mooncake engine (%s)", e)
        return _CHOSEN
    _ENGINE, _CHOSEN, _WHY = WarehouseEngine(engine, session, protocol), "mooncake", f"--transport {mode}"
    logger.info("[mooncake] transport=mooncake session=%s protocol=%s (--transport %s): remote readers read stored "
                "segments with their Transfer Engine", session, protocol, mode)
    return _CHOSEN


def engine() -> WarehouseEngine | None:
    """This process's warehouse engine (None: it serves remote readers over the socket)."""
    return _ENGINE


def effective() -> str:
    """The transport this daemon serves remote readers with: "mooncake" or "socket"."""
    return _CHOSEN


def why() -> str:
    """Why that one (the mode asked for, or what kept the engine from starting)."""
    return _WHY


def ready_fields() -> dict[str, Any]:
    """What the daemon's JSON ready line says about its transport."""
    out: dict[str, Any] = {"transport": _CHOSEN}
    if _ENGINE is not None:
        out["mooncake_session"] = _ENGINE.session
    return out


def hello(out) -> None:
    """Fill a HelloReply's transport field."""
    out.transport = _CHOSEN


def attach(segments) -> WarehouseEngine | None:
    """Register the segments `segments` creates from now on with this process's engine (if any)."""
    if _ENGINE is not None:
        segments.on_create = _ENGINE.register
    return _ENGINE
