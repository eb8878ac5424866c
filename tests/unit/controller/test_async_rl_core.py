"""Asynchronous RL in the pure controller: policy versions and bounded staleness, the pending count
that paces puts, listings that take nothing, and their journal records."""

from __future__ import annotations

import numpy as np
import pytest

from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.errors import DockNotFound, DockValueError


def _put(c: Controller, n: int, version: int | None = None, partition: str = "p"):
    tags = {"version": [version]} if version is not None else None
    return c.commit(partition, ["x"], warehouse=1, new_count=n, tags=tags).tolist()


def test_staleness_hands_out_oldest_version_first_and_never_a_staler_one():
    c = Controller(lease_timeout=60)
    c.create_partition("p", max_staleness=1)
    _put(c, 2, 0)
    _put(c, 2, 3)
    _put(c, 2, 2)
    c.set_version("p", 3)
    got = c.acquire("p", "t", ["x"], 4, allow_partial=True)
    assert got.indexes.tolist() == [4, 5, 2, 3]  # version 2, then 3; version 0 is too stale
    assert c.acquire("p", "t", ["x"], 1, allow_partial=True) is None
    st = c.stats()[0]
    assert (st["stale"], st["version"], st["max_staleness"]) == (2, 3, 1)
    # a get's own bound overrides the partition's
    assert c.acquire("p", "t", ["x"], 2, max_staleness=3).indexes.tolist() == [0, 1]


def test_samples_without_a_version_count_as_version_0():
    c = Controller(lease_timeout=60)
    c.create_partition("p", max_staleness=0)
    _put(c, 2)
    assert c.acquire("p", "a", ["x"], 2).indexes.tolist() == [0, 1]
    c.set_version("p", 1)
    assert c.acquire("p", "b", ["x"], 1, allow_partial=True) is None
    assert c.stats()[0]["tags"] == []  # (no version tag was made for them)


def test_retire_stale_deletes_what_set_version_makes_stale_and_counts_it():
    c = Controller(lease_timeout=60)
    c.create_partition("p", max_staleness=1, retire_stale=True, retire=["t"])
    _put(c, 3, 0)
    _put(c, 3, 1)
    c.confirm(c.acquire("p", "t", ["x"], 1).lease)  # sample 0 taken: retired as consumed, not as stale
    assert c.set_version("p", 2) == 2
    st = c.stats()[0]
    assert (st["deleted"], st["stale_retired"], st["stale"], st["pending"]) == (3, 2, 0, 3)
    assert sorted(np.concatenate(list(c.take_frees()["p"].values())).tolist()) == [0, 1, 2]


def test_pending_counts_what_its_consumers_have_not_taken():
    c = Controller(lease_timeout=60)
    c.create_partition("p", max_pending=4)
    assert not c.must_wait("p", 4)
    _put(c, 4)
    assert c.must_wait("p", 1) and not c.must_wait("p", 0)  # (columns of existing samples never wait)
    lease = c.acquire("p", "a", ["x"], 2)  # every consumer that asked: a
    assert c.stats()[0]["pending"] == 2 and not c.must_wait("p", 1)
    c.acquire("p", "b", ["x"], 1)  # b asked too: a sample counts until both had it
    assert c.stats()[0]["pending"] == 3
    c.release(lease.lease)  # back to the pool: pending again
    assert c.stats()[0]["pending"] == 4
    cons = c.stats()[0]["consumers"]
    assert (cons["a"]["pending"], cons["b"]["pending"]) == (4, 3)
    # with retire_when_consumed_by, only the named consumers count (one that never asked: all pending)
    c.create_partition("p", max_pending=4, retire=["a", "c"])
    assert c.stats()[0]["pending"] == 4
    with pytest.raises(DockValueError):
        c.create_partition("p", retire_stale=True)


def test_list_takes_nothing_and_filters():
    c = Controller(lease_timeout=60)
    c.commit("p", ["x"], warehouse=1, new_count=4, tags={"version": [0, 1, 2, 3], "age": [5]})
    c.reserve("p", 2)  # no column yet: not listed
    c.delete("p", [1])
    idx, tags = c.list_samples("p")
    assert idx.tolist() == [0, 2, 3] and tags["version"].tolist() == [0, 2, 3] and tags["age"].tolist() == [5] * 3
    c.acquire("p", "t", ["x"], 1)
    assert c.list_samples("p", consumer="t")[0].tolist() == [2, 3]
    assert c.list_samples("p", where={"version": (3, 9)})[0].tolist() == [3]
    assert c.list_samples("p", limit=1, start=1)[0].tolist() == [2]
    assert c.acquire("p", "t", ["x"], 2).indexes.tolist() == [2, 3]  # listing took nothing
    with pytest.raises(DockNotFound):
        c.list_samples("nope")
    with pytest.raises(DockNotFound):
        c.set_version("nope", 1)


def test_versions_options_and_retired_counts_survive_the_journal_and_a_snapshot(tmp_path):
    j = Journal(tmp_path)
    core, _ = j.load(lease_timeout=60, now=0.0)
    j.create("p", 1, [], 1, True, 8)
    core.create_partition("p", max_staleness=1, retire_stale=True, max_pending=8)
    j.commit("p", ["x"], 1, None, 4, 1, 0, 0, {"version": [0, 0, 2, 2]})
    core.commit("p", ["x"], warehouse=1, new_count=4, tags={"version": [0, 0, 2, 2]})
    j.set_version("p", 2)
    core.set_version("p", 2)
    j.close()
    want = {k: core.stats()[0][k] for k in ("version", "max_staleness", "retire_stale", "max_pending",
                                            "stale_retired", "deleted", "pending")}
    assert want["stale_retired"] == 2
    again, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)  # replayed, then compacted into a snapshot
    assert {k: again.stats()[0][k] for k in want} == want
    third, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)  # from that snapshot
    assert {k: third.stats()[0][k] for k in want} == want
