"""The controller load benchmark: its arithmetic, and a tiny real run (daemons, client processes, baselines)."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.controller_load import report as load_report
from benchmarks.controller_load.run import LoadConfig, summarize_step, sustained


def test_rate_split_keeps_the_consumers_fed():
    cfg = LoadConfig(consumers=2, consume_fraction=0.9)
    puts, gets = cfg.split(1400)
    assert puts + gets == pytest.approx(1400)
    # each of 2 consumers takes 90 % of what is put, 4.5 samples per get
    assert gets * 4.5 == pytest.approx(puts * 2 * 0.9)
    with pytest.raises(ValueError):
        LoadConfig(rates=())


def _reply(put_lat, get_lat, **kw):
    return {"latencies_s": {"put": put_lat, "get": get_lat}, "offered": {"put": len(put_lat), "get": len(get_lat)},
            "dropped": {"put": 0, "get": 0}, "errors": {}, "late": 0, "samples_got": 3 * len(get_lat),
            "scheduler_behind_max_s": 0.0, **kw}


def test_step_summary_and_sustained():
    cfg = LoadConfig(step_s=2.0, p99_ms=10.0)
    cpu = {"controller": 0.1, "warehouses": 0.2, "clients": 0.4, "machine_busy": 1.0, "machine_total": 4.0}
    s = summarize_step(100.0, cfg, [_reply([0.001] * 150, [0.002] * 50)], cpu, 2.5)
    assert s["answered"] == 200 and s["achieved_rps"] == 100 and s["achieved_fraction"] == 1
    assert s["controller_cpu_us_per_request"] == pytest.approx(500)
    assert s["warehouse_cpu_us_per_request"] == pytest.approx(1000)
    assert s["put_p50_ms"] == pytest.approx(1) and s["get_p99_ms"] == pytest.approx(2)
    assert s["controller_cores_busy"] == pytest.approx(0.04) and s["machine_busy_fraction"] == 0.25
    assert s["passed"]
    slow = summarize_step(200.0, cfg, [_reply([0.001] * 150 + [0.05] * 10, [0.002] * 40)], cpu, 2.5)
    assert not slow["passed"] and slow["all_p99_ms"] == pytest.approx(50)
    assert sustained([s, slow]) == {"offered_rps": 100.0, "achieved_rps": 100.0, "step_index": 0}
    assert sustained([slow]) is None


@pytest.mark.slow  # (CI runs it: make test-slow)
@pytest.mark.timeout(120)
def test_quick_run_reports_rates_and_cpu(tmp_path):
    from benchmarks.controller_load.__main__ import main

    rc = main(["--quick", "--controllers", "1,2", "--results", str(tmp_path), "--name", "q", "--no-plot"])
    assert rc == 0
    res = json.loads((tmp_path / "q.json").read_text())
    for fam in ("unix", "tcp") + (("tcp_compiled",) if shutil.which("cc") or shutil.which("gcc") else ()):
        assert res["baseline"][fam]["p50_us"] > 0 and res["baseline"][fam]["server_cpu_us_per_round_trip"] > 0
    k1 = res["ramps"][0]
    assert k1["controllers"] == 1 and k1["status"] == "ok" and len(k1["steps"]) == 2
    for s in k1["steps"]:
        assert s["achieved_rps"] > 0 and s["puts"] > 0 and s["gets"] > 0 and s["samples_got"] > 0
        assert s["controller_cpu_us_per_request"] > 0 and s["warehouse_cpu_us_per_request"] > 0
        assert not s["errors"]
    # K=2 runs when dockd supports several controllers, and is reported as skipped (not failed) otherwise
    assert res["ramps"][1]["status"] in ("ok", "skipped")
    if res["ramps"][1]["status"] == "skipped":
        assert "not available" in res["ramps"][1]["reason"]
    assert res["streaming"]["cpu_s_per_request"] > 0
    md = (tmp_path / "q.md").read_text()
    assert "Same-run baseline" in md and "Streaming model" in md
    assert load_report.model_cpu_figure(res)[0] == res["streaming_cpu_s_per_request"]


def test_compiled_echo_server_answers_every_round_trip():
    from benchmarks.controller_load.baseline import compiled_echo_round

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    r = compiled_echo_round(300, warmup=10)
    assert r is not None and r["family"] == "tcp" and r["server"] == "c" and r["round_trips"] == 300
    assert r["p99_us"] >= r["p50_us"] > 0 and r["round_trips_per_s"] > 0
    assert r["server_cpu_us_per_round_trip"] > 0  # (its own CPU clock: 300 round trips are far under a tick)


def test_python_echo_server_measures_its_own_cpu_below_procs_tick():
    """300 round trips cost the server well under /proc's 10 ms tick: the figure must still not be 0."""
    from benchmarks.controller_load.baseline import echo_round

    for family in ("unix", "tcp"):
        r = echo_round(family, 300, warmup=10)
        assert r["round_trips"] == 300 and r["p99_us"] >= r["p50_us"] > 0
        assert 0 < r["server_cpu_us_per_round_trip"] < 10_000


def test_compiled_echo_is_skipped_when_it_cannot_be_built(monkeypatch):
    from benchmarks.controller_load import baseline

    monkeypatch.setattr(baseline.shutil, "which", lambda name: "/bin/false")  # a "compiler" that fails
    assert baseline.compiled_echo_round(10) is None


def test_capacity_summary_compares_each_k_with_one_controller():
    from benchmarks.controller_load.capacity import summarize

    def st(rps, passed=True, controller=None, cpu=(100.0, 0.5)):
        s = {"requests_per_s": rps, "passed": passed, "per_controller_cpu_us_per_request": list(cpu)}
        if controller is not None:
            s["controller"] = controller
        return s

    res = {"runs": [
        {"controllers": 1, "capacity": st(1000.0), "alone_capacity": [], "alone": []},
        {"controllers": 2, "capacity": st(900.0), "alone_capacity": [st(950.0, controller=0), st(1000.0, controller=1)],
         "alone": [st(950.0, controller=0, cpu=(100.0, 0.5)), st(1000.0, controller=1, cpu=(2.0, 101.0))]},
    ]}
    summarize(res)
    two = res["runs"][1]
    assert two["scaling"] == pytest.approx(0.9)
    assert two["alone_vs_one"] == pytest.approx([0.95, 1.0]) and two["independent_scaling"] == pytest.approx(1.95)
    assert two["idle_controller_cpu_us_per_request_max"] == pytest.approx(2.0)  # (the loaded one's own CPU is not counted)
    assert res["runs"][0]["scaling"] == pytest.approx(1.0)


@pytest.mark.slow  # (CI runs it: make test-slow)
@pytest.mark.timeout(180)
def test_capacity_probe_loads_each_controller_through_the_real_protocol(tmp_path):
    from benchmarks.controller_load.capacity import main

    out = tmp_path / "cap.json"
    rc = main(["--controllers", "1,2", "--threads", "2", "--seconds", "1", "--fill", "20000", "--partitions", "4",
               "--echo-round-trips", "1000", "--json", str(out), "--report", str(tmp_path / "cap.md")])
    res = json.loads(out.read_text())
    assert rc == 0, res
    one, two = res["runs"]
    for s in one["together"] + two["together"] + two["alone"]:
        assert s["requests"] > 0 and s["samples"] > 0 and not s["errors"]
        assert s["controller_cpu_us_per_request"] > 0 and s["p99_ms"] >= s["p50_ms"] > 0
    assert len(two["together"][0]["owners"]) == 2  # the partitions spread over both controllers
    alone = [s["owners"] for s in two["alone"]]
    assert len(alone) == 2 and all(len(o) == 1 for o in alone) and alone[0] != alone[1]
    for s in two["alone"]:  # the loaded controller did the work
        cpu = s["per_controller_cpu_us_per_request"]
        assert cpu[s["controller"]] == max(cpu)
    assert two["independent_scaling"] is not None and two["scaling"] is not None
    assert "controller 1 only" in (tmp_path / "cap.md").read_text()
