"""A single put's latency with and without --commit-window, and the controller's CPU per put.

    python -m benchmarks.put_window [--count N] [--rounds R] [--window S]

A controller daemon with a state dir and no warehouse, one warehouse joined to it, and one synchronous
client in this process putting one trajectory-sized sample at a time (a 4 KiB and a 2 KiB tensor and a
float) to that warehouse, one put in flight. Each round runs on fresh daemons, the warehouse started
without a window (every put answered after its commit: the baseline) and with `--commit-window S`,
alternating which goes first. Per case: p50 and p99 of the put's latency, and the controller's and the
warehouse's CPU per put (`/proc` counters around the timed loop). The first puts of each case (the
partition's first, which waits for a block) are not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from .controller_load.procstat import cpu_seconds

WARMUP = 200


def one_case(window: float, count: int) -> dict[str, float]:
    import torch

    import dockd
    from dockd.local import spawn_node

    procs = []
    with tempfile.TemporaryDirectory() as state:
        try:
            ctrl, ready = spawn_node(["--host", "127.0.0.1", "--port", "0", "--controller", "--no-warehouse",
                                      "--state-dir", state, "--log-level", "WARNING"])
            procs.append(ctrl)
            address = f"127.0.0.1:{ready['port']}"
            wh, _ = spawn_node(["--host", "127.0.0.1", "--port", "0", "--join", address, "--capacity", "2GiB",
                                "--log-level", "WARNING", "--commit-window", str(window)])
            procs.append(wh)
            sample = {"ids": [torch.zeros(1024, dtype=torch.int32)], "mask": [torch.zeros(512, dtype=torch.float32)],
                      "reward": [0.5]}
            with dockd.connect(address) as d:
                for _ in range(WARMUP):
                    d.put(sample, partition="p")
                times = []
                c0, w0 = cpu_seconds([ctrl.pid]), cpu_seconds([wh.pid])
                for _ in range(count):
                    t = time.perf_counter()
                    d.put(sample, partition="p")
                    times.append(time.perf_counter() - t)
                c1, w1 = cpu_seconds([ctrl.pid]), cpu_seconds([wh.pid])
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                p.wait(20)
    times.sort()
    return {"p50_us": statistics.median(times) * 1e6, "p99_us": times[int(len(times) * 0.99)] * 1e6,
            "controller_us_per_put": (c1 - c0) / count * 1e6, "warehouse_us_per_put": (w1 - w0) / count * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.put_window", description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=2000, help="timed puts per case (default 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each on fresh daemons (default 3)")
    ap.add_argument("--window", type=float, default=0.05, help="--commit-window of the compared case (default 0.05)")
    args = ap.parse_args(argv)
    runs: dict[float, list[dict[str, float]]] = {0.0: [], args.window: []}
    for r in range(args.rounds):
        for w in ((0.0, args.window) if r % 2 == 0 else (args.window, 0.0)):
            res = one_case(w, args.count)
            runs[w].append(res)
            print(f"round {r} window {w:g}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    print(f"\n{args.count} puts per case, {args.rounds} rounds, medians over the rounds")
    print("| --commit-window | put p50 us | put p99 us | controller CPU us / put | warehouse CPU us / put |")
    print("|---|---|---|---|---|")
    for w, mine in runs.items():
        med = {k: statistics.median(x[k] for x in mine) for k in mine[0]}
        print(f"| {w:g} s | {med['p50_us']:.0f} | {med['p99_us']:.0f} | {med['controller_us_per_put']:.1f} | "
              f"{med['warehouse_us_per_put']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
