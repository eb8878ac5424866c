"""Partition requests (`dockd.controller.partition_ops`), PartitionOps driven directly with its real
collaborators (a controller core, a journal in a temporary state dir, waiters, a pacer, warehouse
calls) on a clock the test moves: each change is journaled ahead and comes back after a restart, a
change the controller refuses leaves no record, and the gets and puts waiting on the partition are
answered as the operation says."""

from __future__ import annotations

import asyncio

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller.pacing import Pacer
from dockd.controller.partition_ops import PartitionOps
from dockd.controller.waiters import Waiters
from dockd.controller.warehouse_calls import WarehouseCalls
from dockd.errors import DockClosed, DockValueError
from dockd.terms import CommitOutcome
from tests.unit.controller.fakes import Dock, FakePeer, Journaled
from tests.unit.controller.test_waiters import Gets


class Ops(Journaled):
    """PartitionOps on a state dir, with the collaborators a controller service gives it."""

    def __init__(self, state_dir) -> None:
        super().__init__(state_dir)
        members, timers = self.members, self.timers
        self.waiting = Waiters(self.core, timers, retry_all=lambda: None)
        self.waiting.gets = Gets()
        self.pacer = Pacer(self.core, members, timers, apply=lambda req: CommitOutcome())
        calls = WarehouseCalls(self.core, members, None, timers, daemon_timeout=1.0)
        self.loading: set[str] = set()
        self.ops = PartitionOps(self.core, self.journal, waiting=self.waiting, pacer=self.pacer, calls=calls,
                                loading=self.loading)

    def wait(self, consumer: str) -> tuple[FakePeer, pb.Frame]:
        peer = FakePeer(consumer)
        frame = pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer=consumer, columns=["x"], count=1))
        self.waiting.park(peer, frame)
        return peer, frame


def test_operations_are_journaled_and_come_back_after_a_restart(tmp_path):
    async def main():
        o = Ops(tmp_path)
        o.ops.apply(pb.PartitionRequest(partition="p", create=pb.CreatePartition(group_size=2, max_pending=6)))
        o.ops.apply(pb.PartitionRequest(partition="p", reserve=pb.ReserveSamples(count=4, group_size=2)))
        o.ops.apply(pb.PartitionRequest(partition="p", set_tags=pb.SetTags(indexes=[1, 2], tags=[
            pb.Tag(name="age", values=[5, 6])])))
        o.ops.apply(pb.PartitionRequest(partition="p", delete=pb.DeleteSamples(indexes=[0])))
        o.ops.apply(pb.PartitionRequest(partition="p", seal=True))
        listed = o.ops.apply(pb.PartitionRequest(partition="p", list=pb.ListSamples()))
        assert list(listed.indexes) == [] and o.core.partitions["p"].size == 4  # (reserved: no column written)
        back = o.restarted().partitions["p"]
        assert (back.group_size, back.max_pending, back.size, back.deleted, back.sealed) == (2, 6, 4, 1, True)
        assert back.tags["age"][1:3].tolist() == [5, 6]

    asyncio.run(main())


def test_an_operation_the_controller_refuses_leaves_no_record(tmp_path):
    async def main():
        o = Ops(tmp_path)
        o.ops.apply(pb.PartitionRequest(partition="p", create=pb.CreatePartition(group_size=1)))
        size = o.journal.size
        with pytest.raises(DockValueError, match="group_size=1"):  # written ahead, then refused by the core
            o.ops.apply(pb.PartitionRequest(partition="p", reserve=pb.ReserveSamples(count=4, group_size=2)))
        assert o.journal.size == size and o.core.partitions["p"].size == 0
        assert o.restarted().partitions["p"].size == 0

    asyncio.run(main())


def test_drop_consumer_answers_that_consumers_waiting_gets_only(tmp_path):
    async def main():
        o = Ops(tmp_path)
        o.ops.apply(pb.PartitionRequest(partition="p", create=pb.CreatePartition()))
        o.core.partitions["p"].consumer("gone")  # (a consumer the partition knows)
        (gone, gone_get), (kept, kept_get) = o.wait("gone"), o.wait("kept")
        out = o.ops.apply(pb.PartitionRequest(partition="p", drop_consumer=pb.DropConsumer(consumer="gone")))
        assert out.dropped and "gone" not in o.core.partitions["p"].consumers
        assert isinstance(Dock.answer(gone, gone_get), DockClosed) and Dock.answer(kept, kept_get) is None
        assert o.waiting.count == 1
        out = o.ops.apply(pb.PartitionRequest(partition="p", drop_consumer=pb.DropConsumer(consumer="never")))
        assert not out.dropped

    asyncio.run(main())


def test_a_clear_answers_waiting_gets_and_puts_and_is_journaled(tmp_path):
    async def main():
        o = Ops(tmp_path)
        o.ops.apply(pb.PartitionRequest(partition="p", reserve=pb.ReserveSamples(count=3)))
        peer, frame = o.wait("c")
        assert await o.ops.clear("p") == 3
        assert isinstance(Dock.answer(peer, frame), DockClosed) and "p" not in o.core.partitions
        assert "p" not in o.restarted().partitions

    asyncio.run(main())


def test_a_partition_being_loaded_takes_no_operation_and_an_unknown_one_is_named(tmp_path):
    async def main():
        o = Ops(tmp_path)
        o.ops.apply(pb.PartitionRequest(partition="p", reserve=pb.ReserveSamples(count=3)))
        o.loading.add("p")
        with pytest.raises(DockValueError, match="being loaded from a checkpoint"):
            o.ops.apply(pb.PartitionRequest(partition="p", seal=True))
        o.ops.apply(pb.PartitionRequest(partition="p", list=pb.ListSamples()))  # (a listing reads only)
        with pytest.raises(DockValueError, match="partition operation None is not supported"):
            o.ops.apply(pb.PartitionRequest(partition="q"))

    asyncio.run(main())
