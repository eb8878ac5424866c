"""Same-host puts sent before their writer's copy (`PutRequest.staging_pending`, `dockd.warehouse.pending`):
the request goes first, the tensors (per-sample, or several runs) are copied into the staging buffer right after the send, and
the warehouse commits the put only once the writer's eventfd says the copy is done. One whose connection
closes, or whose timeout runs out, before that signal is dropped: nothing committed, stored or acknowledged."""

from __future__ import annotations

import os

import pytest
import torch

import dockd
from dockd.client.put import put_request
from dockd.errors import DockTimeout
from dockd.net import same_host

pytestmark = pytest.mark.skipif(not same_host.available(), reason="needs Linux memfd and SCM_RIGHTS")


def lists(i: int, n: int = 16) -> dict:
    """n samples of per-sample tensors (six of them ragged, ~2 MiB in all) and two msgpack columns."""
    cols: dict = {f"t{k}": [torch.full((4096 + 37 * j,), float(1000 * i + 10 * k + j)) for j in range(n)]
                  for k in range(6)}
    cols["uid"] = [f"put-{i}-{j}" for j in range(n)]
    cols["reward"] = [float(i) + j / 100 for j in range(n)]
    return cols


def same(got, cols: dict) -> bool:
    return all(got[k] == v if k in ("uid", "reward") else all(torch.equal(a, b) for a, b in zip(got[k], v))
               for k, v in cols.items())


def as_jagged(cols: dict) -> dict:
    """The tensor columns of `lists` as jagged nested tensors (several tensor runs, no per-sample tensors)."""
    return {k: torch.nested.as_nested_tensor(v, layout=torch.jagged) if k.startswith("t") else v
            for k, v in cols.items()}


@pytest.mark.parametrize("form", ["lists", "jagged"])
@pytest.mark.parametrize("wid", [0, 1], ids=["controller-s-warehouse", "another-warehouse"])
def test_puts_sent_before_their_copy_read_back_whole(cluster, partition, wid, form):
    """Each put but a buffer's first goes before its tensors are copied (the first registers the buffer,
    the next its eventfd); each, read at once by another client, holds what was put, in put order. So do
    puts of jagged columns (one tensor run each)."""
    with dockd.connect(cluster.address, warehouse=wid) as w, dockd.connect(cluster.address) as r:
        for i in range(12):
            cols = lists(i)
            assert w.put(as_jagged(cols) if form == "jagged" else cols, partition=partition) == list(
                range(16 * i, 16 * i + 16))
            b = r.get("c", list(cols), 16, partition=partition, timeout=10)
            assert same(b, cols)
            del b
        staging = w._router.pool(wid).via.staging
        bufs = staging._free + [b for b, _ in staging._lent]
        assert bufs and all(b.registered and b.signals for b in bufs)


def _unsent_copy(d: dockd.Dock, wid: int, partition: str, timeout: float | None):
    """A put to warehouse `wid` as its transport sends it before its copy, with that copy never made."""
    for i in range(6):  # (every staging buffer registered, with its eventfd)
        d.put(lists(i, n=4), partition=f"{partition}-warm")
    d.clear(f"{partition}-warm")
    pool = d._router.pool(wid)
    bufs = pool.via.staging._free + [b for b, _ in pool.via.staging._lent]
    assert bufs and all(b.signals for b in bufs)
    put, _ = put_request(lists(99), partition=partition, indexes=None, group_size=1, timeout=timeout, tags=None,
                         device=None, version=None)
    request = pool.via.put_request(put)
    assert request.frame.put.staging_pending
    pool.via._copies.put = None  # (the copy `idle` would make right after the send: never made)
    return pool, request


@pytest.mark.parametrize("wid", [0, 1], ids=["controller-s-warehouse", "another-warehouse"])
def test_a_put_whose_timeout_runs_out_before_the_copy_is_dropped(cluster, partition, wid):
    with dockd.connect(cluster.address, warehouse=wid) as d:
        pool, request = _unsent_copy(d, wid, partition, timeout=0.2)
        conn = pool.get()
        try:
            with pytest.raises(DockTimeout, match="did not finish copying"):
                conn.call(request.frame, fds=request.fds, timeout=30)
        finally:
            conn.close()
        os.eventfd_write(request.answer.__self__.buf.efd, 1)  # a copy done too late changes nothing
        cols = lists(5)
        assert d.put(cols, partition=partition) == list(range(16))  # (no index went to the dropped put)
        assert d.stats()["partitions"][partition]["samples"] == 16
        assert same(d.get("c", list(cols), 16, partition=partition, timeout=10), cols)


def test_a_put_whose_connection_closes_before_the_copy_is_dropped_and_its_room_given_back(partition):
    """The warehouse holds room for one such put only (--capacity 3 MiB): the next put fits once the
    dropped one's room is given back."""
    with dockd.start_local(1, capacity="3MiB") as cluster, dockd.connect(cluster.address) as d:
        pool, request = _unsent_copy(d, 0, partition, timeout=None)  # (no timeout: only the close ends it)
        conn = pool.get()
        conn.send(request.frame, fds=request.fds)
        conn.close()
        cols = lists(6)
        assert d.put(cols, partition=partition, timeout=30) == list(range(16))
        assert d.stats()["partitions"][partition]["samples"] == 16
        assert same(d.get("c", list(cols), 16, partition=partition, timeout=10), cols)
