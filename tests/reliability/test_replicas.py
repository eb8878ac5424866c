"""Replicas (`dockd serve --controller --replicas 2`): every acknowledged put is held by two warehouses,
so a warehouse killed with SIGKILL and never restarted loses nothing: its values are served from
their replicas, bit-exact, and copied again until every value has two holders; a second loss after
that repair loses nothing either. A dock with one warehouse answers puts with one copy and
repairs them once a second warehouse joins. Real `dockd serve` processes on loopback."""

from __future__ import annotations

import signal

import numpy as np
import pytest

import dockd
from dockd.local import spawn_node
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)


def _values(k: int, n: int) -> dict:
    return {"x": np.arange(n * 16, dtype=np.float32).reshape(n, 16) + 1000 * k, "who": [k] * n}


def _replicas(dock, partition: str) -> tuple[int, int]:
    s = dock.stats()["partitions"][partition]
    return s["replicated"], s["under_replicated"]


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def _check_all(dock, partition: str, consumer: str, writers: int, n: int) -> None:
    got = dock.get(consumer, ["x", "who"], writers * n, partition=partition, timeout=30)
    assert sorted(got.indexes) == list(range(writers * n))
    xs, who = got["x"], got["who"]
    for k in range(writers):
        rows = [i for i, w in enumerate(who) if w == k]
        assert len(rows) == n
        expect = _values(k, n)["x"]
        back = np.stack([np.asarray(xs[i]) for i in rows])
        assert np.array_equal(back[np.argsort(back[:, 0])], expect), f"writer {k}'s values differ"


def test_a_warehouse_killed_for_good_loses_nothing_and_its_copies_are_made_again():
    n, partition = 6, "rollouts"
    cluster = dockd.start_local(num_warehouses=3, replicas=2, capacity="256MiB",
                                extra_args=["--warehouse-grace", "2"])
    try:
        addresses = [f"127.0.0.1:{node['port']}" for node in cluster.nodes]
        docks = [dockd.connect(cluster.address, warehouse=a) for a in addresses]
        for k, d in enumerate(docks):
            d.put(_values(k, n), partition=partition)
        # acknowledged puts are already on two warehouses each
        assert _replicas(docks[0], partition) == (3 * n * 2, 0)
        used = {wid: w["bytes"] for wid, w in docks[0].stats()["warehouses"].items()}
        assert len(used) == 3 and all(v > 0 for v in used.values()), used

        _kill(cluster.procs[2])  # a warehouse (not the controller's daemon), never restarted
        wait_until(lambda: docks[0].stats()["warehouses"][2]["state"] == "lost", 30, "warehouse 2 lost")
        _check_all(docks[0], partition, "after-first-loss", 3, n)
        # the values it held, and the replicas it kept for warehouse 1, are copied again
        wait_until(lambda: _replicas(docks[0], partition) == (3 * n * 2, 0), 30, "replicas made again")

        _kill(cluster.procs[1])  # a second loss, after the repair: still nothing lost
        wait_until(lambda: docks[0].stats()["warehouses"][1]["state"] == "lost", 30, "warehouse 1 lost")
        _check_all(docks[0], partition, "after-second-loss", 3, n)
        # one warehouse left: every value is there, none has a second holder
        assert _replicas(docks[0], partition) == (0, 3 * n * 2)
    finally:
        cluster.close()


def test_puts_made_with_one_warehouse_are_copied_once_a_second_one_joins():
    partition = "p"
    ctrl, ready = spawn_node(["--controller", "--port", "0", "--replicas", "2", "--capacity", "128MiB"])
    address = f"127.0.0.1:{ready['port']}"
    extra = None
    try:
        dock = dockd.connect(address)
        dock.put(_values(0, 4), partition=partition)
        assert _replicas(dock, partition) == (0, 8)  # answered with the one copy there is
        extra, _ = spawn_node(["--join", address, "--port", "0", "--capacity", "128MiB"])
        wait_until(lambda: _replicas(dock, partition) == (8, 0), 30, "the repair copied the puts")
        used = {wid: w["bytes"] for wid, w in dock.stats()["warehouses"].items()}
        assert used[1] == used[0] > 0, used  # the new warehouse holds a copy of everything
        got = dock.get("c", ["x"], 4, partition=partition, timeout=10)
        assert np.array_equal(np.stack([np.asarray(v) for v in got["x"]]), _values(0, 4)["x"])
        dock.close()
    finally:
        for proc in (extra, ctrl):
            if proc is not None:
                _kill(proc)


def test_a_dock_without_replicas_reports_none():
    cluster = dockd.start_local(num_warehouses=2, capacity="64MiB")
    try:
        dock = dockd.connect(cluster.address)
        dock.put(_values(0, 2), partition="p")
        assert _replicas(dock, "p") == (0, 0)
    finally:
        cluster.close()


def test_a_put_re_sent_to_another_warehouse_is_applied_once(monkeypatch):
    """A client re-sends a put to another warehouse when its warehouse goes away (same put token):
    answered with the first attempt's indexes while their values are held, written again at those
    indexes once their warehouse is lost. The re-sends are forced here by giving two puts one token."""
    from dockd.client import put as client_put

    cluster = dockd.start_local(num_warehouses=3, capacity="64MiB", extra_args=["--warehouse-grace", "2"])
    try:
        z, a, b = (dockd.connect(cluster.address, warehouse=cluster.warehouses[k]) for k in (0, 1, 2))
        values = _values(7, 4)
        monkeypatch.setattr(client_put.ids, "random_bits", lambda bits: 0x5EED)
        first = a.put(values, partition="p")
        again = z.put(values, partition="p")  # the first attempt's values are on warehouse 1: nothing stored
        monkeypatch.undo()
        assert again == first == [0, 1, 2, 3]
        stats = a.stats()
        assert stats["partitions"]["p"]["samples"] == 4 and stats["warehouses"][0]["bytes"] == 0, stats
        z.close()

        _kill(cluster.procs[1])
        wait_until(lambda: a.stats()["warehouses"][1]["state"] == "lost", 30, "warehouse 1 lost")
        with pytest.raises(dockd.DockDataLost):
            b.get("c", ["x"], 4, partition="p", timeout=10)
        monkeypatch.setattr(client_put.ids, "random_bits", lambda bits: 0x5EED)
        assert b.put(values, partition="p") == first  # its warehouse is gone: written again, at the same indexes
        monkeypatch.undo()
        got = b.get("c", ["x", "who"], 4, partition="p", timeout=10)
        assert sorted(got.indexes) == first and b.stats()["partitions"]["p"]["samples"] == 4
        assert np.array_equal(np.stack([np.asarray(v) for v in got["x"]]), values["x"][np.argsort(got.indexes)])
        b.close()
    finally:
        cluster.close()


def test_values_of_a_warehouse_that_stopped_answering_are_read_from_their_replicas():
    cluster = dockd.start_local(num_warehouses=3, replicas=2, capacity="64MiB",
                                extra_args=["--heartbeat-timeout", "1", "--heartbeat-interval", "0.2"])
    stopped = None
    try:
        writer = dockd.connect(cluster.address, warehouse=cluster.warehouses[2])
        writer.put(_values(3, 6), partition="p")
        stopped = cluster.procs[2]
        stopped.send_signal(signal.SIGSTOP)  # its connections stay open: away, not lost
        reader = dockd.connect(cluster.address, warehouse=cluster.warehouses[0])
        wait_until(lambda: reader.stats()["warehouses"][2]["state"] == "unresponsive", 30, "warehouse 2 unresponsive")
        got = reader.get("c", ["x"], 6, partition="p", timeout=10)
        back = np.stack([np.asarray(v) for v in got["x"]])
        assert np.array_equal(back, _values(3, 6)["x"][got.indexes]), "read from the replicas"
        reader.close()
    finally:
        if stopped is not None:
            stopped.send_signal(signal.SIGCONT)
        cluster.close()


def test_replicas_with_several_controllers():
    """Each controller keeps the replicas of the partitions it owns (same warehouse ids everywhere)."""
    cluster = dockd.start_local(num_warehouses=3, controllers=2, replicas=2, capacity="64MiB",
                                extra_args=["--warehouse-grace", "2"])
    try:
        writer = dockd.connect(cluster.address, warehouse=cluster.warehouses[2])
        names = [f"p{k}" for k in range(6)]
        for k, name in enumerate(names):
            writer.put(_values(k, 3), partition=name)
        stats = writer.stats()["partitions"]
        assert {stats[n]["controller"] for n in names} == set(cluster.controllers)  # (both own some)
        assert all(stats[n]["replicated"] == 6 for n in names), stats
        writer.close()
        _kill(cluster.procs[2])  # the warehouse that every put went to, not a controller's
        reader = dockd.connect(cluster.address)
        wait_until(lambda: reader.stats()["warehouses"][2]["state"] == "lost", 30, "warehouse 2 lost")
        for k, name in enumerate(names):
            got = reader.get("c", ["x"], 3, partition=name, timeout=10)
            back = np.stack([np.asarray(v) for v in got["x"]])
            assert np.array_equal(back, _values(k, 3)["x"][got.indexes])
        reader.close()
    finally:
        cluster.close()
