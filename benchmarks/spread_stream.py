"""One hot stream over two controllers: an ordinary partition against one spread with --shards.

The shape is `benchmarks.prefetch_stream`'s (rollout workers in 2 processes x `--writers` threads,
each process on its own warehouse, put one trajectory at a time; a trainer of 4 threads streams gets
of up to 8 under one consumer name, with get(prefetch=P)), on a dock of two controllers (no
warehouse of their own, each with a state dir) and 2 warehouses. Each round starts fresh daemons
and moves N trajectories through two fresh partitions in turn: an ordinary one, which lives on one
controller, and one declared `--shards NAME=2`, whose two shards live one on each controller.

What it reports, per partition kind: each controller's CPU (utime + stime) from the first put to the
last get, divided by N. The binding figure is the busier controller's: an ordinary partition puts
the whole stream on one of them, a spread one halves it (plus what spreading adds: a get that finds
its home shard empty asks the other). Medians of the rounds.

    python -m benchmarks.spread_stream --trajectories 3000 --prefetch 4 --rounds 3
    python -m benchmarks.spread_stream --trajectories 3000 --prefetch 4 --rounds 3 --window 0.05
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.controller_load.procstat import cpu_seconds
from benchmarks.prefetch_stream import child_env, go, idle_cpu_ms_per_s, start_warehouses, start_workers, stop


def requests(metrics_port: int) -> dict[str, float]:
    """The requests a controller has answered, by kind (its request counters)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {op: float(n) for op, n in re.findall(r'dockd_request_seconds_count\{op="(\w+)"\} ([0-9.e+]+)', text)}


WORKER = Path(__file__).resolve().parent / "prefetch_stream.py"  # (its rollout and trainer processes)


def one_run(address: str, ctrls: list[tuple[int, int]], warehouses: list[int], env: dict[str, str], partition: str,
            n: int, prefetch: int, rate: float, writers: int) -> dict[str, Any]:
    me = [sys.executable, str(WORKER)]
    workers = [[*me, "trainer", address, partition, str(n), "4", str(prefetch), "1"],
               *([*me, "rollout", address, str(wid), partition, str(n // 2 + (w < n % 2)), str(writers), str(rate)]
                 for w, wid in enumerate(warehouses))]
    procs = start_workers(workers, env)
    m0 = [requests(port) for _, port in ctrls]
    cpu0, t0 = [cpu_seconds([pid]) for pid, _ in ctrls], time.perf_counter()
    out = go(procs)
    wall = time.perf_counter() - t0
    cpu = [cpu_seconds([pid]) - c0 for (pid, _), c0 in zip(ctrls, cpu0)]
    m1 = [requests(port) for _, port in ctrls]
    asked = [{op: b[op] - a.get(op, 0.0) for op in b if b[op] > a.get(op, 0.0)} for a, b in zip(m0, m1)]
    messages = [x.get("commit", 0.0) + x.get("commits", 0.0) for x in asked]
    gets = json.loads(out.strip().splitlines()[-1])["gets"]
    per = [c / n * 1e6 for c in cpu]
    return {"prefetch": prefetch, "rate": rate, "cpu_us_per_trajectory": per, "busiest_us": max(per),
            "total_us": sum(per), "commit_messages": messages, "acquires": [x.get("acquire", 0.0) for x in asked],
            "requests": asked, "samples_per_get": n / gets, "wall_s": wall}


def live_warehouses(address: str, count: int) -> list[int]:
    """The ids of the dock's `count` warehouses once all have joined (each controller numbers those it admits
    from ids of its own: k, k + K, ...)."""
    import dockd

    with dockd.connect(address) as dock:
        deadline = time.monotonic() + 30
        while len(ids := sorted(dock.stats()["warehouses"])) < count:
            assert time.monotonic() < deadline, f"only warehouses {ids} joined"
            time.sleep(0.1)
    return ids


def one_round(r: int, n: int, prefetch: int, rate: float, writers: int, window: float, idle_s: float) -> list[dict]:
    from dockd.local import free_ports, spawn_node

    env = dict(child_env(None), DOCKD_DAEMON_SECRET=secrets.token_hex(32))
    ports = free_ports("127.0.0.1", 2)
    listed = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs: list[subprocess.Popen] = []
    ctrls = []
    runs = []
    with tempfile.TemporaryDirectory() as state:
        try:
            for k, port in enumerate(ports):
                c, ready = spawn_node(["--host", "127.0.0.1", "--port", str(port), "--controller", "--no-warehouse",
                                       "--controllers", listed, "--shards", "spread=2", "--metrics-port", "0",
                                       "--state-dir", f"{state}/c{k}", "--log-level", "WARNING"], env=env)
                procs.append(c)
                ctrls.append((c.pid, ready["metrics_port"]))
            address = f"127.0.0.1:{ports[0]}"
            procs += start_warehouses(address, window, env)
            warehouses = live_warehouses(address, 2)
            idle = [idle_cpu_ms_per_s(pid, idle_s) for pid, _ in ctrls]
            for kind, partition in (("ordinary", f"plain{r}"), ("spread over 2", "spread")):  # (plain{r}: either)
                res = one_run(address, ctrls, warehouses, env, partition, n, prefetch, rate, writers)
                res.update(kind=kind, round=r, idle_ms_per_s=idle)
                print(json.dumps(res), flush=True)
                runs.append(res)
        finally:
            stop(procs)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spread_stream")
    p.add_argument("--trajectories", type=int, default=3000)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=0.0, help="puts per second per rollout process (0: back to back)")
    p.add_argument("--writers", type=int, default=4, help="threads per rollout process")
    p.add_argument("--window", type=float, default=0.0, help="the warehouses' --commit-window (0: off)")
    p.add_argument("--idle-seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    runs, loads = [], []
    for r in range(args.rounds):
        with open("/proc/loadavg") as f:
            loads.append(f.read().split()[0])
        runs += one_round(r, args.trajectories, args.prefetch, args.rate, args.writers, args.window,
                          args.idle_seconds)
    print(f"\nN = {args.trajectories} trajectories per run, {args.rounds} rounds, prefetch {args.prefetch}, "
          f"{'back to back' if args.rate <= 0 else f'{args.rate:g} puts/s per process'}, commit window "
          f"{args.window:g} s, loadavg (1 min) at each round's start {', '.join(loads)}")
    print("\n| partition | busier controller us / trajectory | other controller | both | commit messages "
          "(c0, c1) | acquires (c0, c1) | samples per get | wall s |\n|---|---|---|---|---|---|---|---|")
    for kind in ("ordinary", "spread over 2"):
        mine = [x for x in runs if x["kind"] == kind]

        def med(f, mine=mine):
            return statistics.median(f(x) for x in mine)

        print(f"| {kind} | {med(lambda x: x['busiest_us']):.1f} | {med(lambda x: min(x['cpu_us_per_trajectory'])):.1f} "
              f"| {med(lambda x: x['total_us']):.1f} | "
              f"{med(lambda x: x['commit_messages'][0]):.0f}, {med(lambda x: x['commit_messages'][1]):.0f} | "
              f"{med(lambda x: x['acquires'][0]):.0f}, {med(lambda x: x['acquires'][1]):.0f} | "
              f"{med(lambda x: x['samples_per_get']):.2f} | {med(lambda x: x['wall_s']):.1f} |")
    print(model(runs))
    return 0


def model(runs: list[dict]) -> str:
    """Where one stream binds in the streaming model (8 accelerators x 10 trajectories/s per node) at
    these costs: an ordinary partition on its one controller, and one spread over K shards on K
    controllers, each carrying 1/K of the measured cost of both controllers together, times the
    imbalance measured between the two."""
    from benchmarks.multinode.model import Streaming

    per_node = Streaming().accelerators_per_node * Streaming().trajectories_per_s
    plain = statistics.median(x["busiest_us"] for x in runs if x["kind"] == "ordinary") * 1e-6
    spread = [x for x in runs if x["kind"] != "ordinary"]
    both = statistics.median(x["total_us"] for x in spread) * 1e-6
    imbalance = statistics.median(2 * x["busiest_us"] / x["total_us"] for x in spread)
    ks = ", ".join(f"K={k}: {1 / (per_node * both * imbalance / k):,.0f}" for k in (2, 4, 8))
    return (f"\nModel (8 accelerators x 10 trajectories/s per node, one stream): an ordinary partition binds its "
            f"controller at {1 / (per_node * plain):,.0f} nodes; spread over K controllers (imbalance "
            f"{imbalance:.2f}) at {ks} nodes")


if __name__ == "__main__":
    sys.exit(main())
