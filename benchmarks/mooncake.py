"""Mooncake Transfer Engine against dockd's socket path: get throughput in one run (``python -m benchmarks.mooncake``).

One dock on loopback: a controller and a second warehouse started with ``--transport mooncake``
that holds the data. A writer (over TCP: its puts land in the warehouse's registered segments) puts `--calls` gets' worth of samples of each size into
it; then two readers homed on the controller read them back from the second warehouse, one with
``transport="tcp"`` (bytes in the frames' bodies over the TCP stream) and one with
``transport="mooncake"`` (the client's engine reads the warehouse's registered segments into its
pooled receive buffers; the engine's own TCP protocol here, as there is no RDMA NIC). Every round
each reader (a consumer of its own) reads all samples of each size, alternating, so both see the same
machine load; the medians over rounds are compared. Prints a Markdown table (GB/s per side and the
mooncake/socket ratio) and, with ``--json``, writes it.

What this measures is the engine's TCP protocol on one host against dockd's own stream. RDMA
(``--mooncake-protocol rdma``) needs NICs this benchmark has not run on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}


def _read(dock, part: str, consumer: str, batch: int, calls: int) -> float:
    """GB/s of `calls` gets of `batch` samples each."""
    t0 = time.perf_counter()
    nbytes = 0
    for _ in range(calls):
        got = dock.get(consumer, ["x"], batch, partition=part, timeout=120)
        nbytes += sum(t.numel() for t in got["x"])
        del got  # (the values go: a mooncake receive buffer goes back to its pool)
    return nbytes / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per size (default 5)")
    ap.add_argument("--mib-per-get", type=float, default=16.0, help="MiB of samples per get (default 16)")
    ap.add_argument("--calls", type=int, default=4, help="gets per reader, size and round (default 4)")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"sample sizes (default {','.join(SIZES)})")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)

    import torch

    import dockd
    from dockd.local import spawn_node
    from dockd.net import mooncake_engine

    torch.set_num_threads(1)
    env = dict(os.environ)
    procs: list[subprocess.Popen] = []
    rows = []
    try:
        ctl, ready = spawn_node(["--controller", "--port", "0", "--capacity", "256MiB"], env=env)
        procs.append(ctl)
        address = f"127.0.0.1:{ready['port']}"
        wh, ready1 = spawn_node(["--join", address, "--port", "0", "--capacity", "6GiB", "--transport", "mooncake"],
                                env=env)
        procs.append(wh)
        # (a reader is homed on the controller: every value it reads is the second warehouse's)
        os.environ["DOCKD_TRANSPORT"] = "tcp"
        writer = dockd.connect(address, warehouse=1)
        sock = dockd.connect(address, warehouse=0)  # (neither reader uses shared memory: tcp and mooncake only)
        os.environ["DOCKD_TRANSPORT"] = "mooncake"
        moon = dockd.connect(address, warehouse=0)
        del os.environ["DOCKD_TRANSPORT"]
        for label in args.sizes.split(","):
            size = SIZES[label]
            batch = max(1, int(args.mib_per_get * (1 << 20)) // size)
            part = f"mc-{label}"
            x = torch.randint(0, 255, (batch, size), dtype=torch.uint8)
            for _ in range(args.calls):
                writer.put({"x": x}, partition=part)
            # one warm-up read each (connections, the engine's handshake, receive buffers)
            _read(sock, part, "warm-socket", batch, 1)
            _read(moon, part, "warm-mooncake", batch, 1)
            check = moon.get("check", ["x"], batch, partition=part, timeout=120)
            assert all(torch.equal(a, b) for a, b in zip(check["x"], x)), "mooncake read differs"
            del check
            got: dict[str, list[float]] = {"socket": [], "mooncake": []}
            for r in range(args.rounds):
                order = [("socket", sock), ("mooncake", moon)] if r % 2 == 0 else [("mooncake", moon), ("socket", sock)]
                for name, dock in order:
                    got[name].append(_read(dock, part, f"{name}-{r}", batch, args.calls))
            s, m = statistics.median(got["socket"]), statistics.median(got["mooncake"])
            rows.append({"size": label, "samples_per_get": batch, "socket_GBps": round(s, 3),
                         "mooncake_GBps": round(m, 3), "ratio": round(m / s, 2),
                         "socket_all": [round(v, 3) for v in got["socket"]],
                         "mooncake_all": [round(v, 3) for v in got["mooncake"]]})
            writer.clear(part)
        engine = mooncake_engine.stats()
        for d in (writer, sock, moon):
            d.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
            if p.stdout:
                p.stdout.close()
    print(f"\nget throughput from another warehouse on loopback, median of {args.rounds} rounds of {args.calls} gets "
          f"of ~{args.mib_per_get:g} MiB ({os.cpu_count()} CPUs)\n")
    print("| sample | samples/get | socket GB/s | mooncake (tcp) GB/s | mooncake/socket |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['size']} | {row['samples_per_get']} | {row['socket_GBps']:.2f} | {row['mooncake_GBps']:.2f} "
              f"| {row['ratio']:.2f}x |")
    print(f"\nclient engine: {engine.get('reads', 0)} batch reads, "
          f"{engine.get('receive_buffers_registered', 0)} receive buffers registered in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "engine": engine, "rounds": args.rounds, "calls": args.calls,
                       "mib_per_get": args.mib_per_get, "cpus": os.cpu_count()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
