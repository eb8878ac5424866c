"""A client's leases belong to its session, and a Dock is one session over all its connections to
the controller, whatever its random session id drew.

Seen in benchmarks/prefetch_stream.py --whole: the trainer's four threads (one Dock) all failed
together with "lease ... expired or was released while the get took 2.0s", and the controller
logged "confirms refused ... another_clients=1". The Dock's session was 16 random bytes, and a
controller gives a claimed session that starts with a zero byte to no one (that prefix is kept for
connections without a session): such a Dock, one in 256, was a session per connection, so a lease
acquired over one connection and confirmed over another was "another client's". The get that
confirmed itself raised; a get confirmed later returned its samples, and they went out again when
the lease expired or its connection closed (delivered twice). Here the draw is made to start with
a zero byte, and the confirm is made to go over a second connection: the acquire's is taken by a
get that waits in the controller.
"""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import dockd
from dockd.client import get as get_module
from dockd.client.fetch import Fetcher
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("confirm_now_after", [0.0, 3600.0], ids=["confirmed-before-returning", "confirmed-later"])
def test_a_dock_whose_session_draw_starts_with_a_zero_byte_confirms_over_any_connection(
        cluster, partition, monkeypatch, confirm_now_after):
    draw = secrets.token_bytes
    monkeypatch.setattr(secrets, "token_bytes", lambda n=32: b"\0" + draw(n - 1))  # the draw of 1 Dock in 256
    d = dockd.connect(cluster.address)
    monkeypatch.setattr(secrets, "token_bytes", draw)
    # a get confirms its lease before returning when it took longer than this (the benchmark's 2 s get)
    monkeypatch.setattr(get_module, "CONFIRM_NOW_AFTER_S", confirm_now_after)
    fetching, go = threading.Event(), threading.Event()
    fetch = Fetcher.fetch

    def held(self, lease, **kwargs):  # the get's fetch waits for `go`, its acquire answered
        if lease.partition == partition and lease.columns == ["x"] and len(lease.indexes) == 4:
            fetching.set()
            assert go.wait(30)
        return fetch(self, lease, **kwargs)

    monkeypatch.setattr(Fetcher, "fetch", held)
    with dockd.connect(cluster.address) as other:
        other.put({"x": torch.arange(4)}, partition=partition)
        with d, ThreadPoolExecutor(2) as threads:
            got = threads.submit(d.get, "c", ["x"], 4, partition=partition, timeout=30)
            assert fetching.wait(30)
            # another thread's get takes the connection the lease came over, and waits there for a 5th sample
            waiting = threads.submit(d.get, "w", ["x"], 5, partition=partition, timeout=30)
            wait_until(lambda: other.stats()["partitions"][partition]["consumers"].get("w", {}).get("waiting"),
                       what="the second get to wait in the controller")
            go.set()
            batch = got.result(30)  # (confirmed before returning: over another connection)
            assert batch.indexes == [0, 1, 2, 3] and [int(v) for v in batch["x"]] == [0, 1, 2, 3]
            d.stats()  # (confirmed later: a controller call delivers the pending confirm first, over another one)
            c = other.stats()["partitions"][partition]["consumers"]["c"]
            assert (c["taken"], c["leased"]) == (4, 0), f"the get's confirm was refused: {c}"
            other.put({"x": torch.arange(4, 5)}, partition=partition)
            assert waiting.result(30).indexes == [0, 1, 2, 3, 4]
        # the Dock closed: nothing it was given goes out again (ready: only the 5th sample)
        c = other.stats()["partitions"][partition]["consumers"]["c"]
        assert (c["taken"], c["leased"], c["ready"]) == (4, 0, 1), f"samples handed out twice: {c}"
