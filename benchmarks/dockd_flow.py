"""dockd put/get throughput and small-operation latency on real local daemons.

Cases (each the median of ``config.repeats`` repeats):

- throughput, one client: every sample size x batch size x data path. One
  repeat puts ``n`` batches (``[batch, size]`` uint8, one tensor whose first
  dim is the samples) into a fresh partition, then one consumer gets them
  back ``batch`` at a time, reading one byte of every page of what it got
  (``common.touch``: zero-copy results pay their page faults inside the timed
  get), then the partition is cleared. ``n`` moves about
  ``config.bytes_per_repeat`` per repeat (at least one call).
- throughput, several clients: ``config.concurrent_clients`` client processes,
  each on its own partition, started together at a barrier; aggregate GB/s is
  all bytes over the wall time from the first start to the last finish.
- latency: ``config.latency_ops`` single-sample puts of ``latency_bytes``
  bytes, then as many single-sample gets (acquire + fetch + confirm); p50/p99;
  once with the data on the controller's own daemon (the acquire brings the
  value back inline: one round trip) and once on the other warehouse (acquire,
  then fetch: two round trips).
- placement: every other case runs a client pinned to the last warehouse
  (``flow_warehouses - 1``), so with two warehouses its gets are the general
  acquire-then-fetch path. Left to itself a client picks its home by pid, and
  the figures would change from run to run with it.
- where a get's time goes: after each single-client case, one extra pass
  through the client's low-level ``acquire`` / ``fetch`` / ``confirm`` calls
  records the median time of each phase (``extra.get_phase_*`` in the JSON).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any

from . import _dockd
from .common import BenchConfig, Row, latency_row, median, set_single_thread, throughput_row, touch

logger = logging.getLogger(__name__)

NAME = "dockd_flow"
TITLE = "dockd put/get throughput and latency (local daemons)"

COLUMN = "x"
CONSUMER = "bench"
DATA_ON_CONTROLLER = "the controller's daemon"
"""Latency case: the sample is on the warehouse co-hosted with the controller (a get is one round trip)."""
DATA_ELSEWHERE = "another warehouse"
"""Latency case: the sample is on another warehouse (acquire at the controller, then fetch: two round trips)."""
GET_TIMEOUT_S = 120.0


def requirements() -> str | None:
    return _dockd.requirements()


def _round(dock: Any, partition: str, src: Any, n: int) -> tuple[float, float]:
    """n puts then n gets of ``src``'s batch; returns (put seconds, get seconds)."""
    batch = int(src.shape[0])
    t0 = time.perf_counter()
    for _ in range(n):
        dock.put({COLUMN: src}, partition=partition)
    t1 = time.perf_counter()
    got = 0
    for _ in range(n):
        got += touch(dock.get(CONSUMER, [COLUMN], batch, partition=partition, timeout=GET_TIMEOUT_S)[COLUMN])
    t2 = time.perf_counter()
    if got != n * batch:
        raise RuntimeError(f"dockd returned {got} samples, expected {n * batch}")
    return t1 - t0, t2 - t1


def _has_phases(dock: Any) -> bool:
    return all(callable(getattr(dock, m, None)) for m in ("acquire", "fetch", "confirm"))


def get_breakdown(dock: Any, partition: str, src: Any, n: int) -> dict[str, float]:
    """Median seconds per call of each get phase (acquire, fetch, confirm, touch), from one extra pass."""
    batch = int(src.shape[0])
    for _ in range(n):
        dock.put({COLUMN: src}, partition=partition)
    phases: dict[str, list[float]] = {"acquire": [], "fetch": [], "confirm": [], "touch": []}
    for _ in range(n):
        t0 = time.perf_counter()
        lease = dock.acquire(CONSUMER, [COLUMN], batch, partition=partition, timeout=GET_TIMEOUT_S)
        t1 = time.perf_counter()
        values = dock.fetch(lease)
        t2 = time.perf_counter()
        dock.confirm(lease)
        t3 = time.perf_counter()
        touch(values[COLUMN])
        t4 = time.perf_counter()
        phases["acquire"].append(t1 - t0)
        phases["fetch"].append(t2 - t1)
        phases["confirm"].append(t3 - t2)
        phases["touch"].append(t4 - t3)
    dock.clear(partition)
    return {k: median(v) for k, v in phases.items()}


def measure_throughput(dock: Any, path: str, size: int, batch: int, config: BenchConfig) -> list[Row]:
    import torch

    n = config.ops_for(size * batch)
    src = torch.full((batch, size), 7, dtype=torch.uint8)
    _round(dock, f"warm-{path}-{size}-{batch}", src, 1)
    dock.clear(f"warm-{path}-{size}-{batch}")
    put_s, get_s = [], []
    for rep in range(config.repeats):
        part = f"t-{path}-{size}-{batch}-{rep}"
        p, g = _round(dock, part, src, n)
        put_s.append(p)
        get_s.append(g)
        dock.clear(part)
    phases = get_breakdown(dock, f"b-{path}-{size}-{batch}", src, n) if _has_phases(dock) else {}
    rows = []
    for op, secs in (("put", put_s), ("get", get_s)):
        extra: dict[str, Any] = {"calls_per_repeat": n}
        if op == "get" and phases:
            extra["get_phase_s_per_call"] = phases
        row = throughput_row(
            scenario=NAME, system="dockd", op=op, path=path, seconds=secs, nbytes=n * batch * size,
            samples=n * batch, sample_bytes=size, batch=batch, extra=extra,
        )
        logger.info("[flow] op=%s path=%s size=%d batch=%d gbps=%.3f samples_per_s=%.0f",
                    op, path, size, batch, row.gbps, row.samples_per_s)
        rows.append(row)
    return rows


def measure_latency(dock: Any, path: str, config: BenchConfig, data_on: str) -> list[Row]:
    import torch

    one = torch.full((1, config.latency_bytes), 3, dtype=torch.uint8)
    tag = f"{path}-{'near' if data_on == DATA_ON_CONTROLLER else 'far'}"
    for _ in range(min(50, config.latency_ops)):
        dock.put({COLUMN: one}, partition=f"lat-warm-{tag}")
        dock.get(CONSUMER, [COLUMN], 1, partition=f"lat-warm-{tag}", timeout=GET_TIMEOUT_S)
    dock.clear(f"lat-warm-{tag}")
    part = f"lat-{tag}"
    put_lat, get_lat = [], []
    for _ in range(config.latency_ops):
        t0 = time.perf_counter()
        dock.put({COLUMN: one}, partition=part)
        put_lat.append(time.perf_counter() - t0)
    for _ in range(config.latency_ops):
        t0 = time.perf_counter()
        touch(dock.get(CONSUMER, [COLUMN], 1, partition=part, timeout=GET_TIMEOUT_S)[COLUMN])
        get_lat.append(time.perf_counter() - t0)
    dock.clear(part)
    phases = get_breakdown(dock, f"lat-b-{tag}", one, min(config.latency_ops, 500)) if _has_phases(dock) else {}
    rows = []
    for op, lat in (("put", put_lat), ("get", get_lat)):
        extra: dict[str, Any] = {"data_on": data_on}
        if op == "get" and phases:
            extra["get_phase_us"] = {k: v * 1e6 for k, v in phases.items()}
        row = latency_row(scenario=NAME, system="dockd", op=op, path=path, latencies_s=lat,
                          sample_bytes=config.latency_bytes, extra=extra)
        logger.info("[flow] latency op=%s path=%s data_on=%s p50_us=%.1f p99_us=%.1f", op, path, data_on,
                    row.p50_us, row.p99_us)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- several clients


def _client_worker(address: str, path: str, size: int, batch: int, n: int, repeats: int, who: int,
                   barrier: Any, results: Any) -> None:
    """One client process of the concurrent cases; reports perf_counter stamps per repeat."""
    try:
        import torch

        set_single_thread()
        dock = _dockd.connect(address, path)
        src = torch.full((batch, size), 7, dtype=torch.uint8)
        _round(dock, f"cw-{who}", src, 1)
        dock.clear(f"cw-{who}")
        for rep in range(repeats):
            part = f"c-{who}-{rep}"
            barrier.wait(timeout=300)
            t0 = time.perf_counter()
            for _ in range(n):
                dock.put({COLUMN: src}, partition=part)
            t1 = time.perf_counter()
            barrier.wait(timeout=300)
            t2 = time.perf_counter()
            got = 0
            for _ in range(n):
                got += touch(dock.get(CONSUMER, [COLUMN], batch, partition=part, timeout=GET_TIMEOUT_S)[COLUMN])
            t3 = time.perf_counter()
            if got != n * batch:
                raise RuntimeError(f"client {who} got {got} samples, expected {n * batch}")
            dock.clear(part)
            results.put(("ok", who, rep, t0, t1, t2, t3))
        dock.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        barrier.abort()
        results.put(("error", who, f"{type(exc).__name__}: {exc}"))


def measure_concurrent(address: str, path: str, clients: int, size: int, batch: int, config: BenchConfig) -> list[Row]:
    ctx = mp.get_context("spawn")
    n = config.ops_for(size * batch)
    barrier = ctx.Barrier(clients)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_client_worker,
                    args=(address, path, size, batch, n, config.repeats, who, barrier, results), daemon=True)
        for who in range(clients)
    ]
    for p in procs:
        p.start()
    stamps: dict[int, list[tuple[float, float, float, float]]] = {}
    try:
        for _ in range(clients * config.repeats):
            item = results.get(timeout=config.scenario_timeout_s)
            if item[0] == "error":
                raise RuntimeError(f"concurrent client {item[1]} failed: {item[2]}")
            _, who, rep, t0, t1, t2, t3 = item
            stamps.setdefault(rep, []).append((t0, t1, t2, t3))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    put_s = [max(s[1] for s in v) - min(s[0] for s in v) for _, v in sorted(stamps.items())]
    get_s = [max(s[3] for s in v) - min(s[2] for s in v) for _, v in sorted(stamps.items())]
    rows = []
    for op, secs in (("put", put_s), ("get", get_s)):
        row = throughput_row(
            scenario=NAME, system="dockd", op=op, path=path, seconds=secs, nbytes=clients * n * batch * size,
            samples=clients * n * batch, sample_bytes=size, batch=batch, clients=clients,
            extra={"calls_per_client_per_repeat": n},
        )
        logger.info("[flow] concurrent op=%s path=%s clients=%d size=%d gbps=%.3f", op, path, clients, size, row.gbps)
        rows.append(row)
    return rows


def run(config: BenchConfig) -> dict[str, Any]:
    set_single_thread()
    paths = []
    skipped: dict[str, str] = {}
    for path in config.paths:
        reason = _dockd.path_unavailable(path)
        if reason:
            logger.warning("[flow] skipping path=%s: %s", path, reason)
            skipped[path] = reason
        else:
            paths.append(path)
    rows: list[Row] = []
    cluster = _dockd.start(config.flow_warehouses)
    try:
        info = _dockd.describe(cluster, config.flow_warehouses)
        info["transport_in_use"] = {}
        home = config.flow_warehouses - 1  # pinned: a client's home would otherwise follow its pid
        info["client_home_warehouse"] = home
        for path in paths:
            if home > 0:  # a get of data on the controller's own daemon is one round trip (values inline)
                near = _dockd.connect(cluster.address, path, warehouse=0)
                try:
                    rows += measure_latency(near, path, config, DATA_ON_CONTROLLER)
                finally:
                    near.close()
            dock = _dockd.connect(cluster.address, path, warehouse=home)
            info["transport_in_use"][path] = _dockd.transport_in_use(dock)
            try:
                rows += measure_latency(dock, path, config, DATA_ON_CONTROLLER if home == 0 else DATA_ELSEWHERE)
                for size in config.sample_sizes:
                    for batch in config.batch_sizes:
                        rows += measure_throughput(dock, path, size, batch, config)
            finally:
                dock.close()
            for clients in config.concurrent_clients:
                for size in config.concurrent_sample_sizes:
                    rows += measure_concurrent(cluster.address, path, clients, size, max(config.batch_sizes), config)
    finally:
        cluster.close()
    return {"rows": [r.to_dict() for r in rows], "cluster": info, "skipped_paths": skipped}
