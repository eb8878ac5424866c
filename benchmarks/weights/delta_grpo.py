"""Delta versions on a real training run: per GRPO step of examples/grpo_tiny.py, the fraction of bf16
values that change, and the bytes of the delta version dockd publishes for it.

    python -m benchmarks.weights.delta_grpo --steps 20 --lr 5e-3 --lr 1e-5 --lr 1e-6 \\
        --out bench-results/weights_delta_grpo.json

Each of the example's two TP ranks publishes its shard after every step as a version of its own
model (`dockd.weights.Publisher(delta=True)`, weights cast to bf16), so every step after the first
is a delta version. Per step and rank it records the values, how many of their bf16 bits changed,
the bytes stored, and the floor of a sparse encoding: each changed value (2 bytes) plus its int32
index (4 bytes). The summary gives, per learning rate, the mean changed fraction and the bytes of a
delta version against that floor and against the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dockd.config import env

OUT_ENV = "DOCKD_BENCH_DELTA_OUT"
_state: dict[str, Any] = {}  # per worker process: its dock, publisher and last bf16 weights


def publish_step(rank: int, step: int, actor: Any, address: str) -> None:
    """The example's step hook (see examples/grpo_tiny.py `_step_hook`): publish this rank's weights."""
    import dockd
    from dockd.weights import Publisher
    from dockd.weights.delta import changed

    if "pub" not in _state:
        _state["dock"] = dock = dockd.connect(address)
        _state["pub"] = Publisher(dock, f"grpo-rank{rank}", delta=True, full_every=1 << 30, dtype=torch.bfloat16,
                                  keep=2, bucket_size=1 << 20)
    weights = {k: v.detach().to(torch.bfloat16) for k, v in actor.state_dict().items()
               if isinstance(v, torch.Tensor) and v.is_floating_point()}
    prev = _state.get("prev")
    n = sum(v.numel() for v in weights.values())
    k = sum(int(changed(v, prev[name]).numel()) for name, v in weights.items()) if prev is not None else n
    p = _state["pub"].publish(weights.items())
    _state["prev"] = weights
    row = {"rank": rank, "step": step, "values": n, "bytes": 2 * n, "changed": k, "stored": p.stored,
           "delta": p.base is not None, "floor": k * (2 + 4)}
    with open(env(OUT_ENV), "a") as f:
        f.write(json.dumps(row) + "\n")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    deltas = [r for r in rows if r["delta"]]
    frac = [r["changed"] / r["values"] for r in deltas]
    return {
        "steps": len({r["step"] for r in rows}),
        "model_bytes_per_rank": rows[0]["bytes"] if rows else 0,
        "changed_fraction_mean": statistics.mean(frac) if frac else None,
        "changed_fraction_min": min(frac) if frac else None,
        "changed_fraction_max": max(frac) if frac else None,
        "delta_bytes_mean": statistics.mean(r["stored"] for r in deltas) if deltas else None,
        "delta_over_floor_mean": statistics.mean(r["stored"] / max(r["floor"], 1) for r in deltas) if deltas else None,
        "delta_over_floor_max": max(r["stored"] / max(r["floor"], 1) for r in deltas) if deltas else None,
        "delta_over_model_mean": statistics.mean(r["stored"] / r["bytes"] for r in deltas) if deltas else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, action="append", help="learning rates (default: 5e-3, 1e-5, 1e-6)")
    ap.add_argument("--out", default=None, help="write the rows and the summary here (JSON)")
    a = ap.parse_args(argv)
    from examples import grpo_tiny  # (its workers are spawned: they import it by this name, from the checkout)

    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "steps": a.steps, "runs": {}}
    for lr in a.lr or [5e-3, 1e-5, 1e-6]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.jsonl"
            os.environ[OUT_ENV] = str(out)
            t0 = time.perf_counter()
            curve = grpo_tiny.run(steps=a.steps, lr=lr, step_hook="benchmarks.weights.delta_grpo:publish_step")
            rows = [json.loads(line) for line in out.read_text().splitlines()]
        s = summarize(rows)
        s.update(lr=lr, seconds=time.perf_counter() - t0, reward_first=curve["reward"][0],
                 reward_last=curve["reward"][-1])
        result["runs"][str(lr)] = {"summary": s, "rows": rows}
        print(f"lr {lr:g}: changed bf16 values per step {100 * (s['changed_fraction_mean'] or 0):.3f} % "
              f"(min {100 * (s['changed_fraction_min'] or 0):.3f}, max {100 * (s['changed_fraction_max'] or 0):.3f}); "
              f"delta version {s['delta_bytes_mean'] or 0:.0f} B of {s['model_bytes_per_rank']} B per rank "
              f"({100 * (s['delta_over_model_mean'] or 0):.2f} %), {s['delta_over_floor_mean'] or 0:.3f}x the changed "
              f"values + int32 index (max {s['delta_over_floor_max'] or 0:.3f}x); reward "
              f"{s['reward_first']:.2f} -> {s['reward_last']:.2f}", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
