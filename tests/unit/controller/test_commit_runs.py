"""A warehouse's coalesced commits of new samples applied as runs (`dockd.controller.commit_runs`): each
commit answered as if applied alone, one journal record per run, replayed to the same state, re-sends
answered from what was recorded, and a run the dock refuses as a whole applied commit by commit."""

from __future__ import annotations

import asyncio

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller import core as core_mod
from dockd.controller.core import Controller
from dockd.controller.records import read
from dockd.controller.service import ControllerService
from tests.unit.controller.fakes import FakeClock, FakePeer


def _service(state: str | None = None, **kw) -> tuple[ControllerService, int]:
    svc = ControllerService(Controller(lease_timeout=30.0, **kw), state_dir=state, clock=FakeClock())
    svc.start()
    reg = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=77)
    return svc, svc.register(FakePeer("warehouse"), reg).id


def _restarted(state) -> Controller:
    """The core a restarted controller rebuilds from the state dir (before any warehouse rejoins)."""
    svc = ControllerService(Controller(lease_timeout=30.0), state_dir=str(state), clock=FakeClock())
    svc.start()
    svc.shutdown()
    return svc.core


def _new(wid: int, n: int, put_id: int, partition: str = "p", columns=("x", "y"), **kw) -> pb.CommitRequest:
    return pb.CommitRequest(partition=partition, columns=list(columns), new_count=n, warehouse=wid, nbytes=10 * n,
                            put_id=put_id, has_timeout=True, timeout=30.0, **kw)


def _indexes(reply: pb.CommitBatchReply) -> list[list[int]]:
    return [list(r.indexes) for r in reply.results]


def _records(state) -> list[list]:
    journals = sorted(state.glob("journal-*.log"))
    assert journals, list(state.iterdir())
    return [rec for path in journals for rec, _ in read(path)]


def test_a_run_answers_each_commit_in_order_writes_one_record_and_replays_to_the_same_state(tmp_path):
    state = tmp_path / "state"

    async def main():
        svc, wid = _service(str(state))
        waiter = FakePeer("trainer", b"session-t")
        get = pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer="c", columns=["x"], count=6, timeout=30.0))
        svc.commit(pb.CommitRequest(partition="p", columns=["x", "y"], new_count=1, warehouse=wid, put_id=1))
        svc.acquire(waiter, get)  # (one sample ready: the get of 6 waits)
        assert not waiter.replies
        out = svc.commit_batch(pb.CommitBatch(commits=[
            _new(wid, 2, 2, token=101), _new(wid, 1, 3), _new(wid, 3, 4, token=103),
            _new(wid, 1, 5, partition="q"),  # another partition: a run of its own
        ]))
        assert _indexes(out) == [[1, 2], [3], [4, 5, 6], [0]]
        assert all(r.status.code == pb.OK and not r.wait for r in out.results)
        assert [list(f.acquire_reply.indexes) for _, f in waiter.replies] == [[0, 1, 2, 3, 4, 5]]
        kinds = [r[0] for r in _records(state)]
        assert kinds.count("M") == 1 and kinds.count("C") == 2, kinds  # (the first commit, and q's alone)
        part = svc.core.partitions["p"]
        assert part.size == 7 and part.nbytes[wid] == 60
        again = svc.commit_batch(pb.CommitBatch(commits=[_new(wid, 2, 2, token=101), _new(wid, 1, 3)]))
        assert _indexes(again) == [[1, 2], [3]] and svc.core.partitions["p"].size == 7  # (re-sent: not applied)
        assert svc.core.catalog.tokens.get(103) == ("p", ("x", "y"), range(4, 7))  # (a re-send to another warehouse)
        svc.shutdown()  # (the records are in the file: as after a SIGKILL)
        for _ in range(2):  # replayed from the journal, then from the snapshot the replay left
            core = _restarted(state)
            part = core.partitions["p"]
            assert part.size == 7 and part.nbytes[wid] == 60
            assert (part.ready[:7] == part.ready[0]).all() and part.ready[0]  # (x and y written for all seven)
            assert core.catalog.recall(wid, 4).tolist() == [4, 5, 6]  # (a re-send after the restart: answered)
            assert core.partitions["q"].size == 1

    asyncio.run(main())


def test_a_run_the_dock_refuses_as_a_whole_is_applied_commit_by_commit():
    async def main():
        svc, wid = _service(max_samples=5)
        out = svc.commit_batch(pb.CommitBatch(commits=[_new(wid, 2, 1), _new(wid, 2, 2), _new(wid, 2, 3)]))
        assert _indexes(out)[:2] == [[0, 1], [2, 3]]  # (all three do not fit; the first two do)
        assert out.results[2].status.code != pb.OK and "at most 5" in out.results[2].status.message
        svc.partition(pb.PartitionRequest(partition="g", create=pb.CreatePartition(group_size=2)))
        bad = svc.commit_batch(pb.CommitBatch(commits=[_new(wid, 1, 4, partition="g", group_size=2)]))
        assert bad.results[0].status.code != pb.OK
        svc.shutdown()

    asyncio.run(main())


def test_a_commit_that_cannot_join_a_run_cuts_it_and_each_answer_stays_its_own():
    """A token seen before (a put re-sent to this warehouse), explicit indexes and other columns each
    end the run before them; every commit still gets what it would have got alone."""
    async def main():
        svc, wid = _service()
        first = svc.commit_batch(pb.CommitBatch(commits=[_new(wid, 1, 1, token=7), _new(wid, 1, 2)]))
        assert _indexes(first) == [[0], [1]]
        out = svc.commit_batch(pb.CommitBatch(commits=[
            _new(wid, 1, 3), _new(wid, 1, 4, token=7),  # (token 7 seen: its values are held, answered as stored)
            _new(wid, 2, 5), pb.CommitRequest(partition="p", columns=["z"], indexes=[0, 2], warehouse=wid, put_id=6),
            _new(wid, 1, 7), _new(wid, 1, 8, columns=("x",)),
        ]))
        assert _indexes(out) == [[2], [0], [3, 4], [0, 2], [5], [6]]
        assert out.results[1].stored
        assert all(r.status.code == pb.OK for r in out.results)
        svc.shutdown()

    asyncio.run(main())


@pytest.mark.skipif(not (core_mod.__file__ or "").endswith(".py"), reason="patches the core, compiled here")
def test_a_fault_in_a_run_answers_each_of_its_commits_with_it_and_the_batch_goes_on(monkeypatch, caplog):
    async def main():
        svc, wid = _service()

        def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(svc.core, "commit_run", broken)
        out = svc.commit_batch(pb.CommitBatch(commits=[
            _new(wid, 1, 1), _new(wid, 1, 2), pb.CommitRequest(partition="q", columns=["x"], new_count=2,
                                                               warehouse=wid, put_id=3)]))
        assert [r.status.code != pb.OK for r in out.results] == [True, True, False]
        assert "a bug" in out.results[0].status.message and list(out.results[2].indexes) == [0, 1]
        assert "a run of 2 commits failed" in caplog.text
        svc.shutdown()

    asyncio.run(main())


def _write(wid: int, indexes: list[int], put_id: int, column: str = "r", **kw) -> pb.CommitRequest:
    return pb.CommitRequest(partition="p", columns=[column], indexes=indexes, warehouse=wid, nbytes=4 * len(indexes),
                            put_id=put_id, **kw)


def test_column_writes_of_existing_samples_go_as_a_run_and_one_naming_a_sample_twice_refuses_it(tmp_path):
    """Commits of `indexes=` puts (a reward written later for samples put before) go as one run (`I`):
    each answered with its own indexes, replayed to the same state; two that name one sample, or one
    naming a sample that does not exist, refuse the run, and alone each gets what it would have got."""
    state = tmp_path / "state"

    async def main():
        svc, wid = _service(str(state))
        svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=8, warehouse=wid, put_id=1))
        out = svc.commit_batch(pb.CommitBatch(commits=[
            _write(wid, [0, 1], 2, token=11), _write(wid, [5], 3), _write(wid, [2, 3], 4)]))
        assert _indexes(out) == [[0, 1], [5], [2, 3]] and all(r.status.code == pb.OK for r in out.results)
        assert [r[0] for r in _records(state)].count("I") == 1
        twice = svc.commit_batch(pb.CommitBatch(commits=[_write(wid, [4, 6], 5), _write(wid, [6, 7], 6),
                                                         _write(wid, [9], 7)]))
        assert _indexes(twice)[0] == [4, 6] and twice.results[0].status.code == pb.OK
        assert "already written" in twice.results[1].status.message
        assert "do not exist" in twice.results[2].status.message
        again = svc.commit_batch(pb.CommitBatch(commits=[_write(wid, [0, 1], 2, token=11), _write(wid, [5], 3)]))
        assert _indexes(again) == [[0, 1], [5]]  # (re-sent: answered again, not refused as written twice)
        bit = 1 << svc.core.partitions["p"].columns["r"]
        written = [i for i in range(8) if svc.core.partitions["p"].ready[i] & bit]
        assert written == [0, 1, 2, 3, 4, 5, 6]
        svc.shutdown()
        for _ in range(2):  # replayed from the journal, then from the snapshot the replay left
            core = _restarted(state)
            part = core.partitions["p"]
            assert [i for i in range(8) if part.ready[i] & bit] == written
            assert core.catalog.recall(wid, 3).tolist() == [5]

    asyncio.run(main())


def test_with_two_copies_each_commit_of_a_run_is_answered_with_where_its_copy_goes():
    """--replicas 2: a run's answers name the warehouse each put is copied to, as a commit applied alone's do
    (with one copy a run answers its indexes alone: the tests above)."""
    async def main():
        svc = ControllerService(Controller(lease_timeout=30.0), clock=FakeClock(), replicas=2)
        svc.start()
        ids = [svc.register(FakePeer(f"w{k}"), pb.RegisterWarehouse(host=f"10.0.0.{k}", port=7000, capacity=1 << 30,
                                                                   instance=k)).id for k in (1, 2)]
        out = svc.commit_batch(pb.CommitBatch(commits=[_new(ids[0], 2, 1), _new(ids[0], 1, 2)]))
        assert _indexes(out) == [[0, 1], [2]]
        assert [r.replica.id for r in out.results] == [ids[1], ids[1]]
        alone = svc.commit_batch(pb.CommitBatch(commits=[_new(ids[0], 1, 3)]))
        assert _indexes(alone) == [[3]] and alone.results[0].replica.id == ids[1]
        svc.shutdown()

    asyncio.run(main())
