"""Delivery guarantees across processes: leases, shared streams, backpressure, loss, wake-ups."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import dockd
from tests.conftest import scrape, value, wait_until

pytestmark = pytest.mark.timeout(180)


def blocked_gets(address: str, n: int = 1, timeout: float = 30.0) -> None:
    """Wait until the controller holds `n` blocked gets (the precondition of a wake-up test)."""
    with dockd.connect(address) as probe:
        wait_until(lambda: probe.stats()["waiting"] >= n, timeout, what=f"{n} gets to block", interval=0.02)

READER = """
import sys, json, dockd
address, part, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
got = []
with dockd.connect(address) as dock:
    while True:
        try:
            b = dock.get("trainer", ["x"], 7, partition=part, timeout=2.0, allow_partial=True)
        except dockd.DockTimeout:
            break
        got += b.indexes
print(json.dumps(got))
"""


def test_same_consumer_in_several_processes_shares_the_stream(cluster, dock, partition):
    n = 300
    dock.put({"x": torch.arange(n)}, partition=partition)
    procs = [subprocess.Popen([sys.executable, "-c", READER, cluster.address, partition, str(n)], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    everything = sum(outs, [])
    assert sorted(everything) == list(range(n))  # each sample to exactly one of them
    # a different consumer name still sees every sample
    assert dock.get("other", ["x"], n, partition=partition, timeout=5).indexes == list(range(n))


def test_lease_of_a_killed_client_returns_to_the_pool(cluster, dock, partition, client):
    dock.put({"x": torch.arange(8)}, partition=partition)
    code = """
import os, sys, dockd
d = dockd.connect(sys.argv[1])
lease = d.acquire("train", ["x"], 5, partition=sys.argv[2], timeout=10)
print(lease.indexes, flush=True)
os.kill(os.getpid(), 9)  # dies before fetching or confirming
"""
    out = client(code, cluster.address, partition, check=False)
    assert out.returncode == -9 and out.stdout.strip() == "[0, 1, 2, 3, 4]"
    b = dock.get("train", ["x"], 8, partition=partition, timeout=10)
    assert b.indexes == list(range(8))


def test_a_lease_outlives_the_connection_that_took_it_while_its_client_has_another(partition):
    # A client replaces its controller connection while it holds a lease (a reconnect after a
    # controller restart, a better transport): the connection that took the lease closes first.
    # The lease is the client's (its session's), and the client is still connected.
    with dockd.start_local(1, extra_args=["--metrics-port", "0"]) as c, dockd.connect(c.address) as writer, \
            dockd.connect(c.address) as reader:
        metrics = c.nodes[0]["metrics_port"]
        writer.put({"x": torch.arange(4)}, partition=partition)
        lease = reader.acquire("c", ["x"], 4, partition=partition, timeout=10)
        pool = reader._router.ctrl
        took = pool.get()  # the connection the acquire went over (the only one: the values came inline)
        spare = pool.get()  # a new connection of the same client, authenticated, with no request yet
        pool.put(spare)
        open_before = value(scrape(metrics), "dockd_connections")
        took.close()
        wait_until(lambda: value(scrape(metrics), "dockd_connections") < open_before,
                   what="the daemon to see the connection close")
        reader.confirm(lease)  # over the spare connection: the lease is still this client's
        assert writer.stats()["partitions"][partition]["consumers"]["c"]["taken"] == 4


def test_a_call_in_flight_while_the_client_replaces_its_controller_connections_gets_its_answer(partition):
    # Another thread of the client replaces its controller connections (a reconnect, a better
    # transport) while a confirm waits for its answer. Closing the connection under that confirm
    # made it look failed though the controller applied it, and the confirm sent again was refused.
    from dockd.net.transport import Endpoint

    with dockd.start_local(1) as c, dockd.connect(c.address) as d:
        d.put({"x": torch.arange(4)}, partition=partition)
        lease = d.acquire("c", ["x"], 4, partition=partition, timeout=10)
        router, daemon, out = d._router, c.procs[0], {}
        old = router.ctrl
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            def confirm():
                try:
                    d.confirm(lease)
                    out["error"] = None
                except dockd.DockError as e:
                    out["error"] = e

            t = threading.Thread(target=confirm)
            t.start()
            wait_until(lambda: len(old._all) > len(old._idle), what="the confirm to be in flight")
            router._replace_ctrl(router.dialer.plain(Endpoint(router.host, router.port)))
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        t.join(30)
        assert out == {"error": None}
        assert old.closed  # (its last call done, the replaced pool closed)
        assert d.stats()["partitions"][partition]["consumers"]["c"]["taken"] == 4


def test_a_put_in_flight_while_another_thread_drops_its_warehouse_connections_gets_its_answer(partition):
    # Another thread drops the connections to the put's warehouse (its own call to it failed, e.g. on a
    # stale connection) while the put waits for its answer. Closing them under the put made it fail
    # with DockClosed ("the dock client was closed") on an open client, its outcome unknown.
    with dockd.start_local(1) as c, dockd.connect(c.address) as d:
        d.put({"x": torch.arange(4)}, partition=partition)
        router, daemon, out = d._router, c.procs[0], {}
        wid = router.home
        old = router.pools[wid]
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            def put():
                try:
                    out["indexes"] = d.put({"x": torch.arange(4, 8)}, partition=partition)
                except dockd.DockError as e:
                    out["error"] = e

            t = threading.Thread(target=put)
            t.start()
            wait_until(lambda: len(old._all) > len(old._idle), what="the put to be in flight")
            router.forget(wid)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        t.join(30)
        assert out == {"indexes": [4, 5, 6, 7]}
        assert old.closed and router.pools.get(wid) is not old  # (its last call done, the dropped pool closed)
        assert d.put({"x": torch.arange(8, 10)}, partition=partition) == [8, 9]  # (over new connections)
        assert d.stats()["partitions"][partition]["samples"] == 10


def test_unconfirmed_lease_expires(partition):
    with dockd.start_local(1, lease_timeout=0.5) as c, dockd.connect(c.address) as d:
        d.put({"x": torch.arange(4)}, partition=partition)
        lease = d.acquire("c", ["x"], 4, partition=partition, timeout=5)
        assert lease.indexes == [0, 1, 2, 3]
        # the samples come back once the lease times out; get waits for that event
        assert d.get("c", ["x"], 4, partition=partition, timeout=10).indexes == [0, 1, 2, 3]


def test_full_warehouse_applies_backpressure_then_dockfull(partition):
    with dockd.start_local(1, capacity="1MiB") as c, dockd.connect(c.address) as d:
        d.put({"x": [torch.zeros(200_000)]}, partition=partition)  # 800 kB of 1 MiB
        with pytest.raises(dockd.DockFull, match="stayed full"):
            d.put({"x": [torch.zeros(100_000)]}, partition=partition + "b", timeout=0.3)
        with pytest.raises(dockd.DockFull, match="can never fit"):
            d.put({"x": [torch.zeros(300_000)]}, partition=partition + "b", timeout=0.3)
        # a waiting put goes through as soon as a clear frees room
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("idx", d.put({"x": [torch.ones(100_000)]}, partition=partition + "b", timeout=30)))
        t.start()
        time.sleep(0.3)
        assert "idx" not in done
        d.clear(partition)
        t.join(30)
        assert done["idx"] == [0]
        assert torch.equal(d.get("c", ["x"], 1, partition=partition + "b", timeout=5)["x"][0], torch.ones(100_000))
        assert d.stats()["warehouses"][0]["bytes"] < 1 << 20


def test_a_put_that_waits_long_for_room_says_so_once(partition, monkeypatch, caplog):
    """A put without a timeout waits for room as long as it takes; from outside that looked like a hang.
    Past PUT_WAIT_WARN_S (30 s; 0.5 s here) the client logs once what it waits for, then the put lands."""
    from dockd.net import transport

    monkeypatch.setattr(transport, "PUT_WAIT_WARN_S", 0.5)
    with dockd.start_local(1, capacity="1MiB") as c, dockd.connect(c.address) as d:
        d.put({"x": [torch.zeros(200_000)]}, partition=partition)  # 800 kB of 1 MiB
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("idx", d.put({"x": [torch.ones(100_000)]},
                                                                        partition=partition + "b")))
        with caplog.at_level(logging.WARNING, logger="dockd.net.transport"):
            t.start()
            wait_until(lambda: "has waited" in caplog.text, timeout=15, what="the long wait to be logged")
            assert "idx" not in done
            d.clear(partition)
            t.join(30)
        assert done["idx"] == [0]
        said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        assert len(said) == 1 and repr(partition + "b") in said[0] and "waits for room" in said[0], said


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_dead_warehouse_makes_loss_visible(partition):
    with (dockd.start_local(2) as c,
          dockd.connect(c.address, warehouse=0) as d0,
          dockd.connect(c.address, warehouse=1) as d1):
        d0.put({"x": torch.arange(4)}, partition=partition)
        d1.put({"x": torch.arange(4, 8)}, partition=partition)
        c.procs[1].kill()
        c.procs[1].wait()
        # the controller probes the vanished warehouse's port (refused: gone) and records the loss
        wait_until(lambda: d0.stats()["warehouses"][1]["state"] == "lost",
                   what="the dead warehouse to be declared lost")
        assert d0.get("c", ["x"], 4, partition=partition, timeout=10).indexes == [0, 1, 2, 3]
        with pytest.raises(dockd.DockDataLost) as e:
            d0.get("c", ["x"], 4, partition=partition, timeout=10)
        assert e.value.indexes == [4, 5, 6, 7] and e.value.columns == ["x"]
        assert "left the dock" in str(e.value)


def test_fetch_from_a_vanished_warehouse_raises_data_lost(partition):
    with dockd.start_local(2) as c, dockd.connect(c.address, warehouse=1) as d:
        d.put({"x": torch.arange(4)}, partition=partition)
        lease = d.acquire("c", ["x"], 4, partition=partition, timeout=5)
        c.procs[1].kill()
        c.procs[1].wait()
        with pytest.raises(dockd.DockDataLost) as e:
            d.fetch(lease)
        assert e.value.indexes == [0, 1, 2, 3]


def test_closing_the_client_wakes_a_blocked_get(dock, partition):
    errors = []

    def wait_forever():
        try:
            dock.get("c", ["x"], 1, partition=partition)
        except dockd.DockError as e:
            errors.append(e)

    t = threading.Thread(target=wait_forever)
    t.start()
    blocked_gets(dock.address)
    dock.close()
    t.join(10)
    assert not t.is_alive() and isinstance(errors[0], dockd.DockClosed)


def test_controller_death_wakes_a_blocked_get(partition):
    """A controller that is gone for good ends a blocked get after the client's reconnect timeout."""
    c = dockd.start_local(1)
    try:
        d = dockd.connect(c.address, reconnect_timeout=1.0)
        errors = []
        t = threading.Thread(target=lambda: errors.append(pytest.raises(dockd.DockError, d.get, "c", ["x"], 1, partition=partition)))
        t.start()
        blocked_gets(c.address)
        c.procs[0].kill()
        t.join(10)
        assert not t.is_alive()
        assert isinstance(errors[0].value, dockd.DockConnectionError)
        d.close()
    finally:
        c.close()


def test_put_is_visible_when_it_returns_from_any_process(cluster, partition, client):
    """Every put is acknowledged after it is stored and committed: a reader started
    right after sees all of it with timeout=0 (no waiting allowed)."""
    code = """
import sys, torch, dockd
with dockd.connect(sys.argv[1], warehouse=1) as d:
    for k in range(20):
        d.put({"x": torch.full((5,), k)}, partition=sys.argv[2])
"""
    client(code, cluster.address, partition)
    with dockd.connect(cluster.address, warehouse=0) as d:
        b = d.get("c", ["x"], 100, partition=partition, timeout=0)
        assert [int(v) for v in b["x"]] == [k for k in range(20) for _ in range(5)]


def test_async_client(cluster, partition):
    async def main():
        async with await dockd.connect_async(cluster.address) as adock:
            async def blocked(n: int) -> None:
                while (await adock.stats())["waiting"] < n:
                    await asyncio.sleep(0.02)

            waiter = asyncio.ensure_future(adock.get("a", ["x"], 4, partition=partition, timeout=30))
            await asyncio.wait_for(blocked(1), 30)
            assert not waiter.done()
            idx = await adock.put({"x": torch.arange(4)}, partition=partition)
            batch = await waiter
            assert batch.indexes == idx == [0, 1, 2, 3]
            # cancelling a waiting get gives nothing away
            stuck = asyncio.ensure_future(adock.get("b", ["x"], 5, partition=partition))
            await asyncio.wait_for(blocked(1), 30)
            stuck.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stuck
            got = await adock.get("b", ["x"], 4, partition=partition, timeout=10)
            assert got.indexes == [0, 1, 2, 3]
            assert (await adock.stats())["partitions"][partition]["samples"] == 4
            assert (await adock.read(partition, [3], ["x"]))["x"][0].item() == 3
            assert await adock.clear(partition) == 4

    asyncio.run(main())


def test_many_concurrent_writers_and_readers(cluster, partition, client):
    writer = """
import sys, torch, dockd
with dockd.connect(sys.argv[1]) as d:
    for k in range(25):
        d.put({"x": [torch.tensor([int(sys.argv[3]), k])] * 4}, partition=sys.argv[2], group_size=4)
"""
    procs = [subprocess.Popen([sys.executable, "-c", writer, cluster.address, partition, str(w)]) for w in range(3)]
    with dockd.connect(cluster.address) as d:
        got = []
        while len(got) < 300:
            b = d.get("r", ["x"], 20, partition=partition, groups=True, timeout=60)
            got += [tuple(v.tolist()) for v in b["x"]]
    assert all(p.wait(60) == 0 for p in procs)
    assert sorted(set(got)) == sorted((w, k) for w in range(3) for k in range(25))
    assert len(got) == 300


def test_a_confirm_after_its_partition_was_cleared_is_not_a_lost_lease(cluster, partition, caplog):
    """A driver clears a step's partition while a reader's confirm is still on its way: the samples
    went with the clear, nothing was handed out again, so nobody warns that they were."""
    with dockd.connect(cluster.address) as w, dockd.connect(cluster.address) as r:
        w.put({"x": torch.arange(6)}, partition=partition)
        lease = r.acquire("c", ["x"], 3, partition=partition, timeout=10)
        assert sorted(r.fetch(lease)["x"]) == lease.indexes == [0, 1, 2]
        r.get("c", ["x"], 3, partition=partition, timeout=10)  # its confirm is batched: still pending
        w.clear(partition)
        with caplog.at_level(logging.WARNING, logger="dockd"):
            r.confirm(lease)  # no error: the clear took the samples
            r.stats()  # (delivers the batched confirm)
        assert "handed out again" not in caplog.text
        with pytest.raises(dockd.DockLeaseError, match="ended when its partition was cleared"):
            r.extend(lease)
