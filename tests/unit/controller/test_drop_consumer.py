"""drop_consumer: a consumer nobody runs stops holding back the puts of a max_pending partition. In the
pure core, in the service (paced puts, waiting gets, late confirms) and across a restart from the
state dir."""

from __future__ import annotations

import asyncio

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.client.stats import _partition as stats_partition
from dockd.controller.core import Controller
from dockd.controller.service import ControllerService
from dockd.errors import DockClosed, DockNotFound
from tests.unit.controller.fakes import Dock, FakeClock, FakePeer


def _put(c: Controller, n: int) -> list[int]:
    return c.commit("p", ["x"], warehouse=1, new_count=n).tolist()


def test_a_dropped_consumer_is_forgotten_and_its_name_starts_afresh():
    c = Controller(lease_timeout=60)
    c.create_partition("p", max_pending=4)
    _put(c, 4)
    c.confirm(c.acquire("p", "train", ["x"], 4).lease)
    c.confirm(c.acquire("p", "typo", ["x"], 1).lease)  # one get under a name nobody runs again
    held = c.acquire("p", "typo", ["x"], 1)  # ... and a lease of it
    c.ready_count("p", "typo", ["x"], groups=True)  # (another view of its: another bitmap)
    _put(c, 2)
    c.confirm(c.acquire("p", "train", ["x"], 2).lease)
    assert c.stats()[0]["pending"] == 4 and c.must_wait("p", 1)
    assert c.partitions["p"].most_behind() == ("typo", 4)
    cells = c.catalog.cells.used
    leases = c.drop_consumer("p", "typo")
    assert [l.id for l in leases] == [held.lease] and held.lease not in c.leases
    assert c.catalog.cells.used < cells and c.catalog.cells.used == c.partitions["p"].cells_held()
    st = c.stats()[0]
    assert set(st["consumers"]) == {"train"} and st["pending"] == 0 and not c.must_wait("p", 1)
    assert not c.confirm(held.lease)  # a late confirm of its lease takes nothing
    assert c.drop_consumer("p", "typo") is None  # (already gone)
    with pytest.raises(DockNotFound):
        c.drop_consumer("nope", "typo")
    again = c.acquire("p", "typo", ["x"], 6)  # a fresh consumer under the old name: every sample again
    assert again.indexes.tolist() == [0, 1, 2, 3, 4, 5]


def test_a_consumer_retire_when_consumed_by_names_is_waited_for_even_when_dropped():
    c = Controller(lease_timeout=60)
    c.create_partition("p", max_pending=2, retire=["a", "b"])
    _put(c, 2)
    c.confirm(c.acquire("p", "a", ["x"], 2).lease)
    c.acquire("p", "b", ["x"], 1)
    assert c.stats()[0]["pending"] == 1
    c.drop_consumer("p", "b")
    assert c.stats()[0]["pending"] == 2 and c.partitions["p"].most_behind() == ("b", 2)  # b counts as never asked


def test_a_dropped_consumer_s_rank_aware_rounds_are_forgotten():
    c = Controller(lease_timeout=60)
    _put(c, 8)
    share = c.share("p", "typo", ["x"], 2, dp_rank=0, dp_size=2)
    assert share is not None and c.rounds
    c.drop_consumer("p", "typo")
    assert not c.rounds and not c.leases and not c.ranks.next_step
    assert c.share("p", "typo", ["x"], 2, dp_rank=0, dp_size=2).indexes.tolist() == [0, 1]


def _drop(d: Dock, consumer: str) -> pb.PartitionReply:
    return d.svc.partition(pb.PartitionRequest(partition="p", drop_consumer=pb.DropConsumer(consumer=consumer)))


def _paced_put(d: Dock, answers: list) -> None:
    held = d.svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=1, warehouse=d.wid,
                                         has_timeout=True, timeout=60.0), answers.append, d.wpeer)
    assert held is None and len(d.svc.paced["p"]) == 1


def test_dropping_the_consumer_a_put_waits_for_lets_it_in_and_fails_its_waiting_gets():
    async def main():
        d = Dock()
        d.svc.partition(pb.PartitionRequest(partition="p", create=pb.CreatePartition(max_pending=2)))
        d.put("p", 2)
        train, typo = FakePeer("train", b"session-train"), FakePeer("typo", b"session-typo")
        d.svc.confirm(train, pb.ConfirmRequest(leases=[d.answer(train, d.get(train, "p", 2, consumer="train"))
                                                       .acquire_reply.lease]))
        lease = d.answer(typo, d.get(typo, "p", 1, consumer="typo")).acquire_reply.lease  # never confirmed
        d.put("p", 1)
        d.svc.confirm(train, pb.ConfirmRequest(leases=[d.answer(train, d.get(train, "p", 1, consumer="train"))
                                                       .acquire_reply.lease]))
        answers: list = []
        _paced_put(d, answers)  # samples 1 and 2 wait for typo
        waiting = d.get(typo, "p", 5, consumer="typo", timeout=60.0)
        other = d.get(train, "p", 1, consumer="train", timeout=60.0)
        await d.advance(5.0)
        assert answers == [] and d.answer(typo, waiting) is None
        assert _drop(d, "typo").dropped
        await d.advance(0)
        assert len(answers) == 1 and answers[0].listed() == [3]  # the put went in at once
        failed = d.answer(typo, waiting)
        assert isinstance(failed, DockClosed) and "dropped" in str(failed)
        got = d.answer(train, other)  # the other consumer's get still waits, and is served by the put
        assert isinstance(got, pb.Frame) and list(got.acquire_reply.indexes) == [3]
        late = d.svc.confirm(typo, pb.ConfirmRequest(leases=[lease]))
        assert list(late.unknown) == [lease]  # reported, not taken
        assert not _drop(d, "typo").dropped
        assert [c.name for c in d.svc.stats().partitions[0].consumers] == ["train"]
        d.svc.shutdown()

    asyncio.run(main())


def test_a_drop_is_journaled_and_replayed_after_a_restart(tmp_path):
    state = str(tmp_path / "state")

    def service() -> tuple[ControllerService, FakePeer, int]:
        svc = ControllerService(Controller(lease_timeout=30.0), state_dir=state, clock=FakeClock())
        svc.start()
        wpeer = FakePeer("warehouse")
        wid = svc.register(wpeer, pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30,
                                                       instance=77)).id
        return svc, wpeer, wid

    async def main():
        svc, _, wid = service()
        svc.partition(pb.PartitionRequest(partition="p", create=pb.CreatePartition(max_pending=1)))
        svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=2, warehouse=wid))
        typo = FakePeer("typo", b"session-typo")
        svc.acquire(typo, pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer="typo", columns=["x"], count=1)))
        svc.acquire(typo, pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer="keep", columns=["x"], count=2)))
        assert svc.core.must_wait("p", 1)
        svc.partition(pb.PartitionRequest(partition="p", drop_consumer=pb.DropConsumer(consumer="typo")))
        svc.shutdown()  # (the records are in the file: as after a SIGKILL)
        for _ in range(2):  # replayed from the journal, then from the snapshot the replay left
            svc, _, wid = service()
            core = svc.core
            assert set(core.partitions["p"].consumers) == {"keep"}
            assert [l.consumer for l in core.leases.values()] == ["keep"]
            assert core.stats()[0]["pending"] == 0 and not core.must_wait("p", 1)
            svc.shutdown()
        again = Controller.restore(core.snapshot(0.0), wall_offset=0.0)
        assert again.acquire("p", "typo", ["x"], 2).indexes.tolist() == [0, 1]

    asyncio.run(main())


def test_the_error_of_a_paced_put_names_the_consumer_furthest_behind():
    async def main():
        d = Dock()
        d.svc.partition(pb.PartitionRequest(partition="p", create=pb.CreatePartition(max_pending=1)))
        d.put("p", 1)
        d.svc.core.ready_count("p", "typo", ["x"])  # (asked once: a consumer now)
        answers: list = []
        _paced_put(d, answers)
        await d.advance(61.0)
        assert len(answers) == 1 and "dock.drop_consumer('p', 'typo')" in str(answers[0].error)
        d.svc.shutdown()

    asyncio.run(main())


def test_the_stats_say_which_consumers_puts_wait_for():
    p = pb.PartitionStats(name="p", samples=6, max_pending=4, pending=4, consumers=[
        pb.ConsumerStats(name="train", pending=0), pb.ConsumerStats(name="typo", pending=4)])
    assert stats_partition(p)["pending_by"] == {"typo": 4, "train": 0}
    p.retire_when_consumed_by[:] = ["train", "ref"]  # only those named count; "ref" never asked: all pending
    assert stats_partition(p)["pending_by"] == {"ref": 4, "train": 0}
    p.max_pending = 0
    assert stats_partition(p)["pending_by"] == {}
