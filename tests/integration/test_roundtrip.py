"""Put in one process, get in another, through real daemons on loopback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dockd

WRITER = """
import sys, torch, dockd
address, part = sys.argv[1], sys.argv[2]
with dockd.connect(address) as dock:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=g) for n in torch.randint(1, 40, (16,), generator=g)]
    idx = dock.put({"prompts": prompts}, partition=part, group_size=8)
    dock.put({"responses": [torch.randn(int(n), generator=g).to(torch.bfloat16) for n in torch.randint(1, 40, (16,), generator=g)],
              "rewards": [float(i) / 3 for i in range(16)]}, partition=part, indexes=idx)
    print(idx)
"""


def expected():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=g) for n in torch.randint(1, 40, (16,), generator=g)]
    responses = [torch.randn(int(n), generator=g).to(torch.bfloat16) for n in torch.randint(1, 40, (16,), generator=g)]
    return prompts, responses


def test_put_in_one_process_get_in_another(cluster, dock, partition, client):
    out = client(WRITER, cluster.address, partition)
    assert out.stdout.strip() == str(list(range(16)))
    batch = dock.get("reference", ["prompts", "responses", "rewards"], 16, partition=partition, timeout=10)
    prompts, responses = expected()
    assert batch.indexes == list(range(16))
    for got, want in zip(batch["prompts"], prompts):
        assert got.dtype == torch.int64 and torch.equal(got, want)
    for got, want in zip(batch["responses"], responses):
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert batch["rewards"] == [i / 3 for i in range(16)]
    padded, lengths = batch.padded("prompts", pad_value=-1)
    assert padded.shape == (16, max(len(p) for p in prompts))
    assert lengths.tolist() == [len(p) for p in prompts]
    assert torch.equal(padded[3, : lengths[3]], prompts[3]) and (padded[3, lengths[3]:] == -1).all()


def test_value_forms_round_trip(dock, partition):
    base = torch.arange(60, dtype=torch.float64).reshape(5, 12)
    idx = dock.put(
        {
            "stacked": base,                            # first dim is the sample axis
            "noncontig": [base.t()[i] for i in range(5)],
            "numpy": np.arange(10, dtype=np.float16).reshape(5, 2),
            "half_list": [torch.full((2, 2), i, dtype=torch.float16) for i in range(5)],
            "meta": [{"id": i, "tags": ["a", i]} for i in range(5)],
            "text": ["x" * i for i in range(5)],
        },
        partition=partition,
    )
    cols = ["stacked", "noncontig", "numpy", "half_list", "meta", "text"]
    b = dock.get("c", cols, 5, partition=partition, timeout=10)
    assert b.indexes == idx
    for i in range(5):
        assert torch.equal(b["stacked"][i], base[i])
        assert torch.equal(b["noncontig"][i], base.t()[i])
        assert b["numpy"][i].dtype == torch.float16 and b["numpy"][i].tolist() == [2.0 * i, 2.0 * i + 1]
        assert torch.equal(b["half_list"][i], torch.full((2, 2), i, dtype=torch.float16))
    assert b["meta"] == [{"id": i, "tags": ["a", i]} for i in range(5)]
    assert b["text"] == ["x" * i for i in range(5)]


def test_columns_from_different_warehouses_are_joined(cluster, partition):
    with dockd.connect(cluster.address, warehouse=0) as d0, dockd.connect(cluster.address, warehouse=1) as d1:
        idx = d0.put({"a": torch.arange(6)}, partition=partition)
        d1.put({"b": [torch.tensor([i, i]) for i in idx[::2]]}, partition=partition, indexes=idx[::2])
        d0.put({"b": [torch.tensor([i, i]) for i in idx[1::2]]}, partition=partition, indexes=idx[1::2])
        s = d0.stats()
        assert s["warehouses"][0]["bytes"] > 0 and s["warehouses"][1]["bytes"] > 0
        b = d1.get("c", ["a", "b"], 6, partition=partition, timeout=10)
        assert [int(x) for x in b["a"]] == idx
        assert [x.tolist() for x in b["b"]] == [[i, i] for i in idx]


def test_fifo_shuffle_partial_and_groups(dock, partition):
    idx = dock.put({"x": torch.arange(32)}, partition=partition, group_size=4)
    assert dock.get("fifo", ["x"], 5, partition=partition, timeout=5).indexes == [0, 1, 2, 3, 4]
    s1 = dock.get("shuf", ["x"], 32, partition=partition, shuffle=True, seed=3, timeout=5).indexes
    assert sorted(s1) == idx and s1 != idx
    b = dock.get("part", ["x"], 100, partition=partition, allow_partial=True, timeout=5)
    assert b.indexes == idx
    g = dock.get("grp", ["x"], 8, partition=partition, groups=True, timeout=5)
    assert g.indexes == list(range(8))
    with pytest.raises(dockd.DockValueError, match="multiple of the group size 4"):
        dock.get("grp", ["x"], 6, partition=partition, groups=True, timeout=5)


def test_timeout_says_how_many_were_ready(dock, partition):
    dock.put({"x": torch.arange(3)}, partition=partition)
    with pytest.raises(dockd.DockTimeout, match="3 of 10 samples were ready") as e:
        dock.get("c", ["x"], 10, partition=partition, timeout=0.3)
    assert e.value.ready == 3
    with pytest.raises(dockd.DockTimeout, match="does not exist yet"):
        dock.get("c", ["x"], 1, partition=partition + "-never", timeout=0.1)
    with pytest.raises(dockd.DockTimeout, match=r"column\(s\) \['nope'\]"):
        dock.get("c", ["nope"], 1, partition=partition, timeout=0.1)
    # the 3 samples are still there for this consumer: a timeout takes nothing
    assert dock.get("c", ["x"], 3, partition=partition, timeout=5).indexes == [0, 1, 2]


def test_get_waits_for_a_later_put(cluster, dock, partition, client):
    import threading

    result = {}

    def consumer():
        result["batch"] = dock.get("late", ["x"], 4, partition=partition, timeout=60)

    t = threading.Thread(target=consumer)
    t.start()
    client("import sys, torch, dockd\nd = dockd.connect(sys.argv[1])\nd.put({'x': torch.arange(4)}, partition=sys.argv[2])",
           cluster.address, partition)
    t.join(60)
    assert result["batch"].indexes == [0, 1, 2, 3]


def test_clear_frees_every_warehouse_and_stats(cluster, partition):
    with dockd.connect(cluster.address, warehouse=0) as d0, dockd.connect(cluster.address, warehouse=1) as d1:
        d0.put({"x": torch.zeros(4, 1000)}, partition=partition)
        d1.put({"x": torch.zeros(4, 1000)}, partition=partition)
        d0.get("c", ["x"], 3, partition=partition, timeout=5)
        s = d0.stats()
        p = s["partitions"][partition]
        assert p["samples"] == 8 and p["columns"] == {"x": 8}
        assert p["consumers"]["c"] == {"taken": 3, "leased": 0, "ready": 5, "waiting": 0}
        before = {w: s["warehouses"][w]["bytes"] for w in (0, 1)}
        assert all(b >= 16000 for b in before.values())
        assert d0.clear(partition) == 8
        after = d0.stats()
        assert partition not in after["partitions"]
        for w in (0, 1):
            assert after["warehouses"][w]["bytes"] <= before[w] - 16000
        with pytest.raises(dockd.DockNotFound, match="does not exist"):
            d0.clear(partition)
        # the name can be reused from scratch
        assert d1.put({"x": torch.zeros(2)}, partition=partition) == [0, 1]


def test_acquire_inline_or_metadata_only(cluster, partition):
    with dockd.connect(cluster.address, warehouse=0) as d:  # warehouse 0 lives with the controller
        d.put({"x": torch.arange(4)}, partition=partition)
        lease = d.acquire("a", ["x"], 4, partition=partition, timeout=5)
        assert [int(v) for v in lease.inline["x"]] == [0, 1, 2, 3]  # came with the acquire
        meta = d.acquire("b", ["x"], 4, partition=partition, timeout=5, inline=False)
        assert meta.inline == {} and meta.locations.tolist() == [[0, 0, 0, 0]]
        assert [int(v) for v in d.fetch(meta)["x"]] == [0, 1, 2, 3]
        d.confirm(lease)
        d.confirm(meta)
        b = d.stats()["partitions"][partition]["consumers"]["b"]
        assert (b["taken"], b["leased"]) == (4, 0)


def test_read_by_index_takes_nothing(cluster, partition):
    with dockd.connect(cluster.address, warehouse=0) as d0, dockd.connect(cluster.address, warehouse=1) as d1:
        idx = d0.put({"a": torch.arange(6)}, partition=partition)
        d1.put({"b": [str(i) for i in idx[:3]]}, partition=partition, indexes=idx[:3])
        b = d1.read(partition, [2, 0], ["a", "b"])
        assert b.indexes == [2, 0] and [int(v) for v in b["a"]] == [2, 0] and b["b"] == ["2", "0"]
        with pytest.raises(dockd.DockNotFound, match=r"column 'b' is not written for samples \[4\]"):
            d1.read(partition, [4], ["b"])
        with pytest.raises(dockd.DockNotFound, match="do not exist"):
            d1.read(partition, [99], ["a"])
        # nothing was taken: a consumer still gets every sample
        assert d0.get("c", ["a"], 6, partition=partition, timeout=5).indexes == idx


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_batched_columns_round_trip_in_any_order(cluster, partition, monkeypatch, transport):
    """Rows stored back to back travel as one buffer; shuffled and partial reads still match."""
    if transport == "tcp":
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
    x = torch.randn(32, 16)                      # 64-byte rows: one buffer per put
    y = torch.randint(0, 9, (32, 32), dtype=torch.int16)
    with dockd.connect(cluster.address, warehouse=1) as d:
        d.put({"x": x, "y": y}, partition=partition)
        s = d.get("s", ["y", "x"], 20, partition=partition, shuffle=True, seed=5, timeout=5)
        for i, xv, yv in zip(s.indexes, s["x"], s["y"]):
            assert torch.equal(xv, x[i]) and torch.equal(yv, y[i])
        f = d.get("f", ["x"], 32, partition=partition, timeout=5)
        assert torch.equal(torch.stack(f["x"]), x)


@pytest.mark.parametrize("warehouse", [0, 1])
def test_samples_put_one_at_a_time_come_back_as_one_run_per_stretch_of_one_kind(cluster, partition, warehouse):
    """A get of samples put one by one (async RL's per-trajectory puts), inline from the controller's
    node or fetched from another warehouse: the values of consecutive puts that share a kind travel as
    one run per column (one to decode, not one per put), in the order asked; a value of another dtype
    starts a run of its own."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(int(n), generator=g) for n in torch.randint(0, 50, (24,), generator=g)]
    xs[10] = torch.arange(5)  # int64 among float32
    with dockd.connect(cluster.address, warehouse=warehouse) as d:
        for i, x in enumerate(xs):
            d.put({"x": [x], "uid": [f"u{i}"], "v": torch.full((1, 3), float(i))}, partition=partition)
        b = d.get("t", ["x", "uid", "v"], 24, partition=partition, shuffle=True, seed=1, timeout=10)
        runs = {name: len(b._columns[name].runs) for name in ("x", "uid", "v")}  # (before they are decoded)
        pos = b.indexes.index(10)
        assert runs == {"x": 1 + (pos > 0) + (pos < 23), "uid": 1, "v": 1}
        assert sorted(b.indexes) == list(range(24)) and b.indexes != list(range(24))
        for i, x, uid, v in zip(b.indexes, b["x"], b["uid"], b["v"]):
            assert x.dtype == xs[i].dtype and torch.equal(x, xs[i])
            assert uid == f"u{i}" and v.tolist() == [float(i)] * 3
