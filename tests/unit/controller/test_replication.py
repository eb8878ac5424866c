"""`--replicas 2` on the controller (`dockd.controller.replica_service`), Replication driven directly with
its real collaborators (a controller core, a journal in a temporary state dir, membership of two
warehouses: the one in the controller's process, faked, and a remote one) on a clock the test moves:
where a put's copy goes, a copy that does not arrive in time repaired by its home, and the copy's
own commit journaled."""

from __future__ import annotations

import asyncio

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller.replica_service import COPY_DEADLINE, REPAIR_INTERVAL, Replication
from dockd.errors import DockValueError
from dockd.terms import CommitOutcome
from tests.unit.controller.fakes import FakePeer, Journaled


class Hosted:
    """The warehouse in the controller's process: the repairs it was asked to make."""

    def __init__(self) -> None:
        self.asked: list[pb.ReplicateRequest] = []

    async def replicate(self, req: pb.ReplicateRequest) -> int:
        self.asked.append(req)
        return 8 * len(req.indexes)


class Replicated(Journaled):
    """Replication over the hosted warehouse (its values' home) and a remote one (their replicas')."""

    def __init__(self, state_dir) -> None:
        super().__init__(state_dir)
        members = self.members
        joined = [members.register(None, pb.RegisterWarehouse(host="10.0.0.1", port=7000, capacity=1 << 30,
                                                              instance=1), lambda req: CommitOutcome()).id,
                  members.register(FakePeer("remote"), pb.RegisterWarehouse(host="10.0.0.2", port=7000,
                                                                            capacity=1 << 30, instance=2),
                                   lambda req: CommitOutcome()).id]
        self.home, self.other = joined
        self.hosted = Hosted()
        self.replication = Replication(self.core, members, self.journal, self.timers, replicas=2, local=self.hosted,
                                       daemon_timeout=1.0)
        self.journal.commit("p", ["x"], self.home, None, 4, 1, 32, 0)
        self.idx = self.core.commit("p", ["x"], warehouse=self.home, new_count=4, nbytes=32)
        self.put = pb.CommitRequest(partition="p", columns=["x"], warehouse=self.home, new_count=4, nbytes=32)

    async def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.timers.run_due()
        for _ in range(3):
            await asyncio.sleep(0)


def test_a_puts_copy_goes_to_the_next_warehouse_and_its_commit_is_journaled(tmp_path):
    async def main():
        r = Replicated(tmp_path)
        target = r.replication.target_of(r.put, r.idx)
        assert target is not None and (target.id, target.host) == (r.other, "10.0.0.2")
        assert r.replication.counts("p") == (0, 0)  # (on its way: neither held nor lacking)
        copy = pb.CommitRequest(partition="p", columns=["x"], warehouse=r.other, indexes=r.idx.tolist(), nbytes=32,
                                replica=True, put_id=9)
        assert r.replication.commit(copy).tolist() == [0, 1, 2, 3]
        assert r.replication.counts("p") == (4, 0)
        back = r.restarted()
        assert (back.partitions["p"].rloc["x"][:4] == r.other).all()

    asyncio.run(main())


def test_a_copy_that_does_not_arrive_in_time_is_repaired_by_its_home(tmp_path):
    async def main():
        r = Replicated(tmp_path)
        r.replication.start()
        r.replication.target_of(r.put, r.idx)
        await r.advance(COPY_DEADLINE - REPAIR_INTERVAL)
        assert r.hosted.asked == []  # still on its way
        await r.advance(2 * REPAIR_INTERVAL)
        (asked,) = r.hosted.asked
        assert list(asked.indexes) == [0, 1, 2, 3] and list(asked.columns) == ["x"] and asked.target.id == r.other
        for _ in range(10):  # (the repair's task goes on once the warehouse answered)
            await asyncio.sleep(0)
        assert r.replication.repaired == 4
        r.replication.close()

    asyncio.run(main())


def test_replicas_are_one_or_two(tmp_path):
    j = Journaled(tmp_path)
    with pytest.raises(DockValueError, match="--replicas is 1"):
        Replication(j.core, j.members, j.journal, j.timers, replicas=3, local=None, daemon_timeout=1.0)
    j.journal.close()
