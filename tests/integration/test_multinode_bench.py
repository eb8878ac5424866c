"""The simulated-cluster benchmark (``python -m benchmarks.multinode``) end to end, quick mode, as root:
it completes for the central and distributed layouts, every sample reaches every consumer, bytes are
counted on the links and in the warehouses, and nothing with the run's prefix is left afterwards.
Timings are reported by the benchmark, never asserted here (the machine is shared)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(400)]


def _needs_root() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2 (ip, tc) to build network namespaces")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _bench(tmp_path: Path, prefix: str, *args: str, timeout: float = 360) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multinode", "--quick", "--prefix", prefix,
                           "--results", str(tmp_path), "--name", "run", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 0 and proc.stdout.startswith("benchmarks.multinode: skipped:"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return json.loads((tmp_path / "run.json").read_text())


def _assert_nothing_left(prefix: str, res: dict) -> None:
    tag = res["tag"]
    assert res["started_pids"], "the run lists the daemons and agents it started"
    assert res["leftover_pids"] == [] and not [p for p in res["started_pids"] if _running(p)]
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [line for line in ns.splitlines() if line.startswith(prefix)], ns
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":", 2)[1].strip().split("@")[0] for line in links.splitlines() if ":" in line]
    assert not [n for n in names if n.startswith(prefix)], "a bridge, veth or ifb of the run is left"
    mine = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if tag in cmd:
            mine.append(f"{pid}: {cmd}")
    assert not mine, f"processes of the run are left: {mine}"


def _check_run(run: dict, n: int, batch_per_node: int) -> None:
    assert run["status"] == "ok", run.get("error")
    s = run["summary"]
    assert s["delivery_ok"]
    measured = [it for it in run["iterations"] if not it["warmup"]]
    assert measured
    for it in run["iterations"]:
        d = it["delivery"]
        assert d["ok"] and d["written"] == n * batch_per_node
        for name, c in d["consumers"].items():
            assert c == {"taken": d["written"], "missing": 0, "duplicates": 0, "unknown": 0}, name
    assert sum(s["warehouse_stored"].values()) > 0
    assert sum(s["warehouse_served"].values()) > 0
    assert s["samples_per_s"] > 0 and s["iteration_s"] > 0
    if n > 1:  # every node's link carried data both ways
        for node, link in s["links"].items():
            assert link["rx"] > 0 and link["tx"] > 0, node


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_quick_run_central_and_distributed(tmp_path):  # about 17 s on the 2-core VM
    _needs_root()
    prefix = "dkt" + secrets.token_hex(2)
    res = _bench(tmp_path, prefix)
    _assert_nothing_left(prefix, res)
    assert res["tag"].startswith(prefix) and res["leftover_namespaces"] == [] and res["leftover_root_links"] == []
    b = res["config"]["batch_per_node"]
    runs = {(r["layout"], r["nodes"]): r for r in res["runs"] if not r.get("check")}
    for layout in ("central", "distributed"):
        for n in (1, 2):
            _check_run(runs[(layout, n)], n, b)
    central, dist = runs[("central", 2)]["summary"], runs[("distributed", 2)]["summary"]
    # central: everything on node 0's warehouse; distributed: each node's writes on its own
    assert central["warehouses_holding"] == 1 and central["warehouse_stored"]["1"] == 0
    assert dist["warehouses_holding"] == 2
    assert dist["warehouse_stored"]["0"] > 0 and dist["warehouse_stored"]["1"] > 0
    # central: all of node 1's writes cross into node 0, and node 1's consumers read everything from node 0
    # (each sample: responses twice, both columns once), so the counters hold at least that much payload
    w = res["config"]["sample_bytes"]
    assert central["links"]["0"]["rx"] >= b * w and central["links"]["1"]["tx"] >= b * w
    assert central["links"]["1"]["rx"] >= b * 2 * w
    # the report, the plot and the model came out too
    assert (tmp_path / "run.md").read_text().startswith("- when (UTC)")
    if (tmp_path / "run.png").exists():
        assert (tmp_path / "run.png").stat().st_size > 10_000
    assert res["extrapolation"]["model"] and res["extrapolation"]["controller"]
    assert {c["id"] for c in res["checks"]} >= {"distributed_vs_central", "per_warehouse_share"}


@pytest.mark.slow  # a Ray cluster of two raylets starts in 15-30 s on two cores
def test_quick_run_ray_layout(tmp_path):
    _needs_root()
    pytest.importorskip("ray")
    prefix = "dkt" + secrets.token_hex(2)
    res = _bench(tmp_path, prefix, "--nodes", "2", "--layouts", "ray")
    _assert_nothing_left(prefix, res)
    (run,) = [r for r in res["runs"] if r["layout"] == "ray"]
    _check_run(run, 2, res["config"]["batch_per_node"])
    assert run["summary"]["warehouses_holding"] == 1
