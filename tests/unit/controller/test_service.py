"""The controller service driven in-process (no sockets): fake connections on an asyncio loop,
and a clock the test moves by hand, so "a lease expired", "the grace passed" or "the get waited
its timeout" happen when the test says so, and "nothing happened yet" is checked just before."""

from __future__ import annotations

import asyncio
import os

import pytest

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.controller.core import Controller
from dockd.controller.service import ControllerService
from dockd.errors import DockDataLost, DockFull, DockStateFull, DockTimeout, DockValueError
from tests.unit.controller.fakes import Dock, FakeClock, FakePeer, run


def test_an_expired_lease_hands_its_sample_out_again():
    async def main():
        d = Dock(lease_timeout=30.0)
        d.put("p", 1)
        a, b = FakePeer("a", b"session-a"), FakePeer("b", b"session-b")
        first = d.answer(a, d.get(a, "p", 1))
        assert list(first.acquire_reply.indexes) == [0]
        waiting = d.get(b, "p", 1)  # the only sample is leased to a: b waits
        await d.advance(29.0)
        assert d.answer(b, waiting) is None and d.svc.leases_expired == 0
        await d.advance(1.5)  # a never confirmed: its lease expired, and the waiting get gets the sample
        again = d.answer(b, waiting)
        assert isinstance(again, pb.Frame), again
        assert list(again.acquire_reply.indexes) == [0] and again.acquire_reply.lease != first.acquire_reply.lease
        assert d.svc.leases_expired == 1 and d.svc.parked == 0
        late = d.svc.confirm(a, pb.ConfirmRequest(leases=[first.acquire_reply.lease]))  # too late: reported
        assert list(late.unknown) == [first.acquire_reply.lease]
        d.svc.shutdown()

    run(main())


def test_a_confirmed_lease_does_not_expire():
    async def main():
        d = Dock(lease_timeout=30.0)
        d.put("p", 1)
        a = FakePeer("a", b"session-a")
        lease = d.answer(a, d.get(a, "p", 1)).acquire_reply.lease
        assert not list(d.svc.confirm(a, pb.ConfirmRequest(leases=[lease])).unknown)
        await d.advance(60.0)
        assert d.svc.leases_expired == 0
        assert d.svc.stats().partitions[0].consumers[0].taken == 1
        d.svc.shutdown()

    run(main())


def test_a_confirm_sent_again_after_it_was_applied_is_not_reported_as_expired():
    """A client re-sends a request whose answer it did not get (a dropped connection, a controller
    that stalled past the client's probe): a confirm applied the first time must not come back as
    "expired or released", which would tell the trainer its samples went to another reader."""
    async def main():
        d = Dock(lease_timeout=30.0)
        d.put("p", 2)
        a = FakePeer("a", b"session-a")
        lease = d.answer(a, d.get(a, "p", 1)).acquire_reply.lease
        assert not list(d.svc.confirm(a, pb.ConfirmRequest(leases=[lease])).unknown)
        again = d.svc.confirm(a, pb.ConfirmRequest(leases=[lease]))
        assert not list(again.unknown) and not list(again.refused)
        assert d.svc.stats().partitions[0].consumers[0].taken == 1
        other = d.answer(a, d.get(a, "p", 1)).acquire_reply.lease  # (an expired lease is still reported)
        await d.advance(31.0)
        assert list(d.svc.confirm(a, pb.ConfirmRequest(leases=[other])).unknown) == [other]
        d.svc.shutdown()

    run(main())


def test_a_lease_is_kept_while_any_authenticated_connection_of_its_session_is_open():
    async def main():
        d = Dock()
        d.put("p", 2)
        took, spare = FakePeer("took", b"session-a"), FakePeer("spare", b"session-a")
        d.svc.on_authed(took)
        first = d.answer(took, d.get(took, "p", 1)).acquire_reply.lease
        d.svc.on_authed(spare)  # the client's next connection (a reconnect), before any request on it
        d.svc.on_lost(took)  # the connection that took the lease closes: the client is still there
        assert not list(d.svc.confirm(spare, pb.ConfirmRequest(leases=[first])).unknown)
        assert list(d.answer(spare, d.get(spare, "p", 1)).acquire_reply.indexes) == [1]
        d.svc.on_lost(spare)  # its last connection: the client is gone, its lease goes back
        other = FakePeer("other", b"session-b")
        assert list(d.answer(other, d.get(other, "p", 1)).acquire_reply.indexes) == [1]
        d.svc.shutdown()

    run(main())


def test_a_dropped_warehouse_keeps_its_samples_during_grace_and_loses_them_after():
    async def main():
        d = Dock(grace=15.0)
        d.put("p", 2)
        d.svc.on_lost(d.wpeer)  # its connection dropped: it has 15 s to rejoin
        await d.advance(0)
        assert d.probed == [("10.0.0.9", 7000)]  # (asked who answers there: nobody can tell)
        assert d.svc.members.get(d.wid).state == "rejoining"
        c = FakePeer("c", b"session-c")
        got = d.answer(c, d.get(c, "p", 1, consumer="during"))
        assert isinstance(got, pb.Frame) and list(got.acquire_reply.indexes) == [0]  # still served from it
        await d.advance(14.0)
        assert d.svc.members.get(d.wid).state == "rejoining"
        await d.advance(1.5)  # the grace passed: it is lost, and so are the values it held
        assert d.svc.members.get(d.wid).state == "lost"
        with pytest.raises(DockDataLost) as lost:  # (the daemon answers what acquire raises)
            d.get(c, "p", 1, consumer="after")
        assert lost.value.indexes == [0]
        d.svc.shutdown()

    run(main())


def test_a_warehouse_that_rejoins_within_grace_keeps_its_samples():
    async def main():
        d = Dock(grace=15.0)
        d.put("p", 2)
        d.svc.on_lost(d.wpeer)
        await d.advance(10.0)
        inv = pb.InventoryPartition(name="p", group_size=1, nbytes=16,
                                    columns=[pb.InventoryColumn(name="x", runs=[0, 2])])
        back = FakePeer("warehouse again")
        d.svc.register(back, pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=77,
                                                  rejoin=True, id=d.wid, inventory=[inv]))
        await d.advance(10.0)  # past the grace it had: it came back, nothing is lost
        assert d.svc.members.get(d.wid).state == "joined"
        c = FakePeer("c")
        got = d.answer(c, d.get(c, "p", 2))
        assert isinstance(got, pb.Frame) and sorted(got.acquire_reply.indexes) == [0, 1]
        d.svc.shutdown()

    run(main())


def test_a_parked_get_times_out_with_dock_timeout():
    async def main():
        d = Dock()
        d.put("p", 1)
        c = FakePeer("c")
        frame = d.get(c, "p", 3, timeout=2.5)
        await d.advance(2.4)
        assert d.answer(c, frame) is None and d.svc.parked == 1
        await d.advance(0.2)
        err = d.answer(c, frame)
        assert isinstance(err, DockTimeout) and err.ready == 1
        assert "timed out after 2.5 s: 1 of 3 samples were ready" in str(err) and "allow_partial=True" in str(err)
        assert d.svc.parked == 0 and c.parked == 0
        d.svc.shutdown()

    run(main())


def test_a_timeout_after_every_sample_was_taken_says_so():
    async def main():
        d = Dock()
        d.put("p", 2)
        c = FakePeer("c", b"session-c")
        lease = d.answer(c, d.get(c, "p", 2)).acquire_reply.lease
        d.svc.confirm(c, pb.ConfirmRequest(leases=[lease]))
        frame = d.get(c, "p", 1, timeout=0.999997)
        await d.advance(1.0)
        err = d.answer(c, frame)
        assert isinstance(err, DockTimeout)
        msg = str(err)
        assert "timed out after 1 s: 0 of 1 samples were ready: consumer 'c' has already taken all 2 samples" in msg, msg
        assert "allow_partial" not in msg
        with pytest.raises(DockTimeout, match="has already taken all 2"):  # (at once, too: timeout=0)
            d.get(c, "p", 1, timeout=0)
        d.svc.shutdown()

    run(main())


def test_a_commit_waits_for_max_pending_and_goes_in_once_consumers_take_some():
    async def main():
        d = Dock()
        d.svc.partition(pb.PartitionRequest(partition="p", create=pb.CreatePartition(max_pending=2)))
        d.put("p", 2)
        answers = []
        held = d.svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=1, warehouse=d.wid,
                                             has_timeout=True, timeout=30.0), answers.append, d.wpeer)
        assert held is None and d.svc.paced_total == 1 and len(d.svc.paced["p"]) == 1
        await d.advance(10.0)
        assert answers == []  # nobody took anything: it still waits
        c = FakePeer("c", b"session-c")
        lease = d.answer(c, d.get(c, "p", 1)).acquire_reply.lease
        d.svc.confirm(c, pb.ConfirmRequest(leases=[lease]))
        await d.advance(0)
        assert len(answers) == 1 and answers[0].listed() == [2]  # applied: the third sample
        assert "p" not in d.svc.paced and d.wpeer.parked == 0
        d.svc.shutdown()

    run(main())


def test_a_paced_commit_that_waits_its_timeout_fails_with_dock_full():
    async def main():
        d = Dock()
        d.svc.partition(pb.PartitionRequest(partition="p", create=pb.CreatePartition(max_pending=1)))
        d.put("p", 1)
        answers = []
        d.svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=1, warehouse=d.wid, has_timeout=True,
                                      timeout=4.0), answers.append, d.wpeer)
        await d.advance(3.9)
        assert answers == []
        await d.advance(0.2)
        assert len(answers) == 1 and isinstance(answers[0].error, DockFull)
        assert "waited 4 s for them" in str(answers[0].error)
        assert d.svc.core.partitions["p"].size == 1 and "p" not in d.svc.paced
        d.svc.shutdown()

    run(main())


def test_a_commit_batch_answers_each_commit_on_its_own_and_leaves_paced_ones_unapplied():
    """A warehouse's coalesced commits: applied in order, an error answers only its own commit, a
    commit that would wait for its partition's consumers is not applied (`wait`), a get waiting on the
    partition is served, and a commit re-sent is answered again, not applied twice."""
    async def main():
        d = Dock()
        d.svc.partition(pb.PartitionRequest(partition="paced", create=pb.CreatePartition(max_pending=1)))
        d.put("paced", 1)
        c = FakePeer("c", b"session-c")
        waiting = d.get(c, "p", 3)
        assert d.answer(c, waiting) is None

        def new(partition: str, n: int, put_id: int, **kw) -> pb.CommitRequest:
            return pb.CommitRequest(partition=partition, columns=["x"], new_count=n, warehouse=d.wid, nbytes=8 * n,
                                    put_id=put_id, has_timeout=True, timeout=30.0, **kw)

        batch = pb.CommitBatch(commits=[
            new("p", 2, 1),
            pb.CommitRequest(partition="p", columns=["y"], indexes=[999], warehouse=d.wid, nbytes=8, put_id=2),
            new("paced", 1, 3),
            new("p", 1, 4),
        ])
        out = d.svc.commit_batch(batch).results
        assert [list(r.indexes) for r in out] == [[0, 1], [], [], [2]]
        assert out[1].status.code != pb.OK and "999" in out[1].status.message
        assert out[2].wait and out[2].status.code == pb.OK and d.svc.core.partitions["paced"].size == 1
        assert not out[0].wait and not out[3].wait
        assert list(d.answer(c, waiting).acquire_reply.indexes) == [0, 1, 2]
        again = d.svc.commit_batch(pb.CommitBatch(commits=[new("p", 2, 1)])).results  # (re-sent: answered again)
        assert list(again[0].indexes) == [0, 1] and d.svc.core.partitions["p"].size == 3
        d.svc.shutdown()

    run(main())


def test_each_of_several_controllers_numbers_new_warehouses_with_ids_of_its_own():
    async def main():
        ctl = ("10.0.0.1:7450", "10.0.0.2:7450", "10.0.0.3:7450")
        svc = ControllerService(Controller(), controllers=ctl, own=1)

        def reg(port: int, **kw) -> pb.RegisterWarehouse:
            return pb.RegisterWarehouse(host="10.0.0.8", port=port, capacity=1 << 30, instance=port, **kw)

        # ids another controller gave are taken as given (4: one the first gave when it numbered all)
        assert svc.register(FakePeer("warehouse"), reg(7000, id=0, assigned=True)).id == 0
        assert svc.register(FakePeer("warehouse"), reg(7001, id=4, assigned=True)).id == 4
        assert svc.register(FakePeer("warehouse"), reg(7002, id=5, assigned=True)).id == 5
        # new ones: this controller's ids 1, 4, 7, ... above those of them taken
        assert [svc.register(FakePeer("warehouse"), reg(7100 + i)).id for i in range(3)] == [7, 10, 13]
        alone = ControllerService(Controller())
        assert [alone.register(FakePeer("warehouse"), reg(7200 + i)).id for i in range(3)] == [0, 1, 2]
        svc.shutdown()
        alone.shutdown()

    run(main())


def test_a_join_that_gave_up_on_a_controller_leaves_no_second_member_there():
    """A new warehouse of a dock with several controllers asks the next one when a controller takes
    more than a few seconds to answer; that controller may have taken it in meanwhile. When the same
    process asks it again it is that member, not a second one; when it joins it under an id another
    controller gave, the first try leaves (it stayed as a member that never came back)."""
    async def main():
        ctl = ("10.0.0.1:7450", "10.0.0.2:7450")
        svc = ControllerService(Controller(), controllers=ctl, own=0)
        reg = pb.RegisterWarehouse(host="10.0.0.8", port=7000, capacity=1 << 30, instance=0x77)
        first = FakePeer("warehouse")
        assert svc.register(first, reg).id == 0
        svc.on_lost(first)  # it gave up waiting for the answer
        again = FakePeer("warehouse")
        assert svc.register(again, reg).id == 0  # asked again: the same member
        assert [w.id for w in svc.stats().warehouses] == [0]
        svc.on_lost(again)
        assigned = pb.RegisterWarehouse()
        assigned.CopyFrom(reg)
        assigned.id, assigned.assigned = 1, True  # numbered by the second controller meanwhile
        assert svc.register(FakePeer("warehouse"), assigned).id == 1
        assert {w.id: w.state for w in svc.stats().warehouses} == {0: "left", 1: "joined"}
        other = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=0x78)
        assert svc.register(FakePeer("warehouse"), other).id == 2  # another process: a member of its own
        svc.shutdown()

    run(main())


def test_one_of_several_controllers_refuses_partitions_it_does_not_own_and_their_inventory():
    async def main():
        ctl = ("10.0.0.1:7450", "10.0.0.2:7450")
        names = [f"p{i}" for i in range(40)]
        mine = [n for n in names if owners.owner_index(n, 2) == 1]
        theirs = [n for n in names if owners.owner_index(n, 2) == 0]
        svc = ControllerService(Controller(), controllers=ctl, own=1)
        first = pb.RegisterWarehouse(host="10.0.0.8", port=7000, capacity=1 << 30, instance=4, id=0, assigned=True)
        assert svc.register(FakePeer("warehouse"), first).id == 0  # (the id the first controller gave it)
        svc.commit(pb.CommitRequest(partition=mine[0], columns=["x"], new_count=2, warehouse=0, nbytes=16))
        with pytest.raises(DockValueError, match="belongs to the controller at 10.0.0.1:7450"):
            svc.commit(pb.CommitRequest(partition=theirs[0], columns=["x"], new_count=2, warehouse=0, nbytes=16))
        with pytest.raises(DockValueError, match="belongs to the controller"):
            svc.acquire(FakePeer(), pb.Frame(acquire=pb.AcquireRequest(partition=theirs[0], consumer="c",
                                                                       columns=["x"], count=1)))
        # a warehouse rejoining with what it holds: only this controller's partitions are adopted
        reg = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=5, rejoin=True, id=3,
                                   assigned=True)
        for name in (mine[1], theirs[1]):
            reg.inventory.add(name=name, columns=[pb.InventoryColumn(name="x", runs=[0, 4])])
        assert svc.register(FakePeer("warehouse"), reg).id == 3
        assert mine[1] in svc.core.partitions and theirs[1] not in svc.core.partitions
        svc.shutdown()

    run(main())


def test_an_acquire_names_its_warehouses_as_they_are_now():
    """The warehouse infos of an acquire's reply are serialized once per set of warehouses and state:
    a change (its connection dropped, a new address) shows in the next reply."""
    async def main():
        d = Dock()
        d.put("p", 4)
        a = FakePeer("a", b"session-a")
        first = d.answer(a, d.get(a, "p", 1)).acquire_reply
        assert [(w.id, w.host, w.port, w.state, w.alive) for w in first.warehouses] == \
            [(d.wid, "10.0.0.9", 7000, "joined", True)]
        assert list(first.locations) == [d.wid]
        again = d.answer(a, d.get(a, "p", 1)).acquire_reply  # (the same, from what was serialized)
        assert list(again.warehouses) == list(first.warehouses)
        d.svc.members.connection_lost(d.wpeer)  # away: its samples wait for it to rejoin
        away = d.answer(a, d.get(a, "p", 1)).acquire_reply
        assert [(w.id, w.state, w.alive) for w in away.warehouses] == [(d.wid, "rejoining", False)]
        d.svc.shutdown()

    run(main())


def test_a_service_started_from_its_state_dir_serves_from_the_rebuilt_core_in_every_part(tmp_path):
    def service() -> ControllerService:
        svc = ControllerService(Controller(lease_timeout=30.0), state_dir=str(tmp_path), clock=FakeClock())
        svc.start()
        return svc

    async def main():
        svc = service()
        wid = svc.register(FakePeer("warehouse"), pb.RegisterWarehouse(host="10.0.0.9", port=7000,
                                                                      capacity=1 << 30, instance=77)).id
        svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=3, warehouse=wid))
        svc.shutdown()
        again = ControllerService(Controller(lease_timeout=30.0), state_dir=str(tmp_path), clock=FakeClock())
        fresh = again.core
        again.start()
        assert again.core is not fresh and again.core.partitions["p"].size == 3
        parts = [again.members, again.waiting, again.pacer, again.calls, again.leasing, again.replication,
                 again.acquiring, again.checkpoints, again.ops]
        assert [type(p).__name__ for p in parts if p.core is not again.core] == []
        listed = again.partition(pb.PartitionRequest(partition="p", list=pb.ListSamples()))
        assert list(listed.indexes) == [0, 1, 2]
        again.shutdown()

    run(main())


def _journaled(tmp_path) -> tuple[ControllerService, FakeClock, FakePeer, int]:
    clock = FakeClock()
    svc = ControllerService(Controller(lease_timeout=30.0), state_dir=str(tmp_path), clock=clock)
    svc.start()
    wid = svc.register(FakePeer("warehouse"), pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30,
                                                                  instance=77)).id
    return svc, clock, FakePeer("warehouse"), wid


async def _until(svc: ControllerService, clock: FakeClock, done) -> bool:
    """Move the clock an fsync interval at a time (the fsync itself runs in a worker thread) until done()."""
    for _ in range(200):
        if done():
            return True
        clock.now += svc.journal.fsync_interval
        svc.timers.run_due()
        await asyncio.sleep(0.01)
    return done()


def test_the_journal_is_fsynced_after_a_record_and_sets_no_timer_while_nothing_is_written(tmp_path):
    async def main():
        svc, clock, _, wid = _journaled(tmp_path)
        plain = ControllerService(Controller(lease_timeout=30.0), clock=clock)  # (no state dir: the same timers less)
        plain.start()
        plain.register(FakePeer("warehouse"), pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30,
                                                                   instance=77))
        quiet = lambda: not svc.journal.dirty and len(svc.timers) == len(plain.timers)  # noqa: E731
        assert svc.journal.dirty  # (the warehouse's record)
        assert await _until(svc, clock, quiet)  # synced, then an idle controller is not woken for its journal
        svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=3, warehouse=wid))
        assert svc.journal.dirty and len(svc.timers) == len(plain.timers) + 1  # the first record armed it
        assert await _until(svc, clock, quiet)
        svc.shutdown()
        plain.shutdown()

    run(main())


def test_a_journal_that_stops_while_idle_is_resumed_by_a_snapshot(tmp_path):
    async def main():
        svc, clock, _, wid = _journaled(tmp_path)
        svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=3, warehouse=wid))
        client = FakePeer("client", b"session-1")
        svc.acquire(client, pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer="c", columns=["x"], count=2,
                                                               timeout=0)))
        assert await _until(svc, clock, lambda: not svc.journal.dirty and clock.now > 1001.0)
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, svc.journal._fd)  # the disk takes no more, and the half record cannot be cut off
        os.close(full)
        svc.on_lost(client)  # its lease goes back: a decision made, whose record fails
        assert svc.journal.broken is not None
        with pytest.raises(DockStateFull):
            svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=1, warehouse=wid))
        assert await _until(svc, clock, lambda: svc.journal.broken is None)  # a snapshot captured the controller
        svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=1, warehouse=wid))
        svc.shutdown()
        again = ControllerService(Controller(lease_timeout=30.0), state_dir=str(tmp_path), clock=FakeClock())
        again.start()
        part = again.core.partitions["p"]
        assert part.size == 4 and not again.core.leases  # the release is in the snapshot
        again.shutdown()

    run(main())
