"""The partition calls on a spread partition (--shards NAME=2, dockd.client.spread_calls): each acts on
both shards, on their two controllers, and takes and gives the spread partition's indexes (shard k's
sample i is i * 2 + k)."""

from __future__ import annotations

import uuid

import pytest
import torch

import dockd
from dockd import owners
from dockd.client.spread import Spread
from dockd.errors import DockNotFound, DockValueError

pytestmark = pytest.mark.timeout(120)

S = 2


@pytest.fixture(scope="module")
def cluster():
    with dockd.start_local(num_warehouses=2, controllers=2) as c:
        yield c


@pytest.fixture
def spread() -> Spread:
    return Spread(f"s-{uuid.uuid4().hex[:10]}", S)


@pytest.fixture
def dock(cluster, spread):
    with dockd.connect(cluster.address) as d:
        d.stats()  # (both controllers met before the dock's spread partitions are named to this client)
        d._router.shards = {spread.name: S}
        yield d


def put(dock, spread: Spread, k: int, values: list[int], **kw) -> list[int]:
    """Samples with x = `values` put to shard k; their spread indexes."""
    local = dock.put({"x": torch.tensor(values).reshape(-1, 1)}, partition=spread.shard(k), **kw)
    return spread.outward(k, local)


def fill(dock, spread: Spread, n: int = 3) -> dict[int, int]:
    """n samples on each shard, x = 100 + the spread index; spread index -> x."""
    out = {}
    for k in range(S):
        idx = put(dock, spread, k, [100 + i * S + k for i in range(n)])
        out.update({i: 100 + i for i in idx})
    assert sorted(out) == list(range(n * S))
    return out


def test_list_merges_the_shards_by_spread_index_from_start_to_limit(dock, spread):
    with pytest.raises(DockNotFound, match="none of its 2 shards"):
        dock.list(spread.name)
    for k in range(S):  # shard 0's versions 0, 1, 2; shard 1's 10, 11, 12
        put(dock, spread, k, [0, 1, 2], tags={"version": [10 * k + i for i in range(3)]})
    dock.set_version(spread.shard(1), 7)  # (on one shard: "version" is the newest)
    listed = dock.list(spread.name)
    assert listed["indexes"] == [0, 1, 2, 3, 4, 5]
    assert listed["versions"] == [0, 10, 1, 11, 2, 12]
    assert listed["version"] == 7
    assert dock.list(spread.name, start=3)["indexes"] == [3, 4, 5]
    assert dock.list(spread.name, start=2, limit=3)["indexes"] == [2, 3, 4]
    assert dock.list(spread.name, limit=1)["indexes"] == [0]
    dock.set_tags(spread.shard(1), [2], {"age": 5})  # a tag only one shard has: 0 on the other's samples
    assert dock.list(spread.name)["tags"]["age"] == [0, 0, 0, 0, 0, 5]
    dock.get("c", ["x"], 2, partition=spread.shard(0), timeout=10)  # takes shard 0's 0, 1: spread 0, 2
    assert dock.list(spread.name, "c")["indexes"] == [1, 3, 4, 5]
    dock.set_tags(spread.shard(0), [0], {"age": 5})
    assert dock.list(spread.name, where={"age": 5})["indexes"] == [0, 5]


def test_list_since_a_cursor_of_both_shards(dock, spread):
    fill(dock, spread, 2)
    first = dock.list(spread.name, since="")
    assert (first["indexes"], first["full"], first["more"], first["deleted"]) == ([0, 1, 2, 3], True, False, [])
    assert first["cursor"].count("|") == 1
    new = put(dock, spread, 1, [7])  # spread index 5
    dock.delete(spread.name, [2])  # shard 0's 1
    dock.set_tags(spread.name, [1], {"age": 1})  # shard 1's 0
    changed = dock.list(spread.name, since=first["cursor"])
    assert (changed["indexes"], changed["deleted"], changed["full"], changed["more"]) == ([1] + new, [2], False, False)
    assert changed["tags"]["age"] == [1, 0]
    # a limit is shared out among the shards; "more" until each gave all it has
    put(dock, spread, 0, [8, 9])  # spread 4, 6
    page = dock.list(spread.name, since=changed["cursor"], limit=2)
    assert (page["indexes"], page["more"]) == ([4], True)
    page = dock.list(spread.name, since=page["cursor"], limit=2)
    assert (page["indexes"], page["more"], page["full"]) == ([6], False, False)
    quiet = dock.list(spread.name, since=page["cursor"])
    assert (quiet["indexes"], quiet["deleted"], quiet["full"]) == ([], [], False)
    # one shard cleared: its view is gone, so the answer is the whole listing (the other shard's asked again)
    dock.clear(spread.shard(0))
    whole = dock.list(spread.name, since=quiet["cursor"])
    assert (whole["indexes"], whole["full"], whole["deleted"]) == ([1, 3, 5], True, [])
    # ... and once it is written again, what it holds comes as changes
    again = put(dock, spread, 0, [1])
    back = dock.list(spread.name, since=whole["cursor"])
    assert (back["indexes"], back["full"]) == (again, False)
    with pytest.raises(DockValueError, match="spread over 2 shards"):
        dock.list(spread.name, since="nope")


def test_delete_and_set_tags_reach_each_samples_shard(dock, spread):
    fill(dock, spread)
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


def test_read_gives_the_values_in_the_order_asked(dock, spread):
    values = fill(dock, spread)
    for asked in ([5, 0, 3, 2], [4, 0], [1]):  # both shards, shard 0 alone, shard 1 alone
        batch = dock.read(spread.name, asked, ["x"])
        assert (batch.partition, batch.indexes) == (spread.name, asked)
        assert [int(v[0]) for v in batch["x"]] == [values[i] for i in asked]
        assert batch.stacked("x").flatten().tolist() == [values[i] for i in asked]


def test_reserve_comes_from_the_home_shard(dock, spread):
    fill(dock, spread, 2)
    home = dock.home % S
    got = dock.reserve(spread.name, 4)
    assert got == spread.outward(home, [2, 3, 4, 5])
    dock.put({"x": torch.zeros(4, 1)}, partition=spread.shard(home), indexes=[2, 3, 4, 5])
    assert dock.read(spread.name, got, ["x"]).indexes == got


def test_versions_and_consumers_on_every_shard(dock, spread):
    dock.create_partition(spread.name, max_staleness=1, retire_stale=True)
    for k in range(S):
        put(dock, spread, k, [0, 1, 2], tags={"version": [0, 1, 2]})
    assert dock.set_version(spread.name, 2) == 2  # version 0 on each shard is too stale
    assert dock.list(spread.name)["indexes"] == [2, 3, 4, 5]
    assert dock.list(spread.name)["version"] == 2
    assert dock.get("c", ["x"], 1, partition=spread.shard(1), timeout=10).indexes == [1]
    assert dock.drop_consumer(spread.name, "c") is True
    assert dock.drop_consumer(spread.name, "c") is False
    assert "c" not in dock.stats()["partitions"][spread.shard(1)]["consumers"]


def test_seal_ends_both_shards_and_clear_empties_them(dock, spread):
    fill(dock, spread, 2)
    dock.seal(spread.name)
    for k in range(S):
        with pytest.raises(DockValueError, match="is sealed"):  # (no new samples on either shard)
            put(dock, spread, k, [0], timeout=5)
        assert len(dock.get("c", ["x"], 4, partition=spread.shard(k), allow_partial=True, timeout=10)) == 2
        with pytest.raises(dockd.DockDrained):
            dock.get("c", ["x"], 1, partition=spread.shard(k), timeout=10)
    assert dock.stats()["partitions"][spread.name]["sealed"] is True
    assert dock.clear(spread.name) == 4
    parts = dock.stats()["partitions"]
    assert not {spread.name, *spread.shards()} & set(parts)
    with pytest.raises(DockNotFound):
        dock.list(spread.name)


def test_stats_sums_the_shards_under_the_spread_name(dock, spread, cluster):
    dock.create_partition(spread.name, group_size=1, max_pending=5)
    fill(dock, spread, 3)
    dock.get("c", ["x"], 2, partition=spread.shard(0), timeout=10)
    dock.get("c", ["x"], 1, partition=spread.shard(1), timeout=10)
    dock.get("d", ["x"], 1, partition=spread.shard(1), timeout=10)
    st = dock.stats()
    shards = [st["partitions"][name] for name in spread.shards()]
    assert [s["max_pending"] for s in shards] == [3, 3]  # ceil(5 / 2) each
    assert [s["samples"] for s in shards] == [3, 3]
    assert sorted(s["controller"] for s in shards) == sorted(cluster.controllers)
    mine = st["partitions"][spread.name]
    assert mine["samples"] == 6 and mine["columns"] == {"x": 6} and mine["max_pending"] == 6
    assert mine["consumers"]["c"]["taken"] == 3 and mine["consumers"]["d"]["taken"] == 1
    assert mine["depth"] == {"c": 3, "d": 5}
    assert mine["shards"] == spread.shards() and mine["controller"] == [s["controller"] for s in shards]
    assert st["samples"] == sum(p["samples"] for p in st["partitions"].values() if "shards" not in p)  # (once each)


def test_save_and_load_are_refused_with_the_fix(dock, spread, tmp_path):
    fill(dock, spread, 1)
    with pytest.raises(DockValueError, match=r"save each shard.*shard_name"):
        dock.save(spread.name, tmp_path)
    with pytest.raises(DockValueError, match=r"load each shard.*shard_name"):
        dock.load(tmp_path, partition=spread.name)
    saved = dock.save(spread.shard(0), tmp_path / "shard-0")  # the fix it names works
    assert saved["samples"] == 1
    assert owners.shard_of(spread.shard(0)) == (spread.name, 0, S)


def test_a_shard_whose_controller_is_down_fails_the_call_after_the_others():
    with dockd.start_local(num_warehouses=2, controllers=2) as cluster:
        spread = Spread("down", S)
        dead = owners.owner_index(spread.shard(0), S)  # (shard 0 is asked first; shard 1 is still sealed)
        live = cluster.controllers[1 - dead]
        with dockd.connect(live, reconnect_timeout=1.0) as dock:
            dock.stats()
            dock._router.shards = {spread.name: S}
            fill(dock, spread, 1)
            cluster.procs[dead].terminate()
            cluster.procs[dead].wait(20)
            with pytest.raises(dockd.DockConnectionError, match=cluster.controllers[dead]):
                dock.seal(spread.name)
            with pytest.raises(DockValueError, match="is sealed"):
                put(dock, spread, 1, [0], timeout=10)
