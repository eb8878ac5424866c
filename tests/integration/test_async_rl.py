"""Asynchronous RL against real daemons: policy versions and bounded staleness, producers paced by
max_pending (on the controller's own warehouse and on another one), views that take nothing, and
all of it across a controller SIGKILL with a state dir."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import dockd
from tests.conftest import scrape, value, wait_until
from tests.integration.test_cluster import Procs, _two_warehouse_dock, controller_args, free_port

pytestmark = pytest.mark.timeout(120)


def test_staleness_bound_oldest_version_first_and_stale_counts(dock, partition):
    dock.create_partition(partition, max_staleness=1)
    dock.put({"x": torch.zeros(2, 3)}, partition=partition, version=0)
    dock.put({"x": torch.ones(2, 3)}, partition=partition, version=3)
    dock.put({"x": torch.ones(2, 3)}, partition=partition, version=2)
    dock.put({"x": torch.ones(2, 3)}, partition=partition)  # no version: counts as 0
    assert dock.set_version(partition, 3) == 0
    st = dock.stats()["partitions"][partition]
    assert (st["version"], st["max_staleness"], st["stale"], st["pending"]) == (3, 1, 4, 8)
    batch = dock.get("train", ["x"], 4, partition=partition, timeout=5)
    assert batch.indexes == [4, 5, 2, 3]  # version 2 first, then 3
    with pytest.raises(dockd.DockTimeout):
        dock.get("train", ["x"], 1, partition=partition, timeout=0.2)  # only stale ones are left
    assert dock.get("replay", ["x"], 8, partition=partition, max_staleness=5, timeout=5).indexes == \
        [0, 1, 6, 7, 4, 5, 2, 3]
    with pytest.raises(dockd.DockValueError):
        dock.put({"x": torch.ones(1, 3)}, partition=partition, version=-1)
    with pytest.raises(dockd.DockNotFound):
        dock.set_version(partition + "-none", 1)


def test_a_get_waiting_for_a_put_to_the_controller_s_node_gets_its_values_in_one_round_trip(partition):
    """A trainer's get waits on the controller's node; a rollout's put lands in the warehouse there. The
    get is retried once the put is stored, so its answer carries the values (inline): before, it was
    retried inside the put's commit, found no values yet, and fetched them in a second round trip."""
    with dockd.start_local(1, capacity="256MiB", extra_args=["--metrics-port", "0"]) as cluster, \
            dockd.connect(cluster.address) as rollout, dockd.connect(cluster.address) as trainer:

        def fetches() -> float:
            return value(scrape(cluster.nodes[0]["metrics_port"]), "dockd_request_seconds_count", op="fetch")

        rollout.put({"x": torch.zeros(1, 8)}, partition=partition)  # (the partition, and warm connections)
        trainer.get("t", ["x"], 1, partition=partition, timeout=10)
        before = fetches()

        def take(into: dict) -> None:
            into["b"] = trainer.get("t", ["x"], 1, partition=partition, timeout=20)

        for i in range(1, 6):
            got: dict = {}
            t = threading.Thread(target=take, args=(got,))
            t.start()
            wait_until(lambda: rollout.stats()["partitions"][partition]["consumers"]["t"]["waiting"],
                       what="the trainer's get to wait")
            rollout.put({"x": torch.full((1, 8), float(i))}, partition=partition)
            t.join(30)
            assert torch.equal(got["b"]["x"][0], torch.full((8,), float(i)))
        assert fetches() == before, "a waiting get fetched the values its answer could have carried"


def test_retire_stale_deletes_and_frees_what_set_version_makes_stale(cluster, partition):
    with dockd.connect(cluster.address, warehouse=1) as d:  # (a warehouse of its own process)
        d.create_partition(partition, max_staleness=0, retire_stale=True)
        d.put({"x": torch.ones(4, 1024)}, partition=partition, version=0)
        d.put({"x": torch.ones(4, 1024)}, partition=partition, version=1)
        assert d.set_version(partition, 1) == 4
        st = d.stats()["partitions"][partition]
        assert (st["deleted"], st["stale_retired"], st["stale"]) == (4, 4, 0)
        assert d.list(partition)["indexes"] == [4, 5, 6, 7]
        assert d.get("t", ["x"], 4, partition=partition, timeout=5).indexes == [4, 5, 6, 7]


@pytest.mark.parametrize("home", [0, 1], ids=["controller_warehouse", "other_warehouse"])
def test_max_pending_paces_puts_until_consumers_take(cluster, partition, home):
    with dockd.connect(cluster.address, warehouse=home) as producer, dockd.connect(cluster.address) as consumer:
        producer.create_partition(partition, max_pending=4)
        producer.put({"x": torch.ones(4, 8)}, partition=partition)
        t0 = time.monotonic()
        with pytest.raises(dockd.DockFull, match="full of pending samples"):
            producer.put({"x": torch.ones(2, 8)}, partition=partition, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 2
        assert producer.stats()["partitions"][partition]["samples"] == 4  # the refused put left nothing

        took = []

        def consume():
            time.sleep(0.3)
            took.append(time.monotonic())
            consumer.get("train", ["x"], 2, partition=partition, timeout=5)

        th = threading.Thread(target=consume)
        th.start()
        assert producer.put({"x": torch.ones(2, 8)}, partition=partition, timeout=10) == [4, 5]
        done = time.monotonic()
        th.join()
        assert done - took[0] < 0.5  # woken by the get, not by a poll
        st = producer.stats()["partitions"][partition]
        assert (st["pending"], st["max_pending"], st["paced_puts"]) == (4, 4, 0)
        # puts of columns of existing samples are never paced
        producer.put({"y": torch.ones(2, 8)}, partition=partition, indexes=[4, 5], timeout=0)


def test_a_paced_put_fails_clearly_when_its_partition_is_cleared(dock, partition):
    dock.create_partition(partition, max_pending=1)
    dock.put({"x": torch.ones(1, 8)}, partition=partition)
    errors = []

    def blocked():
        try:
            dock.put({"x": torch.ones(1, 8)}, partition=partition, timeout=20)
        except dockd.DockError as e:
            errors.append(e)

    th = threading.Thread(target=blocked)
    th.start()
    wait_until(lambda: dock.stats()["partitions"][partition]["paced_puts"] == 1, 10, "the put to wait")
    dock.clear(partition)
    th.join(10)
    assert len(errors) == 1 and "cleared" in str(errors[0])


def test_views_depth_listing_and_ping(dock, partition):
    dock.put({"x": torch.ones(6, 2)}, partition=partition, tags={"age": [0, 1, 2, 0, 1, 2]}, version=7)
    dock.get("a", ["x"], 2, partition=partition, timeout=5)
    dock.get("b", ["x"], 5, partition=partition, timeout=5)
    assert dock.stats()["partitions"][partition]["depth"] == {"a": 4, "b": 1}
    everything = dock.list(partition)
    assert everything["indexes"] == list(range(6)) and everything["versions"] == [7] * 6
    assert everything["tags"]["age"] == [0, 1, 2, 0, 1, 2]
    assert dock.list(partition, "a", where={"age": 2})["indexes"] == [2, 5]
    assert dock.list(partition, "b", limit=1)["indexes"] == [5]
    assert dock.get("a", ["x"], 4, partition=partition, timeout=5).indexes == [2, 3, 4, 5]  # listing took nothing
    assert 0 < dock.ping() < 1


async def _async_calls(address, partition):
    async with await dockd.connect_async(address) as d:
        await d.create_partition(partition, max_staleness=0, max_pending=8)
        await d.put({"x": torch.ones(2, 2)}, partition=partition, version=1)
        assert await d.set_version(partition, 1) == 0
        assert (await d.list(partition))["versions"] == [1, 1]
        assert (await d.get("t", ["x"], 2, partition=partition, timeout=5)).indexes == [0, 1]
        assert await d.ping() > 0


def test_async_dock_mirrors_the_new_calls(cluster, partition):
    import asyncio

    asyncio.run(_async_calls(cluster.address, partition))


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_versions_and_options_survive_a_controller_sigkill_with_a_state_dir(tmp_path):
    procs = Procs()
    try:
        port = free_port()
        state = str(tmp_path / "state")
        ctl, address = _two_warehouse_dock(procs, port, "--state-dir", state)
        with dockd.connect(address, warehouse=1, reconnect_timeout=60) as d:
            d.create_partition("p", max_staleness=1, retire_stale=True, max_pending=6)
            d.put({"x": torch.ones(2, 4)}, partition="p", version=0)
            d.put({"x": torch.ones(2, 4)}, partition="p", version=2)
            d.put({"x": torch.ones(2, 4)}, partition="p", version=3)
            assert d.set_version("p", 3) == 2
            before = d.stats()["partitions"]["p"]
            ctl.send_signal(signal.SIGKILL)
            ctl.wait()
            procs.start(*controller_args(port, "--state-dir", state))
            st = wait_until(lambda: (s := d.stats()) and s["partitions"]["p"], what="the controller back")
            wait_until(lambda: {w["state"] for w in d.stats()["warehouses"].values()} == {"joined"},
                       what="both warehouses to rejoin")
            keys = ("version", "max_staleness", "retire_stale", "max_pending", "stale_retired", "deleted", "pending")
            assert {k: st[k] for k in keys} == {k: before[k] for k in keys}
            assert d.list("p")["versions"] == [2, 2, 3, 3]
            d.put({"x": torch.ones(2, 4)}, partition="p", version=3)  # 4 pending of 6: one more fits, then none
            with pytest.raises(dockd.DockFull):
                d.put({"x": torch.ones(1, 4)}, partition="p", version=3, timeout=1)
            assert d.get("t", ["x"], 4, partition="p", timeout=10).indexes == [2, 3, 4, 5]
    finally:
        procs.close()
