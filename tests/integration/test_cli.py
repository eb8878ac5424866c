"""The `dockd` command: serve with health checks and clean shutdown, stats, demo."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import grpc
import pytest
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


@pytest.mark.parametrize("flag, what", [("--port", "the framed port clients connect to"),
                                        ("--grpc-port", "the gRPC health and admin port")])
def test_a_port_in_use_names_its_flag(flag, what):
    """Finding 9: "address already in use" named no flag (and a busy --grpc-port ended in a traceback)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"--port": "0", flag: str(port)}
        out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--controller", *(x for kv in ports.items()
                              for x in kv)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert (f"cannot start: cannot listen on 127.0.0.1:{port} ({flag}, {what}): Address already in use (another "
            f"process, perhaps another dockd, listens there); give {flag} another port, or 0 for a free one"
            ) in out.stderr, out.stderr


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


def _imported(stderr: str) -> set[str]:
    """Module names from `python -X importtime` output."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_version_does_not_import_torch():
    """`dockd --version` (and `import dockd`, `import dockd.cli`) costs no torch import: the client is lazy."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "dockd", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"dockd {dockd.__version__}", out
    mods = _imported(out.stderr)
    assert "dockd.cli" in mods and "torch" not in mods, sorted(m for m in mods if m.startswith(("torch", "dockd")))
    code = ("import sys, dockd, dockd.cli; assert 'torch' not in sys.modules; "
            "assert isinstance(dockd.DockLeaseError('x'), dockd.DockError); "
            "dockd.cli.build_parser(); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_status_stats_clear_do_not_import_torch():
    """`dockd status/stats/clear` talk to a dock through the client; none of them needs torch."""
    for cmd in (["status", "127.0.0.1:1", "--interval", "0"], ["stats", "127.0.0.1:1"], ["clear", "127.0.0.1:1", "p"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "dockd", *cmd, "--connect-timeout", "0.2"],
                             capture_output=True, text=True, timeout=60)
        mods = _imported(out.stderr)
        assert "dockd.cli" in mods and "torch" not in mods, (cmd, out.stderr[-2000:])


def test_json_log_lines_carry_numbers_and_booleans():
    """--log-format json: key=value fields become JSON numbers, booleans and null; quoted values stay strings."""
    import logging

    from dockd.cli import JsonFormatter

    msg = ("[warehouse] joined id=3 address=10.0.0.2:7450 capacity=68719476736 ratio=0.25 alive=True "
           "sealed=false lost=None partition='7' name=\"a b\" tail=-2, rate=1e-3;")
    rec = logging.LogRecord("dockd.x", logging.INFO, __file__, 1, msg, None, None)
    out = json.loads(JsonFormatter().format(rec))
    assert out["component"] == "warehouse" and out["event"] == "joined" and out["msg"] == msg
    assert out["id"] == 3 and out["capacity"] == 68719476736 and out["ratio"] == 0.25
    assert out["alive"] is True and out["sealed"] is False and out["lost"] is None
    assert out["partition"] == "7" and out["name"] == "a b" and out["address"] == "10.0.0.2:7450"
    assert out["tail"] == -2 and out["rate"] == 1e-3


def test_lease_timeout_help_states_the_lease_semantics():
    from dockd.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    help_text = " ".join(next(a.help for a in serve._actions if "--lease-timeout" in a.option_strings).split())
    for phrase in ("default 120", "handed out again", "confirm", "dies", "releases", "acquire(lease_timeout=...)",
                   "dock.extend(lease)"):
        assert phrase in help_text, (phrase, help_text)
