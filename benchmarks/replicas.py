"""Replicas against none: put throughput and the bytes daemons move, in one run, as ratios
(``python -m benchmarks.replicas``).

Two docks side by side, each a controller without a warehouse and two warehouses joining it:
one with ``--replicas 1``, one with ``--replicas 2`` (every put is copied to the other warehouse
before it is answered). One client per dock puts to its first warehouse (same host: shared
memory, as a trainer's workers would). Rounds alternate the docks so that both see the same
machine load; each round makes `--calls` puts of one shape, then as many gets of the same
samples, then clears the partition. Link traffic is what the daemons read from their sockets
during the puts (``rchar`` in /proc/PID/io, summed over the dock's daemons), per byte put: the
client's same-host bytes arrive by shared memory, so without replicas it is about 0 and with
them about 1 (the copy crosses a socket, as it would cross the network between nodes). Prints a
Markdown table of medians; ``--json`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# name -> (bytes per sample, samples per put, puts per round)
SHAPES = {"8 x 1MiB": (1 << 20, 8, 16), "64 x 32KiB": (32 << 10, 64, 32), "1 x 4KiB": (4 << 10, 1, 200)}
SIDES = ("one", "two")


def _rchar(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    total += int(line.split()[1])
    return total


def _round(dock, pids: list[int], size: int, batch: int, calls: int) -> tuple[float, float, float, float]:
    """(put MB/s, puts/s, get MB/s, daemon socket bytes read per byte put)."""
    import torch

    x = torch.randint(0, 255, (batch, size), dtype=torch.uint8)
    part = f"rep-{size}-{time.monotonic_ns()}"
    r0 = _rchar(pids)
    t0 = time.perf_counter()
    for _ in range(calls):
        dock.put({"x": x}, partition=part, timeout=120)
    t1 = time.perf_counter()
    r1 = _rchar(pids)
    for _ in range(calls):
        got = dock.get("c", ["x"], batch, partition=part, timeout=120)
        assert len(got["x"]) == batch
    t2 = time.perf_counter()
    dock.clear(part)
    nbytes = calls * batch * size
    return nbytes / 1e6 / (t1 - t0), calls / (t1 - t0), nbytes / 1e6 / (t2 - t1), (r1 - r0) / nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per dock and shape (default 5)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)

    import dockd
    from dockd.local import spawn_node

    procs = []
    docks: dict[str, dockd.Dock] = {}
    pids: dict[str, list[int]] = {}
    try:
        for side, n in zip(SIDES, (1, 2)):
            ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--log-level", "WARNING",
                                      "--replicas", str(n)])
            procs.append(ctrl)
            pids[side] = [ctrl.pid]
            address = f"127.0.0.1:{ready['port']}"
            first = ""
            for _ in range(2):
                p, r = spawn_node(["--join", address, "--port", "0", "--capacity", "2GiB", "--log-level", "WARNING"])
                procs.append(p)
                pids[side].append(p.pid)
                first = first or f"127.0.0.1:{r['port']}"
            docks[side] = dockd.connect(address, warehouse=first)
        rows = []
        for name, (size, batch, calls) in SHAPES.items():
            rates: dict[str, list[tuple[float, ...]]] = {s: [] for s in SIDES}
            for side in SIDES:  # warm-up: connections, staging buffers, the segment pool
                _round(docks[side], pids[side], size, batch, max(2, calls // 4))
            for rnd in range(args.rounds):
                for side in SIDES if rnd % 2 == 0 else tuple(reversed(SIDES)):
                    rates[side].append(_round(docks[side], pids[side], size, batch, calls))
            med = {s: tuple(statistics.median(v[i] for v in rates[s]) for i in range(4)) for s in SIDES}
            row: dict = {"shape": name, "rounds": args.rounds}
            for s in SIDES:
                row[f"put_{s}_MBps"], row[f"puts_{s}_per_s"], row[f"get_{s}_MBps"], row[f"read_{s}_per_byte"] = med[s]
            row["put_ratio"] = med["two"][0] / med["one"][0]
            row["get_ratio"] = med["two"][2] / med["one"][2]
            rows.append(row)
    finally:
        for dock in docks.values():
            dock.close()
        for p in reversed(procs):  # (warehouses before their controller: no rejoin warnings)
            p.terminate()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()

    print(f"Replicas 2 vs 1, same-host client, two warehouses ({os.cpu_count()} CPUs, medians of {args.rounds} "
          "alternating rounds)\n")
    print("| put shape | put MB/s, 1 replica | 2 replicas / 1 | puts/s, 1 replica | socket bytes read per byte put, "
          "1 / 2 | get MB/s, 1 replica | 2 / 1 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['put_one_MBps']:.0f} | {r['put_ratio']:.2f} | {r['puts_one_per_s']:.0f} | "
              f"{r['read_one_per_byte']:.2f} / {r['read_two_per_byte']:.2f} | {r['get_one_MBps']:.0f} | "
              f"{r['get_ratio']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
