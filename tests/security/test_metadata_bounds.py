"""Metadata an adversary inside the limits of one request could pile up without end (finding 8
of the second review): consumer names, parked gets, empty samples, partitions. Each is counted
against a bound, refused with a clear error, and the daemon keeps serving."""

from __future__ import annotations

import pytest
import torch

import dockd
from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.controller.core import Controller
from tests.conftest import serving

pytestmark = pytest.mark.timeout(180)


def test_consumer_names_per_partition_are_bounded(dock, partition):
    dock.put({"x": torch.zeros(1)}, partition=partition)
    for k in range(limits.MAX_CONSUMERS):
        dock.get(f"c{k}", ["x"], 1, partition=partition, timeout=5)
    with pytest.raises(dockd.DockValueError, match="consumers"):
        dock.get("one-too-many", ["x"], 1, partition=partition, timeout=5)
    dock.put({"x": torch.ones(1)}, partition=partition)  # known consumers go on as before
    assert dock.get("c0", ["x"], 1, partition=partition, timeout=5).indexes == [1]


def test_gets_parked_on_one_connection_are_bounded(cluster, raw, partition):
    c = raw(cluster.address)
    for k in range(limits.MAX_PARKED + 1):
        c.send(pb.Frame(id=k + 1, acquire=pb.AcquireRequest(partition=partition, consumer="c", columns=["x"], count=1,
                                                            timeout=60)))
    reply = c.read()  # only the one past the bound is answered now
    assert reply.id == limits.MAX_PARKED + 1 and "wait for data already" in reply.status.message, reply
    with dockd.connect(cluster.address) as d:  # another connection is not held back
        d.put({"x": torch.zeros(2)}, partition=partition)
        assert len(d.get("other", ["x"], 2, partition=partition, timeout=10)) == 2


@pytest.fixture
def small_node():
    with serving("--controller", "--port", "0", "--capacity", "4MiB", "--max-samples", "400000") as (address, _):
        yield address


def test_empty_samples_count_against_capacity_and_the_dock_bounds_samples(small_node):
    """40M zero-byte samples grew a warehouse by 1.77 GiB while it reported 0 bytes used."""
    with dockd.connect(small_node) as d:
        d.put({"x": torch.zeros(300_000, 0)}, partition="p")  # 4.8 MB of bookkeeping, no payload
        with pytest.raises(dockd.DockFull, match="bookkeeping"):
            d.put({"x": torch.zeros(1000, 0)}, partition="p", timeout=0.5)
        d.clear("p")
        d.put({"x": torch.zeros(200_000, 0)}, partition="q")
        with pytest.raises(dockd.DockFull, match="max-samples"):
            d.reserve("q", 200_001)
        assert len(d.reserve("q", 200_000)) == 200_000


def test_partitions_of_a_dock_are_bounded(monkeypatch):
    monkeypatch.setattr(limits, "MAX_PARTITIONS", 3)
    c = Controller()
    for p in "abc":
        c.commit(p, ["x"], warehouse=0, new_count=1)
    with pytest.raises(dockd.DockFull, match="partitions"):
        c.commit("d", ["x"], warehouse=0, new_count=1)
    c.clear("a")
    c.commit("d", ["x"], warehouse=0, new_count=1)
