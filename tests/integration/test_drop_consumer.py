"""drop_consumer against real daemons: one get under a consumer name nobody runs makes every later put
of a max_pending partition wait for it; dropping the name lets them in at once, `dockd status` shows
which consumer they wait for, and the drop survives a controller SIGKILL with a state dir."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

import dockd
from tests.conftest import wait_until
from tests.integration.test_cluster import DurableController, Procs

pytestmark = pytest.mark.timeout(120)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def _status(address: str) -> str:
    env = dict(os.environ, COLUMNS="80")
    out = subprocess.run([sys.executable, "-m", "dockd", "status", address, "--interval", "0"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_dropping_an_unused_consumer_lets_paced_puts_in(cluster, partition):
    with dockd.connect(cluster.address, warehouse=1) as producer, dockd.connect(cluster.address) as trainer, \
            dockd.connect(cluster.address) as typo:
        producer.create_partition(partition, max_pending=4)
        producer.put({"x": torch.ones(4, 8)}, partition=partition)
        trainer.get("train", ["x"], 4, partition=partition, timeout=10)
        typo.get("trian", ["x"], 1, partition=partition, timeout=10)  # one get under a misspelt name
        lease = typo.acquire("trian", ["x"], 1, partition=partition, timeout=10)
        producer.put({"x": torch.ones(2, 8)}, partition=partition)
        trainer.get("train", ["x"], 2, partition=partition, timeout=10)
        st = producer.stats()["partitions"][partition]
        assert (st["pending"], st["pending_by"]) == (4, {"trian": 4, "train": 0})

        put, put_out = _in_thread(lambda: producer.put({"x": torch.ones(1, 8)}, partition=partition, timeout=60))
        get, get_out = _in_thread(lambda: typo.get("trian", ["x"], 100, partition=partition, timeout=60))
        wait_until(lambda: (p := producer.stats()["partitions"][partition])["paced_puts"] == 1
                   and p["consumers"]["trian"]["waiting"] == 1, 20, "the put and the get to wait")
        line = next(l for l in _status(cluster.address).splitlines() if "trian" in l)
        assert "holds puts back" in line

        assert producer.drop_consumer(partition, "trian") is True
        put.join(20)
        get.join(20)
        assert put_out.get("value") == [6], put_out
        assert isinstance(get_out.get("error"), dockd.DockClosed) and "dropped" in str(get_out["error"])
        with pytest.raises(dockd.DockLeaseError):
            typo.confirm(lease)  # its lease ended with it
        st = producer.stats()["partitions"][partition]
        assert set(st["consumers"]) == {"train"} and st["pending"] == 1
        assert producer.drop_consumer(partition, "trian") is False
        with pytest.raises(dockd.DockNotFound):
            producer.drop_consumer(partition + "-none", "trian")
        with pytest.raises(dockd.DockValueError):
            producer.drop_consumer(partition, "")
        # the name again: a fresh consumer, which sees every sample
        assert typo.get("trian", ["x"], 7, partition=partition, timeout=10).indexes == list(range(7))


def test_async_dock_drops_a_consumer(cluster, partition):
    async def main():
        async with await dockd.connect_async(cluster.address) as d:
            await d.put({"x": torch.ones(2, 2)}, partition=partition)
            await d.get("t", ["x"], 1, partition=partition, timeout=5)
            assert await d.drop_consumer(partition, "t") is True
            assert (await d.get("t", ["x"], 2, partition=partition, timeout=5)).indexes == [0, 1]

    asyncio.run(main())


def test_a_drop_survives_a_controller_sigkill_with_a_state_dir(tmp_path):
    procs = Procs()
    try:
        dock = DurableController(procs, str(tmp_path / "state"))
        with dockd.connect(dock.address, reconnect_timeout=60) as d:
            d.create_partition("p", max_pending=2)
            d.put({"x": torch.ones(2, 4)}, partition="p")
            d.get("train", ["x"], 2, partition="p", timeout=10)
            d.get("typo", ["x"], 1, partition="p", timeout=10)
            d.put({"x": torch.ones(1, 4)}, partition="p")  # pending: 2 (typo's)
            with pytest.raises(dockd.DockFull, match="drop_consumer"):
                d.put({"x": torch.ones(1, 4)}, partition="p", timeout=0.5)
            assert d.drop_consumer("p", "typo")
            dock.restart()
            st = wait_until(lambda: (s := d.stats()) and s["partitions"]["p"], what="the controller back")
            wait_until(lambda: {w["state"] for w in d.stats()["warehouses"].values()} == {"joined"},
                       what="the warehouse to rejoin")
            assert set(st["consumers"]) == {"train"} and st["pending"] == 1
            assert d.put({"x": torch.ones(1, 4)}, partition="p", timeout=10) == [3]  # 1 pending of 2: it fits
            assert d.get("typo", ["x"], 4, partition="p", timeout=10).indexes == [0, 1, 2, 3]
    finally:
        procs.close()
