"""One daemon per dir: a second `dockd serve` on a live warehouse's --data-dir, or on a live
controller's --state-dir, refuses to start at once, naming the dir and the holder's pid, and
touches nothing there; the live daemon goes on losing nothing. A SIGKILLed daemon leaves no stale
lock: restarted at once on its dir, it takes it back. Real `dockd serve` processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import dockd
from dockd.local import spawn_node
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)


def _refused(args: list[str]) -> str:
    """Start `dockd serve ARGS`, which must refuse to start (exit code 2); its stderr."""
    proc = subprocess.run([sys.executable, "-m", "dockd", "serve", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    return proc.stderr


def _snapshot(path: str) -> dict[str, bytes]:
    """Every file under `path` and its bytes."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = f.read()
    return out


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(20)
        if p.stdout is not None:
            p.stdout.close()


@pytest.mark.parametrize("window", [[], ["--commit-window", "8"]], ids=["commit", "commit-window"])
def test_a_second_warehouse_on_a_live_data_dir_refuses_to_start(tmp_path, window):
    """Also while the live one holds puts answered before their commit (its window of 8 s not gone out):
    the second one reads nothing (it would send their commits again), and a restart of the first sends them."""
    data = str(tmp_path / "data")
    ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--state-dir", str(tmp_path / "state")])
    address = f"127.0.0.1:{ready['port']}"
    wh, _ = spawn_node(["--join", address, "--data-dir", data, "--port", "0", "--capacity", "256MiB", *window])
    try:
        with dockd.connect(address) as d:
            first = d.put({"x": torch.arange(4)}, partition="p")
            before = _snapshot(data)
            err = _refused(["--join", address, "--data-dir", data, "--port", "0", "--capacity", "256MiB"])
            assert f"--data-dir {data} is in use by another dockd process (pid {wh.pid}" in err, err[-2000:]
            assert "kill" in err and "another --data-dir" in err, err[-2000:]
            assert _snapshot(data) == before  # its identity and files untouched
            second = d.put({"x": torch.arange(4, 8)}, partition="p")  # the live warehouse goes on
            got = d.get("c", ["x"], 8, partition="p", timeout=20)  # (with the window: once it goes out)
            assert sorted(got.indexes) == sorted(first + second)
            assert sorted(int(v) for v in got["x"]) == list(range(8))
        wh.send_signal(signal.SIGKILL)  # no stale lock: restarted at once, it takes its dir back
        wh.wait(10)
        wh.stdout.close()
        wh, _ = spawn_node(["--join", address, "--data-dir", data, "--port", "0", "--capacity", "256MiB", *window])
        with dockd.connect(address) as d:
            assert [int(v) for v in d.read("p", first + second, ["x"])["x"]] == list(range(8))
            third = d.put({"x": torch.arange(8, 12)}, partition="p")
            got = d.get("c", ["x"], 4, partition="p", timeout=10)
            assert sorted(got.indexes) == sorted(third) and sorted(int(v) for v in got["x"]) == list(range(8, 12))
    finally:
        _stop(wh, ctrl)


def test_a_second_controller_on_a_live_state_dir_refuses_to_start(tmp_path):
    state = str(tmp_path / "state")
    ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--state-dir", state])
    port = ready["port"]
    address = f"127.0.0.1:{port}"
    wh, _ = spawn_node(["--join", address, "--port", "0", "--capacity", "256MiB"])
    try:
        with dockd.connect(address) as d:
            d.put({"x": torch.arange(8)}, partition="p")
            assert len(d.get("c", ["x"], 5, partition="p", timeout=10).indexes) == 5  # confirmed
            before = _snapshot(state)
            err = _refused(["--controller", "--no-warehouse", "--port", "0", "--state-dir", state])
            assert f"--state-dir {state} is in use by another dockd process (pid {ctrl.pid}" in err, err[-2000:]
            after = _snapshot(state)  # its snapshot untouched, its journal only appended to (by the live one)
            assert sorted(after) == sorted(before), (sorted(before), sorted(after))
            for name, raw in before.items():
                assert after[name][: len(raw)] == raw if name.startswith("journal-") else after[name] == raw, name
            assert len(d.get("c", ["x"], 3, partition="p", timeout=10).indexes) == 3  # the live one goes on
        ctrl.send_signal(signal.SIGKILL)  # no stale lock: restarted at once, it takes its dir back
        ctrl.wait(10)
        ctrl.stdout.close()
        ctrl, _ = spawn_node(["--controller", "--no-warehouse", "--port", str(port), "--state-dir", state])
        with dockd.connect(address) as d:
            wait_until(lambda: [w["state"] for w in d.stats()["warehouses"].values()] == ["joined"], 30,
                       "the warehouse to rejoin")
            assert d.stats()["partitions"]["p"]["consumers"]["c"]["taken"] == 8  # nothing handed out again
            with pytest.raises(dockd.DockTimeout):
                d.get("c", ["x"], 1, partition="p", timeout=1)
    finally:
        _stop(wh, ctrl)
