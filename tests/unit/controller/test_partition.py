"""What an empty partition costs the controller, and partitions that start empty and grow."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from dockd.controller.core import Controller

N = 4096


def _bytes_each(make) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        make()
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / N
    finally:
        tracemalloc.stop()


def test_an_empty_partition_costs_about_a_kibibyte():
    """65,536 partitions are allowed per dock: at ~10 KiB each (arrays for 1024 samples made up front)
    the empty ones alone took a controller from 274 to 921 MiB."""
    c = Controller()

    def create():
        for i in range(N):
            c.create_partition(f"created-{i}", max_pending=8, retire=["train"])

    def seal():
        for i in range(N):
            c.seal(f"sealed-{i}")

    for make in (create, seal):
        each = _bytes_each(make)
        assert each < 1.5 * 1024, f"{make.__name__}: an empty partition costs {each:.0f} bytes"
    assert c.catalog.cells.used == 0  # (and holds no per-consumer memory)


def test_a_partition_created_empty_grows_with_its_samples_and_consumers():
    c = Controller()
    c.create_partition("p", group_size=4)
    assert c.ready_count("p", "early", ["x"], groups=True) == 0
    assert c.acquire("p", "early", ["x"], 4, groups=True) is None  # (waits: nothing written yet)
    assert c.metadata_bytes("p") < 64
    c.commit("p", ["x"], warehouse=0, new_count=4, group_size=4)
    res = c.acquire("p", "early", ["x"], 4, groups=True)
    assert res is not None and res.indexes.tolist() == [0, 1, 2, 3]
    c.confirm(res.lease)
    n = 3 * 1024  # past the first arrays (1024 samples), twice
    c.commit("p", ["x"], warehouse=0, new_count=n, group_size=4)
    c.commit("p", ["y"], warehouse=1, indexes=np.arange(4, 4 + n))
    assert c.partitions["p"].capacity == 4 * 1024
    assert c.ready_count("p", "early", ["x", "y"], groups=True) == n
    res = c.acquire("p", "late", ["y"], n, allow_partial=True)
    assert res is not None and res.indexes.tolist() == list(range(4, 4 + n))
    assert (res.locations == 1).all()
    c.clear("p")
    assert c.catalog.cells.used == 0
