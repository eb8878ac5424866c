"""Same-host transport: a Unix socket for frames, memfd segments for payloads.

Large put bodies and stored values live in anonymous shared-memory files
(memfd) rather than named /dev/shm segments, and travel between a client and
the warehouse on its host as file descriptors passed over a Unix socket
(SCM_RIGHTS). Nothing has a name, so nothing can leak: a segment's memory is
freed when the last descriptor and mapping of it are gone, whoever crashed.

- put: the client copies its tensors into one of a few *staging* memfds it
  keeps warm (registered with the warehouse once: the descriptor passes once,
  sealed against shrinking), and names it; the warehouse copies the payload
  into a segment of its own, taken warm from its pool, and seals that segment
  against future writes. Two copies into warm memory run several times faster
  than one copy into fresh pages (the kernel hands out fresh shared pages at
  about 1 GB/s on the development VM). The writer lends the buffer: the
  warehouse may answer before it copies the bulk out, and copies it before
  it reads another request; the writer reuses the buffer only once a later
  put is answered (`dockd.net.staging`, `dockd.warehouse.put`).
- get: the warehouse passes the descriptors of the segments holding the values;
  the client maps them copy-on-write (MAP_PRIVATE), so the returned tensors
  are zero-copy views that the caller may still write to: a write copies the
  touched page, never the warehouse's data. Each descriptor lent *pins* its
  segment for the reader's process until the reader reports the mapping gone
  or the process exits; only an unpinned segment whose data was cleared goes
  back to the pool to be filled again (`dockd.warehouse.segments`).

`UnixTransport` gives a `Peer` the asyncio-transport surface it expects over a
non-blocking Unix socket driven by `loop.add_reader`, plus descriptor passing,
which asyncio transports lack.
"""

from __future__ import annotations

import array
import collections
import ctypes
import fcntl
import itertools
import logging
import mmap
import os
import resource
import socket
import struct
import sys
import weakref
from typing import Any

import numpy as np
import pyarrow as pa

from dockd.net import wire

logger = logging.getLogger(__name__)

SHM_MIN_BODY = 256 << 10   # puts at least this big go through a memfd
HUGE = 2 << 20             # PMD size: segments are sized and mapped in its multiples
SHM_MIN_VALUE = 64 << 10   # runs of stored values at least this big are passed by descriptor ...
SHM_COPY_REPLY = 256 << 10  # ... in a reply with more bytes of them than this (fewer: copied, which costs less)
MAX_FDS = 253              # SCM_MAX_FD
_ANC = socket.CMSG_SPACE(MAX_FDS * 4) if hasattr(socket, "CMSG_SPACE") else 0
MSG_CTRUNC = int(socket.MSG_CTRUNC)
"""As a plain int: `flags & socket.MSG_CTRUNC` runs the enum's Python `__rand__` (an IntFlag on the
right of an int), ~7,500 instructions, 8 % of what the daemon spends on an empty request."""
PAGE = mmap.PAGESIZE


def available() -> bool:
    """The probe: Linux with memfd_create and SCM_RIGHTS."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "SCM_RIGHTS")


def unix_name(port: int) -> str:
    """Abstract-namespace socket name of the daemon on `port` (no file to clean up)."""
    return f"dockd-{os.getpid()}-{port}"


def unix_address(name: str) -> str:
    return "\0" + name


# fcntl seals (linux/fcntl.h); F_SEAL_FUTURE_WRITE (Linux 5.1) is missing from Python's fcntl module
F_ADD_SEALS, F_GET_SEALS = 1033, 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE, F_SEAL_FUTURE_WRITE = 0x1, 0x2, 0x4, 0x8, 0x10
STAGING_SEALS = F_SEAL_SHRINK  # a staging memfd cannot shrink under the warehouse's mapping (SIGBUS)
MFD_FLAGS = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2)


def seal(fd: int, seals: int) -> None:
    fcntl.fcntl(fd, F_ADD_SEALS, seals | F_SEAL_SEAL)


def seals(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        return 0


class Segment:
    """A memfd and one shared mapping of it (read/write for segments this process fills,
    read-only for sealed ones it adopted); `buffer` is an Arrow view.

    Each live segment holds one descriptor and one mapping of this process;
    `Segment.live` counts them (see `segment_budget`). The mapping itself holds
    no descriptor (see `_map`)."""

    __slots__ = ("fd", "size", "map", "buffer", "sid", "__weakref__")
    live = 0
    _ids = itertools.count(1)

    def __init__(self, fd: int, size: int, used: int | None = None) -> None:
        self.fd = -1  # owned (closed by __del__) only once mapped; until then the caller closes it
        self.size = size
        self.map = map_shared(fd, size)  # an empty array when size is 0
        self.buffer = pa.py_buffer(self.map)
        self.fd = fd
        self.sid = next(Segment._ids)  # names it to readers, who unpin it by this id
        Segment.live += 1
        self.use(size if used is None else used)

    def use(self, used: int) -> None:
        """Hold `used` payload bytes (a recycled segment is filled again)."""
        full = pa.py_buffer(self.map)
        # slicing would make an Arrow buffer read-only, so only when there is padding
        self.buffer = full.slice(0, used) if used < self.size else full

    def writable(self) -> memoryview:
        """The payload bytes as a writable view (a receive destination)."""
        # (an ndarray is a buffer; numpy's stubs declare its __buffer__ only for Python >= 3.12)
        return memoryview(self.map)[: self.buffer.size]  # type: ignore[arg-type]

    def seal(self) -> None:
        """Filled: no descriptor of it (one a reader gets) can write or resize it any more. Our own
        mapping stays writable, so the segment can be filled again once nobody maps it."""
        if not seals(self.fd) & F_SEAL_FUTURE_WRITE:
            seal(self.fd, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE)

    @classmethod
    def create(cls, size: int, name: str = "dockd", capacity: int | None = None) -> Segment:
        """A new segment holding `size` payload bytes, of `capacity` bytes (default: padded)."""
        cap = max(capacity or 0, padded(size))
        fd = os.memfd_create(name, MFD_FLAGS)
        try:
            os.ftruncate(fd, cap)
            return cls(fd, cap, size)
        except BaseException:
            os.close(fd)
            raise

    def fileno(self) -> int:
        return self.fd

    def __del__(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            Segment.live -= 1
            if os is not None:  # os is gone during interpreter shutdown
                os.close(fd)


def segment_budget() -> int:
    """How many segments this process may hold: its descriptor limit and the kernel's
    mapping limit, less a reserve for sockets (a quarter of the limit), descriptors in
    flight (an eighth) and libraries (see `dockd.node.daemon.Node`).

    A process past its descriptor limit cannot even receive one: the kernel drops
    the descriptors of a message (MSG_CTRUNC) and the connection is lost."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            maps = int(f.read())
    except (OSError, ValueError):
        maps = 65530
    if soft == resource.RLIM_INFINITY:
        soft = maps
    return max(0, min(soft - (64 + soft // 4 + soft // 8), maps // 2))


def padded(size: int) -> int:
    """Segment size for a payload: whole huge pages once it is big enough to use them."""
    return size if size < HUGE else -(-size // HUGE) * HUGE


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapped:
    """Owner of one mapping: unmapped when the last array (or tensor) viewing it is gone."""

    __slots__ = ("__array_interface__", "__weakref__")
    __array_interface__: dict[str, Any]


def _map(fd: int, length: int, offset: int, flags: int, readonly: bool = False, on_free=None) -> np.ndarray:
    """Map `length` bytes of `fd` from `offset` as a uint8 array (writable unless `readonly`).

    Unlike `mmap.mmap`, which keeps a duplicate of the descriptor for as long as the
    mapping lives, this holds none: a process holding thousands of mappings (a
    warehouse's segments, a trainer's zero-copy tensors) does not run out of
    descriptors. Tensors made from the array keep it, and so the mapping, alive."""
    if length == 0:
        return np.empty(0, dtype=np.uint8)
    prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
    addr = _libc.mmap(None, length, prot, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    if length >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        _libc.madvise(addr, length, mmap.MADV_HUGEPAGE)
    owner = _Mapped()
    owner.__array_interface__ = {"data": (addr, readonly), "shape": (length,), "typestr": "|u1", "version": 3}
    weakref.finalize(owner, _unmap, addr, length, on_free).atexit = False  # the exit unmaps; tensors may outlive finalizers
    return np.asarray(owner)


def _unmap(addr: int, length: int, on_free) -> None:
    _libc.munmap(addr, length)
    if on_free is not None:
        on_free()


def map_shared(fd: int, size: int, *, readonly: bool = False) -> np.ndarray:
    """A shared mapping that asks for transparent huge pages (used where the kernel
    allows them for shared memory: far fewer page faults for writer and readers)."""
    return _map(fd, size, 0, mmap.MAP_SHARED, readonly)


def map_private(fd: int, start: int, end: int, on_free=None) -> tuple[np.ndarray, int]:
    """Map [start, end) of a segment copy-on-write; returns (mapping, offset of start in it).
    `on_free` runs once the mapping is gone (the last tensor viewing it was dropped).

    The mapping starts on a huge-page boundary so huge pages can be mapped whole."""
    base = start - start % (HUGE if end - start >= HUGE else PAGE)
    return _map(fd, end - base, base, mmap.MAP_PRIVATE, on_free=on_free), start - base


def huge_pages_state() -> str:
    """The kernel's transparent-huge-page policy for shared memory ('never', 'advise', ...)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


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


class UnixTransport:
    """Just enough of asyncio.Transport for a Peer, over a Unix socket with descriptor passing."""

    def __init__(self, loop, sock: socket.socket, protocol) -> None:
        self.loop = loop
        self.sock = sock
        self.protocol = protocol
        self.passes_fds = True
        sock.setblocking(False)
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
