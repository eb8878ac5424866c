"""The controller's own cost for one iteration at N nodes, measured in-process.

Drives ``dockd.controller.core.Controller`` (pure Python, no sockets) through
exactly the calls one iteration of the benchmark's workload makes at N
nodes, in the order the daemon's controller service makes them:

- every consumer process (3 stages x workers x N nodes) asks for ``get_chunk``
  samples before anything is written and waits;
- the N writers commit ``put_chunk`` new samples each, round-robin, each
  commit placed on the writer's own warehouse;
- after every commit the service retries every waiting acquire of that
  partition in arrival order (``ControllerService._wake``); one that
  succeeds is confirmed, and its process asks again at once (waiting at the
  back of the queue if nothing is left), until it has its share of
  ``batch_per_node``.

Timed separately: commits, acquires that got samples, acquires retried in
vain, confirms. Their sum is the controller CPU one iteration costs, without
the daemon's framing and event-loop work around each request (a daemon's
request round trip adds tens of microseconds, see docs/design.md).
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from typing import Any

from .model import Workload

logger = logging.getLogger(__name__)


def simulate_iteration(nodes: int, wl: Workload) -> dict[str, Any]:
    from dockd.controller.core import Controller

    ctl = Controller(lease_timeout=3600.0)
    part = "iteration"
    columns = list(wl.column_bytes)
    b = wl.batch_per_node
    perf = time.perf_counter
    acc = {"commit_s": 0.0, "acquire_ok_s": 0.0, "acquire_waiting_s": 0.0, "confirm_s": 0.0,
           "commits": 0, "acquires_ok": 0, "acquires_waiting": 0}
    ok_us: list[float] = []
    # one entry per consumer process: [consumer, columns, samples still wanted, owner id]
    procs = [[name, list(cols), share, k] for k, (name, cols, share) in enumerate(
        (name, cols, share) for _ in range(nodes) for name, cols in wl.consumers.items() for share in wl.shares())]

    def attempt(p: list[Any]) -> bool:
        t0 = perf()
        res = ctl.acquire(part, p[0], p[1], min(wl.get_chunk, p[2]), owner=p[3], now=0.0)
        dt = perf() - t0
        if res is None:
            acc["acquire_waiting_s"] += dt
            acc["acquires_waiting"] += 1
            return False
        acc["acquire_ok_s"] += dt
        acc["acquires_ok"] += 1
        ok_us.append(dt * 1e6)
        t0 = perf()
        ctl.confirm(res.lease)
        acc["confirm_s"] += perf() - t0
        p[2] -= len(res.indexes)
        return True

    gc.collect()
    waiting = [p for p in procs if not attempt(p)]
    for k in range(math.ceil(b / wl.put_chunk)):
        count = min(wl.put_chunk, b - k * wl.put_chunk)
        for node in range(nodes):
            t0 = perf()
            ctl.commit(part, columns, warehouse=node, new_count=count, nbytes=count * wl.written_bytes)
            acc["commit_s"] += perf() - t0
            acc["commits"] += 1
            still, parked = [], []
            for p in waiting:  # the wake: every waiter is retried
                if not attempt(p):
                    still.append(p)
                    continue
                while p[2] > 0:  # it asks again; with nothing left it waits at the back
                    if not attempt(p):
                        parked.append(p)
                        break
            waiting = still + parked
    left = sum(p[2] for p in procs)
    if left or waiting:
        raise RuntimeError(f"controller simulation at {nodes} nodes ended with {left} samples not taken")
    total = acc["commit_s"] + acc["acquire_ok_s"] + acc["acquire_waiting_s"] + acc["confirm_s"]
    requests = acc["commits"] + acc["acquires_ok"]
    return {
        "nodes": nodes,
        "partition_samples": nodes * b,
        "consumer_processes": len(procs),
        **acc,
        "controller_s": total,
        "requests": requests,
        "acquire_ok_p50_us": statistics.median(ok_us) if ok_us else None,
        "acquire_ok_mean_us": acc["acquire_ok_s"] / max(1, acc["acquires_ok"]) * 1e6,
        "acquire_waiting_mean_us": acc["acquire_waiting_s"] / max(1, acc["acquires_waiting"]) * 1e6,
        "commit_mean_us": acc["commit_s"] / max(1, acc["commits"]) * 1e6,
        "retries_per_commit": acc["acquires_waiting"] / max(1, acc["commits"]),
        "s_per_request": total / max(1, requests),
        "metadata_bytes": int(ctl.metadata_bytes(part)),
    }


def measure(node_counts: list[int], wl: Workload, *, repeats: int = 3) -> list[dict[str, Any]]:
    """:func:`simulate_iteration` at each node count; the repeat with the least controller time is kept
    (the others are slower only by what the shared machine took from them), all totals recorded."""
    out = []
    for n in node_counts:
        runs = [simulate_iteration(n, wl) for _ in range(repeats)]
        best = min(runs, key=lambda r: r["controller_s"])
        best["controller_s_all"] = [r["controller_s"] for r in runs]
        logger.info("[controller] %d nodes: %.1f ms per iteration (%d requests, %d retries in vain)",
                    n, best["controller_s"] * 1e3, best["requests"], best["acquires_waiting"])
        out.append(best)
    return out
