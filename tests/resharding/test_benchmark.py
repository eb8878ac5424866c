"""Smoke run of benchmarks/resharding.py on tiny models: the script works and
its measured accounting agrees with the memory model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multinode
def test_benchmark_tiny_cpu_run(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.resharding", "--tiny", "--skip-gpu", "--out", str(out)], cwd=ROOT,
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GPU part skipped" in proc.stdout
    result = json.loads(out.read_text())
    assert result["gpu"] is None
    rows = result["cpu"]["rows"]
    assert {r["scenario"] for r in rows} == {s["name"] for s in result["cpu"]["scenarios"]}
    for r in rows:
        assert r["model_max_rel_err"] < 0.05, r  # alignment padding only
        assert r["leak_bytes"] == 0
        assert r["freed_MB"] == pytest.approx(r["update_MB"])
        assert r["swap_during_gen_MB"] == pytest.approx(r["gen_MB"])
        assert r["naive_during_gen_MB"] == pytest.approx(r["update_MB"] + r["gen_MB"])
