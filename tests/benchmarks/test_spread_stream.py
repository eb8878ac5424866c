"""The spread benchmark's model line (no process started)."""

from __future__ import annotations

from benchmarks.spread_stream import model


def _run(kind: str, per: list[float]) -> dict:
    return {"kind": kind, "busiest_us": max(per), "total_us": sum(per), "cpu_us_per_trajectory": per}


def test_the_model_binds_one_controller_at_its_own_cost_and_k_controllers_at_their_share():
    runs = [_run("ordinary", [50.0, 0.0]), _run("spread over 2", [30.0, 30.0])]
    line = model(runs)
    # 8 x 10 trajectories/s per node: 1 / (80 x 50 us) = 250 nodes; spread: 60 us over K, balanced
    assert "binds its controller at 250 nodes" in line
    assert "imbalance 1.00" in line
    assert "K=2: 417" in line and "K=8: 1,667" in line


def test_the_model_counts_the_measured_imbalance_against_the_spread():
    runs = [_run("ordinary", [50.0, 0.0]), _run("spread over 2", [40.0, 20.0])]
    line = model(runs)  # the busier controller carries 40 of 60: imbalance 2 x 40 / 60
    assert "imbalance 1.33" in line and "K=8: 1,250" in line
