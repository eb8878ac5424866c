"""What a warehouse keeps after the thing it belongs to is gone (found by scripts/soak.py).

- Freed segments wait idle for a put of their size class. Classes below 2 MiB were
  exact byte counts, so a segment was reused only by a put of exactly its size:
  ragged GRPO-like puts left one idle segment (a descriptor and its pages) per put,
  until the pool's bounds (a quarter of the capacity, up to 4096 descriptors).
- A same-host writer's staging buffers stayed mapped by the warehouse after the
  writer closed its connections, for as long as its process lived.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import dockd
from dockd.net import memfd, same_host
from dockd.warehouse.segments import Segments, size_class

pytestmark = pytest.mark.skipif(not same_host.available(), reason="Linux shared memory only")


def test_a_freed_segment_is_reused_by_a_put_of_about_its_size():
    pool = Segments(keep_bytes=1 << 30)
    a = pool.take(300_000)
    pool.release(a)
    assert size_class(300_001) == size_class(300_000) == a.size
    b = pool.take(300_001)  # one byte more: the same class, so the same warm segment
    assert b is a and pool.reused == 1 and b.buffer.size == 300_001
    assert size_class(300_000) < 300_000 * 5 // 4  # a class wastes at most a quarter
    assert size_class(5 << 20) % memfd.HUGE == 0 and size_class(300_000) % memfd.PAGE == 0


def test_the_idle_pool_keeps_the_most_recently_freed_segments():
    pool = Segments(keep_bytes=1 << 30, keep_count=3)
    sizes = [300_000 << k for k in range(6)]  # six classes
    segs = [pool.take(n) for n in sizes]
    for seg in segs:
        pool.release(seg)
    assert pool.idle_count == 3
    # the newest three are kept (the pool follows the sizes puts have now), the oldest closed
    assert [pool.take(n) is seg for n, seg in zip(sizes, segs)] == [False] * 3 + [True] * 3
    assert pool.idle_count == 0 and pool.idle_bytes == 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _staging_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("dockd-staging" in line for line in f)


def _ragged(rng, n: int) -> dict:
    return {"x": [np.ones(int(k), dtype=np.int64) for k in rng.integers(256, 2048, n)]}


def test_ragged_puts_and_clears_do_not_pile_up_idle_segments():
    rng = np.random.default_rng(0)
    with dockd.start_local(num_warehouses=1) as cluster, dockd.connect(cluster.address) as dock:
        pid = cluster.procs[0].pid
        for step in range(80):  # ~300 KiB puts, each of its own size
            if step == 20:  # warm: connections, staging buffers, the segments in flight at once
                before = _fds(pid)
            dock.put(_ragged(rng, 32), partition=f"p{step}")
            dock.get("c", ["x"], 32, partition=f"p{step}", timeout=10)
            dock.clear(f"p{step}")
        # a few classes stay warm; before, one idle segment per put of a new size did
        assert _fds(pid) - before < 20, f"{_fds(pid) - before} more descriptors after 60 more puts and clears"


def test_a_writer_that_closed_its_connections_leaves_no_staging_mapped():
    rng = np.random.default_rng(1)
    with dockd.start_local(num_warehouses=1) as cluster:
        pid = cluster.procs[0].pid
        dock = dockd.connect(cluster.address)
        dock.put(_ragged(rng, 64), partition="p")  # a same-host put through a staging buffer
        assert _staging_maps(pid) >= 1
        dock.close()  # this process lives on; its staging buffers are of no use to the warehouse now
        deadline = time.monotonic() + 10
        while _staging_maps(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _staging_maps(pid) == 0
        with dockd.connect(cluster.address) as dock:  # a new connection registers its buffers again
            dock.put(_ragged(rng, 64), partition="p")
            assert dock.get("c", ["x"], 128, partition="p", timeout=10).indexes == list(range(128))
