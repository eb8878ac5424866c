"""Several controllers share the metadata plane: partitions are spread over them by name
(dockd.owners), warehouses register with each, clients reach the owner of each partition
from whichever controller they connected to, and the death of one controller stalls only
the partitions it owns; restarted on its state dir, it recovers them."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time

import pytest
import torch

import dockd
from dockd import owners
from dockd.errors import DockConnectionError, DockTimeout, DockValueError
from dockd.local import free_ports, spawn_node
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(240)


def _names(controllers: list[str], per: int = 2) -> dict[str, list[str]]:
    """Partition names, `per` owned by each controller."""
    out: dict[str, list[str]] = {c: [] for c in controllers}
    k = 0
    while any(len(v) < per for v in out.values()):
        name = f"part-{k}"
        owner = controllers[owners.owner_index(name, len(controllers))]
        if len(out[owner]) < per:
            out[owner].append(name)
        k += 1
    return out


def test_owner_index_is_stable_and_spreads_names_evenly():
    assert owners.owner_index("anything", 1) == 0
    assert owners.owner_index("rollout-17", 4) == owners.owner_index("rollout-17", 4)
    counts = collections.Counter(owners.owner_index(f"step-{i}", 4) for i in range(4000))
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 850, counts


def test_controllers_option_is_checked():
    assert owners.parse("a:1, b:2") == ("a:1", "b:2")
    for bad in ("a", "a:x", "a:1,a:1", ":5"):
        with pytest.raises(DockValueError, match="--controllers"):
            owners.parse(bad)
    with pytest.raises(DockValueError, match="does not name this controller"):
        owners.own_index(("127.0.0.1:7001", "127.0.0.1:7002"), "127.0.0.1", 7003)


def test_partitions_are_spread_and_every_operation_reaches_its_owner():
    with dockd.start_local(num_warehouses=3, controllers=2) as cluster:
        names = _names(cluster.controllers)
        with dockd.connect(cluster.controllers[1]) as dock:  # any controller will do
            for name in sum(names.values(), []):
                dock.create_partition(name, group_size=2)
                dock.put({"x": torch.arange(8).reshape(8, 1) + len(name), "r": list(range(8))}, partition=name,
                         group_size=2, tags={"age": [i % 4 for i in range(8)]})
            st = dock.stats()
            assert st["controllers"] == cluster.controllers
            for owner, parts in names.items():
                for name in parts:
                    p = st["partitions"][name]
                    assert (p["controller"], p["samples"], p["group_size"]) == (owner, 8, 2)
            for name in sum(names.values(), []):
                # groups, tag filters and ordering, exactly-once per consumer, seal: on each partition's owner
                b = dock.get("trainer", ["x"], 4, partition=name, groups=True, where={"age": (0, 1)}, order_by="-age",
                             timeout=10)
                assert sorted(b.indexes) == [0, 1, 4, 5]
                assert [int(v[0]) for v in b["x"]] == [i + len(name) for i in b.indexes]
                dock.seal(name)
                rest = dock.get("trainer", ["x", "r"], 4, partition=name, groups=True, timeout=10)
                assert sorted(rest.indexes) == [2, 3, 6, 7] and list(rest["r"]) == list(rest.indexes)
                with pytest.raises(dockd.DockDrained):
                    dock.get("trainer", ["x"], 2, partition=name, groups=True, timeout=10)
                lease = dock.acquire("other", ["x"], 2, partition=name)  # leases live on the owner too
                assert dock.extend(lease, 30) == 30
                assert dock.release(lease) == 2
                assert len(dock.read(name, [7], ["x"])["x"]) == 1
            st = dock.stats()
            assert all(st["partitions"][n]["consumers"]["trainer"]["taken"] == 8 for n in sum(names.values(), []))
            assert dock.clear(names[cluster.controllers[1]][0]) == 8
            assert names[cluster.controllers[1]][0] not in dock.stats()["partitions"]
        with dockd.connect(cluster.warehouses[2]) as dock:  # a warehouse's address leads to the controllers
            assert dock.stats()["controllers"] == cluster.controllers


def _controller(ports: list[int], k: int, state_dir: str, env: dict, *extra: str) -> tuple:
    """Controller k of the dock whose controllers listen on `ports`, with a state dir (and `extra` arguments)."""
    listed = ",".join(f"127.0.0.1:{p}" for p in ports)
    return spawn_node(["--host", "127.0.0.1", "--port", str(ports[k]), "--grpc-port", "0", "--controller",
                       "--no-warehouse", "--controllers", listed, "--state-dir", state_dir, "--log-level", "WARNING",
                       *extra], env=env)


def _stop(procs: list) -> None:
    """Stop daemons started here (warehouses before controllers) and close their pipes."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p.stdout is not None:
            p.stdout.close()


@pytest.mark.slow
def test_a_dead_controller_stalls_only_its_partitions_and_recovers_them_on_restart(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET="ab" * 32)
    ports = free_ports("127.0.0.1", 2)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for k in range(2):
            procs.append(_controller(ports, k, str(tmp_path / f"state{k}"), env)[0])
        for _ in range(2):
            procs.append(spawn_node(["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--join", addrs[0],
                                     "--controller-grace", "2", "--log-level", "WARNING"], env=env)[0])
        names = _names(addrs, per=1)
        live, dead = names[addrs[0]][0], names[addrs[1]][0]
        with dockd.connect(addrs[0], reconnect_timeout=2.0) as dock:
            for name in (live, dead):
                dock.put({"x": torch.arange(6).reshape(6, 1)}, partition=name)
                assert dock.get("c", ["x"], 2, partition=name, timeout=10).indexes == [0, 1]
            dock.stats()  # (delivers the confirms)
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            procs[1].stdout.close()
            # the live controller's partition goes on
            dock.put({"x": torch.arange(2).reshape(2, 1)}, partition=live)
            assert dock.get("c", ["x"], 6, partition=live, timeout=10).indexes == [2, 3, 4, 5, 6, 7]
            # the dead one's stalls: gets and puts fail after the client's and the warehouse's grace
            with pytest.raises((DockConnectionError, DockTimeout)):
                dock.get("c", ["x"], 1, partition=dead, timeout=3)
            with pytest.raises(DockConnectionError):
                dock.put({"x": torch.zeros(1, 1, dtype=torch.int64)}, partition=dead)
            procs[1] = _controller(ports, 1, str(tmp_path / "state1"), env)[0]
            # back on its journal: what was taken stays taken, the rest is handed out once
            got = dock.get("c", ["x"], 4, partition=dead, timeout=30)
            assert got.indexes == [2, 3, 4, 5] and [int(v[0]) for v in got["x"]] == [2, 3, 4, 5]
            st = dock.stats()
            assert st["partitions"][dead]["controller"] == addrs[1]
            assert st["partitions"][dead]["consumers"]["c"]["taken"] == 6
    finally:
        _stop(procs)


def test_a_get_of_a_partition_whose_controller_is_stopped_or_killed_ends_within_its_timeout():
    """The owner of a partition stopped (SIGSTOP: it accepts connections and answers nothing) before
    this client ever spoke to it: the connection to it is made within the get's time. Its handshake
    waited for the whole connect_timeout (a get(timeout=2) took 10 s). Killed, it is retried for the
    get's time, not for reconnect_timeout."""
    with dockd.start_local(num_warehouses=3, controllers=2) as cluster:
        names = _names(cluster.controllers, per=1)
        (theirs,) = names[cluster.controllers[1]]
        with dockd.connect(cluster.controllers[1]) as dock:
            dock.put({"x": torch.arange(4).reshape(4, 1)}, partition=theirs)
        os.kill(cluster.procs[1].pid, signal.SIGSTOP)
        try:
            with dockd.connect(cluster.controllers[0], reconnect_timeout=30) as dock:
                t = time.monotonic()
                with pytest.raises(DockConnectionError, match="does not answer"):
                    dock.get("c", ["x"], 1, partition=theirs, timeout=2)
                took = time.monotonic() - t
                assert took < 6, f"get(timeout=2) took {took:.1f}s"
                os.kill(cluster.procs[1].pid, signal.SIGKILL)
                t = time.monotonic()
                with pytest.raises(DockConnectionError, match="cannot reach"):
                    dock.get("c", ["x"], 1, partition=theirs, timeout=2)
                took = time.monotonic() - t
                assert took < 6, f"get(timeout=2) took {took:.1f}s"
        finally:
            os.kill(cluster.procs[1].pid, signal.SIGCONT)  # (a killed one: no matter)


class _DurableDock:
    """Two controllers with state dirs (`procs[0]`, `procs[1]`) and a warehouse with a data dir that
    --joins controller `join` (`procs[2]`); `kill(k)` SIGKILLs daemon k, `start(k)` starts it again."""

    def __init__(self, tmp_path, join: int = 1) -> None:
        self.tmp_path = tmp_path
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET="cd" * 32)
        self.ports = free_ports("127.0.0.1", 2)
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports]
        self.wh_args = ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--join", self.addrs[join],
                        "--data-dir", str(tmp_path / "data"), "--log-level", "WARNING"]
        self.procs: list = []
        try:
            for k in range(3):
                self.procs.append(self.start(k))
        except BaseException:
            _stop(self.procs)
            raise

    def start(self, k: int) -> subprocess.Popen:
        if k < 2:
            return _controller(self.ports, k, str(self.tmp_path / f"state{k}"), self.env)[0]
        return spawn_node(self.wh_args, env=self.env)[0]

    def kill(self, k: int) -> None:
        self.procs[k].send_signal(signal.SIGKILL)
        self.procs[k].wait()
        self.procs[k].stdout.close()


def test_a_warehouse_with_a_data_dir_comes_back_to_every_controller(tmp_path):
    """A durable warehouse (--data-dir) killed and restarted rejoins each controller with that
    controller's partitions: nothing is lost, nothing taken comes again, on either controller."""
    dd = _DurableDock(tmp_path)
    try:
        names = _names(dd.addrs, per=1)
        with dockd.connect(dd.addrs[0]) as dock:
            for (name,) in names.values():
                dock.put({"x": torch.arange(10).reshape(10, 1) * 3}, partition=name)
                assert dock.get("c", ["x"], 4, partition=name, timeout=10).indexes == [0, 1, 2, 3]
            dock.stats()  # (delivers the confirms)
            dd.kill(2)
            dd.procs[2] = dd.start(2)
            for (name,) in names.values():
                got = dock.get("c", ["x"], 6, partition=name, timeout=30)
                assert got.indexes == [4, 5, 6, 7, 8, 9] and [int(v[0]) for v in got["x"]] == [3 * i for i in got.indexes]
            st = dock.stats()
            assert {st["partitions"][name]["controller"] for (name,) in names.values()} == set(dd.addrs)
            # (a heartbeat answered late on a loaded machine shows it `unresponsive` for a moment)
            wait_until(lambda: all(w["state"] == "joined" for w in dock.stats()["warehouses"].values()), 30,
                       "the restarted warehouse shown joined")
    finally:
        _stop(dd.procs)


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_a_durable_warehouse_restarted_while_the_first_controller_is_down_serves_the_others(tmp_path):
    """A warehouse restarted on its data dir knows its id and needs no number: it comes back to the
    controllers that are up (their partitions are served again) and to the first one once that is back."""
    dd = _DurableDock(tmp_path)
    try:
        names = _names(dd.addrs, per=1)
        with dockd.connect(dd.addrs[1]) as dock:
            for (name,) in names.values():
                dock.put({"x": torch.arange(10).reshape(10, 1) * 3}, partition=name)
            dd.kill(0)  # the first controller, then the warehouse
            dd.kill(2)
            dd.procs[2] = dd.start(2)  # ready without the first controller
            (mine,) = names[dd.addrs[1]]
            got = dock.get("c", ["x"], 10, partition=mine, timeout=30)
            assert got.indexes == list(range(10)) and [int(v[0]) for v in got["x"]] == [3 * i for i in got.indexes]
            dd.procs[0] = dd.start(0)
            (first,) = names[dd.addrs[0]]
            got = dock.get("c", ["x"], 10, partition=first, timeout=60)
            assert got.indexes == list(range(10)) and [int(v[0]) for v in got["x"]] == [3 * i for i in got.indexes]
            # (its link to the first controller retries every second at most)
            wait_until(lambda: all(w["state"] == "joined" for w in dock.stats()["warehouses"].values()), 30,
                       "the warehouse to rejoin the first controller")
    finally:
        _stop(dd.procs)


def test_a_new_warehouse_joins_while_the_first_controller_is_down(tmp_path):
    """Each controller numbers new warehouses with ids of its own, so a new warehouse joins while the
    first controller is down: the second controller's own warehouse is numbered by it, a new one by
    the next controller that answers; their partitions are served at once, and the warehouses join
    the first controller when that one is back (they waited for the first for ever, or until
    --join-timeout failed them)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET="cd" * 32)
    ports = free_ports("127.0.0.1", 2)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    procs: list = []
    try:
        # the second controller, with a warehouse of its own, while the first is not up
        second, ready = spawn_node(["--host", "127.0.0.1", "--port", str(ports[1]), "--grpc-port", "0", "--controller",
                                    "--controllers", ",".join(addrs), "--join-timeout", "30", "--log-level",
                                    "WARNING"], env=env, timeout=60)
        procs.append(second)
        new, joined = spawn_node(["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--join",
                                  f"{addrs[0]},{addrs[1]}", "--join-timeout", "30", "--log-level", "WARNING"],
                                 env=env, timeout=60)
        procs.append(new)
        wids = {ready["warehouse"], joined["warehouse"]}
        assert wids == {1, 3}  # (the second controller's ids: 1, 3, 5, ...)
        names = _names(addrs, per=1)
        (first,), (second,) = names[addrs[0]], names[addrs[1]]
        with dockd.connect(addrs[1]) as dock:
            assert dock.put({"x": torch.arange(4).reshape(4, 1)}, partition=second) == [0, 1, 2, 3]
            assert dock.get("c", ["x"], 4, partition=second, timeout=10).indexes == [0, 1, 2, 3]
        procs.insert(0, _controller(ports, 0, str(tmp_path / "state0"), env)[0])
        with dockd.connect(addrs[0]) as dock:
            wait_until(lambda: {int(k): w["state"] for k, w in dock.stats()["warehouses"].items()}
                       == {wid: "joined" for wid in wids}, 30,
                       "the warehouses to join the first controller under the ids the second gave them")
            assert dock.put({"x": torch.arange(4).reshape(4, 1) * 2}, partition=first) == [0, 1, 2, 3]
            got = dock.get("c", ["x"], 4, partition=first, timeout=10)
            assert got.indexes == [0, 1, 2, 3] and [int(v[0]) for v in got["x"]] == [0, 2, 4, 6]
    finally:
        _stop(procs)


def test_a_durable_warehouse_that_joins_the_first_controller_comes_back_while_that_one_is_down(tmp_path):
    """A warehouse that --joins the first controller learns the dock's controllers from it; its data dir
    keeps that list, so a restart while the first one is down asks the others and serves their
    partitions (it waited for the first for ever). A new warehouse given several --join addresses
    asks the next one when the first does not answer."""
    dd = _DurableDock(tmp_path, join=0)
    try:
        names = _names(dd.addrs, per=1)
        (mine,) = names[dd.addrs[1]]
        with dockd.connect(dd.addrs[1]) as dock:
            dock.put({"x": torch.arange(10).reshape(10, 1) * 3}, partition=mine)
            dd.kill(0)  # the first controller, then the warehouse
            dd.kill(2)
            dd.procs[2] = dd.start(2)  # ready without the controller it --joins
            got = dock.get("c", ["x"], 10, partition=mine, timeout=30)
            assert got.indexes == list(range(10)) and [int(v[0]) for v in got["x"]] == [3 * i for i in got.indexes]
        dd.procs[0] = dd.start(0)
        (nobody,) = free_ports("127.0.0.1", 1)
        new, ready = spawn_node(["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--join",
                                 f"127.0.0.1:{nobody},{dd.addrs[1]}", "--log-level", "WARNING"], env=dd.env)
        dd.procs.append(new)
        with dockd.connect(dd.addrs[0]) as dock:
            wait_until(lambda: len(dock.stats()["warehouses"]) == 2 and all(
                w["state"] == "joined" for w in dock.stats()["warehouses"].values()), 30,
                "the new warehouse and the restarted one to join both controllers")
            assert ready["warehouse"] in {int(k) for k in dock.stats()["warehouses"]}
    finally:
        _stop(dd.procs)


def test_a_put_made_before_the_warehouse_reached_its_partition_s_controller_goes_out_when_it_does(tmp_path):
    """A warehouse joins the first controller at once and the others in the background: a put whose
    controller it has not reached yet waits for it, and is committed once the link is up (it was
    left waiting for ever)."""
    import threading

    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET="cd" * 32)
    ports = free_ports("127.0.0.1", 2)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    procs = [_controller(ports, 0, str(tmp_path / "state0"), env)[0]]
    try:
        procs.append(spawn_node(["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--join", addrs[0],
                                 "--log-level", "WARNING"], env=env)[0])
        late = _names(addrs, per=1)[addrs[1]][0]
        out: dict = {}

        def put() -> None:
            try:
                with dockd.connect(addrs[0]) as dock:
                    out["indexes"] = dock.put({"x": torch.arange(4).reshape(4, 1)}, partition=late)
            except Exception as e:  # noqa: BLE001 - reported below
                out["error"] = e

        writer = threading.Thread(target=put, daemon=True)
        writer.start()
        writer.join(1.0)
        assert writer.is_alive(), f"the put should wait for its controller, got {out}"
        procs.insert(1, _controller(ports, 1, str(tmp_path / "state1"), env)[0])
        writer.join(30)
        assert not writer.is_alive(), "the put still waits after its controller came up"
        assert out == {"indexes": [0, 1, 2, 3]}, out
    finally:
        _stop(procs)
