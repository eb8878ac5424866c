"""The multinode benchmark's pure parts: the analytic model, the in-process controller measurement, the
workload's bookkeeping, the configuration and the checks. No namespaces, no daemons, no root."""

from __future__ import annotations

import math
import os

import pytest

from benchmarks.multinode import agent as mn_agent  # noqa: E402
from benchmarks.multinode import controller_cost, model, report, workload  # noqa: E402
from benchmarks.multinode.config import MultinodeConfig  # noqa: E402

KiB = 1024
W = {"responses": 48 * KiB, "log_probs": 48 * KiB}


def wl(b: int = 32) -> model.Workload:
    return model.Workload(b, W, workload.CONSUMERS, put_chunk=8, get_chunk=8)


def test_written_and_read_bytes_follow_the_consumers():
    w = wl()
    assert w.written_bytes == 96 * KiB
    # reward and reference read responses, the trainer both columns
    assert w.read_bytes == 48 * KiB * 2 + 96 * KiB
    with pytest.raises(ValueError, match="unknown column"):
        model.Workload(8, W, {"critic": ("values",)})


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 256])
def test_central_traffic(n):
    w, b = wl(), 32
    t = model.traffic("central", n, w)
    assert t["warehouses"] == 1
    assert t["per_warehouse_stored_bytes"] == n * b * w.written_bytes
    assert t["per_warehouse_served_bytes"] == n * b * w.read_bytes
    assert t["node0_link"] == {"rx": (n - 1) * b * w.written_bytes, "tx": (n - 1) * b * w.read_bytes}
    if n > 1:
        assert t["other_link"] == {"rx": b * w.read_bytes, "tx": b * w.written_bytes}
        assert t["busiest_link_bytes"] == (n - 1) * b * w.read_bytes
    else:
        assert t["other_link"] is None and t["busiest_link_bytes"] == 0
    assert model.traffic("ray", n, w)["node0_link"] == t["node0_link"]


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 256])
def test_distributed_traffic_per_warehouse_is_a_1_over_n_share(n):
    w = wl()
    d, c = model.traffic("distributed", n, w), model.traffic("central", n, w)
    assert d["warehouses"] == n
    assert d["per_warehouse_stored_bytes"] * n == pytest.approx(c["per_warehouse_stored_bytes"])
    assert d["per_warehouse_served_bytes"] * n == pytest.approx(c["per_warehouse_served_bytes"])
    x = 32 * w.read_bytes * (n - 1) / n
    assert d["node0_link"] == pytest.approx({"rx": x, "tx": x})
    # every byte a reader fetches from another node leaves one link and enters another
    assert d["all_links_bytes"] == pytest.approx(2 * n * x)


def test_iteration_time_and_throughput_with_a_link_rate():
    w, rate = wl(), 50e6 / 8
    c8 = model.traffic("central", 8, w, link_bytes_per_s=rate)
    assert c8["iteration_s"] == pytest.approx(7 * 32 * w.read_bytes / rate)
    assert c8["samples_per_s"] == pytest.approx(8 * 32 / c8["iteration_s"])
    assert model.traffic("central", 1, w, link_bytes_per_s=rate)["samples_per_s"] == math.inf
    assert model.traffic("central", 2, w)["iteration_s"] is None
    # central saturates at about C / max(W, R) samples/s; distributed grows ~N
    big = [model.traffic("central", n, w, link_bytes_per_s=rate)["samples_per_s"] for n in (64, 256)]
    assert big[1] == pytest.approx(big[0], rel=0.02)
    assert big[1] == pytest.approx(rate / w.read_bytes, rel=0.01)


@pytest.mark.parametrize("n", [2, 4, 8, 64, 256])
def test_speedup_is_n_when_reads_dominate(n):
    # R = 2W here, so the busiest central link is node 0's send side and the speed-up is exactly N
    assert model.speedup(n, wl()) == pytest.approx(n)
    assert model.speedup(1, wl()) == math.inf


def test_request_counts_and_extrapolation():
    w = wl()
    t = model.traffic("distributed", 256, w)
    assert t["puts"] == 256 * 4 and t["acquires"] == 256 * 3 * 4
    # two processes per stage, 16 samples each: two gets of 8 each, the same count
    w2 = model.Workload(32, W, workload.CONSUMERS, put_chunk=8, get_chunk=8, workers=2)
    assert w2.shares() == [16, 16] and model.traffic("central", 4, w2)["acquires"] == 4 * 3 * 4
    w3 = model.Workload(10, W, workload.CONSUMERS, put_chunk=8, get_chunk=4, workers=3)
    assert w3.shares() == mn_agent.split_quota(10, 3) == [4, 3, 3]
    assert model.traffic("central", 1, w3)["acquires"] == 3 * (1 + 1 + 1)
    rows = model.extrapolate([64, 256], w, 50e6 / 8)
    assert [(r["nodes"], r["layout"]) for r in rows] == [(64, "central"), (64, "distributed"),
                                                         (256, "central"), (256, "distributed")]
    for r in rows:
        assert r["controller_requests"] == r["puts"] + r["acquires"]
        assert r["controller_requests_per_s"] == pytest.approx(r["controller_requests"] / r["iteration_s"])
    with pytest.raises(ValueError, match="Unknown layout"):
        model.traffic("mesh", 2, w)


def test_controller_budget():
    b = model.controller_budget(1000, 0.5, 2.0)
    assert b["sustained_requests_per_s"] == 2000 and b["needed_requests_per_s"] == 500
    assert b["utilisation"] == 0.25
    assert model.controller_budget(10, 0.1, None)["utilisation"] is None


@pytest.mark.parametrize("n", [1, 3, 16])
def test_controller_simulation_hands_every_sample_to_every_consumer(n):
    w = model.Workload(12, W, workload.CONSUMERS, put_chunk=5, get_chunk=4)
    r = controller_cost.simulate_iteration(n, w)
    assert r["commits"] == n * 3  # ceil(12 / 5) puts per node
    per_proc = math.ceil(12 / 4)
    assert r["acquires_ok"] == n * 3 * per_proc
    assert r["requests"] == r["commits"] + r["acquires_ok"]
    assert r["partition_samples"] == 12 * n and r["consumer_processes"] == 3 * n
    assert r["controller_s"] > 0 and r["metadata_bytes"] > 0
    # the wake retries every waiting process after every commit: the count grows with n
    assert r["acquires_waiting"] >= r["consumer_processes"]


def test_controller_simulation_with_several_workers_per_stage():
    w = model.Workload(10, W, workload.CONSUMERS, put_chunk=4, get_chunk=4, workers=3)
    r = controller_cost.simulate_iteration(2, w)
    assert r["consumer_processes"] == 2 * 3 * 3
    assert r["acquires_ok"] == model.traffic("distributed", 2, w)["acquires"]


def test_controller_retries_grow_quadratically():
    small, large = (controller_cost.simulate_iteration(n, wl(8))["acquires_waiting"] for n in (4, 16))
    assert large > 8 * small


def test_make_chunk_and_check_values_round_trip():
    cols = workload.make_chunk(node=3, iteration=5, seq0=10, count=4, sample_bytes=4 * KiB)
    assert cols["responses"].shape == (4, 512) and cols["log_probs"].shape == (4, 512)
    values = {c: list(t.unbind(0)) for c, t in cols.items()}
    keys = workload.check_values(values, 5)
    assert keys == [workload.sample_key(3, s) for s in range(10, 14)]
    assert {workload.key_node(k) for k in keys} == {3}
    assert workload.value_bytes(values) == 4 * 4 * KiB
    with pytest.raises(AssertionError, match="iteration"):
        workload.check_values(values, 6)
    values["log_probs"] = values["log_probs"][::-1]
    with pytest.raises(AssertionError, match="header"):
        workload.check_values(values, 5)


def test_verify_delivery():
    written = [1, 2, 3]
    ok = workload.verify_delivery(written, {c: [3, 1, 2] for c in workload.CONSUMERS})
    assert ok["ok"] and ok["consumers"]["trainer"] == {"taken": 3, "missing": 0, "duplicates": 0, "unknown": 0}
    bad = workload.verify_delivery(written, {"reward": [1, 1, 2], "reference": [1, 2, 3, 9], "trainer": [1, 2, 3]})
    assert not bad["ok"]
    assert bad["consumers"]["reward"]["missing"] == 1 and bad["consumers"]["reward"]["duplicates"] == 1
    assert bad["consumers"]["reference"]["unknown"] == 1


def test_quota_split_and_worker_reports_merge():
    assert mn_agent.split_quota(32, 2) == [16, 16]
    assert mn_agent.split_quota(7, 3) == [3, 2, 2]
    assert mn_agent.split_quota(1, 3) == [1]
    merged = mn_agent.merge_workers({
        "trainer": {"start": 0.1, "end": 1.0, "bytes": 10, "calls": 2, "keys": [1], "call_s": [0.5]},
        "trainer#1": {"start": 0.0, "end": 2.0, "bytes": 5, "calls": 1, "keys": [2], "call_s": [0.7]},
        "rollout": {"start": 0.0, "end": 0.2, "bytes": 7, "calls": 1, "keys": [1, 2]},
    })
    assert merged["trainer"]["start"] == 0.0 and merged["trainer"]["end"] == 2.0
    assert merged["trainer"]["bytes"] == 15 and merged["trainer"]["keys"] == [1, 2]
    assert merged["trainer"]["workers"] == 2 and merged["rollout"]["workers"] == 1


def test_config_validation_and_round_trip():
    cfg = MultinodeConfig.quick_config()
    assert cfg.nodes == (1, 2) and cfg.layouts == ("central", "distributed")
    assert MultinodeConfig.from_dict(cfg.to_dict()) == cfg
    assert MultinodeConfig(nodes=(8, 2, 2)).nodes == (2, 8)
    for bad in ({"layouts": ("mesh",)}, {"sample_bytes": 100}, {"prefix": "Bad-Prefix"}, {"rate_mbit": 0},
                {"subnet": "10.88"}, {"get_chunk": 0}):
        with pytest.raises(ValueError):
            MultinodeConfig(**bad)
    with pytest.raises(ValueError, match="Unknown config field"):
        MultinodeConfig.from_dict({"node_count": 3})


def _run(layout: str, n: int, sps: float, served: list[float]) -> dict:
    return {"layout": layout, "nodes": n, "check": None, "status": "ok",
            "summary": {"samples_per_s": sps, "warehouse_served": {str(i): v for i, v in enumerate(served)},
                        "per_warehouse_served": max(served)}}


def test_checks_divide_numbers_of_the_same_run():
    results = {"runs": [_run("central", 4, 10.0, [40, 0, 0, 0]), _run("distributed", 4, 36.0, [10, 10, 10, 10])]}
    checks = {(c["id"], c.get("layout")): c for c in report.compute_checks(results)}
    d = checks[("distributed_vs_central", None)]
    assert d["value"] == pytest.approx(3.6) and d["bound"] == pytest.approx(3.2) and d["met"] is True
    assert checks[("per_warehouse_share", "distributed")]["value"] == pytest.approx(0.25)
    assert checks[("per_warehouse_share", "central")]["value"] == pytest.approx(1.0)


def test_without_root_it_says_so_and_exits_0(monkeypatch, capsys):
    from benchmarks.multinode import __main__ as mn_main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert mn_main.main(["--quick"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped" in out[0] and "root" in out[0]


# ------------------------------------------------------------------ streaming at scale


def test_streaming_request_rate_and_utilisation():
    st = model.Streaming()  # 8 accelerators x 10 trajectories/s x (1 put + 1 get)
    assert st.requests_per_node_per_s == 160
    assert st.requests_per_s(1024) == 163_840
    r = model.streaming_load(1024, st, 500e-6)
    assert r["accelerators"] == 8192 and r["one_controller_sustains_requests_per_s"] == pytest.approx(2000)
    assert r["utilisation"] == pytest.approx(81.92) and r["binds"]
    r4 = model.streaming_load(1024, st, 500e-6, controllers=4)
    assert r4["busiest_controller_requests_per_s"] == pytest.approx(40_960)
    assert r4["utilisation"] == pytest.approx(20.48)
    assert not model.streaming_load(8, st, 500e-6)["binds"]  # 1,280 req/s x 500 us = 0.64
    with pytest.raises(ValueError):
        model.streaming_load(0, st, 500e-6)
    with pytest.raises(ValueError):
        model.Streaming(puts_per_trajectory=0, gets_per_trajectory=0)


def test_streaming_binding_nodes_and_uneven_partitions():
    st = model.Streaming()
    # one controller at 500 us/request sustains 2,000 req/s = 12.5 nodes of 160 req/s
    assert model.streaming_binding_nodes(st, 500e-6) == pytest.approx(12.5)
    assert model.streaming_binding_nodes(st, 500e-6, controllers=8) == pytest.approx(100.0)
    # 6 partitions on 4 controllers: the busiest holds 2 of 6
    assert model.busiest_share(4, 6) == pytest.approx(1 / 3)
    assert model.busiest_share(4, 8) == pytest.approx(1 / 4) == model.busiest_share(4)
    assert model.streaming_binding_nodes(st, 500e-6, controllers=4, partitions=6) == pytest.approx(37.5)
    assert model.controllers_needed(1024, st, 500e-6) == 82  # 81.92 cores of controller work
    assert model.controllers_needed(100, st, 500e-6) == 9  # exactly 8.0 busy: 8 would sit at utilisation 1


def test_streaming_table_and_report():
    st = model.Streaming()
    t = model.streaming_table(st, 636e-6)
    assert [r["nodes"] for r in t["rows"]] == list(model.STREAMING_NODES)
    assert t["rows"][-1]["utilisation"]["1"] == pytest.approx(163_840 * 636e-6)
    assert t["rows"][-1]["utilisation"]["8"] == pytest.approx(163_840 * 636e-6 / 8)
    assert {k: v["first_node_count"] for k, v in t["binds_at"].items()} == {"1": 10, "2": 20, "4": 40, "8": 79}
    assert {k: v["first_listed"] for k, v in t["binds_at"].items()} == {"1": 16, "2": 32, "4": 64, "8": 128}
    assert t["controllers_needed_at_largest"] == 105
    md = report.streaming_markdown(t, source="test")
    assert "| 1 | 9.8 | 10 | 80 |" in md and "K >= 105" in md and "**104.20**" in md
    # the multinode report carries the section, with a load-benchmark figure when the results give one
    assert report.streaming_cpu_figure({})[0] == model.STREAMING_CPU_S_PER_REQUEST
    assert report.streaming_cpu_figure({"streaming_cpu_s_per_request": 4e-4})[0] == 4e-4


@pytest.mark.parametrize("n", [1, 2, 8])
def test_replicated_traffic_adds_one_copy_of_each_write_per_link(n):
    w, b = wl(), 32
    d, r = model.traffic("distributed", n, w), model.traffic("replicated", n, w)
    extra = b * w.written_bytes if n > 1 else 0
    assert r["per_warehouse_stored_bytes"] == d["per_warehouse_stored_bytes"] + extra
    assert r["per_warehouse_served_bytes"] == d["per_warehouse_served_bytes"]  # (readers read the home copy)
    assert r["node0_link"] == {"rx": d["node0_link"]["rx"] + extra, "tx": d["node0_link"]["tx"] + extra}
    assert r["busiest_link_bytes"] == d["busiest_link_bytes"] + extra


def test_the_replicated_layout_is_reported_against_distributed():
    runs = [{"layout": lay, "nodes": 4, "check": None, "status": "ok",
             "summary": {"samples_per_s": sps, "warehouse_served": {0: 1}, "per_warehouse_served": 1}}
            for lay, sps in (("central", 100.0), ("distributed", 400.0), ("replicated", 300.0))]
    checks = {c["id"]: c for c in report.compute_checks({"runs": runs})}
    assert checks["replicated_vs_distributed"]["value"] == pytest.approx(0.75)
