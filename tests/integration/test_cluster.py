"""A dock that survives its parts: any start order, a controller restart (with and
without a state dir), clients that reconnect and re-home, errors that name host:port.

Every test runs real `dockd serve` processes on loopback; the controller runs
without a warehouse of its own (`--no-warehouse`) where the test restarts it,
so that all data lives on warehouses that outlive it."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import dockd
from dockd.local import read_ready, spawn_node
from tests.conftest import scrape, value, wait_until

pytestmark = pytest.mark.timeout(240)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Daemons of one test, stopped (then killed) at the end whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, wait: bool = True):
        if wait:
            proc, ready = spawn_node(list(args))
            self.procs.append(proc)
            return proc, ready
        proc = subprocess.Popen([sys.executable, "-m", "dockd", "serve", *args], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc, None

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            p.stdout.close()


@pytest.fixture
def procs():
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def controller_args(port: int, *extra: str) -> list[str]:
    return ["--controller", "--no-warehouse", "--port", str(port), "--lease-timeout", "60", *extra]


class DurableController:
    """A controller without a warehouse on a --state-dir, with one warehouse joined to it, among `procs`;
    `restart()` SIGKILLs the controller and starts it again on its dir at its address."""

    def __init__(self, procs: Procs, state: str) -> None:
        self.procs, self.state, self.port = procs, state, free_port()
        self.ctl, _ = procs.start(*controller_args(self.port, "--state-dir", state))
        self.address = f"127.0.0.1:{self.port}"
        procs.start("--port", "0", "--join", self.address)

    def restart(self) -> None:
        self.ctl.send_signal(signal.SIGKILL)
        self.ctl.wait()
        self.ctl, _ = self.procs.start(*controller_args(self.port, "--state-dir", self.state))


def live_warehouses(address: str) -> int:
    with dockd.connect(address) as d:
        return sum(w["alive"] for w in d.stats()["warehouses"].values())


def test_a_warehouse_may_start_before_its_controller(procs):
    port = free_port()
    wh, _ = procs.start("--port", "0", "--join", f"127.0.0.1:{port}", wait=False)
    time.sleep(1.0)  # it is up and retrying; nothing to join yet
    assert wh.poll() is None, "a warehouse must wait for its controller, not exit"
    procs.start("--controller", "--port", str(port))
    ready = read_ready(wh, timeout=30)  # printed once it joined
    assert ready["warehouse"] == 1 and not ready["controller"]
    with dockd.connect(f"127.0.0.1:{port}", warehouse=ready["warehouse"]) as d:
        idx = d.put({"x": torch.arange(6)}, partition="p")
        assert d.get("c", ["x"], 6, partition="p", timeout=10).indexes == idx == list(range(6))
        assert d.stats()["warehouses"][1]["bytes"] > 0


def _two_warehouse_dock(procs, port: int, *controller_extra: str):
    """A controller without data, and warehouses 0 and 1 joined to it."""
    ctl, _ = procs.start(*controller_args(port, *controller_extra))
    address = f"127.0.0.1:{port}"
    ids = [procs.start("--port", "0", "--join", address)[1]["warehouse"] for _ in range(2)]
    assert ids == [0, 1]
    return ctl, address


def test_controller_sigkill_and_restart_with_a_state_dir_loses_and_redelivers_nothing(procs, tmp_path):
    port = free_port()
    state = str(tmp_path / "state")
    ctl, address = _two_warehouse_dock(procs, port, "--state-dir", state)
    rows = torch.randn(64, 33).bfloat16()
    with dockd.connect(address, warehouse=0) as writer, dockd.connect(address, warehouse=1) as writer2, \
            dockd.connect(address, reconnect_timeout=60) as trainer:
        assert writer.put({"x": rows[:32]}, partition="p") == list(range(32))
        assert writer2.put({"x": rows[32:]}, partition="p") == list(range(32, 64))
        first = trainer.get("train", ["x"], 32, partition="p", timeout=10)
        assert first.indexes == list(range(32))
        leased = trainer.acquire("train", ["x"], 8, partition="p", timeout=10)  # leased, never fetched

        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        # while the controller is down: warehouses keep their data and serve reads...
        held = trainer.fetch(leased)
        assert all(torch.equal(v, rows[i]) for i, v in zip(leased.indexes, held["x"]))
        # ...and a put waits for the controller instead of failing
        late = {}
        t = threading.Thread(target=lambda: late.setdefault("idx", writer.put({"y": [1, 2]}, partition="q")))
        t.start()
        time.sleep(0.5)
        assert t.is_alive(), "a put during the outage waits for the controller"
        procs.start(*controller_args(port, "--state-dir", state))
        t.join(60)
        assert late["idx"] == [0, 1]

        trainer.confirm(leased)  # the lease survived the restart; its confirm counts
        rest = trainer.get("train", ["x"], 24, partition="p", timeout=30)  # the same Dock object, reconnected
        got = first.indexes + leased.indexes + rest.indexes
        assert sorted(got) == list(range(64)) and len(got) == 64  # the other half exactly, nothing twice
        assert all(torch.equal(v, rows[i]) for i, v in zip(rest.indexes, rest["x"]))
        with pytest.raises(dockd.DockTimeout):
            trainer.get("train", ["x"], 1, partition="p", timeout=0.5)
        other = trainer.get("reference", ["x"], 64, partition="p", timeout=10)
        assert all(torch.equal(v, rows[i]) for i, v in zip(other.indexes, other["x"]))
        stats = trainer.stats()
        train = stats["partitions"]["p"]["consumers"]["train"]
        assert (train["taken"], train["leased"], train["ready"]) == (64, 0, 0)
        assert not stats["partitions"]["p"]["recovered"]
        # both warehouses rejoin (each on its own backoff: one may still be on its way)
        wait_until(lambda: {w["state"] for w in trainer.stats()["warehouses"].values()} == {"joined"},
                 what="both warehouses rejoined")


def test_a_get_blocked_across_a_controller_restart_completes(procs, tmp_path):
    port = free_port()
    state = str(tmp_path / "state")
    ctl, address = _two_warehouse_dock(procs, port, "--state-dir", state)
    with dockd.connect(address) as reader, dockd.connect(address) as writer:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("b", reader.get("c", ["x"], 4, partition="p", timeout=60)))
        t.start()
        wait_until(lambda: writer.stats()["waiting"] == 1, what="the get to block in the controller")
        ctl.kill()
        ctl.wait()
        procs.start(*controller_args(port, "--state-dir", state))
        writer.put({"x": torch.arange(4)}, partition="p")
        t.join(60)
        assert out["b"].indexes == [0, 1, 2, 3]


def test_controller_restart_without_a_state_dir_rebuilds_from_the_warehouses(procs, caplog):
    port = free_port()
    ctl, address = _two_warehouse_dock(procs, port)
    with dockd.connect(address, warehouse=0) as w1, dockd.connect(address, warehouse=1) as w2, \
            dockd.connect(address) as trainer:
        w1.put({"x": torch.arange(8)}, partition="p", group_size=4)
        w2.put({"x": torch.arange(8, 16)}, partition="p", group_size=4)
        w2.put({"y": torch.arange(16)}, partition="p", indexes=list(range(16)))
        assert trainer.get("train", ["x", "y"], 8, partition="p", timeout=10).indexes == list(range(8))
        ctl.kill()
        ctl.wait()
        procs.start(*controller_args(port))
        wait_until(lambda: live_warehouses(address) == 2, what="both warehouses to rejoin")
        stats = trainer.stats()["partitions"]["p"]
        # the data is all there, columns and groups included...
        assert stats["samples"] == 16 and stats["columns"] == {"x": 16, "y": 16} and stats["group_size"] == 4
        assert stats["recovered"]  # ...but consumer progress from before the restart is gone, and it says so
        with caplog.at_level(logging.WARNING, logger="dockd.client.dock"):
            again = trainer.get("train", ["x", "y"], 16, partition="p", timeout=10, groups=True)
        assert again.indexes == list(range(16))
        assert [int(v) for v in again["x"]] == list(range(16)) and [int(v) for v in again["y"]] == list(range(16))
        assert any("rebuilt after a controller restart without a state dir" in r.message for r in caplog.records)
        # new samples after the rebuild continue the partition
        assert w1.put({"x": torch.arange(4), "y": torch.arange(4)}, partition="p", group_size=4) == [16, 17, 18, 19]


def test_a_client_re_homes_when_its_warehouse_dies(procs):
    port = free_port()
    procs.start("--controller", "--port", str(port))
    address = f"127.0.0.1:{port}"
    wh, ready = procs.start("--port", "0", "--join", address)
    with dockd.connect(address, warehouse=None) as d:
        d._router.home = ready["warehouse"]  # as if this process had been placed on that warehouse
        d.put({"x": torch.arange(3)}, partition="p")
        wh.kill()
        wh.wait()
        idx = d.put({"x": torch.arange(3, 6)}, partition="p")  # re-homed to the controller's warehouse
        assert d.home == 0 and idx == [3, 4, 5]
        wait_until(lambda: d.stats()["warehouses"][ready["warehouse"]]["state"] == "lost", what="the loss to be recorded")
        with pytest.raises(dockd.DockDataLost) as e:  # what the dead warehouse held is reported lost, not hung on
            d.get("c", ["x"], 3, partition="p", timeout=10)
        assert e.value.indexes == [0, 1, 2]
        assert [int(v) for v in d.get("c", ["x"], 3, partition="p", timeout=10)["x"]] == [3, 4, 5]


def test_errors_name_the_address_the_user_gave_not_a_socket(procs):
    port = free_port()
    ctl, _ = procs.start("--controller", "--port", str(port))
    with dockd.connect(f"127.0.0.1:{port}", reconnect_timeout=1.0) as d:
        d.put({"x": [1]}, partition="p")
        ctl.terminate()
        ctl.wait()
        with pytest.raises(dockd.DockConnectionError) as e:
            d.stats()
        msg = str(e.value)
        assert f"127.0.0.1:{port}" in msg and "dockd-" not in msg and "unix:" not in msg, msg
        with pytest.raises(dockd.DockConnectionError) as e:
            d.put({"x": [2]}, partition="p")
        assert f"127.0.0.1:{port}" in str(e.value) and "dockd-" not in str(e.value)


def test_a_peer_of_another_protocol_version_is_refused_clearly(procs):
    """A client or warehouse from another dockd version gets a clear error, not a hang."""
    from dockd._proto import dockd_pb2 as pb
    from dockd.net import auth, wire

    _, ready = procs.start("--controller", "--port", "0")

    def frames(payload: bytes) -> list[pb.Frame]:
        with socket.create_connection(("127.0.0.1", ready["port"]), timeout=10) as s:
            s.sendall(payload)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        out = []
        while data:
            _, hlen, blen = wire.PREFIX.unpack_from(data)
            out.append(wire.parse_header(data[wire.PREFIX.size:wire.PREFIX.size + hlen]))
            data = data[wire.PREFIX.size + hlen + blen:]
        return out

    # a v1 client opens with a Hello: it is told to authenticate, then the connection closes
    challenge, refusal = frames(wire.header(pb.Frame(id=1, hello=pb.Hello(client="old"))))
    assert challenge.challenge.protocol == wire.PROTOCOL_VERSION
    assert refusal.status.code == pb.AUTH and "authenticate first" in refusal.status.message
    # a peer that authenticates with another version is told to run the same version
    old = auth.answer(challenge.challenge, auth.CLIENT, None)
    old.protocol = 1
    _, refusal = frames(wire.header(pb.Frame(id=1, auth=old)))
    assert refusal.status.code == pb.PROTOCOL and "run the same dockd version" in refusal.status.message
    with dockd.connect(f"127.0.0.1:{ready['port']}") as d:  # this version is fine
        assert d.stats()["warehouses"][0]["alive"]


def test_rl_partition_state_survives_a_controller_sigkill_with_a_state_dir(procs, tmp_path):
    """Deletes, retirement, tags, reserves and seals are journaled: a restarted controller knows them."""
    port = free_port()
    state = str(tmp_path / "state")
    ctl, address = _two_warehouse_dock(procs, port, "--state-dir", state)
    with dockd.connect(address, warehouse=1, reconnect_timeout=60) as d:
        d.create_partition("p", retire_when_consumed_by=["train"])
        d.put({"x": torch.ones(4, 1024)}, partition="p", tags={"age": [3, 2, 1, 0]})
        d.put({"x": torch.ones(4, 1024)}, partition="p", tags={"age": 9})
        idx = d.reserve("p", 2)
        assert idx == [8, 9]
        assert d.get("train", ["x"], 4, partition="p", order_by="age", timeout=10).indexes == [3, 2, 1, 0]
        d.delete("p", [4, 5, 6, 7])
        d.seal("p")
        used = d.stats()  # (also delivers the get's confirm: the first put retires)
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        procs.start(*controller_args(port, "--state-dir", state))
        st = wait_until(lambda: (s := d.stats()) and s["partitions"]["p"], what="the controller back")
        assert (st["deleted"], st["sealed"], st["tags"], st["retire_when_consumed_by"]) == (8, True, ["age"], ["train"])
        assert wait_until(lambda: d.stats()["warehouses"][1]["bytes"] == 0, what="warehouse 1 freed"), used
        with pytest.raises(dockd.DockValueError, match="sealed"):
            d.put({"x": torch.ones(1, 1024)}, partition="p")
        d.put({"x": torch.ones(2, 1024)}, partition="p", indexes=idx)  # reserved before the restart
        assert d.get("train", ["x"], 4, partition="p", timeout=10).indexes == [8, 9]
        with pytest.raises(dockd.DockDrained):
            d.get("train", ["x"], 1, partition="p", timeout=10)


def test_puts_read_together_commit_in_one_message_each_with_its_own_outcome(procs):
    """A warehouse sends the commits of the puts it reads in one turn as one message to its controller:
    each put is still answered with its own indexes (or its own error), and every value is readable."""
    port = free_port()
    _, ready = procs.start(*controller_args(port, "--metrics-port", "0"))
    address = f"127.0.0.1:{port}"
    wh, _ = procs.start("--port", "0", "--join", address)

    async def puts(dock, n: int, bad: bool = False) -> list:
        calls = [dock.put({"x": torch.full((1, 4), float(i))}, partition="p") for i in range(n)]
        if bad:  # a sample the controller never allocated: refused at the commit
            calls.append(dock.put({"y": torch.zeros(1, 4)}, partition="p", indexes=[10_000]))
        return await asyncio.gather(*calls, return_exceptions=True)

    async def main() -> tuple[list, list, dict]:
        async with await dockd.connect_async(address, warehouse=0) as dock:
            first = await puts(dock, 17)  # (opens the connections the puts below use)
            before = scrape(ready["metrics_port"])
            wh.send_signal(signal.SIGSTOP)  # the puts below wait in its sockets, and are read together
            try:
                pending = asyncio.ensure_future(puts(dock, 16, bad=True))
                await asyncio.sleep(0.5)
            finally:
                wh.send_signal(signal.SIGCONT)
            return first, await pending, before

    first, second, before = asyncio.run(main())
    after = scrape(ready["metrics_port"])
    assert isinstance(second[-1], dockd.DockError) and "10000" in str(second[-1]), second[-1]
    got = [i for res in first + second[:-1] for i in res]
    assert sorted(got) == list(range(33))
    def sent(op: str) -> float:
        return value(after, "dockd_request_seconds_count", op=op) - value(before, "dockd_request_seconds_count", op=op)

    batches, alone = sent("commits"), sent("commit")  # (a turn that read one put sends its commit alone)
    assert batches >= 1 and batches + alone < 17, f"17 commits went as {batches} batches and {alone} alone"
    with dockd.connect(address) as d:
        b = d.get("c", ["x"], 33, partition="p", timeout=10)
        values = {i: float(v[0]) for i, v in zip(b.indexes, b["x"])}
    assert sorted(values) == list(range(33))
    assert [values[res[0]] for res in first] == list(range(17))
    assert [values[res[0]] for res in second[:-1]] == list(range(16))
