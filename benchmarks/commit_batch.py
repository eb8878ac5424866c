"""Commits coalesced per warehouse: what a put costs the controller, coalesced and alone.

    python -m benchmarks.commit_batch [--producers 1,4,12] [--puts 1000] [--rounds 2] [--json PATH]

A controller daemon without a warehouse (``--controller --no-warehouse``: its
CPU counter is controller work only) and one warehouse daemon that joins it.
P producer processes put one trajectory-sized sample at a time (a 4 KiB
tensor and a float) to that warehouse, back to back, so every put's commit
crosses the warehouse's link to the controller. Each producer count runs on
fresh daemons twice per round, in alternating order: coalesced (the default:
the commits of the puts a warehouse reads in one turn of its loop go as one
message) and alone (``DOCKD_COMMIT_BATCH=0``: every commit its own message, as before
coalescing). Per case: puts/s, CPU per put of the controller and of the
warehouse daemon, and commits per message (the controller's request counters
on its metrics port); then coalesced / alone, and the controller's CPU per put
against the CPU a 64-byte Unix echo server spends per round trip (same run).
The best round per case is kept (a shared VM's figures are bimodal).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import secrets
import statistics
import sys
import time
import urllib.request
from typing import Any

from .common import spawn_env
from .controller_load.baseline import echo_round
from .controller_load.procstat import cpu_seconds


def _producer(controller: str, warehouse: str, puts: int, warm: Any, start: Any, done: Any) -> None:
    import torch

    import dockd

    d = dockd.connect(controller, warehouse=warehouse)
    sample = {"tokens": torch.randint(0, 1000, (1, 1024), dtype=torch.int32), "reward": [1.0]}
    part = f"p{os.getpid()}"
    for _ in range(20):  # warm up (the partition exists, the connections are open)
        d.put(sample, partition=part)
    warm.put(True)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(puts):
        d.put(sample, partition=part)
    done.put(time.perf_counter() - t0)
    d.close()


def _commit_messages(metrics_port: int) -> tuple[float, float]:
    """(commit requests, commit-batch requests) the controller has answered: its request counters."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    counts = {op: float(n) for op, n in re.findall(r'dockd_request_seconds_count\{op="(\w+)"\} ([0-9.e+]+)', text)}
    return counts.get("commit", 0.0), counts.get("commits", 0.0)


def run_case(producers: int, puts: int, coalesce: bool) -> dict[str, float]:
    from dockd.local import spawn_node

    env = dict(spawn_env(), DOCKD_DAEMON_SECRET=secrets.token_hex(32), DOCKD_COMMIT_BATCH="1" if coalesce else "0")
    common = ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--capacity", "4GiB", "--log-level", "WARNING"]
    ctl, ready = spawn_node([*common, "--controller", "--no-warehouse", "--metrics-port", "0"], env=env)
    procs = [ctl]
    try:
        controller = f"127.0.0.1:{ready['port']}"
        wh, wready = spawn_node([*common, "--join", controller], env=env)
        procs.append(wh)
        warehouse = f"127.0.0.1:{wready['port']}"
        ctx = mp.get_context("spawn")
        warm, start, done = ctx.Queue(), ctx.Event(), ctx.Queue()
        workers = [ctx.Process(target=_producer, args=(controller, warehouse, puts, warm, start, done))
                   for _ in range(producers)]
        for w in workers:
            w.start()
        for _ in workers:
            warm.get(timeout=300)
        m0 = _commit_messages(ready["metrics_port"])
        c0, w0 = cpu_seconds([ctl.pid]), cpu_seconds([wh.pid])
        t0 = time.perf_counter()
        start.set()
        secs = [done.get(timeout=600) for _ in workers]
        wall = time.perf_counter() - t0
        c1, w1 = cpu_seconds([ctl.pid]), cpu_seconds([wh.pid])
        m1 = _commit_messages(ready["metrics_port"])
        for w in workers:
            w.join(60)
        total = producers * puts
        messages = (m1[0] - m0[0]) + (m1[1] - m0[1])
        return {
            "puts_per_s": total / wall,
            "put_p50_us": statistics.median(secs) / puts * 1e6,
            "controller_cpu_us": (c1 - c0) / total * 1e6,
            "warehouse_cpu_us": (w1 - w0) / total * 1e6,
            "commits_per_message": total / messages if messages else float("nan"),
        }
    finally:
        for p in reversed(procs):  # (the warehouse first: it would log losing its controller)
            p.terminate()
        for p in procs:
            p.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.commit_batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--producers", default="1,4,12", help="producer process counts (comma-separated)")
    ap.add_argument("--puts", type=int, default=1000, help="puts per producer")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.producers.split(",")]
    echo = echo_round("unix", 20000)
    print(f"64-byte Unix echo: p50 {echo['p50_us']:.1f} us, server CPU {echo['server_cpu_us_per_round_trip']:.1f} us per round trip",
          flush=True)
    results: dict[str, Any] = {"echo": echo, "cases": {}}
    for n in counts:
        best: dict[str, dict[str, float]] = {}
        for r in range(args.rounds):
            for coalesce in ((True, False) if r % 2 == 0 else (False, True)):
                name = "coalesced" if coalesce else "alone"
                res = run_case(n, args.puts, coalesce)
                print(f"P={n} round {r + 1} {name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in res.items()), flush=True)
                if name not in best or res["controller_cpu_us"] < best[name]["controller_cpu_us"]:
                    best[name] = res
        results["cases"][n] = best
    print()
    print("| producers | puts/s coalesced / alone | controller CPU us/put coalesced / alone | warehouse CPU us/put "
          "coalesced / alone | commits per message | controller CPU/put vs echo server CPU/rt (coalesced) |")
    print("|---|---|---|---|---|---|")
    for n, b in results["cases"].items():
        c, a = b["coalesced"], b["alone"]
        print(f"| {n} | {c['puts_per_s']:,.0f} / {a['puts_per_s']:,.0f} ({c['puts_per_s'] / a['puts_per_s']:.2f}x) | "
              f"{c['controller_cpu_us']:.0f} / {a['controller_cpu_us']:.0f} "
              f"({c['controller_cpu_us'] / a['controller_cpu_us']:.2f}x) | "
              f"{c['warehouse_cpu_us']:.0f} / {a['warehouse_cpu_us']:.0f} | {c['commits_per_message']:.2f} | "
              f"{c['controller_cpu_us'] / echo['server_cpu_us_per_round_trip']:.0f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
