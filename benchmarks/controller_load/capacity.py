"""``python -m benchmarks.controller_load.capacity``: how many small gets one controller answers per second.

The streaming benchmark (``python -m benchmarks.controller_load``) drives the dock through dockd's full
client, ``AsyncDock``, which costs its processes 1.3-1.65 ms of CPU per request; on a small machine the
clients saturate the cores long before the controller does (it never got busier than a fifth of a core
there), so the rate it sustains describes the machine, not the controller. This probe loads the
controllers alone, with the cheapest client that still speaks the real protocol:

- the daemons: K controllers without warehouses (``dockd serve --controller --no-warehouse``, with
  ``--controllers`` when K > 1) and one warehouse that joins them (``Daemons``, as the streaming run);
- before each step a real client fills P fresh partitions through the warehouse (``--fill`` samples each,
  one 16-byte column);
- C threads in this process, each with one authenticated connection per controller
  (``dockd.net.connection.Connection``), send the controller's side of a small get in a closed loop:
  an acquire of 1..8 samples (``allow_partial``, no wait) of the next (consumer, partition) pair, on the
  connection of that partition's owner, carrying the confirm of that connection's previous lease, as a
  trainer's next get does. No fetch (that is the warehouses' work) and no put in the timed window.

Per K and C: requests/s, p50/p99, the controllers' CPU per request (``/proc``) and cores used, the probe's
own CPU per request. Capacity is the best rate of a step with p99 <= ``--p99-ms``.

For K > 1 each thread count runs twice more: with the partitions spread over all K controllers
("together", what a dock does) and with partitions of one controller at a time ("alone": the others
idle). Together, K controllers sustain K times one only where each has a core of its own and the probe
has cores left; on a machine with fewer cores they take turns on the same ones, and a run shows what
that costs. Alone, each controller's capacity against K = 1's, and the idle controllers' CPU per request
of the loaded one (any work one controller causes another), say whether the controllers are
independent: then K of them on K cores sustain the sum of their rates alone. ``--controller-cpus`` and
``--client-cpus`` pin the roles to CPU sets (the warehouse goes with the probe: it is idle in the timed
window).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..common import REPO_ROOT, machine, versions
from . import baseline
from .daemons import Daemons, parse_cpus
from .procstat import cpu_seconds

DEFAULT_RESULTS = REPO_ROOT / "bench-results"
COLUMN = "x"


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def drive(owner: dict[str, str], pairs: list[tuple[str, str]], threads: int, seconds: float,
          seed: int = 0) -> dict[str, Any]:
    """`threads` closed loops of acquire (+ the previous lease's confirm) for `seconds`; latencies and counts."""
    from dockd._proto import dockd_pb2 as pb
    from dockd.net.connection import Connection, Credentials

    def connect(address: str, creds: Credentials) -> Connection:
        host, port = address.rsplit(":", 1)
        return Connection(host, int(port), creds=creds)

    conns = [{a: connect(a, Credentials(session=secrets.token_bytes(16), name=f"probe{t}"))
              for a in sorted(set(owner.values()))} for t in range(threads)]
    stop = threading.Event()
    lat: list[list[float]] = [[] for _ in range(threads)]
    samples = [0] * threads
    errors: dict[str, int] = {}

    def loop(t: int) -> None:
        rng = random.Random(seed * 1000 + t)
        last: dict[str, list[int]] = {a: [] for a in conns[t]}
        i, rid = t, 0
        while not stop.is_set():
            i, rid = i + 1, rid + 1
            consumer, part = pairs[i % len(pairs)]
            address = owner[part]
            req = pb.AcquireRequest(partition=part, consumer=consumer, columns=[COLUMN], count=rng.randint(1, 8),
                                    allow_partial=True, timeout=0.0, confirm=last[address],
                                    token=rng.getrandbits(63) | 1)
            started = time.perf_counter()
            try:
                reply, _, _ = conns[t][address].call(pb.Frame(id=rid, acquire=req), timeout=30.0)
            except Exception as e:  # noqa: BLE001 - counted and reported; the connection is not reused
                key = f"{type(e).__name__}: {str(e)[:160]}"
                errors[key] = errors.get(key, 0) + 1
                stop.set()
                return
            lat[t].append(time.perf_counter() - started)
            got = reply.acquire_reply
            samples[t] += len(got.indexes)
            last[address] = [got.lease] if got.lease else []

    workers = [threading.Thread(target=loop, args=(t,), name=f"probe{t}") for t in range(threads)]
    t0, own0 = time.perf_counter(), time.process_time()
    for w in workers:
        w.start()
    stop.wait(seconds)
    stop.set()
    for w in workers:
        w.join()
    wall, own = time.perf_counter() - t0, time.process_time() - own0
    for c in conns:
        for conn in c.values():
            conn.close()
    every = sorted(x for xs in lat for x in xs)
    return {"requests": len(every), "wall_s": wall, "probe_cpu_s": own, "samples": sum(samples),
            "errors": errors, "latencies_sorted": every}


def fill(dock: Any, partitions: list[str], n: int) -> None:
    import torch

    for part in partitions:
        dock.put({COLUMN: torch.zeros(n, 4, dtype=torch.float32)}, partition=part)


def partition_names(tag: str, count: int, k: int, only: int | None = None) -> list[str]:
    """`count` partition names; with `only`, names that controller `only` of K owns (the clients' own rule)."""
    from dockd import owners

    out: list[str] = []
    i = 0
    while len(out) < count:
        name, i = f"{tag}-{i}", i + 1
        if only is None or owners.owner_index(name, k) == only:
            out.append(name)
    return out


def step(daemons: Daemons, dock: Any, parts: list[str], threads: int, args: argparse.Namespace,
         seed: int) -> dict[str, Any]:
    """Fill `parts`, drive them for `args.seconds`, clear them; the step's figures."""
    fill(dock, parts, args.fill)
    stats = dock.stats()["partitions"]
    owner = {p: stats[p].get("controller") or daemons.address for p in parts}
    pairs = [(f"consumer{c}", p) for p in parts for c in range(args.consumers)]
    pids = daemons.controller_pids
    cpu0 = [cpu_seconds([pid]) for pid in pids]
    r = drive(owner, pairs, threads, args.seconds, seed=seed)
    cpu = [cpu_seconds([pid]) - c for pid, c in zip(pids, cpu0)]
    for p in parts:
        dock.clear(p)
    lat = r.pop("latencies_sorted")
    n, wall = r["requests"], r["wall_s"]
    out = {"threads": threads, **r, "requests_per_s": n / wall,
           "p50_ms": _pct(lat, 0.5) * 1e3 if lat else None, "p99_ms": _pct(lat, 0.99) * 1e3 if lat else None,
           "controller_cpu_us_per_request": sum(cpu) / n * 1e6 if n else None,
           "controller_cores_busy": sum(cpu) / wall,
           "per_controller_cpu_us_per_request": [c / n * 1e6 if n else None for c in cpu],
           "probe_cpu_us_per_request": r["probe_cpu_s"] / n * 1e6 if n else None,
           "owners": sorted(set(owner.values()))}
    out["passed"] = bool(lat) and not r["errors"] and out["p99_ms"] <= args.p99_ms
    return out


def _line(k: int, what: str, s: dict[str, Any]) -> str:
    return (f"[capacity] K={k} {what} threads={s['threads']}: {s['requests_per_s']:,.0f} requests/s, p50 "
            f"{s['p50_ms'] or 0:.2f} ms, p99 {s['p99_ms'] or 0:.2f} ms, controller CPU "
            f"{s['controller_cpu_us_per_request'] or 0:.0f} us/request ({s['controller_cores_busy']:.2f} cores), "
            f"probe {s['probe_cpu_us_per_request'] or 0:.0f} us/request"
            + (f" errors: {s['errors']}" if s["errors"] else ""))


def _best(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    good = [s for s in steps if s["passed"]]
    return max(good, key=lambda s: s["requests_per_s"]) if good else None


def measure_k(k: int, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """K controllers: every thread count with the partitions spread over all of them ("together"), and,
    for K > 1, with the partitions of one controller at a time ("alone", the others idle)."""
    import dockd

    ctl_cpus, cli_cpus = parse_cpus(args.controller_cpus), parse_cpus(args.client_cpus)
    daemons = Daemons(controllers=k, warehouses=1, capacity="4GiB", controller_cpus=ctl_cpus,
                      warehouse_cpus=cli_cpus, listed=True)
    out: dict[str, Any] = {"controllers": k, "layout": daemons.layout, "together": [], "alone": []}
    try:
        if cli_cpus:
            os.sched_setaffinity(0, cli_cpus)
        with dockd.connect(daemons.address) as dock:
            for n, threads in enumerate(args.threads):
                s = step(daemons, dock, partition_names(f"t{k}-{n}", args.partitions, k), threads, args, n)
                out["together"].append(s)
                log(_line(k, "together", s))
            for i in range(k if k > 1 else 0):
                for n, threads in enumerate(args.threads):
                    s = step(daemons, dock, partition_names(f"a{k}-{i}-{n}", args.partitions, k, only=i), threads,
                             args, n)
                    s["controller"] = i
                    out["alone"].append(s)
                    log(_line(k, f"controller {i} alone", s))
    finally:
        daemons.close()
    out["capacity"] = _best(out["together"])
    out["alone_capacity"] = [_best([s for s in out["alone"] if s["controller"] == i]) for i in range(k if k > 1 else 0)]
    return out


def summarize(results: dict[str, Any]) -> None:
    """Each K's capacity against K = 1's, loaded together and one controller at a time."""
    one = next((r["capacity"] for r in results["runs"] if r["controllers"] == 1), None)
    for r in results["runs"]:
        cap = r["capacity"]
        r["scaling"] = cap["requests_per_s"] / one["requests_per_s"] if cap and one else None
        alone = [c["requests_per_s"] / one["requests_per_s"] if c and one else None for c in r["alone_capacity"]]
        r["alone_vs_one"] = alone
        # what K controllers on K cores of their own would sustain, from each one's rate alone
        r["independent_scaling"] = sum(alone) if alone and None not in alone else None
        idle = [u for s in r["alone"] for j, u in enumerate(s["per_controller_cpu_us_per_request"])
                if j != s["controller"] and u is not None]
        r["idle_controller_cpu_us_per_request_max"] = max(idle) if idle else None


def add_model(results: dict[str, Any]) -> None:
    """The streaming model (`benchmarks/multinode/model.py`) with K = 1's CPU per request at its capacity. That
    figure is a small get's (acquire + confirm); a trajectory's commit is taken to cost the same."""
    from ..multinode.model import Streaming, streaming_table

    one = next((r["capacity"] for r in results["runs"] if r["controllers"] == 1), None)
    if one and one["controller_cpu_us_per_request"]:
        results["streaming"] = streaming_table(Streaming(), one["controller_cpu_us_per_request"] * 1e-6)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(results: dict[str, Any]) -> str:
    b = results.get("baseline", {}).get("tcp", {})
    echo = b.get("server_cpu_us_per_round_trip")
    native = results.get("baseline", {}).get("tcp_compiled", {}).get("server_cpu_us_per_round_trip")
    m = results["machine"]
    lines = [f"# Controller capacity: small gets, closed loop ({results['started_utc']})", "",
             f"`{results['command']}`; {m.get('cpu_model', '?')}, {m.get('cpus', '?')} CPUs. Same-run baseline: "
             f"64-byte TCP echo p50 {_fmt(b.get('p50_us'), '.1f')} us, echo server CPU {_fmt(echo, '.1f')} us per "
             f"round trip (a compiled echo server: {_fmt(native, '.1f')} us). Each request: an acquire of 1..8 "
             "samples carrying the previous lease's confirm.", "",
             "| K | partitions on | threads | requests/s | p50 ms | p99 ms | controller CPU us/request | vs echo "
             "server | controller cores | probe CPU us/request | p99 passed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        for s in r["together"] + r["alone"]:
            cpu = s["controller_cpu_us_per_request"]
            where = "all" if "controller" not in s else f"controller {s['controller']} only"
            lines.append(f"| {r['controllers']} | {where} | {s['threads']} | {s['requests_per_s']:,.0f} | "
                         f"{_fmt(s['p50_ms'], '.2f')} | {_fmt(s['p99_ms'], '.2f')} | {_fmt(cpu, '.0f')} | "
                         f"{_fmt(cpu / echo if cpu and echo else None, '.1f')}x | {s['controller_cores_busy']:.2f} | "
                         f"{_fmt(s['probe_cpu_us_per_request'], '.0f')} | {'yes' if s['passed'] else 'no'} |")
    lines += ["", f"Capacity = the best rate of a step with p99 <= {results['p99_ms']:g} ms.", ""]
    for r in results["runs"]:
        cap = r["capacity"]
        text = f"- K = {r['controllers']}: " + (f"{cap['requests_per_s']:,.0f} requests/s together" if cap else
                                                "no step passed together")
        if r["controllers"] > 1:
            text += (f" ({_fmt(r['scaling'], '.2f')}x K = 1, sharing this machine's cores); each controller alone "
                     + ", ".join(_fmt(a, '.2f') + "x" for a in r["alone_vs_one"])
                     + f" K = 1 (sum {_fmt(r['independent_scaling'], '.2f')}x, goal >= {0.8 * r['controllers']:.1f}x"
                     f"); the idle controllers' CPU per request of the loaded one: at most "
                     f"{_fmt(r['idle_controller_cpu_us_per_request_max'], '.1f')} us")
        lines.append(text)
    if results.get("streaming"):
        from ..multinode.report import streaming_markdown

        lines += ["", "## Streaming model at this CPU per request", "",
                  streaming_markdown(results["streaming"], source="K = 1 at its capacity in this run; a small get's "
                                     "acquire + confirm, and a commit taken to cost the same")]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.controller_load.capacity", description=(
        "Controller capacity: closed-loop small gets (acquire + confirm) from lean threads on the real protocol, "
        "against 1 and K controllers; requests/s with p99 bound, controller CPU per request."))
    p.add_argument("--controllers", default="1", help="controller counts K, e.g. 1,2")
    p.add_argument("--threads", default="2,4,8,16", help="concurrent requests (threads) per step, e.g. 2,4,8,16")
    p.add_argument("--seconds", type=float, default=5.0, help="timed seconds per step (default 5)")
    p.add_argument("--partitions", type=int, default=8, help="partitions, spread over the controllers (default 8)")
    p.add_argument("--consumers", type=int, default=2, help="consumer names, each taking every sample (default 2)")
    p.add_argument("--fill", type=int, default=40000, help=(
        "samples put into each partition before a step (default 40000); a consumer that takes them all ends the "
        "step with an error: raise it for longer steps or a faster machine"))
    p.add_argument("--p99-ms", type=float, default=10.0, help="latency bound of a passing step (default 10)")
    p.add_argument("--controller-cpus", default=None, help="pin the controllers to these CPUs, e.g. 0")
    p.add_argument("--client-cpus", default=None, help="pin this probe (and the warehouse) to these CPUs, e.g. 1")
    p.add_argument("--echo-round-trips", type=int, default=20000, help="timed round trips of the echo baseline")
    p.add_argument("--json", default=None, help=f"results JSON (default {DEFAULT_RESULTS}/controller_capacity.json)")
    p.add_argument("--report", default=None, help="also write the Markdown report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        args.threads = [int(x) for x in args.threads.split(",") if x.strip()]
        ks = [int(x) for x in args.controllers.split(",") if x.strip()]
        if not args.threads or min(args.threads) < 1 or not ks or min(ks) < 1:
            raise ValueError("--threads and --controllers take positive integers")
    except ValueError as e:
        print(f"benchmarks.controller_load.capacity: error: {e}", file=sys.stderr)
        return 2
    started = _dt.datetime.now(_dt.timezone.utc)
    results: dict[str, Any] = {
        "schema": 1, "benchmark": "controller_capacity", "started_utc": started.isoformat(timespec="seconds"),
        "command": "python -m benchmarks.controller_load.capacity " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "versions": versions(), "p99_ms": args.p99_ms, "runs": []}

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results["baseline"] = baseline.measure(args.echo_round_trips, rounds=3)
    for k in ks:
        results["runs"].append(measure_k(k, args, log))
    summarize(results)
    add_model(results)
    out = Path(args.json) if args.json else DEFAULT_RESULTS / "controller_capacity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    md = markdown(results)
    if args.report:
        Path(args.report).write_text(md)
    print(md)
    return 0 if all(r["capacity"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
