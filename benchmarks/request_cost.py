"""What one small request costs: latency against a raw socket round trip, CPU per request.

    python -m benchmarks.request_cost [--count N] [--rounds R] [--only CASES] [--pin one|two] [--json PATH]

A local dock (a controller daemon hosting a warehouse, and a second warehouse)
and one synchronous client in this process, one request in flight:

- ``get@controller``: get of one 64-byte sample held by the controller's own daemon
  (one round trip: the acquire's reply carries it inline);
- ``get@warehouse``: the same sample held by the other warehouse (acquire, then fetch);
- ``get@controller/tcp``: as the first, over TCP (``DOCKD_TRANSPORT=tcp``);
- ``put@controller`` / ``put@warehouse``: put of one sample (a 4 KiB and a 2 KiB tensor
  and a float, the shape of one trajectory's extras) to either daemon; a put to the
  other warehouse commits to the controller before it is answered;
- ``ping``: an empty confirm, the floor of any request.

Per case: p50 and p99 latency, the p50 as a multiple of the same-run 64-byte
echo round trip over the same kind of socket (a Unix socket, or loopback TCP),
and CPU per request of the controller daemon, the other warehouse daemon and
this client (``/proc`` counters around the timed loop; the client's includes
the up-to-200 µs spin of a same-host call waiting for its reply). The best of
``rounds`` rounds (fresh docks) is kept per case, as for the echo: on a shared
VM the figures are bimodal, depending on where the scheduler puts the
processes. ``--pin`` takes the scheduler's choice away: ``one`` puts the
daemons, the client and the echo on CPU 0 (they take turns: latency is the
sum of both sides' CPU), ``two`` the daemons on CPU 0 and the client on CPU 1
(a daemon's work after its reply overlaps the client's), the echo's server
and client placed the same way. ``--only`` runs
some of the cases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from .common import pin_process
from .controller_load.baseline import echo_round
from .controller_load.procstat import cpu_seconds

CASES = ("get@controller", "get@warehouse", "get@controller/tcp", "put@controller", "put@warehouse", "ping")


def _run_cases(count: int, tcp: bool, only: frozenset[str] | None = None, pin: str = "") -> dict[str, dict[str, float]]:
    import torch

    import dockd
    from dockd._proto import dockd_pb2 as pb

    out: dict[str, dict[str, float]] = {}
    with dockd.start_local(num_warehouses=2) as cl:
        ctl_pid, wh_pid = cl.procs[0].pid, cl.procs[1].pid
        pids = {"controller": ctl_pid, "warehouse": wh_pid}
        if pin:  # the daemons on CPU 0; this client there too ("one") or on CPU 1 ("two")
            for p in pids.values():
                pin_process(p, {0})
            pin_process(os.getpid(), {0 if pin == "one" else 1})
        sample = {"tokens": torch.randint(0, 1000, (1, 512)), "logp": torch.randn(1, 512), "reward": [1.0]}
        tiny = torch.zeros(count + 200, 64, dtype=torch.uint8)

        def timed(name: str, fn) -> None:
            if only is not None and name not in only:
                return
            for _ in range(min(200, count)):
                fn()
            lat = []
            c0 = {k: cpu_seconds([p]) for k, p in pids.items()}
            t0 = os.times()
            for _ in range(count):
                t = time.perf_counter()
                fn()
                lat.append(time.perf_counter() - t)
            t1 = os.times()
            c1 = {k: cpu_seconds([p]) for k, p in pids.items()}
            lat.sort()
            out[name] = {
                "p50_us": statistics.median(lat) * 1e6,
                "p99_us": lat[int(0.99 * (len(lat) - 1))] * 1e6,
                "controller_cpu_us": (c1["controller"] - c0["controller"]) / count * 1e6,
                "warehouse_cpu_us": (c1["warehouse"] - c0["warehouse"]) / count * 1e6,
                "client_cpu_us": (t1.user - t0.user + t1.system - t0.system) / count * 1e6,
            }

        for where, home in (("controller", cl.warehouses[0]), ("warehouse", cl.warehouses[1])):
            if tcp and where == "warehouse":
                continue
            d = dockd.connect(cl.address, warehouse=home)
            part = f"g-{where}"
            for i in range(0, len(tiny), 500):
                d.put({"x": tiny[i:i + 500]}, partition=part)
            suffix = "/tcp" if tcp else ""
            timed(f"get@{where}{suffix}", lambda d=d, part=part: d.get("c", ["x"], 1, partition=part))
            if not tcp:
                timed(f"put@{where}", lambda d=d, where=where: d.put(sample, partition=f"p-{where}"))
            if where == "controller" and not tcp:
                frame = pb.Frame(confirm=pb.ConfirmRequest())
                timed("ping", lambda d=d, frame=frame: d._router.controller(lambda pool: pool.call(frame)))
            d.close()
    return out


def _child(count: int, tcp: bool, only: frozenset[str] | None, pin: str) -> None:
    print(json.dumps(_run_cases(count, tcp, only, pin)))


def _cases_in_child(count: int, tcp: bool, only: frozenset[str] | None = None,
                    pin: str = "") -> dict[str, dict[str, float]]:
    """One round in a fresh process (DOCKD_TRANSPORT is read when a client is made)."""
    import subprocess

    env = dict(os.environ)
    if tcp:
        env["DOCKD_TRANSPORT"] = "tcp"
    args = ["--child", str(count)] + (["--tcp"] if tcp else []) + (["--only", ",".join(sorted(only))] if only else []) \
        + (["--pin", pin] if pin else [])
    res = subprocess.run([sys.executable, "-m", "benchmarks.request_cost", *args],
                         env=env, capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise RuntimeError(f"request_cost round failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(count: int, rounds: int, only: frozenset[str] | None = None, pin: str = "") -> dict[str, Any]:
    cpus = os.sched_getaffinity(0)
    if pin:  # (the echo's server inherits CPU 0, as the daemons have it; its client then moves as this one's)
        os.sched_setaffinity(0, {0})
    client = {0 if pin == "one" else 1} if pin else None
    try:
        echo = {fam: min((echo_round(fam, count, client_cpus=client) for _ in range(rounds)), key=lambda r: r["p50_us"])
                for fam in ("unix", "tcp")}
    finally:
        os.sched_setaffinity(0, cpus)
    best: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for tcp in (False, True):
            if only is not None and not any(name.endswith("/tcp") == tcp for name in only):
                continue
            for name, fig in _cases_in_child(count, tcp, only, pin).items():
                if name not in best or fig["p50_us"] < best[name]["p50_us"]:
                    best[name] = fig
    for name, fig in best.items():
        base = echo["tcp" if name.endswith("/tcp") else "unix"]
        fig["p50_vs_echo"] = fig["p50_us"] / base["p50_us"]
    return {"echo": echo, "cases": best, "count": count, "rounds": rounds}


def table(res: dict[str, Any]) -> str:
    e = res["echo"]
    lines = [f"echo round trip p50: Unix {e['unix']['p50_us']:.1f} us, TCP {e['tcp']['p50_us']:.1f} us "
             f"(64 bytes, same run)", "",
             "| request | p50 µs | p99 µs | p50 ÷ echo | controller CPU µs | other warehouse CPU µs | client CPU µs |",
             "|---|---|---|---|---|---|---|"]
    for name in CASES:
        f = res["cases"].get(name)
        if f is None:
            continue
        lines.append(f"| {name} | {f['p50_us']:.0f} | {f['p99_us']:.0f} | {f['p50_vs_echo']:.1f}x | "
                     f"{f['controller_cpu_us']:.0f} | {f['warehouse_cpu_us']:.0f} | {f['client_cpu_us']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.request_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=3000, help="timed requests per case (default 3000)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh docks per case; the best is kept (default 3)")
    ap.add_argument("--only", help=f"comma-separated cases to run (default all: {','.join(CASES)})")
    ap.add_argument("--pin", choices=("one", "two"), default="",
                    help="the daemons on CPU 0, the client there too (one) or on CPU 1 (two); default: the scheduler's "
                         "choice, which moves between rounds (the echo is pinned the same way)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tcp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    only = frozenset(args.only.split(",")) if args.only else None
    if only is not None and not only <= set(CASES):
        ap.error(f"--only: unknown case(s) {', '.join(sorted(only - set(CASES)))}; the cases are {', '.join(CASES)}")
    if args.child:
        _child(args.child, args.tcp, only, args.pin)
        return
    res = measure(args.count, args.rounds, only, args.pin)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
