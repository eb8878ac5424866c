"""A --quick run is too short to judge: its report gives no MISSED verdict and no negative memory figure."""

from __future__ import annotations

import re

from benchmarks.common import BenchConfig, KiB
from benchmarks.report import TOO_SHORT, compute_targets, markdown_report, render


def _results(*, quick: bool) -> dict:
    cfg = BenchConfig.quick_config() if quick else BenchConfig()
    measured = {"mem_overhead_per_value_B": -12.5, "mem_dock_per_sample_B": -50.0, "grpo_put_vs_memcpy": 0.01,
                "grpo_get_vs_memcpy": 0.02, "get_multi_vs_single_stacked": 3.0, "put_1MiB_vs_memcpy": 0.1,
                "put_16MiB_vs_memcpy": 0.1, "grpo_bytes_per_sample": 31.0 * KiB}
    rows = [{"scenario": "columnar", "system": "dockd", "op": "metadata", "path": k, "sample_bytes": None,
             "batch": None, "clients": 1, "gbps": None, "samples_per_s": None, "p50_us": None, "p99_us": None,
             "value": v, "unit": "B" if k.endswith("_B") else "B/sample" if k.endswith("_per_sample") else "x",
             "repeats": 2, "raw": [], "extra": {}} for k, v in measured.items()]
    res = {"config": cfg.to_dict(), "machine": {"cpus": 2},
           "scenarios": {"columnar": {"status": "ok", "title": "t", "wall_s": 1.0, "rows": rows,
                                      "info": {"measured": measured}}}}
    res["targets"] = compute_targets(res)
    return res


def test_quick_run_prints_no_verdicts_and_no_negative_memory():
    res = _results(quick=True)
    assert any(t["met"] is False for t in res["targets"])  # the JSON keeps the raw comparison
    for text in (render(res), render(res, markdown=True), markdown_report(res)):
        assert "MISSED" not in text, text
        assert TOO_SHORT in text
        assert not re.search(r"-\d+(\.\d+)? ?B\b", text), text  # no negative byte figure anywhere
    assert "31,744 B/sample" in render(res)  # payload sizes stay: they are not memory figures


def test_full_run_keeps_verdicts_but_not_negative_memory():
    text = render(_results(quick=False))
    assert "MISSED" in text  # a full run is judged
    assert not re.search(r"-\d+(\.\d+)? ?B\b", text), text
    assert TOO_SHORT in text  # the negative memory figures read as too short to judge
