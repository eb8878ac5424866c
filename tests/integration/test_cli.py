"""The `dockd` command: serve with health checks and clean shutdown, stats, demo."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import dockd
from dockd._proto import dockd_pb2 as pb
from dockd._proto import dockd_pb2_grpc
from dockd.local import spawn_node


def test_serve_health_stats_and_sigterm(tmp_path):
    proc, ready = spawn_node(["--controller", "--port", "0", "--grpc-port", "0", "--capacity", "64MiB"])
    try:
        assert ready["controller"] and ready["warehouse"] == 0
        with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            address = f"127.0.0.1:{ready['port']}"
            with dockd.connect(address) as d:
                d.put({"x": [1, 2, 3]}, partition="s")
            stats = dockd_pb2_grpc.AdminStub(ch).Stats(pb.StatsRequest(), timeout=10)
            assert stats.partitions[0].name == "s" and stats.partitions[0].samples == 3
            assert stats.warehouses[0].capacity == 64 << 20
        out = subprocess.run([sys.executable, "-m", "dockd", "stats", address], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout)["partitions"]["s"]["samples"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_serve_rejects_bad_configuration_clearly():
    for args, match in ((["--port", "0"], "exactly one of the two"), (["--join", "nowhere"], "HOST:PORT"),
                        (["--controller", "--capacity", "lots"], "cannot parse size")):
        out = subprocess.run([sys.executable, "-m", "dockd", "serve", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and match in out.stderr, out.stderr


def test_join_timeout_bounds_the_wait_for_a_missing_controller():
    """A warehouse waits for its controller (start order is free); --join-timeout bounds that wait."""
    out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--port", "0", "--join", "127.0.0.1:1",
                          "--join-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot reach the controller at 127.0.0.1:1" in out.stderr, out.stderr
    assert "waiting for the controller" in out.stderr


def test_demo_runs_a_small_pipeline():
    out = subprocess.run([sys.executable, "-m", "dockd", "--log-level", "WARNING", "demo", "--steps", "3", "--prompts", "4"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    table = out.stdout
    for stage in ("rollout", "reward", "reference", "advantage", "train"):
        line = next(l for l in table.splitlines() if l.startswith(stage))
        assert int(line.split()[1]) == 3 * 4 * 8  # every stage saw every sample
    assert "3 steps x 32 samples through 2 warehouses" in table
