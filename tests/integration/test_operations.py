"""Operating a dock: Prometheus metrics that equal a known workload, `dockd status`, `dockd clear`,
versions everywhere, JSON logs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import dockd
from dockd.local import spawn_node
from tests.conftest import scrape, value, wait_until

ROW = 64  # bytes per sample of a (n, 16) float32 column: runs stay 64-byte aligned, so payload bytes are exact


@pytest.fixture(scope="module")
def metered():
    """A controller (with a warehouse) and a second warehouse, both serving metrics."""
    with dockd.start_local(num_warehouses=2, capacity="256MiB", extra_args=["--metrics-port", "0"]) as c:
        yield c


def test_metrics_equal_a_known_workload(metered, partition, monkeypatch):
    ctl, wh = metered.nodes
    before = [scrape(n["metrics_port"]) for n in metered.nodes]
    # 3 same-host puts (shared memory) and 2 over TCP, all to warehouse 1
    with dockd.connect(metered.address, warehouse=1) as d:
        for n in (100, 50, 7):
            d.put({"x": torch.ones(n, 16)}, partition=partition)
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
        with dockd.connect(metered.address, warehouse=1) as t:
            for n in (20, 3):
                t.put({"x": torch.ones(n, 16)}, partition=partition)
            got_tcp = t.get("late", ["x"], 13, partition=partition, timeout=10)
        got = [d.get("train", ["x"], 60, partition=partition, timeout=10) for _ in range(2)]
        lease = d.acquire("expiring", ["x"], 5, partition=partition, timeout=10, lease_timeout=0.3)
        assert len(got_tcp) == 13 and [len(b) for b in got] == [60, 60] and len(lease.indexes) == 5
        wait_until(lambda: value(scrape(ctl["metrics_port"]), "dockd_leases_expired_total")
                   - value(before[0], "dockd_leases_expired_total") == 1, what="the lease to expire unconfirmed")
        m = scrape(wh["metrics_port"])
        c = scrape(ctl["metrics_port"])
        assert value(c, "dockd_partition_deleted_samples", partition=partition) == 0
        d.delete(partition, [170, 171, 172])
        assert value(scrape(ctl["metrics_port"]), "dockd_partition_deleted_samples", partition=partition) == 3

    def delta(name, **labels):
        return value(m, name, **labels) - value(before[1], name, **labels)

    assert delta("dockd_put_samples_total", transport="shm") == 157
    assert delta("dockd_put_samples_total", transport="tcp") == 23
    assert delta("dockd_put_bytes_total", transport="shm") == 157 * ROW
    assert delta("dockd_put_bytes_total", transport="tcp") == 23 * ROW
    assert delta("dockd_get_samples_total", transport="tcp") == 13
    assert delta("dockd_get_bytes_total", transport="tcp") == 13 * ROW
    assert delta("dockd_get_samples_total", transport="shm") == 120
    assert delta("dockd_get_bytes_total", transport="shm") == 120 * ROW
    assert delta("dockd_request_seconds_count", op="put") == 5
    assert delta("dockd_request_seconds_count", op="fetch") == 3
    assert delta("dockd_request_seconds_bucket", op="put", le="+Inf") == 5
    assert value(m, "dockd_warehouse_used_bytes") >= 180 * ROW
    assert value(m, "dockd_warehouse_capacity_bytes") == 256 << 20
    assert value(m, "dockd_build_info", version=dockd.__version__, controller="false", warehouse="1") == 1
    # the controller: progress per consumer, the expired lease, nothing of the payload
    assert value(c, "dockd_partition_samples", partition=partition) == 180
    assert value(c, "dockd_consumer_taken_samples", partition=partition, consumer="train") == 120
    assert value(c, "dockd_consumer_ready_samples", partition=partition, consumer="train") == 60
    assert value(c, "dockd_consumer_taken_samples", partition=partition, consumer="late") == 13
    assert value(c, "dockd_consumer_ready_samples", partition=partition, consumer="expiring") == 180
    assert value(c, "dockd_leases_expired_total") - value(before[0], "dockd_leases_expired_total") == 1
    assert value(c, "dockd_put_samples_total", transport="shm") == value(before[0], "dockd_put_samples_total",
                                                                          transport="shm")
    assert value(c, "dockd_request_seconds_count", op="commit") - value(before[0], "dockd_request_seconds_count",
                                                                         op="commit") == 5
    assert value(c, "dockd_warehouses", state="joined") == 2


def test_partition_series_vanish_when_cleared_and_waiters_show(metered, partition):
    ctl = metered.nodes[0]
    with dockd.connect(metered.address) as d:
        d.put({"x": torch.ones(4, 16)}, partition=partition)
        errors = []

        def blocked() -> None:
            try:
                d.get("hungry", ["y"], 1, partition=partition, timeout=20)
            except dockd.DockError as e:
                errors.append(e)

        with dockd.connect(metered.address) as other:
            t = threading.Thread(target=blocked)
            t.start()
            wait_until(lambda: value(scrape(ctl["metrics_port"]), "dockd_waiters", consumer="hungry") == 1, 10,
                       what="the blocked get to show in dockd_waiters")
            assert value(scrape(ctl["metrics_port"]), "dockd_partition_samples", partition=partition) == 4
            other.put({"y": torch.ones(1, 16)}, partition=partition, indexes=[0])
            t.join(timeout=20)
        assert not errors
        m = scrape(ctl["metrics_port"])
        assert value(m, "dockd_waiters", consumer="hungry") == 0
        got = [value(m, f"dockd_consumer_{k}_samples", partition=partition, consumer="hungry") for k in ("taken", "leased")]
        assert sum(got) == 1  # leased until the client's confirm (sent in the background) arrives, then taken
        d.clear(partition)
    m = scrape(ctl["metrics_port"])
    assert not [k for k in m if ("partition", partition) in k[1]], "a cleared partition kept its series"


def test_the_metrics_endpoint_survives_bad_requests(metered):
    port = metered.nodes[1]["metrics_port"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
    assert e.value.code == 404 and b"/metrics" in e.value.read()
    e.value.close()
    for junk in (b"\x00" * 40000, b"POST /metrics HTTP/1.1\r\n\r\n", b"GET"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            try:  # whatever it answers (or a reset): it must not hang, and must keep serving
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                s.recv(1024)
            except (ConnectionResetError, BrokenPipeError):
                pass
    assert value(scrape(port), "dockd_connections") >= 0


def test_auth_failures_are_counted(tmp_path):
    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(0o600)
    with dockd.start_local(token_file=str(token), extra_args=["--metrics-port", "0"]) as c:
        with pytest.raises(dockd.DockAuthError):
            dockd.connect(c.address, token="y" * 32, connect_timeout=5)
        with dockd.connect(c.address, token="x" * 32) as d:
            d.put({"x": [1]}, partition="p")
        m = scrape(c.nodes[0]["metrics_port"])
    assert value(m, "dockd_auth_failures_total", reason="bad_proof") == 1


def dockd_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dockd", *args], capture_output=True, text=True, timeout=timeout)


def test_status_json_and_view(cluster, dock, partition):
    dock.put({"x": torch.ones(40, 16)}, partition=partition)
    dock.get("fast", ["x"], 30, partition=partition, timeout=10)
    dock.get("slow", ["x"], 5, partition=partition, timeout=10)
    out = dockd_cli("status", cluster.address, "--json", "--interval", "0.2")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["version"] == dockd.__version__
    p = snap["partitions"][partition]
    assert p["samples"] == 40
    fast, slow = p["consumers"]["fast"], p["consumers"]["slow"]
    assert (fast["taken"] + fast["leased"], fast["ready"], fast["waiting"]) == (30, 10, 0)  # (confirms go in the
    assert slow["taken"] + slow["leased"] == 5                                               # background)
    for w in snap["warehouses"].values():
        assert w["version"] == dockd.__version__ and w["in_per_s"] >= 0 and w["out_per_s"] >= 0
    assert sum(w["put_bytes"] for w in snap["warehouses"].values()) >= 40 * ROW
    view = dockd_cli("status", cluster.address, "--interval", "0")
    assert view.returncode == 0, view.stderr
    assert f"partition {partition}: 40 samples" in view.stdout
    line = next(l for l in view.stdout.splitlines() if "slow" in l)
    assert "(slowest)" in line and "fast" not in line
    assert view.stderr == ""  # a client command logs warnings only


def test_status_at_80_columns_shows_every_address_and_state_whole(cluster, dock, partition, monkeypatch):
    dock.put({"x": torch.ones(4, 16)}, partition=partition)
    dock.get("reference_model_worker", ["x"], 2, partition=partition, timeout=10)
    monkeypatch.setenv("COLUMNS", "80")
    view = dockd_cli("status", cluster.address, "--interval", "0.2")
    assert view.returncode == 0, view.stderr
    rows = [line for line in view.stdout.splitlines() if line.startswith("│")]
    assert all(len(line) <= 80 for line in view.stdout.splitlines()), view.stdout
    for w in dock.stats()["warehouses"].values():
        row = next((r for r in rows if w["address"] in r), None)
        assert row is not None and " joined " in row, f"{w['address']} cut:\n{view.stdout}"
    assert any("reference_model_worker" in r for r in rows) and "…" not in "".join(rows), view.stdout


def test_status_watch_prints_snapshots_until_interrupted(cluster):
    proc = subprocess.Popen([sys.executable, "-m", "dockd", "status", cluster.address, "--watch", "--json",
                             "--interval", "0.2"], stdout=subprocess.PIPE, text=True)
    try:
        lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert all("warehouses" in s for s in lines) and lines[0]["time"] < lines[2]["time"]
        assert all("in_per_s" in w for w in lines[2]["warehouses"].values())  # rates from the second snapshot on
    finally:
        proc.send_signal(2)
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()


def test_clear_command(cluster, dock, partition):
    dock.put({"x": torch.ones(6, 16)}, partition=partition)
    out = dockd_cli("clear", cluster.address, partition)
    assert out.returncode == 0 and f"cleared partition {partition!r}: 6 samples" in out.stdout, out.stderr
    assert partition not in dock.stats()["partitions"]
    again = dockd_cli("clear", cluster.address, partition)
    assert again.returncode == 2 and f"partition {partition!r} does not exist" in again.stderr


def test_status_of_a_dock_that_is_not_there_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = dockd_cli("status", f"127.0.0.1:{port}", "--connect-timeout", "1")
    assert out.returncode == 2 and f"127.0.0.1:{port}" in out.stderr, out.stderr


def test_version_everywhere(tmp_path):
    out = dockd_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"dockd {dockd.__version__}"
    proc = subprocess.Popen([sys.executable, "-m", "dockd", "--log-format", "json", "serve", "--controller", "--port",
                             "0", "--grpc-port", "0", "--capacity", "64MiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["version"] == dockd.__version__
        with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as ch:
            resp, call = health_pb2_grpc.HealthStub(ch).Check.with_call(health_pb2.HealthCheckRequest(), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            assert ("x-dockd-version", dockd.__version__) in tuple(call.initial_metadata())
        with dockd.connect(f"127.0.0.1:{ready['port']}") as d:
            assert d.stats()["version"] == dockd.__version__
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    logs = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    assert logs[0]["event"] == "starting" and logs[0]["version"] == dockd.__version__
    serving = next(entry for entry in logs if entry.get("event") == "serving")
    assert serving["component"] == "node" and serving["grpc_port"] == ready["grpc_port"]
    assert any(entry.get("event") == "stopping node" for entry in logs)


def test_a_metrics_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = dockd_cli("serve", "--controller", "--port", "0", "--metrics-port", str(port))
    assert out.returncode == 2 and "cannot start" in out.stderr and str(port) in out.stderr, out.stderr


def test_spawned_nodes_report_their_metrics_port():
    proc, ready = spawn_node(["--controller", "--port", "0", "--metrics-port", "0"])
    try:
        assert ready["metrics_port"] and value(scrape(ready["metrics_port"]), "dockd_connections") >= 0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        proc.stdout.close()


def test_the_dashboard_queries_only_series_dockd_exports(metered, partition):
    """Every dockd_* name in the Grafana dashboard is exported by a daemon (so the dashboard cannot rot)."""
    import pathlib
    import re

    with dockd.connect(metered.address) as d:  # a workload, so that every labelled family has a series
        d.put({"x": torch.ones(4, 16)}, partition=partition)
        d.get("c", ["x"], 4, partition=partition, timeout=10)
        with pytest.raises(dockd.DockTimeout):
            d.get("c", ["x"], 1, partition=partition, timeout=0.2)
    dash = json.loads((pathlib.Path(__file__).parents[2] / "examples/deploy/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\bdockd_\w+", e)}
    exported = set()
    for n in metered.nodes:
        with urllib.request.urlopen(f"http://127.0.0.1:{n['metrics_port']}/metrics", timeout=10) as r:
            for fam in text_string_to_metric_families(r.read().decode()):
                exported |= {fam.name, *(s.name for s in fam.samples)}
    assert len(used) >= 15 and used <= exported, sorted(used - exported)


def test_the_deployment_examples_are_valid_commands():
    """The systemd units and the Kubernetes manifest hold `dockd serve` lines this version accepts."""
    import pathlib
    import re
    import shlex

    from dockd.cli import build_parser
    from dockd.config import NodeConfig

    deploy = pathlib.Path(__file__).parents[2] / "examples/deploy"
    commands = []
    for unit in deploy.glob("*.service"):
        line = re.search(r"ExecStart=\S+ (serve .*?)\n(?!\s)", unit.read_text(), re.S).group(1)
        commands.append(shlex.split(line.replace("\\\n", " ").replace("${STATE_DIRECTORY}", "/var/lib/dockd")))
    k8s = (deploy / "kubernetes.yaml").read_text()
    flow = re.search(r"command: \[dockd, (serve,.*?)\]", k8s, re.S).group(1)
    commands.append([a.strip().strip('"') for a in flow.replace("\n", " ").split(",")])
    shell = re.search(r'"exec dockd (serve .*?)"', k8s, re.S).group(1)
    commands.append(shlex.split(shell.replace("$NODE_IP", "10.0.0.3")))
    assert len(commands) == 4
    for argv in commands:
        args = build_parser().parse_args(argv)
        cfg = NodeConfig(host=args.host, controller=args.controller, join=args.join or "",
                         warehouse=not args.no_warehouse, token_file=args.token_file or "",
                         metrics_port=args.metrics_port, state_dir=args.state_dir or "")
        assert cfg.metrics_port == 7452, argv


def test_the_chaos_soak_loads_its_harness_from_anywhere(tmp_path):
    """`scripts/soak.py --chaos` runs the chaos test's harness; run from another directory, the
    harness's own imports of this checkout's test helpers resolve (they once failed before any kill)."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
    code = (f"import runpy; m = runpy.run_path({os.path.join(scripts, 'soak.py')!r}, run_name='soak'); "
            "import soak_chaos; h = soak_chaos.chaos_harness(); "
            "print(h.ChaosDock.__name__, callable(h.delivered_count), callable(m['main']))")
    # (`python scripts/soak.py` has its own folder first on the path: its --chaos part is soak_chaos.py there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (scripts, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ChaosDock", "True", "True"], out.stdout
