"""The same-host shared-memory transport: selection, zero-copy gets, lifetime, no leaks."""

from __future__ import annotations

import os

import pytest
import torch

import dockd
from dockd import shm
from dockd.local import spawn_node

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs Linux memfd and SCM_RIGHTS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def dockd_shm_names() -> set[str]:
    """Named shared memory of dockd's; memfd segments have no names, so this stays empty."""
    return {n for n in os.listdir("/dev/shm") if "dockd" in n} if os.path.isdir("/dev/shm") else set()


def test_same_host_clients_pick_shared_memory_and_tcp_can_be_forced(cluster, monkeypatch, caplog):
    caplog.set_level("INFO", logger="dockd.client.dock")
    with dockd.connect(cluster.address) as d:
        assert d._ctrl.transport == "shm"
        assert d._pool(0).transport == "shm" and d._pool(1).transport == "shm"
    assert "transport=shm" in caplog.text  # the choice is logged
    monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
    with dockd.connect(cluster.address) as d:
        assert d._ctrl.transport == "tcp" and d._pool(1).transport == "tcp"


def test_daemon_without_shm_serves_tcp():
    proc, ready = spawn_node(["--controller", "--port", "0", "--no-shm"])
    try:
        with dockd.connect(f"127.0.0.1:{ready['port']}") as d:
            assert d._ctrl.transport == "tcp" and d._pool(0).transport == "tcp"
            d.put({"x": torch.ones(4, 1 << 17)}, partition="p")
            assert torch.equal(torch.stack(d.get("c", ["x"], 4, partition="p", timeout=5)["x"]), torch.ones(4, 1 << 17))
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_large_values_round_trip_on_both_paths(cluster, partition, monkeypatch, transport):
    if transport == "tcp":
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
    data = torch.randn(8, 1 << 16).to(torch.bfloat16)  # 128 KiB per sample: passed by descriptor on shm
    with dockd.connect(cluster.address, warehouse=1) as w, dockd.connect(cluster.address, warehouse=0) as r:
        w.put({"x": data, "small": list(range(8))}, partition=partition)
        b = r.get("c", ["x", "small"], 8, partition=partition, timeout=10)
        assert torch.equal(torch.stack(b["x"]).view(torch.int16), data.view(torch.int16))
        assert b["small"] == list(range(8))


def test_returned_tensors_are_private_and_outlive_a_clear(cluster, partition):
    data = torch.arange(4 * (1 << 16), dtype=torch.float32).reshape(4, -1)
    with dockd.connect(cluster.address, warehouse=1) as d:
        d.put({"x": data}, partition=partition)
        first = d.get("a", ["x"], 4, partition=partition, timeout=10)["x"]
        first[0].fill_(-1)  # writing to a returned tensor copies that page only
        second = d.get("b", ["x"], 4, partition=partition, timeout=10)["x"]
        assert torch.equal(torch.stack(second), data)
        d.clear(partition)
        # the memory the reader maps stays valid after the warehouse freed it
        assert torch.equal(torch.stack(second), data)
        assert (first[0] == -1).all() and torch.equal(torch.stack(first[1:]), data[1:])


def test_no_descriptor_or_segment_leaks_even_when_a_client_is_killed(partition, client):
    assert dockd_shm_names() == set()
    with dockd.start_local(2) as c:
        pids = [p.pid for p in c.procs]
        with dockd.connect(c.address, warehouse=1) as d:
            d.put({"warm": torch.zeros(1)}, partition="warm")
            base = [open_fds(p) for p in pids]
            for k in range(5):
                d.put({"x": torch.randn(4, 1 << 17)}, partition=partition)
            assert open_fds(pids[1]) >= base[1] + 5  # each shared-memory put body is one segment
            code = """
import os, sys, torch, dockd
d = dockd.connect(sys.argv[1], warehouse=1)
d.put({"x": torch.randn(2, 1 << 18)}, partition=sys.argv[2])
b = d.get("killed", ["x"], 12, partition=sys.argv[2], timeout=10)
os.kill(os.getpid(), 9)
"""
            out = client(code, c.address, partition, check=False)
            assert out.returncode == -9
            assert d.clear(partition) == 22
            assert [open_fds(p) for p in pids] == base
    assert dockd_shm_names() == set()


def test_odd_sized_large_bodies_on_both_paths(cluster, partition, monkeypatch):
    """Bodies that are not a whole number of huge pages (their segments are padded)."""
    data = torch.randint(0, 255, (3, 1_234_567), dtype=torch.uint8)
    with dockd.connect(cluster.address, warehouse=1) as d:
        d.put({"x": data}, partition=partition)
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
        with dockd.connect(cluster.address, warehouse=1) as t:
            t.put({"x": data}, partition=partition)
            b = t.get("c", ["x"], 6, partition=partition, timeout=10)
        assert all(torch.equal(v, data[i % 3]) for i, v in enumerate(b["x"]))
        assert torch.equal(torch.stack(d.read(partition, [0, 1, 2], ["x"])["x"]), data)
