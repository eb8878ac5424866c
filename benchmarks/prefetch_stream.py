"""Controller CPU per trajectory in the streaming shape, with and without leases taken ahead.

The shape (issue 44): a controller without a warehouse, with a state dir; 2 warehouses; rollout
workers in 2 processes x 4 threads (`--writers`), each process on its own warehouse, put one
trajectory at a time, back to back or paced (`--rate R`: R puts per second per process, the model's 80 per node); a
trainer process of 4 threads streams gets of up to 8 (allow_partial) under one consumer name, with
get(prefetch=P). Each run moves N trajectories through a fresh partition; the controller's CPU
(utime + stime) from the first put to the last get, divided by N, is its cost per trajectory (its
put's commit plus its share of a get). The controller's request counters give the commit messages
it answered, so each run says how many commits the warehouses coalesced into one message.

Each round starts fresh daemons per tree and runs every rate x P (P = 0, the same-run baseline,
and each P asked for). `--tree LABEL=DIR` (repeatable) runs the daemons and the workers with DIR
first on PYTHONPATH (e.g. a copy of the checkout with the request path compiled by mypyc), the
trees alternating within each round; without it, this checkout. `--whole`: the trainer's gets wait
for 8 samples instead (fewer acquires per trajectory when the stream is slow). Each run's window
opens once every worker has connected. Medians of the rounds are reported.

    python -m benchmarks.prefetch_stream --trajectories 4000 --prefetch 4,8 --rounds 3
    python -m benchmarks.prefetch_stream --trajectories 3000 --prefetch 4 --rate 0,80 \\
        --tree pure=/tmp/dockd-pure --tree compiled=/tmp/dockd-compiled
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.controller_load.procstat import cpu_seconds

REPO_ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()


class Pacer:
    """Open-loop pacing shared by threads: the k-th call to `wait` returns at start + k / rate (late
    callers return at once, so a slow put is caught up rather than lost); rate 0 never waits."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self._clock, self._sleep = rate, clock, sleep
        self._lock = threading.Lock()
        self._start: float | None = None
        self._k = 0

    def slot(self) -> float:
        """The time of the next call's slot (taking it); 0.0 when unpaced."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            if self._start is None:
                self._start = self._clock()
            at = self._start + self._k / self.rate
            self._k += 1
        return at

    def wait(self) -> None:
        delay = self.slot() - self._clock()
        if self.rate > 0 and delay > 0:
            self._sleep(delay)


def ready_then_wait() -> None:
    """Tell the parent this worker is connected (its imports done), then wait for its go: the
    measured window holds the stream, not the workers' start."""
    print("ready", flush=True)
    sys.stdin.readline()


def rollout(address: str, warehouse: int, partition: str, n: int, threads: int, rate: float) -> None:
    import torch

    import dockd

    pacer = Pacer(rate)
    with dockd.connect(address, warehouse=warehouse) as dock:
        ready_then_wait()
        def loop(k: int) -> None:
            for _ in range(k):
                pacer.wait()
                dock.put({"tokens": [torch.randint(0, 32000, (256,), dtype=torch.int32)], "reward": [1.0]},
                         partition=partition)

        ts = [threading.Thread(target=loop, args=(n // threads + (i < n % threads),)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()


def trainer(address: str, partition: str, n: int, threads: int, prefetch: int, partial: bool = True) -> None:
    import dockd

    got: list[int] = []
    lock = threading.Lock()
    gets = [0]
    with dockd.connect(address) as dock:
        ready_then_wait()
        def loop() -> None:
            while True:
                with lock:
                    if len(got) >= n:
                        return
                try:
                    b = dock.get("train", ["tokens", "reward"], 8, partition=partition, allow_partial=partial,
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


def child_env(tree: str | None) -> dict[str, str]:
    """The environment of every daemon and worker: `tree` (if any), then this checkout, first on
    PYTHONPATH; PYTHONSAFEPATH keeps the working directory's `dockd` from shadowing the tree's."""
    parts = [*([tree] if tree else []), str(REPO_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(p for p in parts if p)), PYTHONSAFEPATH="1")


def compiled_modules(pid: int, root: str) -> int:
    """How many extension files from the tree at `root` the process has mapped: mypyc's group library
    (beside the package) and the .so of each module imported from outside the group."""
    with open(f"/proc/{pid}/maps") as f:
        files = {x for x in (line.split()[-1] for line in f) if x.endswith(".so")}
    return len({x for x in files if x.startswith(f"{root}/dockd/") or (os.path.dirname(x) == root and "__mypyc." in x)})


def thread_cpu_s(pid: int) -> float:
    """CPU seconds of the process's live threads to the nanosecond (/proc/<pid>/task/*/schedstat; a
    thread gone since is not counted: for windows in which none ends, such as an idle one)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def idle_cpu_ms_per_s(pid: int, seconds: float) -> float:
    """The controller's own CPU while nothing asks anything of it (its timers, its links' keepalives)."""
    c0, t0 = thread_cpu_s(pid), time.perf_counter()
    time.sleep(seconds)
    return (thread_cpu_s(pid) - c0) / (time.perf_counter() - t0) * 1e3


@dataclasses.dataclass(frozen=True)
class Shape:
    """One run's shape: N trajectories, the trainer's prefetch, each rollout process's rate (0: back to
    back), and whether the trainer's gets take what is ready (allow_partial) or wait for 8."""
    n: int
    prefetch: int
    rate: float
    partial: bool = True
    writers: int = 4  # threads per rollout process (puts in flight per warehouse)


def start_workers(workers: list[list[str]], env: dict[str, str]) -> list[subprocess.Popen]:
    """The worker processes (the trainer first), each started and connected (it said "ready")."""
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for cmd in workers]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.args
    return procs


def go(procs: list[subprocess.Popen]) -> str:
    """Let the workers go and wait for them all; the trainer's output."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    train, *rolls = procs
    for p in rolls:
        assert p.wait(600) == 0
        p.stdout.close()  # type: ignore[union-attr]  # (started with stdout=PIPE)
    out = train.stdout.read()  # type: ignore[union-attr]  # (started with stdout=PIPE)
    assert train.wait(600) == 0
    return out


def one_run(address: str, ctrl: tuple[int, int], env: dict[str, str], partition: str, shape: Shape) -> dict[str, Any]:
    from benchmarks.commit_batch import _commit_messages

    n, prefetch, rate = shape.n, shape.prefetch, shape.rate

    me = [sys.executable, str(HERE)]  # (a script, not -m: a tree's own benchmarks/ must not shadow this one)
    ctrl_pid, metrics_port = ctrl
    workers = [[*me, "trainer", address, partition, str(n), "4", str(prefetch), str(int(shape.partial))],
               *([*me, "rollout", address, str(w), partition, str(n // 2 + (w < n % 2)),
                  str(shape.writers), str(rate)]
                 for w in range(2))]
    procs = start_workers(workers, env)
    m0 = _commit_messages(metrics_port)
    cpu0, t0 = cpu_seconds([ctrl_pid]), time.perf_counter()
    out = go(procs)
    cpu, wall = cpu_seconds([ctrl_pid]) - cpu0, time.perf_counter() - t0
    m1 = _commit_messages(metrics_port)
    gets = json.loads(out.strip().splitlines()[-1])["gets"]
    messages = (m1[0] - m0[0]) + (m1[1] - m0[1])
    return {"prefetch": prefetch, "rate": rate, "cpu_us_per_trajectory": cpu / n * 1e6, "wall_s": wall,
            "samples_per_get": n / gets, "gets": gets,
            "commits_per_message": n / messages if messages else float("nan")}


def run_tree(label: str, tree: str | None, r: int, shapes: list[Shape], idle_s: float,
             window: float = 0.0) -> list[dict]:
    """One round on fresh daemons of one tree (warehouses with --commit-window `window`): every shape."""
    from dockd.local import spawn_node

    env = child_env(tree)
    procs = []
    runs = []
    with tempfile.TemporaryDirectory() as state:
        try:
            c, ready = spawn_node(["--host", "127.0.0.1", "--port", "0", "--controller", "--no-warehouse",
                                   "--metrics-port", "0", "--state-dir", state, "--log-level", "WARNING"], env=env)
            procs.append(c)
            address = f"127.0.0.1:{ready['port']}"
            procs += start_warehouses(address, window, env)
            so = compiled_modules(c.pid, str(Path(tree or REPO_ROOT).resolve()))
            idle = idle_cpu_ms_per_s(c.pid, idle_s)
            for i, shape in enumerate(shapes):
                res = one_run(address, (c.pid, ready["metrics_port"]), env, f"s{r}-{i}", shape)
                res.update(tree=label, round=r, controller_compiled_modules=so, idle_ms_per_s=idle)
                print(json.dumps(res), flush=True)
                runs.append(res)
        finally:
            stop(procs)
    return runs


def start_warehouses(address: str, window: float, env: dict[str, str]) -> list[subprocess.Popen]:
    """Two warehouses joined to the controller at `address`, with --commit-window `window` (0: off)."""
    from dockd.local import spawn_node

    return [spawn_node(["--host", "127.0.0.1", "--port", "0", "--join", address, "--capacity", "2GiB",
                        "--log-level", "WARNING", *(["--commit-window", str(window)] if window else [])], env=env)[0]
            for _ in range(2)]


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop the daemons, the last started first (the warehouses: they would log losing their controller)."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        proc.wait(20)


def table(runs: list[dict], labels: list[str], values: list[int], rates: list[float]) -> list[str]:
    """The markdown table: medians per tree x rate x P, and the ratio to the first tree's P = 0 at that rate."""
    lines = ["| tree | rate / process | prefetch | controller CPU us / trajectory (median) | vs baseline | runs "
             "| commits per message | samples per get | wall s |", "|---|---|---|---|---|---|---|---|---|"]

    def med(mine: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in mine)

    for rate in rates:
        base = med([x for x in runs if x["tree"] == labels[0] and x["rate"] == rate and x["prefetch"] == 0],
                   "cpu_us_per_trajectory")
        for label in labels:
            for pf in values:
                mine = [x for x in runs if x["tree"] == label and x["rate"] == rate and x["prefetch"] == pf]
                cpu = med(mine, "cpu_us_per_trajectory")
                each = ", ".join(f"{x['cpu_us_per_trajectory']:.1f}" for x in mine)
                lines.append(f"| {label} | {'back to back' if rate <= 0 else f'{rate:g}/s'} | {pf} | {cpu:.1f} | "
                             f"{cpu / base:.2f}x | {each} | "
                             f"{med(mine, 'commits_per_message'):.2f} | {med(mine, 'samples_per_get'):.2f} | "
                             f"{med(mine, 'wall_s'):.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rollout":
        rollout(argv[1], int(argv[2]), argv[3], int(argv[4]), int(argv[5]), float(argv[6]) if len(argv) > 6 else 0.0)
        return 0
    if argv and argv[0] == "trainer":
        trainer(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]), argv[6] != "0" if len(argv) > 6 else True)
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefetch_stream")
    p.add_argument("--trajectories", type=int, default=4000)
    p.add_argument("--prefetch", default="4,8", help="prefetch values compared with 0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", default="0", help="puts per second per rollout process, comma-separated (0: back to back)")
    p.add_argument("--whole", action="store_true",
                   help="the trainer's gets wait for 8 samples (no allow_partial); N a multiple of 8")
    p.add_argument("--writers", type=int, default=4,
                   help="threads per rollout process, each with one put in flight (the model's node: 8)")
    p.add_argument("--idle-seconds", type=float, default=3.0,
                   help="how long the controller's idle CPU is measured before each tree's runs")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                   help="run daemons and workers with DIR first on PYTHONPATH (repeatable; default: this checkout)")
    p.add_argument("--window", default="0", metavar="SECONDS,...",
                   help="the warehouses' --commit-window, comma-separated: each tree runs with each (0: off)")
    args = p.parse_args(argv)
    windows = [float(x) for x in args.window.split(",") if x]
    trees: list[tuple[str, str | None]] = [(t.split("=", 1)[0], t.split("=", 1)[1]) if "=" in t else (t, t)
                                           for t in args.tree] or [("checkout", None)]
    for label, tree in trees:
        if tree is not None and not (Path(tree) / "dockd" / "__init__.py").is_file():
            p.error(f"--tree {label}={tree}: no dockd package there (give the root of a copy of the checkout)")
    values = [0, *(int(x) for x in args.prefetch.split(",") if x)]
    rates = [float(x) for x in args.rate.split(",")]
    if args.whole and args.trajectories % 8:
        p.error(f"--whole takes gets of exactly 8: --trajectories {args.trajectories} is not a multiple of 8")
    shapes = [Shape(args.trajectories, pf, rate, not args.whole, args.writers) for rate in rates for pf in values]
    runs = []
    loads = []
    if len(windows) > 1 or windows[0]:  # (each tree once per window: labelled "TREE w=SECONDS")
        runs_of = [(f"{label} w={w:g}", tree, w) for label, tree in trees for w in windows]
    else:
        runs_of = [(label, tree, 0.0) for label, tree in trees]
    for r in range(args.rounds):
        for label, tree, w in runs_of:
            with open("/proc/loadavg") as f:
                loads.append(f.read().split()[0])
            runs += run_tree(label, tree, r, shapes, args.idle_seconds, w)
    print(f"\nN = {args.trajectories} trajectories per run, {args.rounds} rounds, trainer gets of "
          f"{'exactly 8' if args.whole else 'up to 8 (allow_partial)'}, loadavg (1 min) at each start "
          f"{', '.join(loads)}")
    for label, tree, _ in runs_of:
        mine = [x for x in runs if x["tree"] == label]
        so = sorted({x["controller_compiled_modules"] for x in mine})
        idle = sorted({round(x["idle_ms_per_s"], 2) for x in mine})
        print(f"tree {label}: {tree or REPO_ROOT}, dockd extension files mapped by the controller: {so}, "
              f"its idle CPU ms/s: {idle}")
    print("\n".join(table(runs, [t[0] for t in runs_of], values, rates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
