"""The partition calls on a spread partition (--shards NAME=2, dockd.client.spread_calls): each acts on
both shards, on their two controllers, and takes and gives the spread partition's indexes (shard k's
sample i is i * 2 + k)."""

from __future__ import annotations

import pytest
import torch

import dockd
from dockd import owners
from dockd.client.spread import Spread
from dockd.errors import DockNotFound, DockValueError
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

S = 2
NAMES = [f"spread-{i}" for i in range(10)]
"""The cluster's spread partitions, one for each test."""


@pytest.fixture(scope="module")
def cluster():
    with dockd.start_local(num_warehouses=2, controllers=2, shards={name: S for name in NAMES}) as c:
        c.unused = iter(NAMES)
        yield c


@pytest.fixture
def spread(cluster) -> Spread:
    return Spread(next(cluster.unused), S)


@pytest.fixture
def docks(cluster):
    """Two clients, the one at k homed on a warehouse of shard k (ids 0 and 1 are shards 0 and 1: dockd.client.spread.home): its puts go there."""
    with dockd.connect(cluster.address) as first:  # (each controller numbers its own warehouse: ids 0 and 1)
        ids = wait_until(lambda: sorted(first.stats()["warehouses"]) == [0, 1] and [0, 1], what="both warehouses")
    with dockd.connect(cluster.address, warehouse=ids[0]) as d0, dockd.connect(cluster.address, warehouse=ids[1]) as d1:
        yield [d0, d1]


@pytest.fixture
def dock(docks):
    return docks[0]


def put(docks, spread: Spread, k: int, values: list[int], **kw) -> list[int]:
    """Samples with x = `values` put to the spread partition by the client homed on shard k; their indexes."""
    idx = docks[k].put({"x": torch.tensor(values).reshape(-1, 1)}, partition=spread.name, **kw)
    assert {i % S for i in idx} == {k}
    return idx


def fill(docks, spread: Spread, n: int = 3) -> dict[int, int]:
    """n samples put to each shard; spread index -> x."""
    out = {}
    for k in range(S):
        values = [100 + 10 * k + j for j in range(n)]
        out.update(zip(put(docks, spread, k, values), values))
    return out


def test_list_merges_the_shards_by_spread_index_from_start_to_limit(docks, dock, spread):
    with pytest.raises(DockNotFound, match="none of its 2 shards"):
        dock.list(spread.name)
    for k in range(S):  # shard 0's versions 0, 1, 2; shard 1's 10, 11, 12
        put(docks, spread, k, [0, 1, 2], version=None, tags={"version": [10 * k + i for i in range(3)]})
    dock.set_version(spread.shard(1), 7)  # (on one shard: "version" is the newest)
    listed = dock.list(spread.name)
    assert listed["indexes"] == [0, 1, 2, 3, 4, 5]
    assert listed["versions"] == [0, 10, 1, 11, 2, 12]
    assert listed["version"] == 7
    assert dock.list(spread.name, start=3)["indexes"] == [3, 4, 5]
    assert dock.list(spread.name, start=2, limit=3)["indexes"] == [2, 3, 4]
    assert dock.list(spread.name, limit=1)["indexes"] == [0]
    dock.set_tags(spread.name, [5], {"age": 5})  # a tag only shard 1 has: 0 on shard 0's samples
    assert dock.list(spread.name)["tags"]["age"] == [0, 0, 0, 0, 0, 5]
    assert docks[0].get("c", ["x"], 2, partition=spread.name, timeout=10).indexes == [0, 2]  # (its home shard's)
    assert dock.list(spread.name, "c")["indexes"] == [1, 3, 4, 5]
    dock.set_tags(spread.name, [0], {"age": 5})
    assert dock.list(spread.name, where={"age": 5})["indexes"] == [0, 5]


def test_list_since_a_cursor_of_both_shards(docks, dock, spread):
    fill(docks, spread, 2)
    first = dock.list(spread.name, since="")
    assert (first["indexes"], first["full"], first["more"], first["deleted"]) == ([0, 1, 2, 3], True, False, [])
    assert first["cursor"].count("|") == 1
    new = put(docks, spread, 1, [7])  # spread index 5
    dock.delete(spread.name, [2])  # shard 0's 1
    dock.set_tags(spread.name, [1], {"age": 1})  # shard 1's 0
    changed = dock.list(spread.name, since=first["cursor"])
    assert (changed["indexes"], changed["deleted"], changed["full"], changed["more"]) == ([1] + new, [2], False, False)
    assert changed["tags"]["age"] == [1, 0]
    # a limit is shared out among the shards; "more" until each gave all it has
    assert put(docks, spread, 0, [8, 9]) == [4, 6]
    page = dock.list(spread.name, since=changed["cursor"], limit=2)
    assert (page["indexes"], page["more"]) == ([4], True)
    page = dock.list(spread.name, since=page["cursor"], limit=2)
    assert (page["indexes"], page["more"], page["full"]) == ([6], False, False)
    quiet = dock.list(spread.name, since=page["cursor"])
    assert (quiet["indexes"], quiet["deleted"], quiet["full"]) == ([], [], False)
    # one shard cleared: its samples left the view, so the answer is the whole listing (the other shard's
    # asked again from the start)
    dock.clear(spread.shard(0))
    whole = dock.list(spread.name, since=quiet["cursor"])
    assert (whole["indexes"], whole["full"], whole["deleted"]) == ([1, 3, 5], True, [])
    # ... and once it is written again, what it holds comes as changes
    again = put(docks, spread, 0, [1])
    back = dock.list(spread.name, since=whole["cursor"])
    assert (back["indexes"], back["full"]) == (again, False)
    with pytest.raises(DockValueError, match="spread over 2 shards"):
        dock.list(spread.name, since="nope")


def test_delete_and_set_tags_reach_each_samples_shard(docks, dock, spread):
    fill(docks, spread)
    assert dock.delete(spread.name, [1, 2, 5]) == 3  # shard 1's 0 and 2, shard 0's 1
    assert dock.delete(spread.name, [2]) == 0
    assert dock.list(spread.shard(0))["indexes"] == [0, 2]
    assert dock.list(spread.shard(1))["indexes"] == [1]
    dock.set_tags(spread.name, [0, 3, 4], {"age": [10, 13, 14], "round": 2})
    assert dock.list(spread.shard(0))["tags"]["age"] == [10, 14]
    assert dock.list(spread.shard(1))["tags"]["age"] == [13]
    assert dock.list(spread.name)["tags"]["round"] == [2, 2, 2]
    with pytest.raises(DockNotFound, match="do not exist"):
        dock.delete(spread.name, [0, 99])  # (shard 1 has no 49)


def test_read_gives_the_values_in_the_order_asked(docks, dock, spread):
    values = fill(docks, spread)
    for asked in ([5, 0, 3, 2], [4, 0], [1]):  # both shards, shard 0 alone, shard 1 alone
        batch = dock.read(spread.name, asked, ["x"])
        assert (batch.partition, batch.indexes) == (spread.name, asked)
        assert [int(v[0]) for v in batch["x"]] == [values[i] for i in asked]
        assert batch.stacked("x").flatten().tolist() == [values[i] for i in asked]


def test_reserve_comes_from_the_home_shard(docks, spread):
    fill(docks, spread, 2)
    for k, dock in enumerate(docks):
        got = dock.reserve(spread.name, 3)
        assert got == spread.outward(k, [2, 3, 4])
        dock.put({"x": torch.zeros(3, 1)}, partition=spread.name, indexes=got)
        assert dock.read(spread.name, got, ["x"]).indexes == got


def test_versions_and_consumers_on_every_shard(docks, dock, spread):
    dock.create_partition(spread.name, max_staleness=1, retire_stale=True)
    for k in range(S):
        put(docks, spread, k, [0, 1, 2], tags={"version": [0, 1, 2]})
    assert dock.set_version(spread.name, 2) == 2  # version 0 on each shard is too stale
    assert dock.list(spread.name)["indexes"] == [2, 3, 4, 5]
    assert dock.list(spread.name)["version"] == 2
    assert docks[1].get("c", ["x"], 1, partition=spread.name, timeout=10).indexes == [3]  # (shard 1's)
    assert dock.drop_consumer(spread.name, "c") is True
    assert dock.drop_consumer(spread.name, "c") is False
    assert "c" not in dock.stats()["partitions"][spread.shard(1)]["consumers"]


def test_seal_ends_both_shards_and_clear_empties_them(docks, dock, spread):
    written = set(fill(docks, spread, 2))
    dock.seal(spread.name)
    for k in range(S):
        with pytest.raises(DockValueError, match="is sealed"):  # (no new samples on either shard)
            put(docks, spread, k, [0], timeout=5)
    got: list[int] = []
    for _ in range(4):  # what is left, from one shard at a time
        try:
            got += dock.get("c", ["x"], 4, partition=spread.name, timeout=10).indexes
        except dockd.DockDrained:
            break
    else:
        pytest.fail(f"the sealed spread partition was not drained; gets took {got}")
    assert sorted(got) == sorted(written)
    assert dock.stats()["partitions"][spread.name]["sealed"] is True
    assert dock.clear(spread.name) == 4
    parts = dock.stats()["partitions"]
    assert not {spread.name, *spread.shards()} & set(parts)
    with pytest.raises(DockNotFound):
        dock.list(spread.name)


def test_stats_sums_the_shards_under_the_spread_name(docks, dock, spread, cluster):
    dock.create_partition(spread.name, group_size=1, max_pending=5)
    fill(docks, spread, 3)
    docks[0].get("c", ["x"], 2, partition=spread.name, timeout=10)
    docks[1].get("c", ["x"], 1, partition=spread.name, timeout=10)
    docks[1].get("d", ["x"], 1, partition=spread.name, timeout=10)
    docks[1].stats()  # (its gets' confirms go with its next call)
    st = dock.stats()
    shards = [st["partitions"][name] for name in spread.shards()]
    assert [s["max_pending"] for s in shards] == [3, 3]  # ceil(5 / 2) each
    assert [s["samples"] for s in shards] == [3, 3]
    assert sorted(s["controller"] for s in shards) == sorted(cluster.controllers)
    mine = st["partitions"][spread.name]
    assert mine["samples"] == 6 and mine["columns"] == {"x": 6} and mine["max_pending"] == 6
    assert mine["consumers"]["c"]["taken"] == 3 and mine["consumers"]["d"]["taken"] == 1
    assert mine["depth"] == {"c": 3, "d": 5}  # (d never asked shard 0: all 3 of its samples)
    assert mine["shards"] == spread.shards() and mine["controller"] == [s["controller"] for s in shards]
    assert st["samples"] == sum(p["samples"] for p in st["partitions"].values() if "shards" not in p)  # (once each)


def test_save_and_load_are_refused_with_the_fix(docks, dock, spread, tmp_path):
    fill(docks, spread, 1)
    with pytest.raises(DockValueError, match=r"save each shard.*shard_name"):
        dock.save(spread.name, tmp_path)
    with pytest.raises(DockValueError, match=r"load each shard.*shard_name"):
        dock.load(tmp_path, partition=spread.name)
    assert dock.save(owners.shard_name(spread.name, 0, S), tmp_path / "shard-0")["samples"] == 1  # the fix named


def test_a_shard_whose_controller_is_down_fails_the_call_after_the_others():
    spread = Spread("down", S)
    with dockd.start_local(num_warehouses=2, controllers=2, shards={spread.name: S}) as cluster:
        dead = owners.owner_index(spread.shard(0), S)  # (shard 0 is asked first; shard 1 is sealed all the same)
        live = cluster.controllers[1 - dead]
        with dockd.connect(live, reconnect_timeout=1.0) as dock:
            dock.put({"x": torch.zeros(2, 1)}, partition=spread.name)
            cluster.procs[dead].terminate()
            cluster.procs[dead].wait(20)
            with pytest.raises(dockd.DockConnectionError, match=cluster.controllers[dead]):
                dock.seal(spread.name)
            with pytest.raises(DockValueError, match="is sealed"):  # (shard 1 checked by its own name)
                dock.put({"x": torch.zeros(1, 1)}, partition=spread.shard(1), timeout=10)
