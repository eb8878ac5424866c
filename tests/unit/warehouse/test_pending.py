"""The warehouse's wait for a writer's copy (`dockd.warehouse.pending.PendingCopies`): a put goes on once the
staging buffer's eventfd is signalled (at once if it was), and is dropped, never gone on with, when its
connection closes or its timeout runs out first."""

from __future__ import annotations

import asyncio
import os

import pytest

from dockd.errors import DockTimeout
from dockd.warehouse.pending import PendingCopies, Signal

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux-only")


def a_signal() -> tuple[Signal, int]:
    """The warehouse's Signal and the writer's own descriptor of the same eventfd."""
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    return Signal(os.dup(efd)), efd


def test_a_copy_signalled_before_the_wait_goes_on_at_once():
    async def main():
        pending, (signal, efd) = PendingCopies(), a_signal()
        os.eventfd_write(efd, 1)
        went: list[str] = []
        pending.after("conn", signal, 5.0, lambda: went.append("go"), lambda exc: went.append("drop"))
        assert went == ["go"] and len(pending) == 0
        os.close(efd)
    asyncio.run(main())


def test_a_wait_goes_on_once_when_the_writer_signals():
    async def main():
        pending, (signal, efd) = PendingCopies(), a_signal()
        went: list[str] = []
        done = asyncio.get_running_loop().create_future()
        pending.after("conn", signal, 5.0, lambda: (went.append("go"), done.set_result(None)), went.append)
        assert went == [] and len(pending) == 1
        os.eventfd_write(efd, 1)
        await done
        assert went == ["go"] and len(pending) == 0
        pending.lost("conn")  # (gone on already: nothing to drop)
        assert went == ["go"]
        os.close(efd)
    asyncio.run(main())


def test_a_closed_connection_drops_its_waits_and_a_later_signal_changes_nothing():
    async def main():
        pending, (signal, efd) = PendingCopies(), a_signal()
        other, other_efd = a_signal()
        went: list = []
        pending.after("conn", signal, -1, lambda: went.append("go"), went.append)
        pending.after("other", other, -1, lambda: went.append("other go"), went.append)
        pending.lost("conn")
        assert went == [None] and len(pending) == 1
        os.eventfd_write(efd, 1)
        os.eventfd_write(other_efd, 1)
        fut = pending.copied("third", *a_signal()[:1], timeout=-1)
        pending.lost("third")
        with pytest.raises(asyncio.CancelledError):
            await fut
        while len(pending):
            await asyncio.sleep(0.01)
        assert went == [None, "other go"]
        os.close(efd)
        os.close(other_efd)
    asyncio.run(main())


def test_a_wait_past_its_timeout_is_dropped_with_a_timeout_error():
    async def main():
        pending, (signal, efd) = PendingCopies(), a_signal()
        with pytest.raises(DockTimeout, match="did not finish copying"):
            await pending.copied("conn", signal, 0.0)  # (waits MIN_WAIT_S at least)
        assert len(pending) == 0
        os.eventfd_write(efd, 1)  # (too late: nothing waits on it)
        os.close(efd)
    asyncio.run(main())
