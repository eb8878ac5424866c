"""Puts paced by max_pending (`dockd.controller.pacing`), the Pacer driven directly: a real controller
core and membership, the commits it lets in applied by a function of the test, and a clock the test
moves. A commit of new samples waits while its partition has max_pending samples pending, goes in
once a consumer takes some, in order, and fails with DockFull when its timeout passes."""

from __future__ import annotations

import asyncio

from dockd._proto import dockd_pb2 as pb
from dockd.controller.clock import Timers
from dockd.controller.core import Controller
from dockd.controller.membership import Membership
from dockd.controller.pacing import Pacer
from dockd.errors import DockFull, DockStateFull
from dockd.terms import CommitOutcome
from tests.unit.controller.fakes import FakeClock


class Paced:
    """A Pacer over a partition of max_pending=2 on one warehouse; `answers` are the paced commits' outcomes."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.timers = Timers(self.clock)
        self.core = Controller()
        self.core.create_partition("p", max_pending=2)
        self.members = Membership(self.core, None, grace=15.0, on_change=lambda: None, timers=self.timers)
        reg = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=7)
        self.wid = self.members.register(None, reg, self.apply).id
        self.applied: list[int] = []  # put ids, in the order the pacer applied them
        self.full = False  # the state dir refuses commits
        self.pacer = Pacer(self.core, self.members, self.timers, apply=self.apply)
        self.answers: dict[int, CommitOutcome] = {}

    def apply(self, req: pb.CommitRequest) -> CommitOutcome:
        if self.full:
            raise DockStateFull("the state dir is full")
        self.applied.append(req.put_id)
        return CommitOutcome(self.core.commit(req.partition, req.columns[:], warehouse=req.warehouse,
                                              new_count=req.new_count, put_id=req.put_id))

    def commit(self, put_id: int, n: int = 1, timeout: float = 10.0) -> CommitOutcome | None:
        """A commit as a warehouse sends it: applied now (its outcome), or waiting (None)."""
        req = pb.CommitRequest(partition="p", columns=["x"], new_count=n, warehouse=self.wid, put_id=put_id,
                               timeout=timeout, has_timeout=True)
        if not self.pacer.must_wait(req):
            return self.apply(req)
        return self.pacer.park(req, lambda res: self.answers.__setitem__(put_id, res), None)

    def take(self, n: int) -> None:
        """Consumer "c" takes n samples, and the pacer hears of it (as a get's grant tells it)."""
        res = self.core.acquire("p", "c", ["x"], n)
        assert res is not None
        self.core.confirm(res.lease)
        self.pacer.soon("p")

    async def settle(self) -> None:
        for _ in range(3):
            await asyncio.sleep(0)


def test_a_paced_commit_goes_in_once_a_consumer_takes_samples_in_the_order_they_came():
    async def main():
        p = Paced()
        assert p.commit(1, n=2) is not None  # 2 pending: the partition is at max_pending
        assert p.commit(2) is None and p.commit(3) is None and p.pacer.total == 2
        p.take(1)
        await p.settle()
        assert p.applied == [1, 2] and list(p.answers) == [2]  # one sample taken: room for one commit
        p.take(2)
        await p.settle()
        assert p.applied == [1, 2, 3] and p.answers[3].error is None and not p.pacer.paced

    asyncio.run(main())


def test_a_paced_commit_fails_with_dockfull_when_its_timeout_passes():
    async def main():
        p = Paced()
        p.commit(1, n=2)
        try:
            p.commit(2, timeout=0)
        except DockFull as e:
            assert "max_pending=2" in str(e)
        else:
            raise AssertionError("a commit with no time to wait was parked")
        assert p.commit(3, timeout=5.0) is None
        p.clock.now += 5.0
        p.timers.run_due()
        err = p.answers[3].error
        assert isinstance(err, DockFull) and "this put waited 5 s" in str(err)
        assert not p.pacer.paced and p.applied == [1]

    asyncio.run(main())


def test_a_resent_commit_that_was_applied_is_answered_again_without_waiting():
    async def main():
        p = Paced()
        p.commit(1, n=2)
        req = pb.CommitRequest(partition="p", columns=["x"], new_count=2, warehouse=p.wid, put_id=1, timeout=5.0,
                               has_timeout=True)
        assert p.pacer.must_wait(req)
        again = p.pacer.park(req, lambda res: None, None)
        assert again is not None and list(again.indexes) == [0, 1] and not p.pacer.paced

    asyncio.run(main())


def test_a_paced_commit_the_state_dir_refuses_keeps_its_place_and_is_tried_again():
    async def main():
        p = Paced()
        p.commit(1, n=2)
        p.commit(2)
        p.commit(3)
        p.full = True
        p.take(2)
        await p.settle()
        assert p.applied == [1] and [q.req.put_id for q in p.pacer.paced["p"]] == [2, 3]
        p.full = False
        p.clock.now += 1.0
        p.timers.run_due()  # the retry a second later
        await p.settle()
        assert p.applied == [1, 2, 3] and not p.pacer.paced

    asyncio.run(main())
