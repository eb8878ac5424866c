"""A spread partition when one of its controllers is SIGKILLed: the other shard goes on serving the
stream, the dead one's samples wait, and once its controller is back on its state dir every sample
comes out exactly once."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import dockd
from dockd import owners
from dockd.client import spread
from dockd.errors import DockTimeout
from dockd.local import free_ports, spawn_node
from tests.integration.test_controllers import _controller as controller
from tests.integration.test_controllers import _stop

pytestmark = pytest.mark.slow  # (CI runs it: make test-slow)


def _controller(ports: list[int], k: int, state_dir: str, env: dict):
    return controller(ports, k, state_dir, env, "--shards", "stream=2")[0]


def test_one_controller_killed_stalls_only_its_shard_and_its_samples_come_once_after_restart(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET="ef" * 32)
    ports = free_ports("127.0.0.1", 2)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for k in range(2):
            procs.append(_controller(ports, k, str(tmp_path / f"state{k}"), env))
        for _ in range(2):
            procs.append(spawn_node(["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--join", addrs[0],
                                     "--log-level", "WARNING"], env=env)[0])
        with dockd.connect(addrs[0]) as d:
            wids = sorted(d.stats()["warehouses"])
        assert len(wids) == 2, wids
        # a writer on each warehouse: one on each shard
        writers = {spread.home(w, 2, 2): dockd.connect(addrs[0], warehouse=w) for w in wids}
        assert set(writers) == {0, 1}
        put = {k: w.put({"x": torch.arange(6).reshape(6, 1) + 100 * k}, partition="stream")
               for k, w in writers.items()}
        assert all(i % 2 == k for k, idx in put.items() for i in idx)
        value = {i: 100 * k + j for k, idx in put.items() for j, i in enumerate(idx)}
        for w in writers.values():
            w.close()
        dead = owners.owner_index(owners.shard_name("stream", 0, 2), 2)
        with dockd.connect(addrs[1 - dead], reconnect_timeout=2.0) as dock:
            got = {}

            def take(count: int, timeout: float) -> None:
                b = dock.get("c", ["x"], count, partition="stream", timeout=timeout)
                for i, v in zip(b.indexes, b["x"]):
                    assert i not in got, f"sample {i} handed out twice"
                    got[i] = int(v[0])

            take(2, 10)
            dock.stats()  # (delivers the confirms)
            procs[dead].send_signal(signal.SIGKILL)
            procs[dead].wait()
            procs[dead].stdout.close()
            # the live shard (shard 1) serves its samples; the dead one's wait
            while sum(1 for i in got if i % 2 == 1) < 6:
                take(2, 10)
            with pytest.raises(DockTimeout, match="shard 0"):
                take(1, 1.0)
            procs[dead] = _controller(ports, dead, str(tmp_path / f"state{dead}"), env)
            while len(got) < 12:
                take(2, 30)
            assert got == value
    finally:
        _stop(procs)
