"""Client sessions and their leases (`dockd.controller.sessions`), Leasing driven directly with its real
collaborators (a controller core, a journal in a temporary state dir, waiters with a fake of the gets
they try, a pacer, warehouse calls) on a clock the test moves: whose a lease is and what its ticket
hands over, a session's leases going back when its last connection closes, confirms reported, and
expiry journaled and waking the gets waiting on the partition."""

from __future__ import annotations

import asyncio

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller.pacing import Pacer
from dockd.controller.sessions import Leasing
from dockd.controller.waiters import Waiters
from dockd.controller.warehouse_calls import WarehouseCalls
from dockd.errors import DockLeaseError
from dockd.terms import CommitOutcome
from tests.unit.controller.fakes import FakePeer, Journaled
from tests.unit.controller.test_waiters import Gets


class Sessions(Journaled):
    """Leasing over a partition "p" of 4 samples, its leases journaled in `state_dir`."""

    def __init__(self, state_dir) -> None:
        super().__init__(state_dir)
        self.journal.commit("p", ["x"], 1, None, 4, 1, 0, 0, None)
        self.core.commit("p", ["x"], warehouse=1, new_count=4)
        members = self.members
        self.waiting = Waiters(self.core, self.timers, retry_all=lambda: None)
        self.gets = self.waiting.gets = Gets()
        pacer = Pacer(self.core, members, self.timers, apply=lambda req: CommitOutcome())
        calls = WarehouseCalls(self.core, members, None, self.timers, daemon_timeout=1.0)
        self.leasing = Leasing(self.core, self.journal, self.timers, waiting=self.waiting, pacer=pacer, calls=calls)

    def lease(self, peer: FakePeer, n: int = 1) -> int:
        """A lease granted to the peer's session, journaled as Acquiring grants one."""
        res = self.core.acquire("p", "c", ["x"], n, owner=self.leasing.session(peer), now=self.clock())
        assert res is not None
        self.journal.grant(self.core.leases[res.lease], 30.0)
        self.leasing.schedule_expiry()
        return res.lease

    def wait(self) -> FakePeer:
        """A get parked on "p" (its tries are in gets.tried)."""
        peer = FakePeer("waiting")
        self.waiting.park(peer, pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer="d", columns=["x"],
                                                                   count=10)))
        return peer


def test_a_lease_belongs_to_its_session_and_its_ticket_hands_it_over(tmp_path):
    async def main():
        s = Sessions(tmp_path)
        owner, other = FakePeer("owner", b"session-a"), FakePeer("other", b"session-b")
        assert s.leasing.session(owner) == b"session-a"
        anonymous = s.leasing.session(FakePeer("anonymous"))
        forged = s.leasing.session(FakePeer("forged", b"\0claims a private one"))
        assert anonymous[0] == forged[0] == 0 and anonymous != forged != b"\0claims a private one"
        lid = s.lease(owner)
        assert s.leasing.owned(owner, lid, b"") is s.core.leases[lid]
        with pytest.raises(DockLeaseError, match="belongs to another client"):
            s.leasing.owned(other, lid, b"")
        assert s.leasing.owned(other, lid, s.leasing.ticket(lid)) is s.core.leases[lid]
        assert s.leasing.owned(other, lid + 99, b"") is None

    asyncio.run(main())


def test_a_sessions_leases_go_back_when_its_last_connection_closes(tmp_path):
    async def main():
        s = Sessions(tmp_path)
        first, second = FakePeer("first", b"session-a"), FakePeer("second", b"session-a")
        lid = s.lease(first, 2)
        s.leasing.session(second)
        assert s.leasing.peer_lost(first) == [] and lid in s.core.leases
        released = s.leasing.peer_lost(second)
        assert [lease.id for lease in released] == [lid] and lid not in s.core.leases
        assert s.restarted().leases == {}  # (their release was journaled)

    asyncio.run(main())


def test_confirms_report_the_leases_that_expired_and_those_of_other_clients(tmp_path):
    async def main():
        s = Sessions(tmp_path)
        mine, theirs = FakePeer("mine", b"session-a"), FakePeer("theirs", b"session-b")
        lid, their_lid = s.lease(mine), s.lease(theirs)
        out = pb.ConfirmReply()
        s.leasing.confirm(mine, [lid, their_lid, 12345], [], out)
        assert list(out.refused) == [their_lid] and list(out.unknown) == [12345]
        assert lid not in s.core.leases and their_lid in s.core.leases
        assert lid not in s.restarted().leases  # (the confirm was journaled)

    asyncio.run(main())


def test_an_expired_lease_is_journaled_and_wakes_the_gets_waiting_on_its_partition(tmp_path):
    async def main():
        s = Sessions(tmp_path)
        lid = s.lease(FakePeer("slow", b"session-a"))
        s.wait()
        s.clock.now += 29.0
        s.timers.run_due()
        assert s.leasing.expired == 0 and s.gets.tried == []
        s.clock.now += 1.5
        s.timers.run_due()
        assert s.leasing.expired == 1 and lid not in s.core.leases and s.gets.tried == ["waiting"]
        assert s.restarted().leases == {}

    asyncio.run(main())


def test_a_release_gives_the_samples_back_and_wakes_the_waiting_gets(tmp_path):
    async def main():
        s = Sessions(tmp_path)
        peer = FakePeer("owner", b"session-a")
        lid = s.lease(peer, 3)
        s.wait()
        assert s.leasing.release(peer, pb.ReleaseRequest(lease=lid)) == 3
        assert s.gets.tried == ["waiting"] and s.core.ready_count("p", "c", ["x"]) == 4
        assert s.leasing.release(peer, pb.ReleaseRequest(lease=lid)) == 0  # (released already)

    asyncio.run(main())
