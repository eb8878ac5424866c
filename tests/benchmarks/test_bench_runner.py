"""The benchmark runner end to end on tiny sizes: it runs, its JSON has the fields. No timed assertions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ROW_FIELDS = {"scenario", "system", "op", "path", "sample_bytes", "batch", "clients", "gbps", "samples_per_s",
              "p50_us", "p99_us", "value", "unit", "repeats", "raw", "extra"}


def _bench(*args: str, path_first: Path | None = None, timeout: float = 280) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    parts = [str(path_first)] if path_first else []
    parts += [str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_quick_run_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    md = tmp_path / "report.md"
    proc = _bench("--quick", "--only", "ceilings,dockd_flow,peer_dockd_central,controller_scale",
                  "--json", str(out), "--plot", str(png), "--report-md", str(md))
    _ok(proc)
    res = json.loads(out.read_text())
    for key in ("schema", "command", "machine", "versions", "config", "scenarios", "targets", "started_utc"):
        assert key in res, key
    assert res["config"]["quick"] is True and res["config"]["repeats"] == 2
    assert res["machine"]["cpus"] and res["versions"]["packages"]["torch"]
    assert set(res["scenarios"]) == {"ceilings", "dockd_flow", "peer_dockd_central", "controller_scale"}
    for name, sc in res["scenarios"].items():
        assert sc["status"] == "ok", (name, sc)
        assert sc["rows"], name
        for row in sc["rows"]:
            assert set(row) >= ROW_FIELDS, (name, set(row) ^ ROW_FIELDS)
            assert row["scenario"] == name
    ops = {(r["system"], r["op"]) for r in res["scenarios"]["ceilings"]["rows"]}
    assert {("memcpy", "copy"), ("socket", "transfer"), ("socket", "rtt")} <= ops
    flow = res["scenarios"]["dockd_flow"]["rows"]
    assert {r["op"] for r in flow} == {"put", "get"}
    assert any(r["clients"] > 1 for r in flow), "concurrent-client rows missing"
    assert any(r["p50_us"] is not None for r in flow), "latency rows missing"
    for r in flow:
        if r["gbps"] is not None:
            assert len(r["raw"]) == 2 and r["gbps"] > 0
    grpo = [r for r in res["scenarios"]["peer_dockd_central"]["rows"] if r["extra"].get("workload") == "grpo"]
    assert {(r["op"], r["path"]) for r in grpo} >= {("put", "auto"), ("get", "auto")}
    assert all(r["samples_per_s"] > 0 and r["gbps"] > 0 and r["sample_bytes"] is None for r in grpo)
    wide = [r for r in res["scenarios"]["peer_dockd_central"]["rows"] if r["extra"].get("workload") == "columns4"]
    assert {(r["op"], r["path"]) for r in wide} >= {("put", "auto"), ("get", "auto")}
    assert all(r["samples_per_s"] > 0 and r["extra"]["columns"] == ["c0", "c1", "c2", "c3"] for r in wide)
    # every target with a value is the ratio of the two measured numbers it names
    with_values = [t for t in res["targets"] if t["value"] is not None]
    assert with_values
    for t in with_values:
        if t["unit"] == "x":
            assert t["value"] == pytest.approx(t["measured"] / t["reference"])
        assert t["met"] in (True, False)
    assert "Targets" in proc.stdout and "dockd_flow" in proc.stdout
    assert png.exists() and png.stat().st_size > 1000
    report = md.read_text()
    assert "### Targets" in report and "](r.png)" in report and res["command"] in report


def test_missing_peers_are_skipped_with_install_hint(tmp_path):
    fake = tmp_path / "fake"
    for mod in ("ray", "transfer_queue"):
        (fake / mod).mkdir(parents=True)
        (fake / mod / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    out = tmp_path / "r.json"
    proc = _bench("--quick", "--only", "peer_transferqueue,peer_ray_buffer", "--json", str(out), "--no-plot",
                  path_first=fake)
    _ok(proc)
    res = json.loads(out.read_text())
    for name in ("peer_transferqueue", "peer_ray_buffer"):
        sc = res["scenarios"][name]
        assert sc["status"] == "skipped"
        assert "pip install -e '.[peers]'" in sc["reason"]
    assert "SKIPPED" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("ray", "transfer_queue", "tensordict")),
    reason="peers not installed: pip install -e '.[peers]'",
)
def test_quick_peers_run(tmp_path):
    out = tmp_path / "r.json"
    proc = _bench("--quick", "--only", "peer_transferqueue,peer_ray_buffer", "--json", str(out), "--no-plot")
    _ok(proc)
    res = json.loads(out.read_text())
    for name, system in (("peer_transferqueue", "transferqueue"), ("peer_ray_buffer", "ray-actor")):
        sc = res["scenarios"][name]
        assert sc["status"] == "ok", sc
        assert {(r["system"], r["op"]) for r in sc["rows"]} == {(system, "put"), (system, "get")}
        grpo = {r["op"] for r in sc["rows"] if r["extra"].get("workload") == "grpo"}
        assert grpo == {"put", "get"}, name
        wide = {r["op"] for r in sc["rows"] if r["extra"].get("workload") == "columns4"}
        assert wide == {"put", "get"}, name


def test_versions_list_and_bad_name():
    proc = _bench("--versions")
    _ok(proc)
    info = json.loads(proc.stdout)
    assert info["versions"]["python"] and "cpus" in info["machine"]
    proc = _bench("--list")
    _ok(proc)
    assert "ceilings" in proc.stdout and "resharding" in proc.stdout
    assert "runnable" in proc.stdout or "would be skipped" in proc.stdout
    proc = _bench("--only", "no-such-scenario")
    assert proc.returncode != 0 and "Valid scenarios are" in proc.stderr


def test_the_benchmarks_record_which_transport_a_client_uses():
    """`_dockd.transport_in_use` read a client attribute that had gone (every row said null, and a client
    asked for shared memory that fell back to TCP was measured as if it were on shared memory)."""
    import dockd
    from benchmarks import _dockd
    from dockd.net import same_host

    with dockd.start_local(1) as cluster:
        paths = {"socket": "tcp"} | ({"shm": "shm"} if same_host.available() else {})
        for path, transport in paths.items():
            dock = _dockd.connect(cluster.address, path)
            try:
                assert _dockd.transport_in_use(dock) == transport
            finally:
                dock.close()
