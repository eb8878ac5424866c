"""`dockd serve` started the way the docs never show: each setting that cannot work is refused at
start, within seconds, with a message naming the fix (never a traceback, a hang, or a dock that
serves half its partitions)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import dockd
from dockd.local import free_ports, spawn_node

pytestmark = pytest.mark.timeout(180)


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--grpc-port", "0", *args], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert time.monotonic() - t < 30, out.stderr[-2000:]
    return out


def _token(path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def _cases(tmp_path, port: int) -> list[tuple[list[str], str]]:
    token = _token(tmp_path / "token", "t" * 64)
    return [
        # NaN passed `<= 0`: the daemon started, then every connection's handshake raised in its watchdog
        (["--controller", "--port", "0", "--handshake-timeout", "nan"], "handshake-timeout must be > 0 seconds"),
        # a traceback (a protobuf field out of range) once the node was built
        (["--controller", "--port", "0", "--capacity", "1e30"], "is past the 9223372036854775807 bytes"),
        # started, then every put failed with DockFull
        (["--controller", "--port", "0", "--max-samples", "0"], "--max-samples must be 1 or more"),
        # waited for ever, logging every second that it is a warehouse without the controller
        (["--port", str(port), "--join", f"localhost:{port}"], f"--join localhost:{port} is this warehouse's own"),
        # served, and the puts of the second name's partitions were refused by its own warehouse
        (["--controller", "--port", str(port), "--controllers", f"127.0.0.1:{port},localhost:{port}"],
         "names this controller twice"),
        # "Unknown error -2" and "Cannot assign requested address" at listen, with "give --port another port"
        (["--controller", "--port", "0", "--host", "no-such-host.invalid", "--insecure"],
         "--host no-such-host.invalid: cannot resolve it"),
        (["--controller", "--port", "0", "--host", "192.0.2.1", "--insecure"],
         "--host 192.0.2.1 is not an address of this machine"),
        # served under the address 127.0.0.1:9999:PORT, which nobody could reach
        (["--controller", "--port", "0", "--advertise", "127.0.0.1:9999"], "without a port"),
        # served, and every client could prove the daemon role
        (["--controller", "--port", "0", "--token-file", token, "--daemon-token-file",
          _token(tmp_path / "daemon-token", "t" * 64 + "\n")], "holds the same token as --token-file"),
    ]


def test_settings_that_cannot_work_are_refused_at_start_naming_the_fix(tmp_path):
    [port] = free_ports("127.0.0.1", 1)
    for args, needle in _cases(tmp_path, port):
        out = _serve(*args)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, (args, out.stderr[-2000:])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(20)
    proc.stdout.close()


def test_a_state_dir_restarted_under_another_controller_list_is_refused_and_serves_under_its_own(tmp_path):
    """A controller with a state dir restarted as one of two: half its partitions would now belong to
    the other controller, which knows nothing of them. It is refused, naming the list it had; started
    again as before, it serves what it kept."""
    env = {k: v for k, v in os.environ.items() if k != "DOCKD_DAEMON_SECRET"}
    ports = free_ports("127.0.0.1", 2)
    address = f"127.0.0.1:{ports[0]}"
    args = ["--controller", "--host", "127.0.0.1", "--port", str(ports[0]), "--grpc-port", "0",
            "--state-dir", str(tmp_path / "state"), "--log-level", "WARNING"]
    proc, _ = spawn_node(args, env=env)
    try:
        with dockd.connect(address) as dock:
            dock.put({"x": [torch.arange(3)]}, partition="kept", timeout=10)
    finally:
        _stop(proc)
    out = _serve(*args, "--controllers", f"{address},127.0.0.1:{ports[1]}", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert (f"--state-dir {tmp_path / 'state'} was kept by a controller started with one controller (no "
            f"--controllers); this one has --controllers {address},127.0.0.1:{ports[1]} (as {address})"
            ) in out.stderr, out.stderr[-2000:]
    assert "Start it with the list it had" in out.stderr
    proc, _ = spawn_node(args, env=env)
    try:
        with dockd.connect(address) as dock:
            assert dock.stats()["partitions"]["kept"]["samples"] == 1
    finally:
        _stop(proc)


def test_status_refuses_an_interval_that_is_not_a_number():
    out = subprocess.run([sys.executable, "-m", "dockd", "status", "127.0.0.1:1", "--interval", "nan"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--interval must be > 0 seconds with --watch (>= 0 without), got nan" in out.stderr, \
        out.stderr


@pytest.mark.slow
def test_a_second_warehouse_on_a_spill_dir_is_refused_and_the_first_keeps_its_values(tmp_path):
    """Two warehouses given one --spill-dir: the second removed the first one's spill files at its start
    and wrote its own under the same names, and the first then served them as its samples' values
    ([100.0, 101.0, ...] for [0.0, 1.0, ...]). Now the second is refused, naming the first's pid; a
    warehouse whose spill dir is its own data dir still starts."""
    ctl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--grpc-port", "0",
                             "--log-level", "WARNING"])
    address = f"127.0.0.1:{ready['port']}"
    spill = str(tmp_path / "spill")
    first, _ = spawn_node(["--port", "0", "--grpc-port", "0", "--join", address, "--spill-dir", spill,
                           "--capacity", "1MiB", "--log-level", "WARNING"])
    try:
        with dockd.connect(address) as dock:
            for k in range(6):  # 400 kB each: all but two spill
                dock.put({"x": [torch.full((100_000,), float(k))]}, partition="spilled", timeout=20)
        out = _serve("--port", "0", "--join", address, "--spill-dir", spill, "--capacity", "1MiB")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"--spill-dir {spill} is in use by another dockd process (pid {first.pid}" in out.stderr, \
            out.stderr[-2000:]
        with dockd.connect(address) as dock:
            got = dock.get("c", ["x"], 6, partition="spilled", timeout=20)
            assert sorted(float(v[0]) for v in got["x"]) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        same = str(tmp_path / "data")
        proc, _ = spawn_node(["--port", "0", "--grpc-port", "0", "--join", address, "--data-dir", same,
                              "--spill-dir", same, "--log-level", "WARNING"])
        _stop(proc)
    finally:
        _stop(first)
        _stop(ctl)
