"""Warm receive buffers for large socket replies, shared by a process's connections."""

from __future__ import annotations

import collections
import os
import threading
import weakref

import numpy as np

from dockd.config import ClientConfig


class RecvPool:
    """Warm receive buffers for large replies.

    Reading into fresh memory runs at page-fault speed (about 1.2 GB/s on the
    development VM, against 3+ GB/s from the socket into warm memory). A reply
    body is handed out as a numpy view of a pooled block; the tensors decoded
    from it keep that view alive, and when the last of them is gone the block
    returns here for the next reply. Up to `max_bytes` are kept, and always the
    last block given back, however big (older blocks are dropped to make room),
    so a steady stream of huge gets reuses it.
    Sizes are rounded up to 8 classes per power of two.
    """

    MIN = 1 << 20

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pooled = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._back: collections.deque[np.ndarray] = collections.deque()  # given back, for the lock's next holder
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        if n < self.MIN or self.max_bytes <= 0:
            return np.empty(n, dtype=np.uint8)
        step = max(1, 1 << max(0, (n - 1).bit_length() - 4))
        size = -(-n // step) * step
        block = None
        with self._lock:
            self._settle()
            blocks = self._free.get(size)
            if blocks:  # no empty lists are kept
                block = blocks.pop()
                self.pooled -= size
                if not blocks:
                    del self._free[size]
        if block is None:
            block = np.empty(size, dtype=np.uint8)
        view = block[:n]
        weakref.finalize(view, self._give_back, block)
        return view

    def _give_back(self, block: np.ndarray) -> None:
        """(A finalizer: it runs inside any allocation of its thread, maybe one made under this lock, so it
        never waits for the lock; a block it finds taken is pooled by the lock's next holder.)"""
        self._back.append(block)
        if self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self) -> None:
        """(Under the lock.) Pool the blocks given back: the one given back last is the likeliest to be asked
        for next, so older ones make room for it."""
        while self._back:
            block = self._back.popleft()
            while self.pooled + block.nbytes > self.max_bytes and self._free:
                size, blocks = next(iter(self._free.items()))
                blocks.pop()
                self.pooled -= size
                if not blocks:
                    del self._free[size]
            self._free.setdefault(block.nbytes, []).append(block)
            self.pooled += block.nbytes


_POOL: RecvPool | None = None
_POOL_LOCK = threading.Lock()


def recv_pool() -> RecvPool:
    """This process's pool, made on first use with $DOCKD_RECV_POOL_BYTES as it is then."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = RecvPool(ClientConfig.from_env().recv_pool_bytes)
    return _POOL


def _fresh_locks_in_child() -> None:
    """A fork copies locks as they are: one that another thread of the parent held at that moment
    stays held for ever in the child, and the child's first large reply (or its drop of a tensor
    received before the fork) would wait on it. The child, one thread here, takes fresh ones."""
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    if _POOL is not None:
        _POOL._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks_in_child)
