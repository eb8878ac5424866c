"""A warehouse data dir against none: put and get throughput in one run, as ratios
(``python -m benchmarks.data_dir``).

One controller without a warehouse, and three warehouses joining it: one without a data dir,
one with ``--data-dir`` on tmpfs (``/dev/shm``) and one on disk (``/var/tmp``). The client
pins each side's puts to its warehouse (same host: shared memory, as a trainer's workers
would). Rounds alternate the order of the sides so that all see the same machine load; each
round makes `--calls` puts of one shape, then as many gets of the same samples, then clears
the partition (which deletes the files). Prints a Markdown table of medians (MB/s, puts/s) and
each data dir's ratio to no data dir; ``--json`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from .common import put_get_round

# name -> (bytes per sample, samples per put, puts per round)
SHAPES = {"8 x 1MiB": (1 << 20, 8, 16), "256 x 4KiB": (4 << 10, 256, 16), "1 x 4KiB": (4 << 10, 1, 200)}
SIDES = ("none", "tmpfs", "disk")


def _round(dock, size: int, batch: int, calls: int, tag: str) -> tuple[float, float, float]:
    """(put MB/s, puts/s, get MB/s) for `calls` puts of `batch` samples of `size` bytes, then as many gets."""
    return put_get_round(dock, size, batch, calls, f"dd-{tag}", timeout=60.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per side and shape (default 5)")
    ap.add_argument("--tmpfs", default="/dev/shm", help="where the tmpfs data dir goes (default /dev/shm)")
    ap.add_argument("--disk", default="/var/tmp", help="where the on-disk data dir goes (default /var/tmp)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)

    import dockd
    from dockd.local import spawn_node

    dirs = {"tmpfs": tempfile.mkdtemp(prefix="dockd-bench-", dir=args.tmpfs),
            "disk": tempfile.mkdtemp(prefix="dockd-bench-", dir=args.disk)}
    procs = []
    docks: dict[str, dockd.Dock] = {}
    try:
        ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--log-level", "WARNING"])
        procs.append(ctrl)
        address = f"127.0.0.1:{ready['port']}"
        for side in SIDES:
            extra = ["--data-dir", os.path.join(dirs[side], "d")] if side in dirs else []
            p, r = spawn_node(["--join", address, "--port", "0", "--capacity", "2GiB", "--log-level", "WARNING",
                               *extra])
            procs.append(p)
            docks[side] = dockd.connect(address, warehouse=f"127.0.0.1:{r['port']}")
        rows = []
        for name, (size, batch, calls) in SHAPES.items():
            rates: dict[str, list[tuple[float, float, float]]] = {s: [] for s in SIDES}
            for side in SIDES:  # warm-up: connections, staging buffers, the segment pool
                _round(docks[side], size, batch, max(2, calls // 4), side)
            for rnd in range(args.rounds):
                order = SIDES if rnd % 2 == 0 else tuple(reversed(SIDES))
                for side in order:
                    rates[side].append(_round(docks[side], size, batch, calls, side))
            med = {s: tuple(statistics.median(v[i] for v in rates[s]) for i in range(3)) for s in SIDES}
            row: dict = {"shape": name, "rounds": args.rounds}
            for s in SIDES:
                row[f"put_{s}_MBps"], row[f"puts_{s}_per_s"], row[f"get_{s}_MBps"] = med[s]
            for s in ("tmpfs", "disk"):
                row[f"put_{s}_ratio"] = med[s][0] / med["none"][0]
                row[f"get_{s}_ratio"] = med[s][2] / med["none"][2]
            rows.append(row)
    finally:
        for dock in docks.values():
            dock.close()
        for p in procs:
            p.terminate()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)

    print(f"Warehouse data dir vs none, same-host client ({os.cpu_count()} CPUs, medians of {args.rounds} "
          f"alternating rounds; tmpfs {args.tmpfs}, disk {args.disk})\n")
    print("| put shape | put MB/s none | tmpfs/none | disk/none | puts/s none | get MB/s none | tmpfs/none "
          "| disk/none |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['put_none_MBps']:.0f} | {r['put_tmpfs_ratio']:.2f} | {r['put_disk_ratio']:.2f} | "
              f"{r['puts_none_per_s']:.0f} | {r['get_none_MBps']:.0f} | {r['get_tmpfs_ratio']:.2f} | "
              f"{r['get_disk_ratio']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
