"""The Mooncake Transfer Engine binding: loading and starting the engine, and the reader's engine.

`load_engine_class` and `start_engine` load the engine (`mooncake.engine.TransferEngine`) and start it
in P2P-handshake mode (no metadata server: its session is "host:port" of its handshake listener),
raising `EngineUnavailable` naming what is missing (the package, a system library such as libibverbs,
the engine's own error). A reading process runs one engine (`client_engine`, started on first use), with
a pool of receive buffers registered with it once each (`ReceivePool`); `ClientEngine.read` reads a
Mooncake answer's spans into one of them with one batch transfer. The transport around it, both of its
ends, is `dockd.net.mooncake`.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import logging
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockValueError

logger = logging.getLogger(__name__)

ALIGN = 4096  # each span starts page-aligned in the receive buffer (run offsets keep their 64-byte alignment)


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


@functools.lru_cache(maxsize=1)
def installed() -> bool:
    """Whether the engine's package is there (no import: cheap)."""
    return importlib.util.find_spec("mooncake") is not None


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
        self._back: collections.deque[tuple[mmap.mmap, int, int]] = collections.deque()  # given back, to settle
        self._lock = threading.Lock()
        self._warned = False

    def take(self, n: int) -> tuple[mmap.mmap, int, int]:
        """(buffer, its address, its size) of at least `n` bytes."""
        size = _size_class(n)
        with self._lock:
            unregister = self._settle()
            idle = self._idle.get(size)
            reused = idle.pop() if idle else None
            if reused is not None:
                self.idle_bytes -= size
            self.lent_bytes += size
            over = self.lent_bytes + self.idle_bytes > self.budget
        self._unregister(unregister)
        if reused is not None:
            return reused[0], reused[1], size
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
        """(A finalizer: it runs inside any allocation of its thread, maybe one made under this lock, so it
        never waits for the lock; a buffer it finds taken is settled by the lock's next holder.)"""
        self._back.append((mm, addr, size))
        if not self._lock.acquire(blocking=False):
            return
        try:
            unregister = self._settle()
        finally:
            self._lock.release()
        self._unregister(unregister)

    def _settle(self) -> list[int]:
        """(Under the lock.) The buffers given back, idle again within the budget; the addresses of the
        others, to unregister outside the lock (the mmap is freed with its last reference)."""
        over = []
        while self._back:
            mm, addr, size = self._back.popleft()
            self.lent_bytes -= size
            if self.idle_bytes + size <= self.budget:
                self._idle.setdefault(size, []).append((mm, addr))
                self.idle_bytes += size
            else:
                over.append(addr)
        return over

    def _unregister(self, addrs: list[int]) -> None:
        if self.engine is not None:
            for addr in addrs:
                self.engine.unregister_memory(addr)

    def forked(self) -> None:
        """In a forked child: the engine is the parent's and runs no thread here. Buffers still in use
        are dropped when they come back, and nothing is unregistered with it."""
        self._lock = threading.Lock()
        self.engine, self.budget = None, 0
        self._idle.clear()
        self._back.clear()
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


def usable() -> None:
    """Raise EngineUnavailable when this process cannot read with the engine: it is not installed or
    does not load, it did not start, or it cannot run here (a fork of a process that ran one)."""
    load_engine_class()
    if _ENGINE_ERROR is not None:
        raise _ENGINE_ERROR


def stats() -> dict[str, Any]:
    """This process's engine figures (empty: none started)."""
    if _ENGINE is None:
        return {}
    p = _ENGINE.pool
    return {"session": _ENGINE.session, "protocol": _ENGINE.protocol, "reads": _ENGINE.reads,
            "read_bytes": _ENGINE.read_bytes, "receive_buffers_registered": p.registered,
            "receive_idle_bytes": p.idle_bytes, "receive_lent_bytes": p.lent_bytes}
