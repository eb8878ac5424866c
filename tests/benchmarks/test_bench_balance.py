"""Smoke run of benchmarks/balance.py at tiny sizes: both methods in the table and the JSON,
valid figures, and dockd's spread no worse than the greedy heap on any batch. No timing."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import balance as bench


def test_balance_benchmark_tiny(tmp_path: Path, capsys) -> None:
    out = tmp_path / "balance.json"
    rc = bench.main(["--dp", "2,4,8", "--counts", "8,32", "--groups", "1,8", "--batches", "2", "--repeats", "1",
                     "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "dockd" in text and "greedy" in text
    table = [line for line in text.splitlines() if line.startswith(("| longtail", "| uniform"))]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == len(table) == 2 * 2 * 3 * 2  # workloads x groups x dp x counts
    assert {(r["workload"], r["group_size"], r["dp"], r["count"]) for r in rows} == {
        (w, g, dp, c) for w in ("longtail", "uniform") for g in (1, 8) for dp in (2, 4, 8) for c in (8, 32)
    }
    for r in rows:
        ours, theirs = r["dockd"], r["greedy"]
        for m in (ours, theirs):
            assert m["ms"] > 0 and m["ratio"] >= 1.0 and m["spread"] >= 0
            assert len(m["raw"]["spread"]) == 2
        for a, b in zip(ours["raw"]["spread"], theirs["raw"]["spread"]):
            assert a <= b, r
        if r["group_size"] == r["count"]:  # one group per rank: nothing to choose, both the same
            assert ours["raw"]["spread"] == theirs["raw"]["spread"]
