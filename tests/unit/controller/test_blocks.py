"""Blocks of new indexes granted to warehouses (`--commit-window`: `dockd.controller.blocks`, `block_service`):
grants and their refusals, block commits (written like columns of existing samples, or answered cleared when
their samples are gone), a seal's handshake with the owners, blocks dropped with their owner, and the registry
through journal replay and snapshots. The controller service in-process, on fake connections."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller import blocks
from dockd.controller.core import Controller
from dockd.controller.records import read
from dockd.controller.service import ControllerService
from dockd.errors import DockConnectionError, DockDrained, DockTimeout, DockValueError
from tests.unit.controller import test_warehouse_calls
from tests.unit.controller.fakes import FakeClock, FakePeer


class Warehouse(test_warehouse_calls.Warehouse):
    """A warehouse's link: the requests the controller sends it wait for the test to answer them."""

    def asked(self, kind: str) -> list[tuple[pb.Frame, asyncio.Future]]:
        return [(f, fut) for f, fut in self.sent if f.WhichOneof("kind") == kind]


def _service(state=None, **kw) -> ControllerService:
    svc = ControllerService(Controller(lease_timeout=30.0, **kw), state_dir=None if state is None else str(state),
                            clock=FakeClock(), daemon_timeout=0.2)

    async def cannot_tell(host, port):  # (the probe of an away warehouse's address: no answer either way)
        return None

    svc.members.probe = cannot_tell
    svc.start()
    return svc


def _join(svc: ControllerService, port: int = 7000, instance: int = 77) -> tuple[Warehouse, int]:
    peer = Warehouse(f"warehouse:{port}")
    reg = pb.RegisterWarehouse(host="10.0.0.9", port=port, capacity=1 << 30, instance=instance)
    return peer, svc.register(peer, reg).id


def _commit(wid: int, block: int, indexes, put_id: int, partition: str = "p", **kw) -> pb.CommitRequest:
    return pb.CommitRequest(partition=partition, columns=["x"], indexes=list(indexes), warehouse=wid, block=block,
                            nbytes=8 * len(indexes), put_id=put_id, **kw)


def _records(state) -> list[list]:
    return [rec for path in sorted(state.glob("journal-*.log")) for rec, _ in read(path)]


def _get(svc: ControllerService, peer: FakePeer, count: int, **kw) -> pb.Frame:
    frame = pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer="c", columns=["x"], count=count, **kw))
    svc.acquire(peer, frame)
    return frame


def _on_a_dock(test):
    """A test as a coroutine taking a controller with a state dir in tmp_path/state and one warehouse joined
    (its link, its id), run on a loop (the controller shut down after)."""
    def run(tmp_path) -> None:
        async def main() -> None:
            svc = _service(tmp_path / "state")
            try:
                await test(svc, *_join(svc), tmp_path / "state")
            finally:
                svc.shutdown()

        asyncio.run(main())

    run.__name__, run.__doc__ = test.__name__, test.__doc__
    return run


def _restarted(state) -> Controller:
    svc = _service(state)
    svc.shutdown()
    return svc.core


def _registry(core: Controller) -> tuple[int, list[tuple]]:
    return core.blocks.next_id, sorted((b.id, b.partition, b.owner, b.start, b.count)
                                       for b in core.blocks.by_id.values())


def test_a_grant_reserves_the_block_in_one_record_and_refusals_say_why(tmp_path):
    async def main():
        svc = _service(tmp_path / "state", max_samples=40)
        peer, wid = _join(svc)
        first = svc.block(peer, pb.BlockRequest(partition="p", count=8, group_size=2))
        second = svc.block(peer, pb.BlockRequest(partition="p", count=4, group_size=2))
        assert (first.block, first.start, first.count, second.block, second.start) == (1, 0, 8, 2, 8)
        part = svc.core.partitions["p"]
        assert part.size == 12 and not part.ready[:12].any() and part.group_size == 2
        assert [r for r in _records(tmp_path / "state") if r[0] == "N"] == [
            ["N", 1, "p", wid, 0, 8, 2], ["N", 2, "p", wid, 8, 4, 2]]
        for bad in (pb.BlockRequest(partition="p", count=0, group_size=2),
                    pb.BlockRequest(partition="p", count=5, group_size=2),
                    pb.BlockRequest(partition="p", count=8, group_size=4)):  # (p holds groups of 2)
            with pytest.raises(DockValueError):
                svc.block(peer, bad)
        with pytest.raises(DockValueError, match="joined"):  # (not a member's link)
            svc.block(Warehouse("stranger"), pb.BlockRequest(partition="p", count=2, group_size=2))
        full = svc.block(peer, pb.BlockRequest(partition="p", count=30, group_size=2))
        assert full.block == 0 and "max-samples" in full.why
        svc.partition(pb.PartitionRequest(partition="paced", create=pb.CreatePartition(max_pending=4)))
        assert "max_pending" in svc.block(peer, pb.BlockRequest(partition="paced", count=2)).why
        svc.partition(pb.PartitionRequest(partition="done", seal=True))
        assert "sealed" in svc.block(peer, pb.BlockRequest(partition="done", count=2)).why
        assert svc.core.partitions["p"].size == 12 and svc.core.blocks.next_id == 3  # (refusals granted nothing)
        svc.shutdown()

        plain = _service()  # (no state dir: a block would not outlive a restart)
        peer, _ = _join(plain)
        reply = plain.block(peer, pb.BlockRequest(partition="p", count=2))
        assert reply.block == 0 and "state dir" in reply.why and "p" not in plain.core.partitions
        assert not plain.register(Warehouse(), pb.RegisterWarehouse(host="h", port=1, instance=5)).blocks
        plain.shutdown()
        copies = ControllerService(Controller(), state_dir=str(tmp_path / "copies"), clock=FakeClock(), replicas=2)
        copies.start()
        peer, _ = _join(copies)
        assert "--replicas 2" in copies.block(peer, pb.BlockRequest(partition="p", count=2)).why
        copies.shutdown()

    asyncio.run(main())


@_on_a_dock
async def test_a_block_commit_writes_columns_tags_and_token_and_a_waiting_get_takes_them(svc, peer, wid, state):
    assert svc.register(Warehouse(), pb.RegisterWarehouse(host="10.0.0.9", port=7001, instance=5)).blocks
    svc.block(peer, pb.BlockRequest(partition="p", count=4))
    reader = FakePeer("trainer", b"session-t")
    get = _get(svc, reader, 2, timeout=30.0)
    assert not reader.replies  # (reserved samples are not ready)
    res = svc.commit(_commit(wid, 1, [0, 1], put_id=1, token=9, tags=[pb.Tag(name="age", values=[3, 4])]))
    assert res.listed() == [0, 1] and not res.cleared
    (frame, out), = reader.replies
    assert frame is get and list(out.acquire_reply.indexes) == [0, 1]
    part = svc.core.partitions["p"]
    assert part.tag("age")[:2].tolist() == [3, 4] and svc.core.catalog.tokens.get(9)[0] == "p"
    assert svc.commit(_commit(wid, 1, [0, 1], put_id=1, token=9)).listed() == [0, 1]  # (re-sent: answered)
    assert [r[0] for r in _records(state)].count("C") == 1


@_on_a_dock
async def test_block_commits_whose_samples_are_gone_are_answered_cleared_and_record_nothing(svc, peer, wid, state):
    other, oid = _join(svc, port=7001, instance=78)
    svc.block(peer, pb.BlockRequest(partition="p", count=8))
    assert svc.commit(_commit(wid, 99, [0], put_id=1)).cleared  # (an unknown block: dropped)
    svc.partition(pb.PartitionRequest(partition="p", delete=pb.DeleteSamples(indexes=[2])))
    out = pb.CommitReply()
    svc.commit_reply(_commit(wid, 1, [2, 3], 2), svc.commit(_commit(wid, 1, [2, 3], put_id=2)), out)
    assert out.cleared and not out.indexes
    part = svc.core.partitions["p"]
    assert part.gone[:4].tolist() == [False, False, True, True] and not part.ready[:4].any()
    # the writer re-sent its put to another warehouse, which committed it first (after its commit)
    first = svc.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=1, warehouse=oid, token=55))
    assert svc.commit(_commit(wid, 1, [4], put_id=3, token=55)).cleared
    assert part.gone[4] and svc.core.catalog.tokens.get(55)[2] == range(first.listed()[0], first.listed()[0] + 1)
    for bad, why in ((_commit(oid, 1, [5], put_id=4), "granted to warehouse"),
                     (_commit(wid, 1, [9], put_id=5), "outside block"),
                     (_commit(wid, 1, [5], put_id=6, partition="q"), "of partition")):
        with pytest.raises(DockValueError, match=why):
            svc.commit(bad)
    assert not part.ready[5:8].any() and not part.gone[5:8].any()
    await svc.clear(pb.ClearRequest(partition="p"))
    assert not svc.core.blocks.by_id and svc.commit(_commit(wid, 1, [5], put_id=7)).cleared
    kinds = [r[0] for r in _records(state)]
    assert kinds.count("C") == 1 and kinds.count("D") == 3, kinds  # (the other's put; the delete, two clears)


@_on_a_dock
async def test_block_commits_of_a_batch_go_in_one_run_beside_a_cleared_one(svc, peer, wid, state):
    svc.block(peer, pb.BlockRequest(partition="p", count=8))
    reply = svc.commit_batch(pb.CommitBatch(commits=[
        _commit(wid, 1, [0, 1], 1, token=1), _commit(wid, 1, [2], 2, token=2), _commit(wid, 1, [3], 3),
        _commit(wid, 7, [4], 4)]))  # (its block is unknown)
    assert [list(r.indexes) for r in reply.results] == [[0, 1], [2], [3], []]
    assert [r.cleared for r in reply.results] == [False, False, False, True]
    assert [r[0] for r in _records(state)].count("I") == 1
    assert svc.core.partitions["p"].ready[:5].astype(bool).tolist() == [True] * 4 + [False]
    svc.partition(pb.PartitionRequest(partition="p", delete=pb.DeleteSamples(indexes=[6])))
    reply = svc.commit_batch(pb.CommitBatch(commits=[_commit(wid, 1, [5], 5), _commit(wid, 1, [6], 6)]))
    assert [(list(r.indexes), r.cleared) for r in reply.results] == [([5], False), ([], True)]  # (each alone)
    kinds = [r[0] for r in _records(state)]
    assert kinds[-2:] == ["D", "C"] and kinds.count("I") == 1  # (the run's record refused: cut off again)


@_on_a_dock
async def test_a_block_written_to_its_end_is_dropped_and_one_with_a_hole_is_kept(svc, peer, wid, state):
    """A stream that is never sealed must not grow the registry by a block per 16 puts for ever."""
    svc.block(peer, pb.BlockRequest(partition="p", count=4))
    svc.block(peer, pb.BlockRequest(partition="p", count=4))
    svc.commit_batch(pb.CommitBatch(commits=[_commit(wid, 1, [0, 1], 1), _commit(wid, 1, [2, 3], 2),
                                             _commit(wid, 2, [4], 3), _commit(wid, 2, [7], 4)]))  # (5, 6: a hole)
    assert sorted(svc.core.blocks.by_id) == [2]  # (block 1 written in full: dropped; block 2 kept, its hole too)
    part = svc.core.partitions["p"]
    assert part.ready[[0, 1, 2, 3, 4, 7]].all() and not part.ready[5:7].any() and not part.gone.any()
    again = svc.commit_batch(pb.CommitBatch(commits=[_commit(wid, 1, [2, 3], 9)]))  # (a re-send, its put id new)
    assert list(again.results[0].indexes) == [2, 3] and not again.results[0].cleared  # (answered as applied)
    assert part.ready[:4].all() and not part.gone[:4].any()
    svc.commit_batch(pb.CommitBatch(commits=[_commit(wid, 2, [5], 10)]))
    kinds = [r[0] for r in _records(state)]
    assert kinds[-2] == "H" and [r for r in _records(state) if r[0] == "H"] == [["H", [1]]]  # (with the next write)
    svc.shutdown()
    assert _registry(_restarted(state)) == (3, [(2, "p", wid, 4, 4)])  # (the drop replayed)


@_on_a_dock
async def test_a_seal_takes_the_blocks_back_deletes_their_rest_and_a_get_ends_drained(svc, peer, wid, state):
    other, oid = _join(svc, port=7001, instance=78)
    svc.block(peer, pb.BlockRequest(partition="p", count=4))
    svc.block(other, pb.BlockRequest(partition="p", count=4))
    svc.commit(_commit(wid, 1, [0], put_id=1))
    with pytest.raises(DockValueError, match="blocks of indexes open"):  # (not without the handshake)
        svc.partition(pb.PartitionRequest(partition="p", seal=True))
    sealing = asyncio.ensure_future(svc.seal(pb.PartitionRequest(partition="p", seal=True)))
    again = asyncio.ensure_future(svc.seal(pb.PartitionRequest(partition="p", seal=True)))
    await asyncio.sleep(0)
    (ask, fut), = peer.asked("return_blocks")
    assert ask.return_blocks.partition == "p" and len(other.asked("return_blocks")) == 1
    assert "being sealed" in svc.block(peer, pb.BlockRequest(partition="p", count=2)).why
    svc.commit(_commit(wid, 1, [1], put_id=2))  # (the owner flushes its commits before it answers)
    fut.set_result((pb.Frame(return_blocks_reply=pb.ReturnBlocksReply(blocks=[1])), None))
    other.asked("return_blocks")[0][1].set_result((pb.Frame(return_blocks_reply=pb.ReturnBlocksReply(blocks=[2])),
                                                   None))
    await sealing
    await again  # (waited for the first: nothing left to take back)
    part = svc.core.partitions["p"]
    assert part.sealed and not svc.core.blocks.by_id
    assert part.gone[:8].tolist() == [False, False] + [True] * 6
    reader = FakePeer("trainer", b"session-t")
    got = _get(svc, reader, 8, allow_partial=True, timeout=0)
    lease = reader.replies[0][1].acquire_reply
    assert list(lease.indexes) == [0, 1] and reader.replies[0][0] is got
    svc.confirm(reader, pb.ConfirmRequest(leases=[lease.lease]))  # (the written ones taken)
    with pytest.raises(DockDrained):
        _get(svc, reader, 1, timeout=0)
    assert len(peer.asked("return_blocks")) == 1  # (the second seal asked nothing)


@_on_a_dock
async def test_a_seal_whose_owner_does_not_answer_fails_naming_it_and_grants_go_on(svc, peer, wid, state):
    svc.block(peer, pb.BlockRequest(partition="p", count=4))
    with pytest.raises(DockConnectionError, match=rf"warehouse {wid} at 10\.0\.0\.9:7000 holds block\(s\) \[1\]"
                                                  r".*did not answer.*restart it"):
        await svc.seal(pb.PartitionRequest(partition="p", seal=True))
    part = svc.core.partitions["p"]
    assert not part.sealed and not part.gone[:4].any() and 1 in svc.core.blocks.by_id
    assert svc.block(peer, pb.BlockRequest(partition="p", count=4)).block == 2  # (the sealing mark is lifted)
    svc.on_lost(peer)  # (away: a seal fails at once, naming it)
    with pytest.raises(DockConnectionError, match="rejoining, not connected"):
        await svc.seal(pb.PartitionRequest(partition="p", seal=True))


@_on_a_dock
async def test_an_owner_that_leaves_or_rejoins_without_them_has_its_blocks_dropped(svc, peer, wid, state):
    other, oid = _join(svc, port=7001, instance=78)
    for p in (peer, peer, other):
        svc.block(p, pb.BlockRequest(partition="p", count=4))
    svc.commit(_commit(wid, 1, [0], put_id=1))
    svc.on_lost(peer)
    back = Warehouse("warehouse again")  # (names block 2 only; its pending commit of block 1 goes first)
    reply = svc.register(back, pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=77,
                                                    rejoin=True, id=wid, blocks=[2],
                                                    pending=[_commit(wid, 1, [1], put_id=2)]))
    assert list(reply.pending[0].indexes) == [1] and reply.blocks
    part = svc.core.partitions["p"]
    assert sorted(svc.core.blocks.by_id) == [2, 3]
    assert part.gone[:4].tolist() == [False, False, True, True] and not part.gone[4:12].any()
    svc.leave(other, pb.LeaveRequest(id=oid))
    assert sorted(svc.core.blocks.by_id) == [2] and part.gone[8:12].all()
    assert [r for r in _records(state) if r[0] == "H"] == [["H", [1]], ["H", [3]]]


def test_replay_and_snapshots_restore_the_registry_and_a_block_commit_is_recalled(tmp_path):
    state = tmp_path / "state"

    async def main():
        svc = _service(state)
        peer, wid = _join(svc)
        for _ in range(3):
            svc.block(peer, pb.BlockRequest(partition="p", count=4))
        svc.commit(_commit(wid, 3, [8, 9], put_id=5))  # (its owner moved past blocks 1 and 2: dropped, holes)
        assert _registry(svc.core) == (4, [(3, "p", wid, 8, 4)])
        svc.on_lost(peer)
        svc.register(Warehouse(), pb.RegisterWarehouse(host="10.0.0.9", port=7000, instance=77, rejoin=True, id=wid,
                                                       blocks=[1, 3]))
        want = _registry(svc.core)
        assert want == (4, [(3, "p", wid, 8, 4)])
        svc.shutdown()
        for _ in range(2):  # replayed from the journal, then from the snapshot the replay left
            core = _restarted(state)
            assert _registry(core) == want and core.partitions["p"].gone[0:8].all()
            assert core.catalog.recall(wid, 5).tolist() == [8, 9]
        svc = _service(state)  # a restart, then the owner rejoins re-sending the commit its answer missed
        svc.register(Warehouse(), pb.RegisterWarehouse(host="10.0.0.9", port=7000, instance=77, rejoin=True, id=wid,
                                                       blocks=[1]))  # (block 3 dropped: its rest deleted)
        assert svc.commit(_commit(wid, 3, [8, 9], put_id=5)).listed() == [8, 9]  # (recalled, not cleared)
        nxt = svc.block(svc.members.get(wid).peer, pb.BlockRequest(partition="p", count=4))
        assert nxt.block == 4 and nxt.start == 12  # (ids and indexes never handed out twice)
        svc.shutdown()
        snap = Controller().snapshot(0.0)
        del snap["blocks"]  # (a snapshot from before blocks)
        assert _registry(Controller.restore(snap, wall_offset=0.0)) == (1, [])

    asyncio.run(main())


def test_the_rest_of_a_dropped_block_is_what_no_column_was_written_for():
    core = Controller()
    block = core.grant_block("p", 1, 6, 2)
    core.commit("p", ["x"], warehouse=1, indexes=[0, 1])
    core.delete("p", [4])
    dropped, deleted = core.drop_blocks([block.id, 99])
    assert [b.id for b in dropped] == [block.id] and deleted == 3
    assert core.partitions["p"].gone[:6].tolist() == [False, False, True, True, True, True]
    assert np.count_nonzero(core.partitions["p"].ready[:6]) == 2


@_on_a_dock
async def test_an_owner_restarted_as_a_new_process_at_its_address_has_its_blocks_dropped(svc, peer, wid, state):
    svc.block(peer, pb.BlockRequest(partition="p", count=4))
    svc.commit(_commit(wid, 1, [0], put_id=1))

    async def the_new_one_answers(host, port):
        return 99

    svc.members.probe = the_new_one_answers
    svc.on_lost(peer)
    restarted = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=99)
    with pytest.raises(DockTimeout):  # (while the controller asks who answers at the address)
        svc.register(Warehouse("restarted"), restarted)
    for _ in range(3):
        await asyncio.sleep(0)
    new = svc.register(Warehouse("restarted"), restarted).id
    assert svc.members.get(wid).state == "lost" and new != wid and not svc.core.blocks.by_id
    part = svc.core.partitions["p"]
    assert part.gone[:4].tolist() == [False, True, True, True]  # (the written one is lost, not deleted)
    assert svc.commit(_commit(new, 1, [1], put_id=1)).cleared  # (its block is gone)


def test_holds_is_where_owned_gives_the_block():
    """`Blocks.holds` (a block commit may go into a run) is true exactly where `owned` returns the block."""
    cat = Controller(lease_timeout=30.0).catalog
    reg = blocks.Blocks()
    b = blocks.grant(cat, reg, "p", owner=3, count=4, group_size=1)
    blocks.grant(cat, reg, "q", owner=3, count=4, group_size=1)
    for block_id in (b.id, b.id + 1, 99):
        for wid in (3, 4):
            for partition in ("p", "q"):
                for indexes in ([], [b.start], [b.start, b.stop - 1], [b.stop - 1, b.stop], [b.start - 1]):
                    try:
                        got = blocks.owned(reg, block_id, wid, partition, indexes) is not None
                    except DockValueError:
                        got = False
                    assert reg.holds(block_id, wid, partition, indexes) is got, (block_id, wid, partition, indexes)


@_on_a_dock
async def test_a_block_commit_sent_again_after_it_was_applied_is_answered_again_and_deletes_nothing(svc, peer, wid,
                                                                                                    state):
    """A warehouse restarted on its data dir sends again the block commits it has no answer recorded for:
    one applied long ago (its put id forgotten: another one now) whose samples were partly consumed and
    deleted since, its block dropped or not, is AGAIN and deletes none of the rest; all its samples gone:
    cleared, nothing deleted. One never applied whose block was dropped is cleared, as before."""
    svc.block(peer, pb.BlockRequest(partition="p", count=8))
    assert svc.commit(_commit(wid, 1, [0, 1, 2], put_id=1)).listed() == [0, 1, 2]
    assert svc.commit(_commit(wid, 1, [3, 4], put_id=2)).listed() == [3, 4]
    svc.partition(pb.PartitionRequest(partition="p", delete=pb.DeleteSamples(indexes=[0])))  # (consumed)
    part = svc.core.partitions["p"]
    again = svc.commit(_commit(wid, 1, [0, 1, 2], put_id=101))  # (block there, a sample of it gone)
    assert not again.cleared and again.listed() == [0, 1, 2]
    assert part.gone[:5].tolist() == [True, False, False, False, False]
    svc.on_lost(peer)
    held = pb.InventoryPartition(name="p", group_size=1, nbytes=32, columns=[pb.InventoryColumn(name="x", runs=[1, 5])])
    svc.register(Warehouse("warehouse again"), pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30,
                                                                     instance=77, rejoin=True, id=wid, inventory=[held]))
    assert not svc.core.blocks.by_id and part.gone[:8].tolist() == [True] + [False] * 4 + [True] * 3
    for idx, put_id in (([0, 1, 2], 102), ([3, 4], 103)):  # (block dropped)
        res = svc.commit(_commit(wid, 1, idx, put_id=put_id))
        assert not res.cleared and res.listed() == idx
    assert svc.commit(_commit(wid, 1, [5], put_id=104)).cleared  # (never applied: its sample went with its block)
    svc.partition(pb.PartitionRequest(partition="p", delete=pb.DeleteSamples(indexes=[1, 2])))
    assert svc.commit(_commit(wid, 1, [0, 1, 2], put_id=105)).cleared  # (all gone)
    assert part.gone[:5].tolist() == [True, True, True, False, False]
    assert (part.ready[3:5] != 0).all()
    assert [r[0] for r in _records(state)].count("C") == 2  # (only the first two commits recorded)


@_on_a_dock
async def test_a_block_commit_sent_again_with_its_block_open_and_nothing_deleted_is_answered_again(svc, peer, wid,
                                                                                                  state):
    """A re-send of an applied commit whose put id and token are forgotten (its `committed` record lost:
    a power cut, a full disk), its block still open and nothing of the partition deleted, is AGAIN: it
    failed as "already written" and the warehouse freed the values the controller has on it. A commit
    only some of whose samples are written fails as before."""
    svc.block(peer, pb.BlockRequest(partition="p", count=8))
    assert svc.commit(_commit(wid, 1, [0, 1, 2], put_id=1)).listed() == [0, 1, 2]
    again = svc.commit(_commit(wid, 1, [0, 1, 2], put_id=101))
    assert not again.cleared and again.listed() == [0, 1, 2]
    assert svc.commit(_commit(wid, 1, [3, 4], put_id=2)).listed() == [3, 4]  # (the block serves on)
    with pytest.raises(DockValueError, match="already written"):
        svc.commit(_commit(wid, 1, [2, 5], put_id=3))
    assert [r[0] for r in _records(state)].count("C") == 2
    assert not svc.core.partitions["p"].gone[:6].any()


@_on_a_dock
async def test_a_block_commit_applies_after_its_block_went_when_a_column_was_written_to_its_samples_since(
        svc, peer, wid, state):
    """--commit-window: a put is answered before its commit, and its writer may write another column of its samples
    by explicit index at once. Each sample of the block then has a column written, so the block goes (written in
    full) before the put's own commit comes: that commit applies, where answering it cleared made the warehouse
    free an acknowledged put."""
    svc.block(peer, pb.BlockRequest(partition="p", count=2))
    svc.commit(pb.CommitRequest(partition="p", columns=["r"], indexes=[1], warehouse=wid, nbytes=8, put_id=1))
    svc.commit_batch(pb.CommitBatch(commits=[_commit(wid, 1, [0], 2)]))
    assert not svc.core.blocks.by_id  # (written in full, as far as the controller can tell)
    reply = svc.commit_batch(pb.CommitBatch(commits=[_commit(wid, 1, [1], 3)]))
    assert list(reply.results[0].indexes) == [1] and not reply.results[0].cleared
    part = svc.core.partitions["p"]
    assert part.ready[1] >> part.columns["x"] & 1 and part.ready[1] >> part.columns["r"] & 1 and not part.gone[1]
    assert not svc.commit(_commit(wid, 1, [1], put_id=4)).cleared  # (alone, a re-send: answered as applied)
