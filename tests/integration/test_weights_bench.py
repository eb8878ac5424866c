"""The weights benchmark in the simulated cluster (``python -m benchmarks.weights``), small, as root: every
method completes with every node getting the same weights (the run checks checksums and raises
otherwise), the relay sends the model over the trainer's link once for two rollout nodes where every
reader pulling from the trainer sends it twice, a delta version is a fraction of the model, and no
namespace of the run is left. Timings are reported by the benchmark, never asserted here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(600)]


def test_weights_bench_small(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2 (ip, tc) to build network namespaces")
    out = tmp_path / "w.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.weights", "--nodes", "2", "--mib", "8", "--tensors", "4",
                           "--bucket-mib", "1", "--changed", "0.02", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"relay", "direct", "gloo", "delta"}
    model = runs["relay"]["model_bytes"]
    assert model <= runs["relay"]["trainer_tx"] < 1.1 * model
    assert runs["direct"]["trainer_tx"] > 1.9 * model
    assert sorted(runs["relay"]["depth"]) == [1, 2]  # a chain
    assert runs["delta"]["base"] is not None and runs["delta"]["stored"] < 0.2 * model
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [line for line in ns.splitlines() if line.startswith("dkwt")], ns
