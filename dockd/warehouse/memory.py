"""Private memory for what a warehouse keeps outside shared-memory segments: put bodies under
256 KiB (and every body of a daemon without segments), spilled puts read back, compactions,
checkpoint loads, device-tier copies to the host.

Values of 64 KiB and more come from jemalloc where pyarrow has it, smaller ones from Arrow's
default pool (mimalloc). Measured on the development VM: memory the default pool had not
handed out before took 0.3 ms per MiB to allocate and write in some runs and 2.2-2.8 ms in
others, jemalloc's 0.5-0.6 ms in every run; while a warehouse fills, a stream of puts of
240 KiB ran 1.55-1.75x as fast from jemalloc; and jemalloc gave the memory back after a clear
(0.3 GiB resident after 1 GB of puts was cleared, against 1.4 GiB). For small values the
default pool is as fast and packs them tighter (4-6 bytes less per sample of 1,000-sample puts
of 64 KB).
`ARROW_DEFAULT_MEMORY_POOL` set for the daemon: that pool serves every size.
"""

from __future__ import annotations

import contextlib

import pyarrow as pa

from dockd import config

LARGE = 64 << 10  # values of this many bytes and more come from the large pool

_large: pa.MemoryPool | None = None


def choose() -> str:
    """Pick the pools (a daemon calls this once, at start); says which."""
    global _large
    _large = None
    if not config.env("ARROW_DEFAULT_MEMORY_POOL"):
        with contextlib.suppress(NotImplementedError):  # (a pyarrow built without it: the default serves all)
            _large = pa.jemalloc_memory_pool()
    small = pa.default_memory_pool().backend_name
    return small if _large is None else f"{small}<{LARGE >> 10}KiB,{_large.backend_name}"


def allocate(size: int) -> pa.Buffer:
    """`size` bytes of private memory (not zeroed)."""
    if _large is not None and size >= LARGE:
        return pa.allocate_buffer(size, memory_pool=_large)
    return pa.allocate_buffer(size)
