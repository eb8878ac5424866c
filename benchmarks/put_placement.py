"""A warm same-host put of one big tensor, with client and daemon placed on the CPUs as asked.

    python -m benchmarks.put_placement [--mib M] [--puts N] [--repeats R] [--pin free|apart|one] [--json PATH]

A local dock (`start_local(1)`) and one synchronous client in this process. After a warm-up of N puts
(each repeat then finds the warehouse's segments warm), R repeats of N puts of one `M` MiB tensor, one
partition a repeat, cleared after it. Per repeat: microseconds a put, the put as a multiple of a
single-thread memcpy of the same bytes measured in this run, and the CPU per put of this client and of
the daemon (`/proc` counters; the client's includes its spin while it waits for the answer).

On a 2-core VM the put is bimodal, depending on where the scheduler puts the two processes: `--pin
apart` puts the client on CPU 0 and the daemon on CPU 1, `--pin one` both on CPU 0 (they take turns,
so a put costs both sides' CPU), `--pin free` (the default) leaves it to the scheduler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from .columnar import memcpy_gbps
from .common import pin_process
from .controller_load.procstat import cpu_seconds

PLACEMENTS = {"free": None, "apart": (0, 1), "one": (0, 0)}


def measure(*, mib: int = 1, puts: int = 64, repeats: int = 6, pin: str = "free") -> dict[str, Any]:
    import torch

    import dockd

    torch.set_num_threads(1)
    size = mib << 20
    x = torch.randint(0, 255, (1, size), dtype=torch.uint8)
    rows: list[dict[str, float]] = []
    mine = os.sched_getaffinity(0)
    with dockd.start_local(1, capacity="8GiB") as cluster, dockd.connect(cluster.address) as d:
        daemon = cluster.procs[0].pid
        cpus = PLACEMENTS[pin]
        try:
            if cpus is not None:
                pin_process(os.getpid(), {cpus[0]})
                pin_process(daemon, {cpus[1]})
            rows = _repeats(d, x, puts, repeats, daemon)
        finally:
            pin_process(os.getpid(), mine)  # (this process's threads as they were)
    copy_gbps = memcpy_gbps(size)
    for r in rows:
        r["vs_memcpy"] = size / (r["us_per_put"] / 1e6) / 1e9 / copy_gbps
    return {"mib": mib, "puts": puts, "pin": pin, "memcpy_GBps": copy_gbps, "repeats": rows,
            "median_vs_memcpy": statistics.median(r["vs_memcpy"] for r in rows)}


def _repeats(d: Any, x: Any, puts: int, repeats: int, daemon: int) -> list[dict[str, float]]:
    """The warm-up, then `repeats` rounds of `puts` puts of `x`: per round, us a put and each side's CPU."""
    rows: list[dict[str, float]] = []
    for _ in range(puts):
        d.put({"x": x}, partition="warm")
    d.clear("warm")
    for r in range(repeats):
        c0, d0, t0 = time.process_time(), cpu_seconds([daemon]), time.perf_counter()
        for _ in range(puts):
            d.put({"x": x}, partition=f"p{r}")
        secs = (time.perf_counter() - t0) / puts
        c1, d1 = time.process_time(), cpu_seconds([daemon])
        d.clear(f"p{r}")
        rows.append({"us_per_put": secs * 1e6, "client_cpu_us": (c1 - c0) / puts * 1e6,
                     "daemon_cpu_us": (d1 - d0) / puts * 1e6})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.put_placement", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1, help="MiB of the one tensor each put carries (default 1)")
    ap.add_argument("--puts", type=int, default=64, help="puts a repeat, and in the warm-up (default 64)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--pin", choices=sorted(PLACEMENTS), default="free")
    ap.add_argument("--json", help="write the figures here as well")
    args = ap.parse_args(argv)
    if args.pin != "free" and len(os.sched_getaffinity(0)) < 2:
        print("put_placement: --pin needs two CPUs this process may run on", file=sys.stderr)
        return 2
    res = measure(mib=args.mib, puts=args.puts, repeats=args.repeats, pin=args.pin)
    print(f"{args.mib} MiB puts, pin={args.pin}, memcpy {res['memcpy_GBps']:.2f} GB/s")
    for i, r in enumerate(res["repeats"]):
        print(f"  repeat {i}: {r['us_per_put']:7.0f} us a put ({r['vs_memcpy']:.2f}x memcpy)  "
              f"client CPU {r['client_cpu_us']:.0f} us, daemon CPU {r['daemon_cpu_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
