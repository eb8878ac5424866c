"""The measurement: for every node count, build the cluster, run every layout on it, collect the numbers.

Per node count N: one topology (N namespaces, links capped both ways); on
it, dockd on every node with one agent per node, measuring ``central`` then
``distributed`` on the same daemons and links; then a Ray cluster with fresh
agents for ``ray``. Per layout: ``warmup_iterations`` uncounted, then at
least ``iterations`` measured (more, up to ``max_iterations``, until they add
up to ``min_measure_s``), each a fresh partition cleared afterwards. At
``half_cap_nodes`` every layout runs again with the link cap halved, which
shows whether the links or the CPUs set the pace.

Per iteration: the time from the common start to the last stage's end, the
bytes each node's link carried (switch-port counters), the bytes each
warehouse stores (``dock.stats()``) and serves (every sample a consumer took,
attributed to the warehouse that holds it), the machine's CPU busy fraction
(``/proc/stat``) and the proof that every consumer took every sample once.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..controller_load.procstat import cpu_seconds as cpu_ticks
from .cluster import Agents, DockdNodes, RayNodes, dock_token, system_cpu
from .config import MultinodeConfig
from .model import Workload, traffic
from .netns import Topology, list_namespaces, namespace_pids
from .workload import CONSUMERS, key_node, verify_delivery

logger = logging.getLogger(__name__)

START_DELAY_S = 0.25  # agents get the command, then all start together this much later


def workload_of(cfg: MultinodeConfig) -> Workload:
    return Workload(cfg.batch_per_node, cfg.column_bytes, CONSUMERS, cfg.put_chunk, cfg.get_chunk,
                    cfg.consumer_workers)


def _say(msg: str) -> None:
    print(f"[multinode] {msg}", file=sys.stderr, flush=True)


def run_all(cfg: MultinodeConfig, tag: str, workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": [], "topologies": {}, "leftover_namespaces": []}
    for n in cfg.nodes:
        topo = Topology(n, cfg.rate_mbit, tag=tag, subnet=cfg.subnet, latency_ms=cfg.link_latency_ms,
                        burst_bytes=cfg.link_burst_bytes or None, sysctls=cfg.node_sysctls)
        with topo:
            out["topologies"][str(n)] = topo.describe()
            dockd_layouts = [l for l in cfg.layouts if l in ("central", "distributed")]
            if dockd_layouts:
                out["runs"] += _run_dockd(topo, n, cfg, workdir, tag, dockd_layouts)
            if "replicated" in cfg.layouts:  # (a dock of its own: --replicas is the controller's)
                out["runs"] += _run_dockd(topo, n, cfg, workdir, tag, ["replicated"], replicas=2)
            if "ray" in cfg.layouts:
                out["runs"] += _run_ray(topo, n, cfg, workdir, tag)
        left = [ns for ns in list_namespaces() if ns.startswith(tag)]
        out["leftover_namespaces"] += left
        if left:
            logger.error("[runner] namespaces left after N=%d: %s", n, left)
    return out


def _failed(layout: str, n: int, cfg: MultinodeConfig, error: str) -> dict[str, Any]:
    _say(f"N={n} {layout}: FAILED: {error.splitlines()[0] if error else ''}")
    return {"layout": layout, "nodes": n, "rate_mbit": cfg.rate_mbit, "check": None, "status": "failed",
            "error": error}


def _run_dockd(topo: Topology, n: int, cfg: MultinodeConfig, workdir: Path, tag: str,
               layouts: list[str], replicas: int = 1) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    try:
        auth = dock_token(workdir)
        daemons = DockdNodes(topo, n, workdir, capacity=cfg.daemon_capacity, timeout=cfg.start_timeout_s,
                             env_extra=auth, replicas=replicas)
    except Exception as e:
        return [_failed(l, n, cfg, str(e)) for l in layouts]
    runs: list[dict[str, Any]] = []
    try:
        agents = Agents(topo.nodes[:n], workdir, tag, timeout=cfg.start_timeout_s, env_extra=auth)
    except Exception as e:
        daemons.close()
        return [_failed(l, n, cfg, str(e)) for l in layouts]
    startup = time.perf_counter() - t0
    try:
        wids = daemons.warehouse_ids()
        for layout in layouts:
            home = wids[0] if layout == "central" else None
            setup = {"cmd": "setup", "backend": "dockd", "controller": daemons.controller, "warehouse": home,
                     "consumer_workers": cfg.consumer_workers,
                     "prefer_local": bool(cfg.prefer_local and layout != "central")}
            expect = [wids[0]] * n if layout == "central" else wids

            def check_homes(replies: list[dict[str, Any]], expect: list[int] = expect) -> None:
                for i, r in enumerate(replies):
                    bad = {s: h for s, h in r["homes"].items() if h != expect[i]}
                    if bad:
                        raise RuntimeError(f"node {i}'s workers write to warehouses {bad}, expected {expect[i]} "
                                           "(the default home should be the warehouse on the writer's node)")

            runs += _measure_layout(topo, n, layout, agents, setup, cfg, check_homes,
                                    controller_pid=daemons.pids()[0],
                                    warehouse_nodes={w: i for i, w in enumerate(wids)},
                                    extra={"startup_s": startup, "controller": daemons.controller,
                                           "warehouse_ids": wids, "authenticated": bool(auth),
                                           "replicas": replicas})
    finally:
        agents.close()
        daemons.close()
    return runs


def _run_ray(topo: Topology, n: int, cfg: MultinodeConfig, workdir: Path, tag: str) -> list[dict[str, Any]]:
    try:
        import ray  # noqa: F401
    except ImportError:
        reason = "Ray is not installed in this environment; install it with: pip install 'ray[default]'"
        _say(f"N={n} ray: SKIPPED: {reason}")
        return [{"layout": "ray", "nodes": n, "rate_mbit": cfg.rate_mbit, "check": None, "status": "skipped",
                 "reason": reason}]
    t0 = time.perf_counter()
    try:
        cluster = RayNodes(topo, n, workdir, object_store_bytes=cfg.ray_object_store_bytes,
                           timeout=cfg.start_timeout_s)
    except Exception as e:
        return [_failed("ray", n, cfg, str(e))]
    agents = None
    try:
        agents = Agents(topo.nodes[:n], workdir, tag, timeout=cfg.start_timeout_s)
        startup = time.perf_counter() - t0
        base = {"cmd": "setup", "backend": "ray", "head": cluster.head, "max_concurrency": cfg.ray_max_concurrency,
                "timeout": cfg.start_timeout_s}
        # the actor exists before the other nodes look it up
        agents[0].call({**base, "create_actor": True}, cfg.start_timeout_s)
        setup = [None] + [{**base, "create_actor": False}] * (n - 1)
        return _measure_layout(topo, n, "ray", agents, setup, cfg, None, controller_pid=None,
                               warehouse_nodes={0: 0}, extra={"startup_s": startup, "head": cluster.head})
    except Exception as e:
        return [_failed("ray", n, cfg, str(e))]
    finally:
        if agents is not None:
            agents.close()
        cluster.close()


def _measure_layout(topo: Topology, n: int, layout: str, agents: Agents, setup: Any, cfg: MultinodeConfig,
                    check_homes: Callable[[list[dict[str, Any]]], None] | None, *, controller_pid: int | None,
                    warehouse_nodes: dict[int, int], extra: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        if isinstance(setup, list):  # per-agent messages; None: already set up
            replies = [agents[i].call(m, cfg.start_timeout_s) if m else {} for i, m in enumerate(setup)]
        else:
            replies = agents.broadcast(setup, cfg.start_timeout_s)
        if check_homes is not None:
            check_homes(replies)
        runs = [_iterations(topo, n, layout, agents, cfg, cfg.warmup_iterations, cfg.iterations, controller_pid,
                            warehouse_nodes, extra, min_seconds=cfg.min_measure_s)]
        if n == cfg.half_cap_nodes and n > 1:
            full = topo.rate_mbit
            topo.set_rate(full / 2)
            try:
                half = _iterations(topo, n, layout, agents, cfg, 0, cfg.half_cap_iterations, controller_pid,
                                   warehouse_nodes, extra)
            finally:
                topo.set_rate(full)
            half["check"] = "half_cap"
            base = runs[0]["summary"]["samples_per_s"]
            half["summary"]["throughput_vs_full_cap"] = half["summary"]["samples_per_s"] / base if base else None
            runs.append(half)
        agents.broadcast({"cmd": "teardown"}, cfg.command_timeout_s)
        return runs
    except Exception as e:
        logger.debug("[runner] %s at N=%d failed", layout, n, exc_info=True)
        return [_failed(layout, n, cfg, f"{type(e).__name__}: {e}")]


def _iterations(topo: Topology, n: int, layout: str, agents: Agents, cfg: MultinodeConfig, warmup: int,
                measured: int, controller_pid: int | None, warehouse_nodes: dict[int, int],
                extra: dict[str, Any], *, min_seconds: float = 0.0) -> dict[str, Any]:
    """``warmup`` uncounted iterations, then at least ``measured``, more (up to ``cfg.max_iterations``) until
    the measured ones add up to ``min_seconds``: short iterations get more repeats."""
    iters: list[dict[str, Any]] = []
    cpu_pids: dict[int, list[int]] = {}
    cpu0: dict[int, float] = {}
    ctrl0 = 0.0
    k = 0
    while True:
        done = [i["seconds"] for i in iters if not i["warmup"]]
        if len(done) >= measured and (sum(done) >= min_seconds or len(done) >= max(measured, cfg.max_iterations)):
            break
        if k == warmup:  # per-node process CPU over the measured iterations only
            cpu_pids = {node.index: namespace_pids(node.ns) for node in topo.nodes[:n]}
            cpu0 = {i: cpu_ticks(p) for i, p in cpu_pids.items()}
            ctrl0 = cpu_ticks([controller_pid]) if controller_pid else 0.0
        rec = _one_iteration(topo, n, layout, agents, cfg, k, warehouse_nodes)
        rec["warmup"] = k < warmup
        iters.append(rec)
        _say(f"N={n} {layout} {topo.rate_mbit:g} Mbit/s: iteration {k + 1} {rec['seconds']:.2f} s"
             f"{' (warm-up)' if rec['warmup'] else ''}{'' if rec['delivery']['ok'] else ' DELIVERY CHECK FAILED'}")
        k += 1
    count = k - warmup
    proc_cpu = {i: (cpu_ticks(p) - cpu0[i]) / count for i, p in cpu_pids.items()}
    ctrl_cpu = ((cpu_ticks([controller_pid]) - ctrl0) / count) if controller_pid else None
    run = {"layout": layout, "nodes": n, "rate_mbit": topo.rate_mbit, "check": None, "status": "ok",
           "iterations": iters, **extra}
    run["summary"] = summarize(run, cfg, proc_cpu, ctrl_cpu)
    return run


def _one_iteration(topo: Topology, n: int, layout: str, agents: Agents, cfg: MultinodeConfig, k: int,
                   warehouse_nodes: dict[int, int]) -> dict[str, Any]:
    part = f"{layout}-{topo.rate_mbit:g}-it{k}"
    c0, q0, t0 = topo.counters(), topo.qdisc_stats(), topo.tcp_stats()
    start_at = time.monotonic() + START_DELAY_S
    msg = {"cmd": "iter", "partition": part, "iteration": k, "start_at": start_at,
           "batch_per_node": cfg.batch_per_node, "put_chunk": cfg.put_chunk, "get_chunk": cfg.get_chunk,
           "sample_bytes": cfg.sample_bytes, "timeout": cfg.command_timeout_s,
           "consumer_workers": cfg.consumer_workers}
    for a in agents.agents:
        a.send(msg)
    time.sleep(max(0.0, start_at - time.monotonic()))
    busy0, total0 = system_cpu()
    sampler = _Sampler(topo, start_at)
    try:
        replies = [a.receive(cfg.command_timeout_s + 30, what="iteration report") for a in agents.agents]
    finally:
        timeline = sampler.stop()
    busy1, total1 = system_cpu()
    c1, q1, t1 = topo.counters(), topo.qdisc_stats(), topo.tcp_stats()
    stats = agents[0].call({"cmd": "stats"}, cfg.command_timeout_s)
    agents[0].call({"cmd": "clear", "partition": part}, cfg.command_timeout_s)

    stages = [r["stages"] for r in replies]
    end = max(s["end"] for node in stages for s in node.values())
    written = [key for node in stages for key in node["rollout"]["keys"]]
    taken = {c: [key for node in stages for key in node[c]["keys"]] for c in CONSUMERS}
    central = layout not in ("distributed", "replicated")
    col_bytes = cfg.column_bytes
    served = {i: 0 for i in range(n)}
    remote_reads = {i: 0 for i in range(n)}
    for reader, node in enumerate(stages):
        for c, cols in CONSUMERS.items():
            per_sample = sum(col_bytes[x] for x in cols)
            for key in node[c]["keys"]:
                holder = 0 if central else key_node(key)
                served[holder] += per_sample
                if holder != reader:
                    remote_reads[reader] += per_sample
    if stats.get("warehouses"):
        stored = {i: 0 for i in range(n)}
        for wid, w in stats["warehouses"].items():
            stored[warehouse_nodes[int(wid)]] += int(w["bytes"])
    else:  # the Ray actor on node 0 holds everything written
        stored = {0: sum(node["rollout"]["bytes"] for node in stages), **{i: 0 for i in range(1, n)}}
    return {
        "partition": part,
        "seconds": end - start_at,
        "links": {i: {"rx": c1[i]["rx_bytes"] - c0[i]["rx_bytes"], "tx": c1[i]["tx_bytes"] - c0[i]["tx_bytes"]}
                  for i in range(n)},
        "warehouse_stored": stored,
        "warehouse_served": served,
        "remote_read_bytes": remote_reads,
        "link_drops": {i: {k: q1[i][k] - q0[i][k] for k in ("tx_drops", "rx_drops")} for i in range(n)},
        "tcp": {i: {k: t1[i][k] - t0[i][k] for k in t1[i]} for i in range(n)},
        "cpu_busy": (busy1 - busy0) / (total1 - total0) if total1 > total0 else None,
        "delivery": verify_delivery(written, taken),
        "stages": {i: {s: _stage_record(rep, start_at) for s, rep in node.items()} for i, node in enumerate(stages)},
        "controller_stats": stats.get("partitions", {}).get(part),
        "timeline": timeline,
    }


def _stage_record(rep: dict[str, Any], start_at: float) -> dict[str, Any]:
    """A stage's report without its sample keys, times relative to the iteration's start (0.1 ms)."""
    out = {k: v for k, v in rep.items() if k != "keys"}
    out["start"], out["end"] = round(rep["start"] - start_at, 4), round(rep["end"] - start_at, 4)
    if "in_calls_s" in out:
        out["in_calls_s"] = round(out["in_calls_s"], 4)
    return out


class _Sampler:
    """Each node's link rates while an iteration runs, from the switch counters every ``interval`` seconds.

    ``stop()`` returns ``{"t_start": first sample, "t": [end of each interval], "rx_mbit": {node: [...]},
    "tx_mbit": {node: [...]}}``, times in seconds after the iteration's start."""

    def __init__(self, topo: Topology, t0: float, interval: float = 0.2) -> None:
        self.topo, self.t0, self.interval = topo, t0, interval
        self.samples: list[tuple[float, dict[int, dict[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.topo.counters()))
            except Exception as e:  # a sample less; the iteration's own counters are read separately
                logger.debug("[runner] link sample failed: %s", e)
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        try:  # close the last interval at the end of the iteration
            self.samples.append((time.monotonic() - self.t0, self.topo.counters()))
        except Exception as e:
            logger.debug("[runner] link sample failed: %s", e)
        out: dict[str, Any] = {"t_start": round(self.samples[0][0], 3) if self.samples else 0.0, "t": [],
                               "rx_mbit": {}, "tx_mbit": {}}
        for (t0, a), (t1, b) in zip(self.samples, self.samples[1:]):
            out["t"].append(round(t1, 3))
            for i in a:
                for d in ("rx", "tx"):
                    rate = (b[i][f"{d}_bytes"] - a[i][f"{d}_bytes"]) * 8 / 1e6 / (t1 - t0)
                    out[f"{d}_mbit"].setdefault(i, []).append(round(rate, 1))
        return out


def _med(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarize(run: dict[str, Any], cfg: MultinodeConfig, proc_cpu: dict[int, float],
              ctrl_cpu: float | None) -> dict[str, Any]:
    n = run["nodes"]
    it = [i for i in run["iterations"] if not i["warmup"]]
    secs = [i["seconds"] for i in it]
    t = _med(secs)
    wl = workload_of(cfg)
    samples = n * cfg.batch_per_node
    rate = run["rate_mbit"] * 1e6 / 8
    links = {i: {d: _med([x["links"][i][d] for x in it]) for d in ("rx", "tx")} for i in range(n)}
    util = [max(x["links"][i][d] for i in range(n) for d in ("rx", "tx")) / (rate * x["seconds"]) for x in it]
    stored = {i: _med([x["warehouse_stored"][i] for x in it]) for i in range(n)}
    served = {i: _med([x["warehouse_served"][i] for x in it]) for i in range(n)}
    holders = [i for i in range(n) if stored[i] > 0] or [0]
    model = traffic(run["layout"], n, wl, link_bytes_per_s=rate)
    busiest = max(max(v.values()) for v in links.values())
    requests = sum(st["calls"] for x in it for node in x["stages"].values() for st in node.values()) / len(it)
    return {
        "iteration_s": t,
        "iteration_s_all": secs,
        "samples_per_iteration": samples,
        "samples_per_s": samples / t if t > 0 else None,
        "payload_mb_per_s": samples * (wl.written_bytes + wl.read_bytes) / t / 1e6 if t > 0 else None,
        "links": links,
        "busiest_link_bytes": busiest,
        "all_links_bytes": sum(v["rx"] + v["tx"] for v in links.values()),
        "bottleneck_utilisation": _med(util),
        "warehouse_stored": stored,
        "warehouse_served": served,
        "warehouses_holding": len(holders),
        "per_warehouse_stored": max(stored.values()),
        "per_warehouse_served": max(served.values()),
        "cpu_busy": _med([x["cpu_busy"] for x in it if x["cpu_busy"] is not None]),
        "process_cpu_s_per_iteration": proc_cpu,
        # what the benchmark's own processes (everything inside the nodes' namespaces) used of the machine
        "own_cpu_share": sum(proc_cpu.values()) / (t * (os.cpu_count() or 1)) if t > 0 else None,
        "controller_daemon_cpu_s_per_iteration": ctrl_cpu,
        "requests_per_iteration": requests,
        "delivery_ok": all(x["delivery"]["ok"] for x in run["iterations"]),
        "model": model,
        "busiest_link_vs_model": busiest / model["busiest_link_bytes"] if model["busiest_link_bytes"] else None,
        "link_bound_time_s": model["iteration_s"],
    }
