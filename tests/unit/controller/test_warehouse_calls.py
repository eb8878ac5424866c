"""Frees the controller sends a warehouse that do not arrive are applied once it is back
(`dockd.controller.warehouse_calls`, finding 10 of the hardening review): the frees of deleted
samples are sent again (after its rejoin, or after FREE_RETRY_S when it answered an error), and
a partition cleared meanwhile is dropped from its rejoin when the dock has that name again, unless
the warehouse holds the new partition's values. The controller service in-process, on fake
connections and a clock the test moves."""

from __future__ import annotations

import asyncio

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller.warehouse_calls import FREE_RETRY_S
from dockd.errors import DockConnectionError, DockStateFull
from tests.unit.controller.fakes import Dock, FakePeer


class Warehouse(FakePeer):
    """A warehouse connection: the requests the controller sends it wait for the test to answer."""

    def __init__(self, name: str = "warehouse") -> None:
        super().__init__(name)
        self.sent: list[tuple[pb.Frame, asyncio.Future]] = []

    def request(self, frame: pb.Frame) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((frame, fut))
        return fut

    def frees(self) -> list[tuple[str, list[int]]]:
        return [(f.free.partition, list(f.free.indexes)) for f, _ in self.sent if f.WhichOneof("kind") == "free"]


def _dock() -> Dock:
    d = Dock()
    d.wpeer = Warehouse()
    d.svc.members.get(d.wid).peer = d.wpeer
    return d


def _on_a_dock(test):
    """A test as a coroutine taking a fresh dock, run on a loop (the dock shut down after)."""
    def run() -> None:
        async def main() -> None:
            d = _dock()
            try:
                await test(d)
            finally:
                d.svc.shutdown()

        asyncio.run(main())

    run.__doc__ = test.__doc__
    return run


def _rejoin(d: Dock, partition: str, indexes: list[int], pending=()) -> tuple[Warehouse, pb.RegisterReply]:
    back = Warehouse("warehouse again")
    inv = [pb.InventoryPartition(name=partition, group_size=1, nbytes=8 * len(indexes),
                                 columns=[pb.InventoryColumn(name="x", runs=[indexes[0], len(indexes)])])]
    reply = d.svc.register(back, pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=77,
                                                      rejoin=True, id=d.wid, inventory=inv, pending=list(pending)))
    return back, reply


def _delete(d: Dock, partition: str, indexes: list[int]) -> None:
    d.svc.partition(pb.PartitionRequest(partition=partition, delete=pb.DeleteSamples(indexes=indexes)))


@_on_a_dock
async def test_a_free_cut_by_its_connection_is_sent_again_after_the_rejoin(d: Dock):
    d.put("p", 8)
    _delete(d, "p", [0, 1, 2])
    await asyncio.sleep(0)
    (frame, fut), = d.wpeer.sent
    fut.set_exception(DockConnectionError("connection closed"))
    d.svc.on_lost(d.wpeer)  # (the connection ends)
    await d.advance(FREE_RETRY_S * 3)
    assert d.wpeer.frees() == [("p", [0, 1, 2])]  # nothing sent while it is away
    back, _ = _rejoin(d, "p", list(range(8)))
    await d.advance(0)
    assert back.frees() == [("p", [0, 1, 2])]


@_on_a_dock
async def test_a_free_the_warehouse_answered_with_an_error_is_sent_again(d: Dock):
    d.put("p", 8)
    _delete(d, "p", [5])
    await asyncio.sleep(0)
    d.wpeer.sent[0][1].set_exception(DockStateFull("its data dir is full"))
    await d.advance(FREE_RETRY_S / 2)
    assert len(d.wpeer.frees()) == 1
    await d.advance(FREE_RETRY_S)
    assert d.wpeer.frees() == [("p", [5]), ("p", [5])]
    d.wpeer.sent[1][1].set_result((pb.Frame(free_reply=pb.FreeReply(nbytes=8)), None))
    await d.advance(FREE_RETRY_S * 3)
    assert len(d.wpeer.frees()) == 2  # answered: done


@_on_a_dock
async def test_the_frees_of_a_warehouse_declared_lost_are_not_kept(d: Dock):
    d.put("p", 8)
    d.svc.on_lost(d.wpeer)
    _delete(d, "p", [0])
    await d.advance(16.0)  # past the grace: lost
    assert d.svc.members.get(d.wid).state == "lost" and not d.svc.core.pending_frees


@_on_a_dock
async def test_a_partition_cleared_meanwhile_and_made_again_is_dropped_from_the_rejoin(d: Dock):
    d.put("r", 8)
    d.svc.on_lost(d.wpeer)  # away while the partition is cleared and made again
    await d.svc.clear(pb.ClearRequest(partition="r"))
    d.svc.partition(pb.PartitionRequest(partition="r", create=pb.CreatePartition()))
    _, reply = _rejoin(d, "r", list(range(8)))
    assert list(reply.drop) == ["r"]  # the warehouse drops its old copy
    assert d.svc.core.warehouse_bytes().get(d.wid, 0) == 0  # and none of it is counted


@_on_a_dock
async def test_a_warehouse_that_applied_the_clear_keeps_the_new_partition(d: Dock):
    """The clear's free reached it but its answer was cut: the warehouse went on to file the new
    partition's puts (their answers came after the free), and it keeps them."""
    d.put("r", 8)
    clear = asyncio.ensure_future(d.svc.clear(pb.ClearRequest(partition="r")))
    await asyncio.sleep(0)
    new = d.put("r", 4)  # answered after the free, on the same connection
    d.wpeer.sent[-1][1].set_exception(DockConnectionError("connection closed"))
    await clear
    d.svc.on_lost(d.wpeer)
    _, reply = _rejoin(d, "r", new.tolist())
    assert not list(reply.drop) and d.svc.core.warehouse_bytes()[d.wid] == 32


@_on_a_dock
async def test_a_new_put_whose_answer_was_lost_does_not_keep_the_old_partition(d: Dock):
    """The warehouse never read the clear's free, nor the answer to its commit of the new partition
    that came after it: it re-sends the commit, and its old copy is dropped all the same."""
    d.put("r", 8)
    clear = asyncio.ensure_future(d.svc.clear(pb.ClearRequest(partition="r")))
    await asyncio.sleep(0)
    new = d.put("r", 4, put_id=9)
    d.wpeer.sent[-1][1].set_exception(DockConnectionError("connection closed"))
    await clear
    d.svc.on_lost(d.wpeer)
    resent = pb.CommitRequest(partition="r", columns=["x"], new_count=4, warehouse=d.wid, nbytes=32, put_id=9)
    _, reply = _rejoin(d, "r", list(range(8)), pending=[resent])
    assert list(reply.drop) == ["r"]
    assert np.array_equal(reply.pending[0].indexes, new)  # (its first answer, filed after the drop)
