"""Replica records on the controller (`--replicas 2`), without sockets: where a put's copy goes, the
copy's commit, promotion of a lost warehouse's values to their replicas, repairs, deletes freeing
both copies, rejoins, the journal and snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from dockd.controller import replica_map as replicas
from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.controller.partition import NO_WAREHOUSE, PENDING_WAREHOUSE
from dockd.controller.warehouses import DURABLE_REJOIN, Inventory
from dockd.errors import DockDataLost, DockNotFound, DockValueError


def _dock() -> Controller:
    """Partition p: samples 0-3 on warehouse 0 (replicas on 1), 4-7 on warehouse 1 (replicas on 2)."""
    c = Controller()
    c.commit("p", ["x", "y"], warehouse=0, new_count=4, nbytes=40)
    c.commit("p", ["x", "y"], warehouse=1, new_count=4, nbytes=40)
    c.commit_replica("p", ["x", "y"], warehouse=1, indexes=[0, 1, 2, 3], nbytes=40, put_id=7)
    c.commit_replica("p", ["x", "y"], warehouse=2, indexes=[4, 5, 6, 7], nbytes=40)
    return c


def test_the_copy_goes_to_the_next_joined_warehouse_in_id_order():
    assert replicas.target([0, 1, 2], 0) == 1
    assert replicas.target([0, 1, 2], 2) == 0
    assert replicas.target([0, 3, 5], 3) == 5
    assert replicas.target([4], 4) is None and replicas.target([], 0) is None


def test_a_replica_commit_is_recorded_once_and_counted():
    c = _dock()
    part = c.partitions["p"]
    assert part.rloc["x"][:8].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert replicas.counts(part) == (16, 0)
    assert part.nbytes == {0: 40, 1: 80, 2: 40}
    # re-sent with its put_id: answered again, not applied twice
    again = c.commit_replica("p", ["x", "y"], warehouse=1, indexes=[0, 1, 2, 3], nbytes=40, put_id=7)
    assert again.tolist() == [0, 1, 2, 3] and part.nbytes[1] == 80


def test_replica_commits_that_do_not_describe_a_copy_are_refused():
    c = _dock()
    c.commit("p", ["z"], warehouse=0, indexes=[0])
    with pytest.raises(DockNotFound, match="not written"):
        c.commit_replica("p", ["z"], warehouse=1, indexes=[1])
    with pytest.raises(DockValueError, match="holds column 'x' of some of these samples already"):
        c.commit_replica("p", ["x"], warehouse=0, indexes=[3, 4])
    with pytest.raises(DockValueError, match="already has its replica on warehouse 1"):
        c.commit_replica("p", ["x"], warehouse=2, indexes=[0])
    with pytest.raises(DockNotFound, match="do not exist"):
        c.commit_replica("p", ["x"], warehouse=1, indexes=[99])
    with pytest.raises(DockNotFound, match="does not exist"):
        c.commit_replica("q", ["x"], warehouse=1, indexes=[0])


def test_a_lost_warehouse_s_values_move_to_their_replicas_and_nothing_is_lost():
    c = _dock()
    assert c.warehouse_lost(1) == {}  # samples 4-7 now live on warehouse 2 (none left unwritten)
    part = c.partitions["p"]
    assert part.loc["x"][:8].tolist() == [0, 0, 0, 0, 2, 2, 2, 2]
    # the replicas warehouse 1 held (of 0-3) are gone; 4-7 are home on 2 without a replica now
    assert part.rloc["x"][:8].tolist() == [NO_WAREHOUSE] * 8
    assert replicas.counts(part) == (0, 16)
    lease = c.acquire("p", "train", ["x", "y"], 8)
    assert sorted(lease.indexes.tolist()) == list(range(8))
    assert c.locate("p", list(range(8)), ["x"]).tolist() == [[0, 0, 0, 0, 2, 2, 2, 2]]
    # each is repaired from its home
    miss = replicas.missing(part, c.dead_warehouses, {0, 2})
    assert {k: v.tolist() for k, v in miss.items()} == {
        (0, "x"): [0, 1, 2, 3], (0, "y"): [0, 1, 2, 3], (2, "x"): [4, 5, 6, 7], (2, "y"): [4, 5, 6, 7]}


def test_values_without_a_live_replica_are_lost_as_before():
    c = _dock()
    c.warehouse_lost(2)  # 4-7's replicas
    c.warehouse_lost(1)  # 4-7's home: nowhere left
    with pytest.raises(DockDataLost) as e:
        c.acquire("p", "train", ["x"], 8)
    assert sorted(e.value.indexes) == [4, 5, 6, 7]


def test_a_pending_copy_is_neither_a_replica_nor_repaired_until_it_is_given_up():
    c = Controller()
    c.commit("p", ["x"], warehouse=0, new_count=4)
    part = c.partitions["p"]
    idx = np.arange(4)
    replicas.mark_pending(part, ["x"], idx)
    assert part.rloc["x"][:4].tolist() == [PENDING_WAREHOUSE] * 4
    assert replicas.missing(part, set(), {0, 1}) == {} and replicas.counts(part) == (0, 0)  # (on its way: not under-replicated)
    # a copy on its way is no replica: the put was not answered yet, its values are unwritten again
    assert c.warehouse_lost(0)["p"]["x"].tolist() == [0, 1, 2, 3] and part.ready[:4].tolist() == [0] * 4
    c2 = Controller()
    c2.commit("p", ["x"], warehouse=0, new_count=4)
    replicas.mark_pending(c2.partitions["p"], ["x"], idx)
    replicas.unmark(c2.partitions["p"], ["x"], idx)
    assert replicas.missing(c2.partitions["p"], set(), {0, 1})[(0, "x")].tolist() == [0, 1, 2, 3]


def test_deletes_free_both_copies():
    c = _dock()
    c.delete("p", [0, 5])
    frees = {w: ix.tolist() for w, ix in c.take_frees()["p"].items()}
    assert frees == {0: [0], 1: [0, 5], 2: [5]}


def test_a_rejoining_warehouse_without_some_replicas_gets_them_made_again():
    c = _dock()
    held = {"p": Inventory(1, 80, {"x": np.arange(8), "y": np.array([4, 5, 6, 7])})}  # lacks y's replicas of 0-3
    c.rejoin(1, held, known=DURABLE_REJOIN)
    part = c.partitions["p"]
    assert part.rloc["x"][:4].tolist() == [1] * 4 and part.rloc["y"][:4].tolist() == [NO_WAREHOUSE] * 4
    assert part.loc["y"][:8].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_replicas_survive_the_journal_and_a_snapshot_but_not_a_copy_on_its_way(tmp_path):
    j = Journal(tmp_path)
    core, _ = j.load(lease_timeout=60, now=0.0)
    idx = core.commit("p", ["x"], warehouse=0, new_count=4)
    j.commit("p", ["x"], 0, None, 4, 1, 0, 0)
    core.commit_replica("p", ["x"], warehouse=1, indexes=idx[:2], nbytes=8, put_id=3)
    j.replica("p", ["x"], 1, idx[:2], 8, 3)
    replicas.mark_pending(core.partitions["p"], ["x"], idx[2:])
    j.lost(1)
    j.sync()
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    part = back.partitions["p"]
    assert part.rloc["x"][:4].tolist() == [NO_WAREHOUSE] * 4  # warehouse 1 was lost after the copy
    core.partitions["p"].loc["x"][:2] = 0  # (compare the snapshot path too)
    snap = Controller.restore(core.snapshot(0.0), wall_offset=0.0)
    assert snap.partitions["p"].rloc["x"][:4].tolist() == [1, 1, NO_WAREHOUSE, NO_WAREHOUSE]


def test_a_copy_that_failed_is_reported_by_the_home_and_repaired_later():
    c = Controller()
    c.commit("p", ["x"], warehouse=0, new_count=4)
    part = c.partitions["p"]
    replicas.mark_pending(part, ["x"], np.arange(4))
    # the home itself commits the "replica": its copy failed, the values have none (not a pending one)
    assert c.commit_replica("p", ["x"], warehouse=0, indexes=[0, 1, 2, 3]).tolist() == [0, 1, 2, 3]
    assert part.rloc["x"][:4].tolist() == [NO_WAREHOUSE] * 4
    assert replicas.missing(part, set(), {0, 1})[(0, "x")].tolist() == [0, 1, 2, 3]


def test_values_whose_copy_was_on_its_way_when_their_warehouse_died_were_never_acknowledged(tmp_path):
    j = Journal(tmp_path)
    core, _ = j.load(lease_timeout=60, now=0.0)
    core.commit("p", ["x"], warehouse=0, new_count=2, token=11)
    j.commit("p", ["x"], 0, None, 2, 1, 0, 0, None, 11)
    core.commit("p", ["x"], warehouse=0, new_count=2, token=12)
    j.commit("p", ["x"], 0, None, 2, 1, 0, 0, None, 12)
    replicas.mark_pending(core.partitions["p"], ["x"], np.array([2, 3]))  # put 12's copy on its way
    core.commit_replica("p", ["x"], warehouse=1, indexes=[0, 1])
    j.replica("p", ["x"], 1, [0, 1], 0, 0)
    unwritten = core.warehouse_lost(0)
    j.lost(0, unwritten)
    assert {p: {c: ix.tolist() for c, ix in cols.items()} for p, cols in unwritten.items()} == {"p": {"x": [2, 3]}}
    # put 11 is served from its replica; put 12 was never answered: unwritten, not lost
    assert core.acquire("p", "t", ["x"], 4, allow_partial=True).indexes.tolist() == [0, 1]
    assert core.ready_count("p", "u", ["x"]) == 2
    # its writer re-sends it (same token) to warehouse 2: written again at the same indexes
    assert core.catalog.stored("p", 12) is None and core.catalog.stored("p", 11).tolist() == [0, 1]
    again = core.commit("p", ["x"], warehouse=2, new_count=2, token=12)
    j.commit("p", ["x"], 2, None, 2, 1, 0, 0, None, 12)
    assert again.tolist() == [2, 3] and core.partitions["p"].size == 4
    assert core.locate("p", [0, 1, 2, 3], ["x"]).tolist() == [[1, 1, 2, 2]]
    j.sync()
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.locate("p", [0, 1, 2, 3], ["x"]).tolist() == [[1, 1, 2, 2]] and back.partitions["p"].size == 4


def test_a_put_re_sent_elsewhere_after_its_warehouse_died_fills_the_same_samples():
    c = Controller()
    c.commit("p", ["x"], warehouse=0, new_count=3, token=5)
    c.warehouse_lost(0)
    with pytest.raises(DockDataLost):
        c.acquire("p", "t", ["x"], 3)
    # a consumer met them lost; the re-send (same token) at warehouse 1 makes them readable again
    assert c.commit("p", ["x"], warehouse=1, new_count=3, token=5).tolist() == [0, 1, 2]
    assert sorted(c.acquire("p", "t", ["x"], 3).indexes.tolist()) == [0, 1, 2]
    assert c.catalog.stored("p", 5).tolist() == [0, 1, 2]


def test_a_put_re_sent_while_its_warehouse_is_away_moves_its_values_to_the_new_one(tmp_path):
    """Warehouse 0 committed the put but does not answer now (it may never have stored the values):
    a re-send with the same token is not "held elsewhere", warehouse 1 stores the values and holds
    them on record, and warehouse 0 coming back from its data dir without them loses nothing. The
    journal keeps which warehouses were away, so a replay moves the same values."""
    j = Journal(tmp_path)
    c, _ = j.load(lease_timeout=60, now=0.0)
    j.commit("p", ["x"], 0, None, 2, 1, 16, 1, None, 5)
    c.commit("p", ["x"], warehouse=0, new_count=2, nbytes=16, put_id=1, token=5)
    assert c.catalog.stored("p", 5).tolist() == [0, 1]  # warehouse 0 answers: held there
    assert c.catalog.stored("p", 5, away=[0]) is None
    j.commit("p", ["x"], 1, None, 2, 1, 16, 1, None, 5, [0])
    assert c.commit("p", ["x"], warehouse=1, new_count=2, nbytes=16, put_id=1, token=5, away=[0]).tolist() == [0, 1]
    assert c.locate("p", [0, 1], ["x"]).tolist() == [[1, 1]]
    c.rejoin(0, {}, known=DURABLE_REJOIN)  # back from its data dir without them
    assert sorted(c.acquire("p", "t", ["x"], 2).indexes.tolist()) == [0, 1]
    j.sync()
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.locate("p", [0, 1], ["x"]).tolist() == [[1, 1]] and back.partitions["p"].size == 2
