"""Staged puts sent before their writer's copy (`PutRequest.staging_pending`): their wait for its signal.

A same-host writer whose put has per-sample tensors or several tensor runs
(`codec.Body.late`) sends the request first and copies the tensors into its
staging buffer right after the send; its other
bytes (the msgpack values the checks read) are in the buffer already. The
warehouse admits and checks such a put meanwhile (`dockd.warehouse.put`), and
goes on to its commit only once the writer signals the buffer's eventfd
(registered with the buffer's descriptor: `Signal`). The eventfd's read (a
system call, as the writer's write is) orders the writer's copy before the
warehouse's reads of it.

A put whose connection closes first, or whose timeout (at least
MIN_WAIT_S) runs out first, is dropped: nothing of it is committed or stored,
and the writer never gets an answer that acknowledges it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable

from dockd.errors import DockTimeout

MIN_WAIT_S = 1.0
"""The shortest wait for a writer's copy, whatever the put's timeout (a put with timeout 0 waits for no
room, but its copy, of a few ms, is still on its way)."""


class Signal:
    """The eventfd of a writer's staging buffer (the warehouse's descriptor, closed with the last reference)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def take(self) -> bool:
        """Whether the writer signalled (the count is cleared)."""
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            return False
        return True

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclasses.dataclass(eq=False)
class _Wait:
    key: object
    signal: Signal
    go: Callable[[], None]
    drop: Callable[[BaseException | None], None]
    timer: asyncio.TimerHandle | None = None


class PendingCopies:
    """The puts of each connection that wait for their writer's copy."""

    def __init__(self) -> None:
        self._waits: dict[object, list[_Wait]] = {}

    def __len__(self) -> int:
        return sum(len(w) for w in self._waits.values())

    def after(self, key: object, signal: Signal, timeout: float, go: Callable[[], None],
              drop: Callable[[BaseException | None], None]) -> None:
        """`go()` once `signal` says the copy is done (now, if it was); else `drop(exc)`: `exc` a DockTimeout
        when `timeout` seconds (< 0: no limit; at least MIN_WAIT_S) pass first, None when `lost(key)` (the
        connection, whose answer no one reads) comes first."""
        if signal.take():
            go()
            return
        loop = asyncio.get_running_loop()
        w = _Wait(key, signal, go, drop)
        self._waits.setdefault(key, []).append(w)
        loop.add_reader(signal.fd, self._signalled, w)
        if timeout >= 0:
            wait = max(timeout, MIN_WAIT_S)
            w.timer = loop.call_later(wait, self._expired, w, wait)

    def copied(self, key: object, signal: Signal, timeout: float) -> asyncio.Future[None]:
        """`after` as a future: done once the copy is; failed with the DockTimeout, or cancelled when `lost(key)`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done() -> None:
            if not fut.done():
                fut.set_result(None)

        def dropped(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is None:
                fut.cancel()
            else:
                fut.set_exception(exc)

        self.after(key, signal, timeout, done, dropped)
        return fut

    def lost(self, key: object) -> None:
        """The connection `key` closed: its puts that wait are dropped."""
        for w in self._waits.pop(key, ()):
            self._end(w)
            w.drop(None)

    def _signalled(self, w: _Wait) -> None:
        if not w.signal.take():
            return  # (a spurious wake-up)
        if self._forget(w):
            w.go()

    def _expired(self, w: _Wait, wait: float) -> None:
        if self._forget(w):
            w.drop(DockTimeout(
                f"the writer did not finish copying the put's tensors into its staging buffer within {wait:g}s "
                "(the put's timeout): the put was dropped, nothing of it stored. Is the writing process stalled?"))

    def _forget(self, w: _Wait) -> bool:
        """End `w`'s wait; False if it had ended."""
        waits = self._waits.get(w.key)
        if waits is None or w not in waits:
            return False
        waits.remove(w)
        if not waits:
            del self._waits[w.key]
        self._end(w)
        return True

    @staticmethod
    def _end(w: _Wait) -> None:
        if w.timer is not None:
            w.timer.cancel()
        if w.signal.fd >= 0:
            asyncio.get_running_loop().remove_reader(w.signal.fd)
