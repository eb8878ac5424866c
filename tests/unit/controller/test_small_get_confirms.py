"""The confirms an acquire carries (the client's previous gets), applied after its answer where there is no
journal to write them ahead of it: the get is answered as it would have been had they come first."""

from __future__ import annotations

import logging

import pytest

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockDrained, DockFull, DockTimeout, DockValueError
from tests.unit.controller.fakes import Dock, FakePeer, run


def _lease(d: Dock, peer: FakePeer, frame: pb.Frame) -> int:
    out = d.answer(peer, frame)
    assert isinstance(out, pb.Frame), out
    return out.acquire_reply.lease


def _taken(d: Dock) -> int:
    return d.svc.stats().partitions[0].consumers[0].taken


def test_the_confirm_a_get_carries_is_applied_once_it_is_answered():
    async def main():
        d = Dock(lease_timeout=30.0)
        d.put("p", 3)
        c = FakePeer("c", b"session-c")
        first = _lease(d, c, d.get(c, "p", 1))
        second = d.get(c, "p", 1, confirm=[first])
        assert list(d.answer(c, second).acquire_reply.indexes) == [1]
        assert _taken(d) == 1 and first not in d.svc.core.leases
        await d.advance(31.0)  # (the second lease, never confirmed, expires; the first was confirmed)
        assert d.svc.leases_expired == 1
        d.svc.shutdown()

    run(main())


def test_a_sealed_partitions_last_get_raises_dock_drained_at_once_when_its_confirm_ends_the_last_lease():
    async def main():
        d = Dock()
        d.put("p", 2)
        c = FakePeer("c", b"session-c")
        first = _lease(d, c, d.get(c, "p", 2))
        d.svc.partition(pb.PartitionRequest(partition="p", seal=True))
        with pytest.raises(DockDrained):  # (not a DockTimeout: the lease it confirms was the last one out)
            d.get(c, "p", 1, timeout=0, confirm=[first])
        assert _taken(d) == 2
        d.svc.shutdown()

    run(main())


def test_a_sealed_partitions_last_get_with_a_timeout_does_not_wait_when_its_confirm_ends_the_last_lease():
    async def main():
        d = Dock()
        d.put("p", 1)
        c = FakePeer("c", b"session-c")
        first = _lease(d, c, d.get(c, "p", 1))
        d.svc.partition(pb.PartitionRequest(partition="p", seal=True))
        with pytest.raises(DockDrained):
            d.get(c, "p", 1, timeout=5.0, confirm=[first])
        assert d.svc.parked == 0
        d.svc.shutdown()

    run(main())


def test_a_sealed_partitions_get_that_still_waits_on_another_lease_waits_and_ends_with_it():
    async def main():
        d = Dock(lease_timeout=30.0)
        d.put("p", 2)
        c, other = FakePeer("c", b"session-c"), FakePeer("o", b"session-o")
        mine = _lease(d, c, d.get(c, "p", 1))
        theirs = _lease(d, other, d.get(other, "p", 1))
        d.svc.partition(pb.PartitionRequest(partition="p", seal=True))
        with pytest.raises(DockTimeout):  # (the other client's lease may still come back)
            d.get(c, "p", 1, timeout=0, confirm=[mine])
        waiting = d.get(c, "p", 1, timeout=5.0)
        assert d.answer(c, waiting) is None
        d.svc.confirm(other, pb.ConfirmRequest(leases=[theirs]))
        assert isinstance(d.answer(c, waiting), DockDrained)
        d.svc.shutdown()

    run(main())


def test_a_get_refused_for_the_leases_outstanding_goes_in_when_its_confirm_ends_one(monkeypatch):
    async def main():
        d = Dock()
        d.put("p", 3)
        c = FakePeer("c", b"session-c")
        first = _lease(d, c, d.get(c, "p", 1))
        monkeypatch.setattr(limits, "MAX_OPEN_LEASES", 1)
        with pytest.raises(DockFull):  # (one lease out: no room for another)
            d.get(c, "p", 1, timeout=0)
        assert list(d.answer(c, d.get(c, "p", 1, timeout=0, confirm=[first])).acquire_reply.indexes) == [1]
        assert _taken(d) == 1
        d.svc.shutdown()

    run(main())


def test_a_get_that_fails_still_applies_the_confirms_it_carries():
    async def main():
        d = Dock()
        d.put("p", 2)
        c = FakePeer("c", b"session-c")
        first = _lease(d, c, d.get(c, "p", 1))
        with pytest.raises(DockValueError):
            d.get(c, "p", 0, confirm=[first])  # (a count of 0 is refused)
        assert _taken(d) == 1 and first not in d.svc.core.leases
        d.svc.shutdown()

    run(main())


def test_a_confirm_that_cannot_be_applied_is_logged_and_the_get_is_answered(caplog):
    async def main():
        d = Dock()
        d.put("p", 2)
        c, other = FakePeer("c", b"session-c"), FakePeer("o", b"session-o")
        theirs = _lease(d, other, d.get(other, "p", 1))
        with caplog.at_level(logging.WARNING, logger="dockd.controller.sessions"):
            frame = d.get(c, "p", 1, confirm=[theirs, 12345])
        assert list(d.answer(c, frame).acquire_reply.indexes) == [1]
        assert "expired_or_released=1 another_clients=1" in caplog.text
        assert theirs in d.svc.core.leases  # (another client's lease, without its ticket: not confirmed)
        d.svc.shutdown()

    run(main())
