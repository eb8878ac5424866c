"""RL data semantics against real daemons: tags, delete, retirement, seal and drain, reserve,
rank-balanced and rank-aware gets across processes, the streaming dataset."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import pytest
import torch

import dockd
from dockd.errors import DockDrained, DockLeaseError, DockNotFound, DockTimeout, DockValueError
from tests.conftest import wait_until


def _bytes(dock, wid=None) -> int:
    ws = dock.stats()["warehouses"]
    return sum(w["bytes"] for k, w in ws.items() if wid is None or k == wid)


def test_tags_filter_order_and_update(dock, partition):
    idx = dock.put({"x": torch.arange(8)}, partition=partition, tags={"age": [3, 1, 2, 0, 3, 1, 2, 0]})
    b = dock.get("oldest", ["x"], 4, partition=partition, order_by="-age", timeout=5)
    assert sorted(b.indexes) == [0, 2, 4, 6] and b.indexes[:2] == [0, 4]
    b = dock.get("young", ["x"], 2, partition=partition, where={"age": (None, 0)}, timeout=5)
    assert b.indexes == [3, 7] and [int(v) for v in b["x"]] == [3, 7]
    dock.set_tags(partition, idx, {"age": 9})  # one value for all
    dock.set_tags(partition, [1], {"age": [5]})
    b = dock.get("mid", ["x"], 1, partition=partition, where={"age": (4, 6)}, timeout=5)
    assert b.indexes == [1]
    with pytest.raises(DockTimeout):
        dock.get("mid", ["x"], 1, partition=partition, where={"age": (4, 6)}, timeout=0.2)
    with pytest.raises(DockValueError, match="no tag 'size'"):
        dock.get("c", ["x"], 1, partition=partition, order_by="size", timeout=1)
    with pytest.raises(DockValueError, match="one per sample"):
        dock.put({"x": torch.arange(3)}, partition=partition, tags={"age": [1, 2]})
    assert dock.stats()["partitions"][partition]["tags"] == ["age"]


def test_delete_frees_every_warehouse_and_unblocks_a_sealed_wait(cluster, partition):
    with dockd.connect(cluster.address, warehouse=0) as d0, dockd.connect(cluster.address, warehouse=1) as d1:
        base0, base1 = _bytes(d0, 0), _bytes(d0, 1)
        a = d0.put({"x": torch.ones(8, 1024)}, partition=partition, group_size=4)
        d1.put({"y": torch.ones(8, 2048)}, partition=partition, indexes=a)
        assert _bytes(d0, 0) - base0 >= 8 * 4096 and _bytes(d0, 1) - base1 >= 8 * 8192
        b = d0.get("c", ["x", "y"], 4, partition=partition, groups=True, timeout=5)
        assert b.indexes == [0, 1, 2, 3]
        # the second group is dropped whole (DAPO-style): a sealed get waiting for it ends
        d0.seal(partition)
        assert d0.delete(partition, [4, 5, 6, 7]) == 4
        assert d0.delete(partition, [4, 5]) == 0  # already gone
        with pytest.raises(DockDrained):
            d0.get("c", ["x", "y"], 4, partition=partition, groups=True, timeout=5)
        d0.delete(partition, b.indexes)
        assert wait_until(lambda: _bytes(d0, 0) == base0 and _bytes(d0, 1) == base1), d0.stats()["warehouses"]
        st = d0.stats()["partitions"][partition]
        assert st["deleted"] == 8 and st["sealed"]
        with pytest.raises(DockNotFound, match="deleted"):
            d0.put({"z": [1] * 2}, partition=partition, indexes=[0, 1])
        with pytest.raises(DockNotFound):
            d0.read(partition, [0], ["x"])


def test_retire_when_consumed_by_frees_what_every_consumer_confirmed(cluster, partition):
    with dockd.connect(cluster.address) as dock:
        dock.create_partition(partition, retire_when_consumed_by=["reference", "actor"])
        base = _bytes(dock)
        # (a put's memory is released once all of its samples are deleted: two puts of 32)
        dock.put({"x": torch.ones(32, 4096)}, partition=partition)
        dock.put({"x": torch.ones(32, 4096)}, partition=partition)
        grown = _bytes(dock) - base
        assert grown >= 64 * 16384
        dock.get("logger", ["x"], 16, partition=partition, timeout=5)  # not named: holds nothing back
        dock.get("reference", ["x"], 64, partition=partition, timeout=5)
        dock.get("actor", ["x"], 32, partition=partition, timeout=5)
        dock.stats()  # (confirms ride on the next request)
        # half the samples are consumed by both named consumers: their bytes go
        assert wait_until(lambda: dock.stats()["partitions"][partition]["deleted"] == 32)
        assert wait_until(lambda: _bytes(dock) - base <= grown // 2 + 4096), (grown, _bytes(dock) - base)
        dock.get("actor", ["x"], 32, partition=partition, timeout=5)
        dock.stats()
        assert wait_until(lambda: _bytes(dock) == base)
        # a retired sample is not handed out again, even to a consumer that did not have it yet
        with pytest.raises(DockTimeout, match="0 of 1"):
            dock.get("logger", ["x"], 1, partition=partition, timeout=0.2)


def test_reserve_then_fill_and_seal_ends_the_stream(dock, partition):
    idx = dock.reserve(partition, 6, group_size=2)
    assert idx == [0, 1, 2, 3, 4, 5]
    dock.put({"x": torch.arange(4)}, partition=partition, indexes=idx[:4])
    dock.seal(partition)
    with pytest.raises(DockValueError, match="sealed"):
        dock.put({"x": torch.arange(2)}, partition=partition, group_size=2)
    assert dock.get("c", ["x"], 4, partition=partition, timeout=5).indexes == [0, 1, 2, 3]
    # reserved samples 4, 5 are still to come: the sealed partition is not drained yet
    with pytest.raises(DockTimeout):
        dock.get("c", ["x"], 2, partition=partition, timeout=0.3)
    dock.put({"x": torch.arange(2)}, partition=partition, indexes=idx[4:])
    assert dock.get("c", ["x"], 2, partition=partition, timeout=5).indexes == [4, 5]
    with pytest.raises(DockDrained):
        dock.get("c", ["x"], 1, partition=partition, timeout=5)


RANK_WORKER = """
import json, random, sys, time
import dockd
address, partition, rank, size, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
time.sleep(random.random() * 0.5)  # ranks arrive in random order and at different times
with dockd.connect(address) as dock:
    steps = []
    for _ in range(2):
        b = dock.get("train", ["tokens", "length"], count, partition=partition, dp_rank=rank, dp_size=size,
                     balance_by="tokens", timeout=30)
        again = dock.get("train", ["tokens", "length"], count, partition=partition, dp_rank=rank, dp_size=size,
                         balance_by="tokens", step=b.step, timeout=30)
        assert again.indexes == b.indexes, (again.indexes, b.indexes)
        assert [len(t) for t in b["tokens"]] == [int(n) for n in b["length"]]
        steps.append({"step": b.step, "indexes": b.indexes, "tokens": sum(len(t) for t in b["tokens"]),
                      "weights": b.rank_weights})
    print(json.dumps(steps))
"""


def test_rank_balanced_gets_across_processes(cluster, partition, client):
    import subprocess
    import sys
    import textwrap

    rng = np.random.default_rng(7)
    size, count = 4, 8
    lengths = np.minimum(16 + rng.lognormal(5, 1.0, 2 * size * count).astype(int), 4096)
    with dockd.connect(cluster.address) as dock:
        dock.put({"tokens": [torch.ones(int(n), dtype=torch.int32) for n in lengths],
                  "length": [int(n) for n in lengths]}, partition=partition)
        procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(RANK_WORKER), cluster.address, partition,
                                   str(r), str(size), str(count)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in random.sample(range(size), size)]
        outs = {}
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            rank = int(p.args[5])
            outs[rank] = json.loads(out)
        for step in (0, 1):
            shares = [outs[r][step] for r in range(size)]
            assert all(s["step"] == step for s in shares)
            seen = [i for s in shares for i in s["indexes"]]
            assert len(seen) == size * count and len(set(seen)) == size * count
            sums = [s["tokens"] for s in shares]
            assert shares[0]["weights"] == [float(x) for x in sums]  # the reported sums are the real ones
            assert max(sums) - min(sums) <= int(lengths.max()) - int(lengths.min())
            # by position the same batch would be far less even on long-tailed lengths
            batch = sorted(seen)
            by_position = [int(lengths[batch[r * count:(r + 1) * count]].sum()) for r in range(size)]
            assert max(sums) - min(sums) <= max(by_position) - min(by_position)
        all_seen = {i for r in range(size) for s in outs[r] for i in s["indexes"]}
        assert all_seen == set(range(2 * size * count))
        assert dock.stats()["partitions"][partition]["consumers"]["train"]["taken"] == 2 * size * count


def test_rank_split_by_position_and_a_dead_rank_does_not_strand_the_others(cluster, partition, client):
    with dockd.connect(cluster.address) as dock:
        dock.put({"x": torch.arange(12)}, partition=partition)
        # rank 1 takes its share and dies before confirming it
        client("""
            import sys, dockd
            with dockd.connect(sys.argv[1]) as d:
                lease = d.acquire("c", ["x"], 3, partition=sys.argv[2], dp_rank=1, dp_size=2, timeout=10)
                print(lease.indexes)
                import os; os._exit(0)
        """, cluster.address, partition)
        b0 = dock.get("c", ["x"], 3, partition=partition, dp_rank=0, dp_size=2, timeout=5)
        assert b0.indexes == [0, 1, 2] and b0.step == 0
        # the dead rank's share expires back to the pool; its replacement gets a fresh share of step 0
        lease = dock.acquire("c", ["x"], 3, partition=partition, dp_rank=1, dp_size=2, timeout=10,
                             lease_timeout=0.5)
        assert lease.step == 0 and len(lease.indexes) == 3
        dock.fetch(lease)
        dock.confirm(lease)
        b0 = dock.get("c", ["x"], 3, partition=partition, dp_rank=0, dp_size=2, timeout=5)
        assert b0.step == 1
        with pytest.raises(DockValueError, match="dp_rank must be below"):
            dock.get("c", ["x"], 3, partition=partition, dp_rank=2, dp_size=2)


MP_WORKER = """
import json, sys
import dockd
address, partition, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
with dockd.connect(address) as dock:
    out = []
    for _ in range(2):
        b = dock.get("train", ["x"], 4, partition=partition, mp_group=(0, rank, 2), timeout=30)
        out.append([b.step, b.indexes, [int(v) for v in b["x"]]])
    print(json.dumps(out))
"""


def test_mp_group_reads_the_same_batch_and_takes_it_once(cluster, partition):
    import subprocess
    import sys
    import textwrap

    with dockd.connect(cluster.address) as dock:
        dock.put({"x": torch.arange(12) * 10}, partition=partition)
        procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(MP_WORKER), cluster.address, partition,
                                   str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in (1, 0)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(json.loads(out))
        assert outs[0] == outs[1]
        assert outs[0] == [[0, [0, 1, 2, 3], [0, 10, 20, 30]], [1, [4, 5, 6, 7], [40, 50, 60, 70]]]
        cons = dock.stats()["partitions"][partition]["consumers"]["train"]
        assert cons["taken"] == 8 and cons["leased"] == 0 and cons["ready"] == 4
        # another model-parallel group takes its own batch from the same pool
        b = dock.get("train", ["x"], 4, partition=partition, mp_group=(1, 0, 1), timeout=5)
        assert b.indexes == [8, 9, 10, 11]


def test_rank_aware_get_checks_its_arguments(dock, partition):
    dock.put({"x": torch.arange(4), "s": ["a", "b", "c", "d"]}, partition=partition)
    with pytest.raises(DockValueError, match="dp_rank needs dp_size"):
        dock.get("c", ["x"], 1, partition=partition, dp_rank=0)
    with pytest.raises(DockValueError, match="neither a tag"):
        dock.get("c", ["x"], 1, partition=partition, dp_rank=0, dp_size=2, balance_by="nope", timeout=1)
    with pytest.raises(DockValueError, match="not numbers"):
        dock.get("c", ["x", "s"], 1, partition=partition, dp_rank=0, dp_size=2, balance_by="s", timeout=5)
    with pytest.raises(DockValueError, match="mp_group"):
        dock.get("c", ["x"], 1, partition=partition, mp_group=(0, 2, 2))
    with pytest.raises(DockValueError, match="allow_partial"):
        dock.get("c", ["x"], 1, partition=partition, dp_rank=0, dp_size=2, allow_partial=True, timeout=1)
    with pytest.raises(DockTimeout, match=r"rank 1 of 2 .* a step needs 3 x 2 = 6 samples ready at once, 4 were"):
        dock.get("c", ["x"], 3, partition=partition, dp_rank=1, dp_size=2, timeout=0.3)
    # the failed round gave its samples back
    assert dock.get("c", ["x"], 4, partition=partition, timeout=5).indexes == [0, 1, 2, 3]
    lease = dock.acquire("c2", ["x"], 2, partition=partition, dp_rank=0, dp_size=2, timeout=5, lease_timeout=0.2)
    wait_until(lambda: dock.stats()["partitions"][partition]["consumers"]["c2"]["leased"] == 0,
               what="the share's lease to expire unconfirmed")
    with pytest.raises(DockLeaseError):
        dock.confirm(lease)


def test_streaming_dataset_with_workers_delivers_each_sample_once(cluster, partition):
    import threading

    from torch.utils.data import DataLoader

    from dockd.data import StreamingDataset

    with dockd.connect(cluster.address) as dock:
        def produce():
            for k in range(6):
                dock.put({"x": torch.arange(k * 10, k * 10 + 10)}, partition=partition)
                time.sleep(0.05)
            dock.seal(partition)

        t = threading.Thread(target=produce)
        t.start()
        ds = StreamingDataset(cluster.address, "trainer", ["x"], 4, partition=partition, timeout=30)
        got = []
        for batch in DataLoader(ds, batch_size=None, num_workers=2, timeout=60):
            assert len(batch["indexes"]) == len(batch["x"]) and 1 <= len(batch["x"]) <= 4
            assert [int(v) for v in batch["x"]] == list(batch["indexes"])
            got += list(batch["indexes"])
        t.join()
        assert sorted(got) == list(range(60))


def test_a_rank_aware_get_waits_for_the_confirm_of_its_last_share_that_the_flusher_is_sending(cluster, partition):
    """The confirm of a get goes out on its own (the flusher, 20 ms later) unless the next acquire takes
    it along. A next rank-aware get sent while the flusher's confirm was on its way could reach the
    controller first: the rank's step had not moved on, so it was handed the same share again and its
    samples were delivered twice (CI: test_streaming_dataset_with_dp_ranks_and_workers)."""
    import threading
    import time

    with dockd.connect(cluster.address) as dock:
        dock.put({"x": torch.arange(8)}, partition=partition)
        confirms, sending = dock._confirms, threading.Event()
        send = confirms.send

        def slow(leases, at="", **kw):  # (the flusher's confirm takes a while to reach the controller)
            if threading.current_thread().name == "dockd-confirm":
                sending.set()
                time.sleep(0.5)
            return send(leases, at, **kw)

        confirms.send = slow
        first = dock.get("trainer", ["x"], 2, partition=partition, dp_rank=0, dp_size=1, timeout=10)
        assert sending.wait(10)  # (the flusher took the confirm and is on its way)
        second = dock.get("trainer", ["x"], 2, partition=partition, dp_rank=0, dp_size=1, timeout=10)
        assert (first.step, second.step) == (0, 1)
        assert not set(first.indexes) & set(second.indexes), (first.indexes, second.indexes)


def test_streaming_dataset_with_dp_ranks_and_workers(cluster, partition):
    import json
    import subprocess
    import sys
    import textwrap

    with dockd.connect(cluster.address) as dock:
        dock.put({"x": torch.arange(64), "n": list(range(64))}, partition=partition)
        dock.seal(partition)

    # two data-parallel ranks, each its own process as in training, with two loader workers
    # each: four readers per step
    rank = textwrap.dedent("""
        import json, sys
        from torch.utils.data import DataLoader
        from dockd.data import StreamingDataset
        address, partition, r = sys.argv[1], sys.argv[2], int(sys.argv[3])
        ds = StreamingDataset(address, "trainer", ["x", "n"], 4, partition=partition, dp_rank=r, dp_size=2,
                              balance_by="n", timeout=60)
        out = []
        for batch in DataLoader(ds, batch_size=None, num_workers=2, timeout=90):
            assert len(batch["indexes"]) == 4
            out += [int(i) for i in batch["indexes"]]
        print(json.dumps(out))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", rank, cluster.address, partition, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    seen = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err[-3000:]
        seen += json.loads(out.strip().splitlines()[-1])
    assert sorted(seen) == list(range(64))


def test_checkpoint_round_trip_across_a_restart_of_the_dock(tmp_path):
    path = tmp_path / "ckpt"
    values = [torch.randn(n).bfloat16() for n in (3, 5, 7, 2, 4, 6)]
    objects = [{"uid": "a"}, "text", 2.5, [1, [2]], None, {"k": b"\x00\x01"}]
    with (dockd.start_local(num_warehouses=2) as c,
          dockd.connect(c.address, warehouse=0) as d0,
          dockd.connect(c.address, warehouse=1) as d1):
        d0.create_partition("p", group_size=2, retire_when_consumed_by=["never"])
        idx = d0.put({"x": values, "m": objects}, partition="p", group_size=2, tags={"age": [5, 4, 3, 2, 1, 0]})
        d1.put({"y": torch.arange(12, dtype=torch.int16).view(6, 2)}, partition="p", indexes=idx)
        assert d0.get("c", ["x"], 2, partition="p", timeout=5).indexes == [0, 1]
        d0.acquire("c", ["x"], 2, partition="p", timeout=5)  # leased, not confirmed: not taken in the checkpoint
        d0.delete("p", [4, 5])
        d0.seal("p")
        saved = d0.save("p", path)
        assert saved["samples"] == 4 and saved["bytes"] > 0
        assert sorted(os.listdir(path)) == ["partition.msgpack", "warehouse-0.arrow", "warehouse-1.arrow"]
    with dockd.start_local(num_warehouses=1) as c, dockd.connect(c.address) as d:  # one warehouse loads both files
        assert d.load(path, partition="back") == saved
        st = d.stats()["partitions"]["back"]
        assert (st["samples"], st["group_size"], st["deleted"], st["sealed"]) == (6, 2, 2, True)
        assert st["retire_when_consumed_by"] == ["never"] and st["tags"] == ["age"]
        got = d.read("back", [0, 1, 2, 3], ["x", "m", "y"])
        for i, k in enumerate([0, 1, 2, 3]):
            assert got["x"][i].dtype == torch.bfloat16 and torch.equal(got["x"][i], values[k])
            assert got["m"][i] == objects[k]
            assert torch.equal(got["y"][i], torch.tensor([2 * k, 2 * k + 1], dtype=torch.int16))
        # consumer c had 0 and 1; 2 and 3 were only leased: they come again, oldest first
        b = d.get("c", ["x", "m", "y"], 2, partition="back", order_by="-age", timeout=5)
        assert b.indexes == [2, 3]
        with pytest.raises(DockDrained):
            d.get("c", ["x"], 1, partition="back", timeout=5)
        with pytest.raises(DockValueError, match="exists"):
            d.load(path, partition="back")
        with pytest.raises(DockNotFound, match="no dockd checkpoint"):
            d.load(tmp_path / "nothing", partition="other")
        with pytest.raises(DockNotFound):
            d.save("missing", tmp_path / "x")


def test_prefer_local_hands_out_the_home_warehouses_samples_first(cluster, partition):
    with dockd.connect(cluster.address, warehouse=0) as d0, dockd.connect(cluster.address, warehouse=1) as d1:
        assert d1.put({"x": torch.arange(4)}, partition=partition) == [0, 1, 2, 3]  # on warehouse 1
        assert d0.put({"x": torch.arange(4, 8)}, partition=partition) == [4, 5, 6, 7]  # on warehouse 0
        assert d0.get("c", ["x"], 2, partition=partition, prefer_local=True, timeout=5).indexes == [4, 5]
        assert d0.get("c", ["x"], 4, partition=partition, prefer_local=True, timeout=5).indexes == [6, 7, 0, 1]
        assert d0.get("c", ["x"], 2, partition=partition, timeout=5).indexes == [2, 3]
        assert d1.get("fifo", ["x"], 2, partition=partition, timeout=5).indexes == [0, 1]
        with pytest.raises(DockValueError, match="prefer_local"):
            d0.get("r", ["x"], 1, partition=partition, dp_rank=0, dp_size=1, prefer_local=True)


def test_get_on_a_device_checks_the_device(dock, partition):
    dock.put({"x": [torch.arange(n) for n in (1, 3)], "s": ["a", "b"]}, partition=partition)
    with pytest.raises(DockValueError, match="no cuda device|not a device"):
        dock.get("c", ["x"], 2, partition=partition, device="cuda:0" if not torch.cuda.is_available() else "nope")
    with pytest.raises(DockValueError, match="not a device"):
        dock.get("c", ["x"], 2, partition=partition, device="nope")
    b = dock.get("c", ["x", "s"], 2, partition=partition, device="cpu", timeout=5)
    assert [t.tolist() for t in b["x"]] == [[0], [0, 1, 2]] and b["s"] == ["a", "b"]


@pytest.mark.parametrize("where", [0, 1], ids=["controller-warehouse", "joined-warehouse"])
def test_deleting_half_of_a_put_frees_its_bytes(cluster, partition, where):
    """Issue 21: 16 of 32 samples of a put deleted freed 0 bytes (storage went back per whole put).
    DAPO drops whole groups, evictions drop single samples: their memory comes back now."""
    with dockd.connect(cluster.address, warehouse=where) as d:
        before = d.stats(traffic=True)["warehouses"][where]
        d.put({"x": torch.ones(32, 8192, dtype=torch.uint8), "r": [float(i) for i in range(32)]}, partition=partition)
        d.delete(partition, list(range(16)))

        def freed():
            w = d.stats(traffic=True)["warehouses"][where]
            return w["freed_bytes"] - before["freed_bytes"] >= 16 * 8192 and w
        w = wait_until(freed)
        assert w, d.stats(traffic=True)["warehouses"][where]
        assert w["reclaimable_bytes"] == before["reclaimable_bytes"]  # compacted: nothing deleted is held
        b = d.get("c", ["x", "r"], 16, partition=partition, timeout=10)
        assert b.indexes == list(range(16, 32)) and b["r"] == [float(i) for i in range(16, 32)]
        assert torch.equal(b.stacked("x"), torch.ones(16, 8192, dtype=torch.uint8))
