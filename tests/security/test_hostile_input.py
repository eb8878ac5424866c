"""Requests within every limit that an adversary (or a buggy client) sends to grow a daemon or
to get something applied and reported as failed. From the second trust review (findings 2, 3)."""

from __future__ import annotations

import pytest
import torch

import dockd
from dockd import limits

pytestmark = pytest.mark.timeout(180)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("where", [0, 1], ids=["controller-warehouse", "joined-warehouse"])
def test_a_put_naming_a_huge_index_is_refused_before_memory_is_spent(cluster, partition, where):
    pid = cluster.procs[where].pid
    with dockd.connect(cluster.address, warehouse=where) as d:
        d.put({"x": [0]}, partition=partition)
        before = _rss(pid)
        for index in (2**30, 2**31, 2**33, 2**62):
            with pytest.raises(dockd.DockNotFound, match="do not exist"):
                d.put({"w": [1]}, partition=partition, indexes=[index])
        assert _rss(pid) - before < 64 << 20  # it grew by gigabytes per put before
        with pytest.raises(dockd.DockValueError, match="negative"):
            d.put({"w": [1]}, partition=partition, indexes=[-1])
        # the daemon keeps serving, and the legitimate column write still works
        assert d.put({"w": [7]}, partition=partition, indexes=[0]) == [0]
        assert d.get("c", ["x", "w"], 1, partition=partition, timeout=10)["w"] == [7]
        assert d.stats()["partitions"][partition]["samples"] == 1


def test_requests_within_the_limits_are_answered_not_applied_and_reported_failed(cluster, dock, partition):
    """3,000,000 samples in one put: stored once and answered (the reply of 3M indexes was over the
    header limit: the put was stored, reported failed, and stored again when retried)."""
    n = 3_000_000
    idx = dock.put({"x": torch.zeros(n, dtype=torch.int8)}, partition=partition)
    assert len(idx) == n and idx[-1] == n - 1
    assert dock.stats()["partitions"][partition]["samples"] == n
    b = dock.get("c", ["x"], n, partition=partition, timeout=60)  # a get of all of them, answered
    assert len(b.indexes) == n and dock.stats()["partitions"][partition]["consumers"]["c"]["leased"] == 0
    r = dock.reserve(partition, limits.MAX_SAMPLES)
    assert len(r) == limits.MAX_SAMPLES and r[0] == n


def test_a_request_past_the_limits_is_refused_before_anything_is_applied(dock, partition):
    dock.put({c: torch.zeros(16) for c in "abcd"}, partition=partition)
    with pytest.raises(dockd.DockValueError, match="sample-columns"):
        dock.get("c", list("abcd"), limits.MAX_CELLS // 2, partition=partition, timeout=1)
    assert dock.stats()["partitions"][partition]["consumers"].get("c", {"leased": 0})["leased"] == 0
    # "everything that is ready" with a huge count is fine: a partial get takes what one reply holds
    assert len(dock.get("c", list("abcd"), limits.MAX_CELLS // 2, partition=partition, timeout=1,
                        allow_partial=True)) == 16
    with pytest.raises(dockd.DockValueError, match="too many"):
        dock.put({"x": torch.zeros(limits.MAX_SAMPLES + 1, dtype=torch.int8)}, partition=partition)
    assert dock.stats()["partitions"][partition]["samples"] == 16


def test_checkpoints_stay_under_their_root_and_open_regular_files_only(tmp_path):
    """Finding 10: save() wrote anywhere the daemon's user could, and load() of a checkpoint whose
    file entry was a FIFO blocked forever."""
    import os

    import msgpack

    from tests.conftest import serving

    root = tmp_path / "ckpt"
    root.mkdir()
    with (serving("--controller", "--port", "0", "--checkpoint-root", str(root)) as (address, _),
          dockd.connect(address) as d):
        d.put({"x": torch.arange(4)}, partition="p")
        for outside in (tmp_path / "elsewhere", root / ".." / "escape"):
            with pytest.raises(dockd.DockValueError, match="checkpoint-root"):
                d.save("p", outside)
        assert d.save("p", root / "good")["samples"] == 4
        fifo = root / "fifo"
        fifo.mkdir()
        os.mkfifo(fifo / "partition.msgpack")
        with pytest.raises(dockd.DockValueError, match="not a regular file"):
            d.load(fifo, partition="q")
        evil = root / "evil"
        evil.mkdir()
        meta = msgpack.unpackb((root / "good" / "partition.msgpack").read_bytes(), raw=False,
                               strict_map_key=False)
        meta["files"] = [[0, "../good/warehouse-0.arrow"]]
        (evil / "partition.msgpack").write_bytes(msgpack.packb(meta, use_bin_type=True))
        with pytest.raises(dockd.DockValueError, match="outside its directory"):
            d.load(evil, partition="q")
        d.load(root / "good", partition="q")
        assert torch.equal(d.get("c", ["x"], 4, partition="q", timeout=10).stacked("x"), torch.arange(4))
