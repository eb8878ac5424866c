"""Anonymous shared memory: sealed memfd segments and mappings that hold no descriptor.

Large put bodies and stored values live in anonymous shared-memory files
(memfd) rather than named /dev/shm segments. Nothing has a name, so nothing
can leak: a segment's memory is freed when the last descriptor and mapping of
it are gone, whoever crashed. A warehouse keeps its stored values in
`Segment`s (pooled by `dockd.warehouse.segments`), seals each one against
writes through any other descriptor once it is filled, and passes their
descriptors to same-host readers (`dockd.net.same_host`), who map them
copy-on-write (`map_private`). Writers stage their puts in memfds of their own
(`dockd.net.staging`), sealed against shrinking.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import resource
import weakref
from typing import Any

import numpy as np
import pyarrow as pa

HUGE = 2 << 20             # PMD size: segments are sized and mapped in its multiples
PAGE = mmap.PAGESIZE

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


def map_whole_private(fd: int, size: int) -> np.ndarray:
    """Bytes [0, size) of a segment mapped copy-on-write, unmapped once the array (and every view of it) is gone."""
    return _map(fd, size, 0, mmap.MAP_PRIVATE)


def huge_pages_state() -> str:
    """The kernel's transparent-huge-page policy for shared memory ('never', 'advise', ...)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()
