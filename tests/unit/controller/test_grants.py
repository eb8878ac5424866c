"""A get's try and its answer (`dockd.controller.grants`), Acquiring driven directly with its real
collaborators (a controller core, a journal in a temporary state dir, sessions, waiters, a pacer,
warehouse calls, replication, membership with one warehouse) on a clock the test moves: the lease a
get is granted is journaled ahead of its answer and expires on the clock, a get the journal cannot
take gets nothing, the staleness of what is handed out is counted, and the reply carries the
lease's ticket and the addresses of the warehouses holding the samples."""

from __future__ import annotations

import asyncio

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller.grants import STALENESS_BUCKETS, Acquiring
from dockd.controller.journal import Journal
from dockd.controller.pacing import Pacer
from dockd.controller.replica_service import Replication
from dockd.controller.sessions import Leasing
from dockd.controller.waiters import Waiters
from dockd.controller.warehouse_calls import WarehouseCalls
from dockd.errors import DockStateFull
from dockd.terms import CommitOutcome
from tests.unit.controller.fakes import Dock, FakePeer, Journaled


class Grants(Journaled):
    """Acquiring over partition "p" (4 samples of versions 0, 0, 3, 3; the trainer's version is 4) on one
    warehouse, its decisions journaled in `state_dir`."""

    def __init__(self, state_dir) -> None:
        super().__init__(state_dir)
        reg = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=7)
        self.wid = self.members.register(FakePeer("warehouse"), reg, lambda req: CommitOutcome()).id
        tags = {"version": [0, 0, 3, 3]}
        self.journal.commit("p", ["x"], self.wid, None, 4, 1, 32, 0, tags)
        self.core.commit("p", ["x"], warehouse=self.wid, new_count=4, nbytes=32, tags=tags)
        self.journal.set_version("p", 4)
        self.core.set_version("p", 4)
        waiting = Waiters(self.core, self.timers, retry_all=lambda: None)
        pacer = Pacer(self.core, self.members, self.timers, apply=lambda req: CommitOutcome())
        calls = WarehouseCalls(self.core, self.members, None, self.timers, daemon_timeout=1.0)
        self.leasing = Leasing(self.core, self.journal, self.timers, waiting=waiting, pacer=pacer, calls=calls)
        replication = Replication(self.core, self.members, self.journal, self.timers, replicas=1, local=None,
                                  daemon_timeout=1.0)
        self.acquiring = waiting.gets = Acquiring(
            self.core, self.journal, self.timers, leasing=self.leasing, waiting=waiting, pacer=pacer, calls=calls,
            replication=replication, members=self.members, local=None)


def _get(count: int, **kw) -> pb.AcquireRequest:
    return pb.AcquireRequest(partition="p", consumer="c", columns=["x"], count=count, **kw)


def test_a_grant_is_journaled_ahead_and_expires_on_the_clock(tmp_path):
    async def main():
        g = Grants(tmp_path)
        res = g.acquiring.attempt(FakePeer("a", b"session-a"), _get(2, lease_seconds=10.0))
        assert res is not None and res.indexes.tolist() == [0, 1]
        assert g.core.leases[res.lease].owner == b"session-a"
        g.clock.now += 10.5
        g.timers.run_due()
        assert res.lease not in g.core.leases and g.leasing.expired == 1
        again = g.acquiring.attempt(FakePeer("b", b"session-b"), _get(1))
        assert again is not None and again.indexes.tolist() == [0]
        assert list(g.restarted().leases) == [again.lease]  # (grants and the expiry were journaled)

    asyncio.run(main())


def test_a_get_the_journal_cannot_take_is_granted_nothing(tmp_path):
    async def main():
        g = Grants(tmp_path)
        g.journal.broken = "the disk failed"
        with pytest.raises(DockStateFull, match="cannot record its decisions"):
            g.acquiring.attempt(FakePeer("a", b"session-a"), _get(1))
        assert not g.core.leases and g.core.ready_count("p", "c", ["x"]) == 4

    asyncio.run(main())


def test_the_staleness_of_what_is_handed_out_is_counted_per_bucket(tmp_path):
    async def main():
        g = Grants(tmp_path)
        assert g.acquiring.attempt(FakePeer("a"), _get(4)) is not None  # versions 0, 0, 3, 3 at version 4
        want = [0] * (len(STALENESS_BUCKETS) + 1)
        want[STALENESS_BUCKETS.index(1)] = want[STALENESS_BUCKETS.index(4)] = 2
        assert g.acquiring.staleness_counts == want and g.acquiring.staleness_sum == 10

    asyncio.run(main())


def test_a_reply_carries_the_ticket_the_samples_and_their_warehouses(tmp_path):
    async def main():
        g = Grants(tmp_path)
        peer, frame = FakePeer("a", b"session-a"), pb.Frame(acquire=_get(3))
        res = g.acquiring.attempt(peer, frame.acquire)
        g.acquiring.reply(peer, frame, frame.acquire, res)
        out = Dock.answer(peer, frame).acquire_reply
        assert out.lease == res.lease and out.ticket == g.leasing.ticket(res.lease)
        assert list(out.indexes) == [0, 1, 2] and list(out.locations) == [g.wid] * 3
        assert [(w.id, w.host, w.port) for w in out.warehouses] == [(g.wid, "10.0.0.9", 7000)]

    asyncio.run(main())


def test_a_split_grant_is_one_record_and_a_retry_gets_every_lease_back_also_after_a_restart(tmp_path):
    """get(prefetch=n): an acquire with per_lease is one journal record for all its leases, and the
    same acquire re-sent (its reply lost) gets all of them back, not only the first, before and after
    the controller is rebuilt from the state dir (journal, then snapshot)."""
    async def main():
        g = Grants(tmp_path)
        peer = FakePeer("a", b"session-a")
        records = g.journal.records
        res = g.acquiring.attempt(peer, _get(4, per_lease=2, token=77, allow_partial=True))
        assert res is not None and len(res.leases) == 2 and res.indexes.tolist() == [0, 1, 2, 3]
        assert g.journal.records == records + 1
        again = g.acquiring.attempt(peer, _get(4, per_lease=2, token=77, allow_partial=True))
        assert again is not None and again.leases == res.leases and again.indexes.tolist() == [0, 1, 2, 3]
        assert again.lease == res.lease and again.seconds > 0
        core = g.restarted()  # (replayed from the journal)
        retried = core.acquire("p", "c", ["x"], 4, allow_partial=True, token=77, owner=b"session-a", now=g.clock())
        assert retried is not None and retried.leases == res.leases and retried.indexes.tolist() == [0, 1, 2, 3]
        j = Journal(tmp_path)
        j.compact(core, {}, now=g.clock())  # (a snapshot holds them, the journal nothing)
        j.close()
        core, _ = Journal(tmp_path).load(lease_timeout=30.0, now=g.clock())
        retried = core.acquire("p", "c", ["x"], 4, allow_partial=True, token=77, owner=b"session-a", now=g.clock())
        assert retried is not None and retried.leases == res.leases and retried.indexes.tolist() == [0, 1, 2, 3]
        assert core.ready_count("p", "c", ["x"]) == 0

    asyncio.run(main())


def test_a_big_reply_names_each_column_s_warehouse_as_a_small_one_does(tmp_path):
    """A reply of many locations appends them as packed bytes (`wire.packed_bytes`) rather than one by one:
    parsed, it names the same warehouse for every column of every sample, and every warehouse's address."""
    async def main():
        g = Grants(tmp_path)
        reg = pb.RegisterWarehouse(host="10.0.0.8", port=7001, capacity=1 << 30, instance=8)
        other = g.members.register(FakePeer("warehouse2"), reg, lambda req: CommitOutcome()).id
        g.journal.commit("q", ["x"], g.wid, None, 40, 1, 320, 0, None)  # (samples 0..39: x on one, y on the other)
        g.core.commit("q", ["x"], warehouse=g.wid, new_count=40, nbytes=320)
        g.journal.commit("q", ["y"], other, list(range(40)), 0, 1, 320, 0, None)
        g.core.commit("q", ["y"], warehouse=other, indexes=list(range(40)), nbytes=320)
        far = other
        while far < 300:  # (a warehouse id of two bytes as a varint: the locations go one by one)
            reg = pb.RegisterWarehouse(host=f"10.0.1.{far % 250}", port=8000 + far, capacity=1 << 30, instance=far)
            far = g.members.register(FakePeer(f"w{far}"), reg, lambda req: CommitOutcome()).id
        g.journal.commit("q", ["z"], far, list(range(40)), 0, 1, 320, 0, None)
        g.core.commit("q", ["z"], warehouse=far, indexes=list(range(40)), nbytes=320)
        for columns, want in ((["x", "y"], [g.wid] * 40 + [other] * 40), (["y"], [other] * 40),
                              (["x", "z"], [g.wid] * 40 + [far] * 40)):
            req = pb.AcquireRequest(partition="q", consumer="".join(columns), columns=columns, count=40)
            peer, frame = FakePeer("a", b"session-a"), pb.Frame(acquire=req)
            res = g.acquiring.attempt(peer, frame.acquire)
            g.acquiring.reply(peer, frame, frame.acquire, res)
            out = Dock.answer(peer, frame).acquire_reply
            assert list(out.indexes) == list(range(40)) and list(out.locations) == want
            assert sorted(w.id for w in out.warehouses) == sorted(set(want))

    asyncio.run(main())
