"""The controller load benchmark: its arithmetic, and a tiny real run (daemons, client processes, baselines)."""

from __future__ import annotations

import json

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
    for fam in ("unix", "tcp"):
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
