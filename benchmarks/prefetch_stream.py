"""Controller CPU per trajectory in the streaming shape, with and without leases taken ahead.

The shape (issue 44): a controller without a warehouse, with a state dir; 2 warehouses; rollout
workers in 2 processes x 4 threads, each process on its own warehouse, put one trajectory at a time;
a trainer process of 4 threads streams gets of up to 8 (allow_partial) under one consumer name,
with get(prefetch=P). Each run moves N trajectories through a fresh partition of the same daemons;
the controller's CPU (utime + stime) from the first put to the last get, divided by N, is its cost
per trajectory (its put's commit plus its share of a get). Runs alternate P = 0 (the same-run
baseline) and each P asked for, `--rounds` times; medians are reported.

    python -m benchmarks.prefetch_stream --trajectories 4000 --prefetch 4,8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.controller_load.procstat import cpu_seconds


def rollout(address: str, warehouse: int, partition: str, n: int, threads: int) -> None:
    import torch

    import dockd

    with dockd.connect(address, warehouse=warehouse) as dock:
        def loop(k: int) -> None:
            for _ in range(k):
                dock.put({"tokens": [torch.randint(0, 32000, (256,), dtype=torch.int32)], "reward": [1.0]},
                         partition=partition)

        ts = [threading.Thread(target=loop, args=(n // threads + (i < n % threads),)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()


def trainer(address: str, partition: str, n: int, threads: int, prefetch: int) -> None:
    import dockd

    got: list[int] = []
    lock = threading.Lock()
    gets = [0]
    with dockd.connect(address) as dock:
        def loop() -> None:
            while True:
                with lock:
                    if len(got) >= n:
                        return
                try:
                    b = dock.get("train", ["tokens", "reward"], 8, partition=partition, allow_partial=True,
                                 timeout=1.0, prefetch=prefetch)
                except dockd.DockTimeout:
                    continue
                with lock:
                    got.extend(b.indexes)
                    gets[0] += 1

        ts = [threading.Thread(target=loop) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert len(got) == len(set(got)) == n, (len(got), len(set(got)), n)
    print(json.dumps({"gets": gets[0]}), flush=True)


def one_run(address: str, ctrl_pid: int, partition: str, n: int, prefetch: int) -> dict[str, float]:
    me = [sys.executable, "-m", "benchmarks.prefetch_stream"]
    cpu0, t0 = cpu_seconds([ctrl_pid]), time.perf_counter()
    train = subprocess.Popen([*me, "trainer", address, partition, str(n), "4", str(prefetch)],
                             stdout=subprocess.PIPE, text=True)
    rolls = [subprocess.Popen([*me, "rollout", address, str(w), partition, str(n // 2 + (w < n % 2)), "4"])
             for w in range(2)]
    for p in rolls:
        assert p.wait(600) == 0
    out, _ = train.communicate(timeout=600)
    assert train.returncode == 0
    cpu, wall = cpu_seconds([ctrl_pid]) - cpu0, time.perf_counter() - t0
    gets = json.loads(out.strip().splitlines()[-1])["gets"]
    return {"prefetch": prefetch, "cpu_us_per_trajectory": cpu / n * 1e6, "wall_s": wall,
            "samples_per_get": n / gets, "gets": gets}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rollout":
        rollout(argv[1], int(argv[2]), argv[3], int(argv[4]), int(argv[5]))
        return 0
    if argv and argv[0] == "trainer":
        trainer(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefetch_stream")
    p.add_argument("--trajectories", type=int, default=4000)
    p.add_argument("--prefetch", default="4,8", help="prefetch values compared with 0")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    from dockd.local import spawn_node

    procs = []
    with tempfile.TemporaryDirectory() as state:
        try:
            c, ready = spawn_node(["--host", "127.0.0.1", "--port", "0", "--controller", "--no-warehouse",
                                   "--state-dir", state, "--log-level", "WARNING"])
            procs.append(c)
            address = f"127.0.0.1:{ready['port']}"
            for _ in range(2):
                procs.append(spawn_node(["--host", "127.0.0.1", "--port", "0", "--join", address,
                                         "--capacity", "2GiB", "--log-level", "WARNING"])[0])
            runs = []
            values = [0, *(int(x) for x in args.prefetch.split(","))]
            for r in range(args.rounds):
                for pf in values:
                    res = one_run(address, c.pid, f"s{r}-{pf}", args.trajectories, pf)
                    print(json.dumps(res), flush=True)
                    runs.append(res)
            with open("/proc/loadavg") as f:
                load = f.read().split()[:3]
            print(f"\nN = {args.trajectories} trajectories per run, {args.rounds} rounds, loadavg at end {load}")
            print("| prefetch | controller CPU us / trajectory (median) | runs | samples per get | wall s |")
            print("|---|---|---|---|---|")
            for pf in values:
                mine = [x for x in runs if x["prefetch"] == pf]
                cpu = [x["cpu_us_per_trajectory"] for x in mine]
                print(f"| {pf} | {statistics.median(cpu):.1f} | {', '.join(f'{v:.1f}' for v in cpu)} | "
                      f"{statistics.median(x['samples_per_get'] for x in mine):.2f} | "
                      f"{statistics.median(x['wall_s'] for x in mine):.1f} |")
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
