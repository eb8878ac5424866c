"""The benchmark report: ratios come from measured values, missing inputs say so. No timing here."""

from __future__ import annotations

import json

import pytest

from benchmarks import SCENARIOS, scenario_names  # noqa: E402
from benchmarks.common import BenchConfig, KiB, MiB, percentile  # noqa: E402
from benchmarks.report import compute_targets, plot, render  # noqa: E402


def _row(scenario, system, op, **kw):
    base = {"scenario": scenario, "system": system, "op": op, "path": None, "sample_bytes": None, "batch": None,
            "clients": 1, "gbps": None, "samples_per_s": None, "p50_us": None, "p99_us": None, "value": None,
            "unit": None, "repeats": 5, "raw": [], "extra": {}}
    base.update(kw)
    return base


def _results() -> dict:
    ok = lambda rows: {"status": "ok", "title": "t", "wall_s": 1.0, "rows": rows}  # noqa: E731
    return {
        "config": BenchConfig().to_dict(),
        "machine": {"cpus": 2, "cpu_model": "test"},
        "scenarios": {
            "ceilings": ok([
                _row("ceilings", "memcpy", "copy", sample_bytes=64 * MiB, gbps=5.0),
                _row("ceilings", "memcpy", "copy", sample_bytes=1 * MiB, gbps=10.0),
                _row("ceilings", "socket", "transfer", path="socket", sample_bytes=64 * MiB, gbps=3.0),
                _row("ceilings", "socket", "rtt", path="socket", sample_bytes=64, p50_us=25.0),
            ]),
            "dockd_flow": ok([
                _row("dockd_flow", "dockd", "get", path="shm", sample_bytes=1 * MiB, batch=64, gbps=4.0),
                _row("dockd_flow", "dockd", "get", path="shm", sample_bytes=1 * MiB, batch=1, gbps=2.0),
                _row("dockd_flow", "dockd", "get", path="socket", sample_bytes=1 * MiB, batch=64, gbps=1.5),
                _row("dockd_flow", "dockd", "get", path="socket", sample_bytes=64, batch=1, p50_us=120.0),
                _row("dockd_flow", "dockd", "get", path="shm", sample_bytes=4 * KiB, batch=64, gbps=9.0),
            ]),
            "peer_dockd_central": ok([
                _row("peer_dockd_central", "dockd-central", "get", path="auto", sample_bytes=4 * KiB, batch=64,
                     samples_per_s=50_000.0, gbps=0.2),
                _row("peer_dockd_central", "dockd-central", "get", path="auto", sample_bytes=1 * MiB, batch=64,
                     samples_per_s=2_000.0, gbps=2.0),
                _row("peer_dockd_central", "dockd-central", "get", path="auto", batch=64, samples_per_s=6_000.0,
                     gbps=0.19, extra={"workload": "grpo", "mean_sample_bytes": 31 * KiB, "columns": ["a"] * 8}),
                _row("peer_dockd_central", "dockd-central", "get", path="socket", batch=64, samples_per_s=9_000.0,
                     gbps=0.28, extra={"workload": "grpo", "mean_sample_bytes": 31 * KiB, "columns": ["a"] * 8}),
                _row("peer_dockd_central", "dockd-central", "get", path="auto", batch=64, samples_per_s=40_000.0,
                     gbps=0.66, extra={"workload": "columns4", "mean_sample_bytes": 16 * KiB, "columns": ["a"] * 4}),
            ]),
            "peer_transferqueue": ok([
                _row("peer_transferqueue", "transferqueue", "get", sample_bytes=4 * KiB, batch=64,
                     samples_per_s=2_500.0, gbps=0.01),
                _row("peer_transferqueue", "transferqueue", "get", sample_bytes=1 * MiB, batch=64,
                     samples_per_s=500.0, gbps=0.5),
                _row("peer_transferqueue", "transferqueue", "get", batch=64, samples_per_s=1_500.0, gbps=0.05,
                     extra={"workload": "grpo", "mean_sample_bytes": 31 * KiB, "columns": ["a"] * 8}),
                _row("peer_transferqueue", "transferqueue", "get", batch=64, samples_per_s=5_000.0, gbps=0.08,
                     extra={"workload": "columns4", "mean_sample_bytes": 16 * KiB, "columns": ["a"] * 4}),
            ]),
            "peer_ray_buffer": {"status": "skipped", "reason": "Ray is not installed; pip install -e '.[peers]'"},
            "controller_scale": ok([
                _row("controller_scale", "dockd-controller", "acquire", batch=256, p50_us=40.0,
                     extra={"partition_samples": 10_000}),
                _row("controller_scale", "dockd-controller", "acquire", batch=256, p50_us=60.0,
                     extra={"partition_samples": 1_000_000}),
                _row("controller_scale", "dockd-controller", "metadata", value=33.0, unit="B/sample",
                     extra={"partition_samples": 1_000_000}),
            ]),
        },
    }


def _by(targets, tid, needle=""):
    found = [t for t in targets if t["id"] == tid and needle in t["description"]]
    assert found, f"no target {tid!r} containing {needle!r} in {[t['description'] for t in targets]}"
    return found[0]


def test_ratios_are_measured_over_reference():
    t = compute_targets(_results())
    shm = _by(t, "same_host_get_vs_memcpy", "x 64")
    assert shm["measured"] == 4.0 and shm["reference"] == 5.0  # memcpy of the same 64 MiB payload
    assert shm["value"] == pytest.approx(0.8) and shm["met"] is True and shm["primary"] is True
    shm1 = _by(t, "same_host_get_vs_memcpy", "x 1 ")
    assert shm1["reference"] == 10.0 and shm1["value"] == pytest.approx(0.2) and shm1["met"] is False
    assert shm1["primary"] is False  # batch 1 is reported, the target is on the bulk batch
    sock = _by(t, "socket_get_vs_raw_socket")
    assert sock["value"] == pytest.approx(0.5) and sock["met"] is False
    lat = _by(t, "small_get_p50_vs_rtt")
    assert lat["value"] == pytest.approx(120.0 / 25.0) and lat["comparison"] == "<=" and lat["met"] is False
    tq_s = _by(t, "vs_transferqueue_get_samples_per_s")
    assert tq_s["value"] == pytest.approx(20.0) and tq_s["bound"] == 10.0 and tq_s["met"] is True
    tq_b = _by(t, "vs_transferqueue_get_gbps")
    assert tq_b["value"] == pytest.approx(4.0) and tq_b["bound"] == 3.0 and tq_b["met"] is True
    grpo = _by(t, "vs_transferqueue_grpo_get_samples_per_s")
    assert grpo["measured"] == 6_000.0  # the default path, not the socket row
    assert grpo["value"] == pytest.approx(4.0) and grpo["bound"] == 1.0 and grpo["met"] is True
    assert grpo["primary"] is True
    assert _by(t, "vs_transferqueue_get_samples_per_s")["measured"] == 50_000.0  # GRPO rows never match a size
    assert _by(t, "vs_transferqueue_grpo_put_samples_per_s")["met"] is None  # no put rows here
    wide = _by(t, "vs_transferqueue_columns4_get_samples_per_s")  # four 4 KiB columns: the 4 KiB bound
    assert wide["value"] == pytest.approx(8.0) and wide["bound"] == 10.0 and wide["met"] is False
    flat = _by(t, "controller_acquire_flat")
    assert flat["value"] == pytest.approx(1.5) and flat["met"] is True
    assert _by(t, "controller_acquire_under_1ms")["met"] is True
    assert _by(t, "controller_metadata_bytes")["value"] == 33.0


def test_missing_inputs_give_no_verdict():
    t = compute_targets(_results())
    ray = _by(t, "vs_ray-actor_get_samples_per_s")
    assert ray["value"] is None and ray["met"] is None
    assert "not measured" in ray["detail"]
    ray_grpo = _by(t, "vs_ray-actor_grpo_get_samples_per_s")
    assert ray_grpo["met"] is None and "not measured" in ray_grpo["detail"]
    empty = compute_targets({"config": {}, "scenarios": {}})
    assert empty and all(x["met"] is None for x in empty)


def test_same_host_falls_back_to_socket_rows_when_no_shm_path():
    res = _results()
    res["scenarios"]["dockd_flow"]["rows"] = [
        r for r in res["scenarios"]["dockd_flow"]["rows"] if r["path"] != "shm"
    ]
    shm = _by(compute_targets(res), "same_host_get_vs_memcpy")
    assert "no shm path" in shm["description"]
    assert shm["value"] == pytest.approx(1.5 / 5.0)


def test_render_and_plot(tmp_path):
    res = _results()
    text = render(res)
    assert "dockd_flow" in text and "Targets" in text and "SKIPPED" in text
    md = render(res, markdown=True)
    assert "| system |" in md
    assert "GRPO ~31 KiB" in md and "8 columns, ragged" in md
    png = plot(res, tmp_path / "p.png")
    assert png is not None and png.stat().st_size > 1000
    json.dumps(compute_targets(res))  # JSON-serialisable


def test_config_round_trip_and_validation():
    cfg = BenchConfig.quick_config(repeats=3)
    again = BenchConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.repeats == 3 and again.quick
    with pytest.raises(ValueError, match="Valid paths"):
        BenchConfig(paths=("rdma",))
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(repeats=0)
    assert BenchConfig().ops_for(1 << 40) == 1
    assert BenchConfig().ops_for(1) == BenchConfig().max_ops_per_repeat


def test_percentile_and_registry():
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    assert percentile(list(map(float, range(101))), 99) == 99.0
    names = scenario_names()
    assert len(names) == len(set(names)) == len(SCENARIOS)
    assert "resharding" not in scenario_names(include_optional=False)


def test_grpo_touch_columns_counts_every_column():
    import torch

    from benchmarks.columnar import TENSORS, grpo_samples
    from benchmarks.peers.workload import GRPO_COLUMNS, GRPO_TENSOR_COLUMNS, touch_columns

    assert GRPO_TENSOR_COLUMNS == TENSORS
    data = grpo_samples(4)
    assert set(data) == set(GRPO_COLUMNS)
    assert touch_columns(data, GRPO_COLUMNS, 4, "t") == 4
    nested = dict(data, prompts=torch.nested.as_nested_tensor(data["prompts"], layout=torch.jagged),
                  reward=torch.tensor(data["reward"]))
    assert touch_columns(nested, GRPO_COLUMNS, 4, "t") == 4
    with pytest.raises(RuntimeError, match="'uid' came back with 3 values"):
        touch_columns(dict(data, uid=data["uid"][:3]), GRPO_COLUMNS, 4, "t")


def test_request_instructions_reads_the_totals_and_the_copies_out_of_a_callgrind_annotation():
    from benchmarks.request_instructions import totals

    annotated = """--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
1,234,567 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                 file:function
--------------------------------------------------------------------------------
  400,000 (32.40%)  ./string/../sysdeps/x86_64/multiarch/memmove-vec-unaligned-erms.S:__memcpy_avx_unaligned_erms [libc.so.6]
  300,000 (24.30%)  Python/ceval.c:_PyEval_EvalFrameDefault [libpython3.11.so.1.0]
   34,567 ( 2.80%)  ./string/../sysdeps/x86_64/multiarch/memset-vec-unaligned-erms.S:__memset_avx2_unaligned_erms [libc.so.6]
   12,000 ( 0.97%)  ???:memsetlike_user_function [mylib.so]
"""
    assert totals(annotated) == (1_234_567, 1_234_567 - 400_000 - 34_567)
