"""Admission (`dockd.warehouse.admission`), driven directly. The capacity queue shares what bodies still
arriving may hold by who sends them: one identity at most a quarter of --capacity, everyone at most
half, a bigger body only alone; a put over its identity's share is passed over, and each body let
in sends its identity's other puts behind everyone else's (on a loop). A staged payload is copied
into the warehouse's storage in two steps (a lent staging buffer)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dockd.errors import DockFull
from dockd.warehouse.admission import Admission
from dockd.warehouse.core import Warehouse
from dockd.warehouse.segments import Segments

MiB = 1 << 20


class _Peer:
    """What the queue reads of a connection: who sends on it, and the hook told when its body is in."""

    def __init__(self, who: str) -> None:
        self.identity = ("client", "host", who)
        self.on_body_done = None

    def arrived(self) -> None:
        done, self.on_body_done = self.on_body_done, None
        assert done is not None, "no body of this connection was let in"
        done()


def _admission(capacity: int = 64 * MiB) -> Admission:
    return Admission(Warehouse(capacity), Segments(keep_bytes=0), lambda: 0)


def _run(coro) -> None:
    asyncio.run(coro)


def _in(wait) -> bool:
    """Whether a reservation was let in (at once, or since)."""
    return wait is None or (wait.done() and wait.exception() is None)


def test_one_identity_holds_a_quarter_however_many_connections_and_the_others_get_in():
    async def main():
        adm = _admission()
        slow = [_Peer("10.0.0.9") for _ in range(20)]
        waits = [adm.reserve(p, 16 * MiB, -1, arriving=True) for p in slow]
        assert waits[0] is None and not any(w.done() for w in waits[1:])  # one body: a quarter of 64 MiB
        assert adm.arriving == adm.warehouse.reserved == 16 * MiB
        assert adm.reserve(_Peer("10.0.0.7"), 8 * MiB, -1, arriving=True) is None  # another host: at once
        assert adm.reserve(_Peer("here"), 4 * MiB, -1) is None                     # bytes here already: at once
        slow[0].arrived()  # its body is in: its next one may arrive
        await asyncio.sleep(0)
        assert _in(waits[1]) and not any(w.done() for w in waits[2:])
        assert adm.arriving_by[slow[0].identity] == 16 * MiB

    _run(main())


def test_small_bodies_of_one_identity_share_its_quarter():
    async def main():
        adm = _admission()
        peers = [_Peer("10.0.0.9") for _ in range(6)]
        waits = [adm.reserve(p, 4 * MiB, -1, arriving=True) for p in peers]
        assert [_in(w) for w in waits] == [True] * 4 + [False] * 2  # 16 MiB in flight
        peers[0].arrived()
        await asyncio.sleep(0)
        assert _in(waits[4]) and not _in(waits[5])

    _run(main())


def test_a_body_bigger_than_a_share_arrives_alone_and_its_identity_does_not_go_first_again():
    """Bodies of 40 MiB (over a quarter, over half): each arrives only alone. When one is cut, the
    sender's next waits behind the put another identity queued meanwhile, however many it sent."""
    async def main():
        adm = _admission()
        slow = [_Peer("10.0.0.9") for _ in range(10)]
        waits = [adm.reserve(p, 40 * MiB, -1, arriving=True) for p in slow]
        honest = _Peer("10.0.0.7")
        mine = adm.reserve(honest, 30 * MiB, -1, arriving=True)
        assert _in(waits[0]) and not _in(mine)  # 40 + 30 of a half of 64 MiB: it waits for the one arriving
        for k in range(2):  # the body arriving is cut (too slow), and its room given back
            slow[k].arrived()
            adm.release(unreserve=40 * MiB)
            await asyncio.sleep(0)
            assert _in(waits[k + 1]) != _in(mine)
        assert _in(mine) and not any(_in(w) for w in waits[2:])

    _run(main())


def test_a_put_over_its_share_times_out_saying_so():
    async def main():
        adm = _admission()
        assert adm.reserve(_Peer("10.0.0.9"), 16 * MiB, -1, arriving=True) is None
        wait = adm.reserve(_Peer("10.0.0.9"), 16 * MiB, 0.05, arriving=True)
        with pytest.raises(DockFull, match="a quarter of --capacity") as e:
            await wait
        assert "host 10.0.0.9" in str(e.value)
        assert adm.reserve(_Peer("10.0.0.7"), 16 * MiB, -1, arriving=True) is None

    _run(main())


def test_a_connection_that_closes_mid_body_gives_its_share_back():
    async def main():
        adm = _admission()
        first, second = _Peer("10.0.0.9"), _Peer("10.0.0.9")
        assert adm.reserve(first, 16 * MiB, -1, arriving=True) is None
        wait = adm.reserve(second, 16 * MiB, -1, arriving=True)
        adm.lost(first)  # (the peer calls on_body_done when its connection ends mid-body, then the node this)
        first.arrived()
        adm.release(unreserve=16 * MiB)
        await asyncio.sleep(0)
        assert _in(wait) and adm.arriving == 16 * MiB

    _run(main())


def test_the_bytes_checked_before_the_answer_are_the_bytes_kept():
    """The ranges the put's checks read are copied first; the rest, copied after the answer, never
    overwrites them, so a writer that scribbles on its lent buffer in between cannot change values
    that were checked (its msgpack values stay the ones that decoded)."""
    size = 3 << 20  # a segment of the pool
    staged = np.arange(size, dtype=np.uint64).astype(np.uint8)
    adm = Admission(Warehouse(1 << 30), Segments(keep_bytes=0), lambda: 0)
    adm.segment_budget = 8  # (into a segment of the pool, as a daemon does)
    first = [(100, 50), (2 << 20, 4096), (size - 10, 10)]
    body, rest = adm.copy_in_later(staged, size, first)
    got = np.frombuffer(body.buffer, dtype=np.uint8, count=size)
    for off, n in first:
        assert np.array_equal(got[off : off + n], staged[off : off + n])
    original = staged.copy()
    staged[:] = 7  # the writer writes into its buffer before the rest is copied
    rest()
    for off, n in first:
        assert np.array_equal(got[off : off + n], original[off : off + n]), "a checked range was copied again"
    checked = np.zeros(size, dtype=bool)
    for off, n in first:
        checked[off : off + n] = True
    assert (got[~checked] == 7).all()
