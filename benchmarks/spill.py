"""The spill tier against plenty of memory: put and get throughput in one run, as ratios
(``python -m benchmarks.spill``).

One controller without a warehouse, and three warehouses joining it: one whose ``--capacity``
holds everything ("memory"), and two with a ``--capacity`` of a quarter of what a round puts
and a ``--spill-dir``, one on disk (``/var/tmp``) and one on tmpfs (``/dev/shm``). The client
pins each side's puts to its warehouse (same host: shared memory, as a trainer's workers
would). Each round puts `--total` bytes in puts of one shape (with spilling: three quarters of
it go to files while the puts run), then a consumer gets every sample oldest first (with
spilling: most come from the files), then the partition is cleared (which deletes the files).
Rounds alternate the order of the sides so that all see the same machine load. Prints a
Markdown table of medians (MB/s) and each spill side's ratio to memory; ``--json`` also writes it.
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

# name -> (bytes per sample, samples per put)
SHAPES = {"8 x 1MiB": (1 << 20, 8), "64 x 64KiB": (64 << 10, 64)}
SIDES = ("memory", "disk", "tmpfs")


def _round(dock, size: int, batch: int, total: int, tag: str) -> tuple[float, float]:
    """(put MB/s, get MB/s) for puts of `batch` samples of `size` bytes, `total` bytes in all, then gets of all."""
    put, _, get = put_get_round(dock, size, batch, max(1, total // (batch * size)), f"sp-{tag}")
    return put, get


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per side and shape (default 3)")
    ap.add_argument("--total", default="256MiB", help="bytes each round puts (default 256MiB; the spilling "
                    "warehouses hold a quarter of it in memory)")
    ap.add_argument("--tmpfs", default="/dev/shm", help="where the tmpfs spill dir goes (default /dev/shm)")
    ap.add_argument("--disk", default="/var/tmp", help="where the on-disk spill dir goes (default /var/tmp)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)

    import dockd
    from dockd.config import parse_size
    from dockd.local import spawn_node

    total = parse_size(args.total)
    dirs = {"tmpfs": tempfile.mkdtemp(prefix="dockd-bench-", dir=args.tmpfs),
            "disk": tempfile.mkdtemp(prefix="dockd-bench-", dir=args.disk)}
    procs = []
    docks: dict[str, dockd.Dock] = {}
    try:
        ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--log-level", "WARNING"])
        procs.append(ctrl)
        address = f"127.0.0.1:{ready['port']}"
        for side in SIDES:
            extra = ["--capacity", str(total // 4), "--spill-dir", os.path.join(dirs[side], "s")] if side in dirs \
                else ["--capacity", str(2 * total)]
            p, r = spawn_node(["--join", address, "--port", "0", "--log-level", "WARNING", *extra])
            procs.append(p)
            docks[side] = dockd.connect(address, warehouse=f"127.0.0.1:{r['port']}")
        rows = []
        for name, (size, batch) in SHAPES.items():
            rates: dict[str, list[tuple[float, float]]] = {s: [] for s in SIDES}
            for side in SIDES:  # warm-up: connections, staging buffers, the segment pool
                _round(docks[side], size, batch, total // 2, side)
            for rnd in range(args.rounds):
                order = SIDES if rnd % 2 == 0 else tuple(reversed(SIDES))
                for side in order:
                    rates[side].append(_round(docks[side], size, batch, total, side))
            med = {s: tuple(statistics.median(v[i] for v in rates[s]) for i in range(2)) for s in SIDES}
            row: dict = {"shape": name, "rounds": args.rounds, "total_bytes": total}
            for s in SIDES:
                row[f"put_{s}_MBps"], row[f"get_{s}_MBps"] = med[s]
            for s in ("disk", "tmpfs"):
                row[f"put_{s}_ratio"] = med[s][0] / med["memory"][0]
                row[f"get_{s}_ratio"] = med[s][1] / med["memory"][1]
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

    print(f"Spill tier (--capacity a quarter of {total >> 20} MiB a round) vs plenty of memory, same-host client "
          f"({os.cpu_count()} CPUs, medians of {args.rounds} alternating rounds; disk {args.disk}, tmpfs {args.tmpfs})\n")
    print("| put shape | put MB/s memory | disk/memory | tmpfs/memory | get MB/s memory | disk/memory | tmpfs/memory |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['put_memory_MBps']:.0f} | {r['put_disk_ratio']:.2f} | {r['put_tmpfs_ratio']:.2f} | "
              f"{r['get_memory_MBps']:.0f} | {r['get_disk_ratio']:.2f} | {r['get_tmpfs_ratio']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
