"""Mooncake Transfer Engine: a warehouse serves remote reads out of its registered segments.

`dockd serve --transport mooncake|auto|socket` (`NodeConfig.transport`):

- `mooncake` (required): the engine must start, or the daemon refuses to start, naming what is
  missing (the Python package, a system library such as libibverbs, the engine's own error).
- `auto`: the engine is used where it starts; the daemon logs which transport it chose and why.
- `socket`: no engine; remote readers get their bytes in the frames' bodies over the TCP stream.

With the engine running, every storage segment (`dockd.warehouse.segments`) is registered with it
once, when the segment is created; a warm segment taken again from the pool is already registered,
and the registration goes when the segment does. A reader that asks for a Mooncake answer
(`FetchRequest.mooncake`) gets, instead of body bytes, the remote address and length of each
segment span its runs use; it reads them with its own engine into its registered receive buffers
(`dockd.net.mooncake`) and then names the answer's loan in `FetchRequest.mooncake_done`.
Until then the loan pins those segments (a cleared segment is not refilled under a read); a loan
whose connection closed, or that is older than `LOAN_TIMEOUT_S`, is given back.

The engine runs in P2P-handshake mode (no metadata server): its session is "host:port" of its
handshake listener, sent in each Mooncake answer. `PROTOCOL` is "tcp" unless `--mooncake-protocol`
says "rdma" (RDMA NICs). The engine authenticates nobody: see docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
import weakref
from typing import Any

from dockd.errors import DockValueError

logger = logging.getLogger(__name__)

LOAN_TIMEOUT_S = 300.0
"""Seconds a Mooncake answer's segments stay pinned for a reader that never says it read them."""

MODES = ("auto", "socket", "mooncake")
PROTOCOLS = ("tcp", "rdma")


class EngineUnavailable(DockValueError):
    """The Mooncake Transfer Engine cannot start here (the message says what is missing)."""


def load_engine_class() -> Any:
    """`mooncake.engine.TransferEngine`, or EngineUnavailable saying why it cannot be imported."""
    try:
        from mooncake.engine import TransferEngine
    except ModuleNotFoundError as e:
        raise EngineUnavailable(
            f"the Mooncake Transfer Engine is not installed ({e}): pip install mooncake-transfer-engine-non-cuda "
            "(mooncake-transfer-engine on CUDA machines; from a dockd checkout: pip install -e '.[mooncake]')"
        ) from None
    except ImportError as e:
        hint = ""
        if "ibverbs" in str(e) or "mlx5" in str(e) or "rdmacm" in str(e):
            hint = " (the RDMA user-space libraries: apt-get install libibverbs1 ibverbs-providers, or `make mooncake`)"
        elif "cuda" in str(e).lower():
            hint = (" (this is the CUDA build of the engine: install mooncake-transfer-engine-non-cuda on a "
                    "machine without CUDA: pip install mooncake-transfer-engine-non-cuda)")
        raise EngineUnavailable(f"the Mooncake Transfer Engine does not load: {e}{hint}") from None
    return TransferEngine


def start_engine(hostname: str, protocol: str = "tcp", device: str = "") -> tuple[Any, str]:
    """A Transfer Engine listening on `hostname` (P2P handshake, no metadata server) and its session
    name ("host:port"); EngineUnavailable when it does not start."""
    cls = load_engine_class()
    engine = cls()
    try:
        rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
    except Exception as e:  # noqa: BLE001 - the engine's own error, reported as such
        raise EngineUnavailable(f"the Mooncake Transfer Engine did not start on {hostname} "
                                f"(protocol {protocol}): {e}") from None
    if rc != 0:
        raise EngineUnavailable(f"the Mooncake Transfer Engine did not start on {hostname} (protocol {protocol}): "
                                f"initialize returned {rc}; its log lines above say why")
    return engine, f"{hostname}:{engine.get_rpc_port()}"


def engine_host(host: str, advertise: str = "") -> str:
    """The address readers reach this node's engine at: the advertised name, else the bound host,
    else (a wildcard bind) this machine's name."""
    name = advertise or host
    if name in ("", "0.0.0.0", "::", "[::]"):
        name = socket.gethostname()
    return name.strip("[]")


def address_of(array) -> int:
    """Where a numpy array's bytes start in this process."""
    return int(array.__array_interface__["data"][0])


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
