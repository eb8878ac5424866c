"""Checks, tables, the Markdown report and the plot of one multinode run (all from the results dict).

The results dict is the JSON the run writes (node indexes are string keys);
every ratio divides two numbers measured in that run, or a measured number
by the analytic model of the same configuration.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from ..common import human_bytes
from .model import STREAMING_CPU_S_PER_REQUEST, Streaming, streaming_table

logger = logging.getLogger(__name__)

LAYOUT_LABEL = {"central": "dockd central", "distributed": "dockd distributed",
                "replicated": "dockd distributed, 2 replicas", "ray": "Ray actor"}
COLORS = {"central": "tab:orange", "distributed": "tab:blue", "replicated": "tab:purple", "ray": "tab:green"}
MB = 1e6


def main_runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results.get("runs", []) if not r.get("check")]


def find(results: dict[str, Any], layout: str, n: int, check: str | None = None) -> dict[str, Any] | None:
    for r in results.get("runs", []):
        if r["layout"] == layout and r["nodes"] == n and r.get("check") == check:
            return r
    return None


def _sps(run: dict[str, Any] | None) -> float | None:
    return run["summary"]["samples_per_s"] if run and run.get("status") == "ok" else None


def compute_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The expectations of the scenario, each with its measured value (reported, not enforced)."""
    out = []
    nodes = sorted({r["nodes"] for r in main_runs(results)})
    for n in nodes:
        if n < 2:
            continue
        c, d = _sps(find(results, "central", n)), _sps(find(results, "distributed", n))
        ratio = d / c if c and d else None
        out.append({"id": "distributed_vs_central", "nodes": n,
                    "description": f"distributed / central samples/s at {n} nodes",
                    "value": ratio, "bound": 0.8 * n, "met": None if ratio is None else ratio >= 0.8 * n})
        rep = _sps(find(results, "replicated", n))
        if rep and d:  # (what keeping two copies costs: reported, no bound)
            out.append({"id": "replicated_vs_distributed", "nodes": n,
                        "description": f"2 replicas / 1 (distributed) samples/s at {n} nodes",
                        "value": rep / d, "bound": None, "met": None})
        for layout in ("central", "distributed", "replicated", "ray"):
            run = find(results, layout, n)
            if run and run.get("status") == "ok":
                s = run["summary"]
                total_served = sum(s["warehouse_served"].values())
                out.append({"id": "per_warehouse_share", "nodes": n, "layout": layout,
                            "description": f"{layout}: busiest warehouse's share of the bytes served at {n} nodes",
                            "value": s["per_warehouse_served"] / total_served if total_served else None,
                            "bound": 1.0 / n if layout in ("distributed", "replicated") else 1.0, "met": None})
    for r in results.get("runs", []):
        if r.get("check") == "half_cap" and r.get("status") == "ok":
            v = r["summary"].get("throughput_vs_full_cap")
            # 0.5: the links set the pace; near 1: something else (CPU) does
            out.append({"id": "half_cap", "nodes": r["nodes"], "layout": r["layout"],
                        "description": f"{r['layout']} at {r['nodes']} nodes: samples/s with the cap halved / full cap",
                        "value": v, "bound": 0.65, "met": None if v is None else v <= 0.65})
    return out


# ------------------------------------------------------------------ tables


def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / MB:,.1f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def throughput_table(results: dict[str, Any]) -> str:
    rows = []
    for r in sorted(main_runs(results), key=lambda r: (r["nodes"], list(LAYOUT_LABEL).index(r["layout"]))):
        if r.get("status") != "ok":
            why = (r.get("error") or r.get("reason") or "-").splitlines()[0][:120]
            rows.append([str(r["nodes"]), LAYOUT_LABEL[r["layout"]], r["status"].upper(), *["-"] * 6, why])
            continue
        s = r["summary"]
        c = _sps(find(results, "central", r["nodes"]))
        rel = f"{s['samples_per_s'] / c:.2f}x" if c and s["samples_per_s"] else "-"
        own = s.get("own_cpu_share")
        rows.append([str(r["nodes"]), LAYOUT_LABEL[r["layout"]], f"{s['iteration_s']:.2f}", _f(s["samples_per_s"], 1),
                     rel, _f(s["link_bound_time_s"]), f"{s['bottleneck_utilisation']:.0%}",
                     "-" if own is None else f"{own:.0%}", f"{s['cpu_busy']:.0%}",
                     "all" if s["delivery_ok"] else "MISSING"])
    return _table(["N", "layout", "iteration s", "samples/s", "vs central", "link-bound s (model)",
                   "busiest link use", "CPU used by the run", "machine CPU busy", "delivered"], rows)


def traffic_table(results: dict[str, Any]) -> str:
    rows = []
    for r in sorted(main_runs(results), key=lambda r: (r["nodes"], list(LAYOUT_LABEL).index(r["layout"]))):
        if r.get("status") != "ok":
            continue
        s, n = r["summary"], r["nodes"]
        links = s["links"]
        others = [links[str(i)] for i in range(1, n)]
        rows.append([
            str(n), LAYOUT_LABEL[r["layout"]], str(s["warehouses_holding"]), _mb(s["per_warehouse_stored"]),
            _mb(s["per_warehouse_served"]),
            f"{_mb(links['0']['rx'])} / {_mb(links['0']['tx'])}",
            f"{_mb(max(o['rx'] for o in others))} / {_mb(max(o['tx'] for o in others))}" if others else "-",
            _mb(s["busiest_link_bytes"]), _mb(s["model"]["busiest_link_bytes"]), _mb(s["all_links_bytes"]),
        ])
    return _table(["N", "layout", "warehouses", "per warehouse stored MB", "per warehouse served MB",
                   "node-0 link rx / tx MB", "other links max rx / tx MB", "busiest link MB",
                   "busiest link MB (model)", "all links MB"], rows)


def reads_table(results: dict[str, Any]) -> str:
    """Per run, medians over the measured iterations: the share of read bytes served on the reader's own
    node, a put's time (the commit's round trip to the controller included), and what the links lost:
    tbf drops, TCP segments sent again, retransmission timeouts (each idles a flow >= 200 ms)."""
    rows = []
    for r in sorted(main_runs(results), key=lambda r: (r["nodes"], list(LAYOUT_LABEL).index(r["layout"]))):
        its = [i for i in r.get("iterations", []) if not i.get("warmup")]
        if r.get("status") != "ok" or not its or "link_drops" not in its[0]:
            continue
        local = [1 - sum(i["remote_read_bytes"].values()) / max(1, sum(i["warehouse_served"].values())) for i in its]
        puts = [st["rollout"]["in_calls_s"] / max(1, st["rollout"]["calls"]) for i in its for st in i["stages"].values()]
        drops = [sum(d["tx_drops"] + d["rx_drops"] for d in i["link_drops"].values()) for i in its]
        tcp = {k: [sum(t[k] for t in i["tcp"].values()) for i in its] for k in ("retrans_segs", "rto_timeouts")}
        rows.append([str(r["nodes"]), LAYOUT_LABEL[r["layout"]], f"{statistics.median(local):.0%}",
                     _f(statistics.median(puts) * 1e3, 0), _f(statistics.median(drops), 0),
                     _f(statistics.median(tcp["retrans_segs"]), 0), f"{statistics.mean(tcp['rto_timeouts']):.1f}"])
    return _table(["N", "layout", "reads on the reader's node", "put ms (p50)", "tbf drops / iteration",
                   "TCP segments resent / iteration", "TCP timeouts / iteration (mean)"], rows) if rows else ""


def half_cap_table(results: dict[str, Any]) -> str:
    rows = []
    for r in results.get("runs", []):
        if r.get("check") != "half_cap":
            continue
        full = find(results, r["layout"], r["nodes"])
        if r.get("status") != "ok" or not full or full.get("status") != "ok":
            rows.append([str(r["nodes"]), LAYOUT_LABEL[r["layout"]], "-", "-", "-", "-", r.get("status", "?")])
            continue
        own = r["summary"].get("own_cpu_share")
        rows.append([str(r["nodes"]), LAYOUT_LABEL[r["layout"]],
                     f"{_f(full['summary']['samples_per_s'], 1)} at {full['rate_mbit']:g} Mbit/s",
                     f"{_f(r['summary']['samples_per_s'], 1)} at {r['rate_mbit']:g} Mbit/s",
                     f"{r['summary']['throughput_vs_full_cap']:.2f}", "-" if own is None else f"{own:.0%}",
                     f"{r['summary']['cpu_busy']:.0%}"])
    if not rows:
        return ""
    return _table(["N", "layout", "samples/s, full cap", "samples/s, half cap", "ratio (0.5 = link-bound)",
                   "CPU used by the run at half cap", "machine CPU busy"], rows)


def extrapolation_table(results: dict[str, Any]) -> str:
    ex = results.get("extrapolation", {})
    rows = []
    for t in ex.get("model", []):
        rows.append([str(t["nodes"]), t["layout"], _mb(t["per_warehouse_stored_bytes"]),
                     _mb(t["per_warehouse_served_bytes"]), _mb(t["busiest_link_bytes"]), _f(t["iteration_s"]),
                     _f(t["samples_per_s"], 1), f"{t['vs_central']:.0f}x", str(t["controller_requests"]),
                     _f(t["controller_requests_per_s"], 0)])
    return _table(["N", "layout", "per warehouse stored MB", "per warehouse served MB", "busiest link MB",
                   "link-bound iteration s", "samples/s", "vs central", "controller requests / iteration",
                   "requests/s needed"], rows)


def controller_table(results: dict[str, Any]) -> str:
    rows = []
    for c in results.get("extrapolation", {}).get("controller", []):
        b = c["budget"]
        rows.append([str(c["nodes"]), str(c["partition_samples"]), str(c["consumer_processes"]),
                     str(c["requests"]), _f(c["acquire_ok_p50_us"], 1), _f(c["commit_mean_us"], 1),
                     f"{c['acquires_waiting']:,} ({c['retries_per_commit']:.0f}/commit)",
                     _f(c["controller_s"] * 1e3, 1), _f(b["sustained_requests_per_s"], 0),
                     _f(b["needed_requests_per_s"], 0), _f(b["utilisation"]), _f(c["binds_above_gbit"], 2)])
    return _table(["N", "partition samples", "consumer processes", "requests / iteration", "acquire p50 us",
                   "commit mean us", "acquires retried in vain", "controller ms / iteration",
                   "requests/s one controller sustains", "requests/s the links allow", "controller utilisation",
                   "controller binds above Gbit/s per link"], rows)


def measured_controller_table(results: dict[str, Any]) -> str:
    sim = {c["nodes"]: c for c in results.get("extrapolation", {}).get("controller", [])}
    rows = []
    for r in main_runs(results):
        s = r.get("summary") or {}
        if r.get("status") != "ok" or s.get("controller_daemon_cpu_s_per_iteration") is None:
            continue
        c = sim.get(r["nodes"])
        rows.append([str(r["nodes"]), LAYOUT_LABEL[r["layout"]], _f(s["requests_per_iteration"], 0),
                     _f(s["controller_daemon_cpu_s_per_iteration"] * 1e3, 1),
                     _f(s["controller_daemon_cpu_s_per_iteration"] / s["requests_per_iteration"] * 1e6, 0)
                     if s["requests_per_iteration"] else "-",
                     _f(c["controller_s"] * 1e3, 2) if c else "-"])
    return _table(["N", "layout", "client requests / iteration", "node-0 daemon CPU ms / iteration",
                   "daemon CPU us / request", "controller logic ms / iteration (in-process)"], rows)


def checks_table(results: dict[str, Any]) -> str:
    rows = []
    for c in results.get("checks", []):
        if c["id"] == "per_warehouse_share":
            continue
        met = {True: "met", False: "MISSED", None: "n/a"}[c["met"]]
        bound = (f">= {c['bound']:.1f}x" if c["id"] == "distributed_vs_central"
                 else "- (the cost of a second copy)" if c["id"] == "replicated_vs_distributed"
                 else "<= 0.65 (0.5: link-bound, 1: not at all)")
        rows.append([c["description"], _f(c["value"]), bound, met])
    return _table(["expectation", "value", "bound", "status"], rows) if rows else ""


def markdown_report(results: dict[str, Any], *, plot_name: str | None = None) -> str:
    mach, ver, cfg = results.get("machine", {}), results.get("versions", {}), results.get("config", {})
    pk = ver.get("packages", {})
    mem = mach.get("memory_bytes") or 0
    load = lambda v: "/".join(f"{x:.1f}" for x in v) if v else "?"  # noqa: E731
    head = [
        f"- when (UTC): {results.get('started_utc', '?')} to {results.get('finished_utc', '?')} "
        f"({results.get('wall_s', 0):.0f} s)",
        f"- machine: {mach.get('cpu_model', '?')}, {mach.get('cpus', '?')} CPUs, {mem / 2**30:.1f} GiB memory, "
        f"{mach.get('platform', '?')}",
        f"- load average (1/5/15 min) at start {load(mach.get('loadavg'))}, at end {load(mach.get('loadavg_end'))}",
        f"- versions: Python {ver.get('python', '?')}, dockd {pk.get('dockd')} (git {ver.get('dockd_git')}"
        f"{', uncommitted changes' if ver.get('dockd_git_dirty') else ''}), "
        + ", ".join(f"{k} {v}" for k, v in pk.items() if k != "dockd" and v),
        f"- command: `{results.get('command', '?')}`",
        f"- config: nodes {cfg.get('nodes')}, layouts {cfg.get('layouts')}, links {cfg.get('rate_mbit'):g} Mbit/s "
        f"each way (tbf, queue up to {cfg.get('link_latency_ms'):g} ms), samples of "
        f"{human_bytes(cfg.get('sample_bytes'))} (responses + log_probs), {cfg.get('batch_per_node')} samples per "
        f"node per iteration, puts of {cfg.get('put_chunk')}, {cfg.get('consumer_workers')} workers per consumer "
        f"stage per node, gets of {cfg.get('get_chunk')}; {cfg.get('warmup_iterations')} warm-up iteration(s), "
        f"then at least {cfg.get('iterations')} measured, more until {cfg.get('min_measure_s'):g} s (at most "
        f"{cfg.get('max_iterations')}); halved cap at N={cfg.get('half_cap_nodes')} (every field in the JSON)",
        f"- run tag `{results.get('tag')}`; namespaces left afterwards: {results.get('leftover_namespaces') or 'none'}",
    ]
    parts = ["\n".join(head)]
    if plot_name:
        parts.append(f"![samples/s and traffic against N per layout]({plot_name})")
    parts += ["### Throughput (one iteration = every node writes its batch, every consumer takes it)",
              throughput_table(results), checks_table(results),
              "### Traffic per iteration (payload + protocol bytes on the links)", traffic_table(results)]
    reads = reads_table(results)
    if reads:
        parts += ["### Where reads go, what a put waits, what the links lose (medians over the iterations)", reads]
    hc = half_cap_table(results)
    if hc:
        parts += ["### Links or CPUs? The same runs with the link cap halved", hc]
    parts += ["### Analytic model extrapolated (same per-node batch and sample size, same link cap)",
              extrapolation_table(results),
              "### The controller at that scale (in-process `Controller`, one iteration's calls)",
              controller_table(results),
              "### The controller daemon in the runs above", measured_controller_table(results)]
    table = results.get("streaming") or streaming_table(Streaming(), streaming_cpu_figure(results)[0])
    parts += ["### Streaming at up to 1,024 nodes x 8 accelerators: where the controllers bind",
              streaming_markdown(table, source=streaming_cpu_figure(results)[1])]
    return "\n\n".join(p for p in parts if p) + "\n"


# ------------------------------------------------------------------ streaming model


def streaming_cpu_figure(results: dict[str, Any]) -> tuple[float, str]:
    """Controller CPU seconds per request for the streaming model, and where it comes from: the results'
    ``streaming_cpu_s_per_request`` (a load-benchmark figure) when given, else the model's default."""
    v = results.get("streaming_cpu_s_per_request")
    if v:
        return float(v), str(results.get("streaming_cpu_source") or "given with the results")
    return STREAMING_CPU_S_PER_REQUEST, ("the model's default (`STREAMING_CPU_S_PER_REQUEST`: node-0 daemon CPU "
                                         "per request in the 2026-12-01 multinode runs)")


def streaming_markdown(table: dict[str, Any], *, source: str = "") -> str:
    """The streaming model as Markdown: the assumptions, where each K binds, and utilisation per N and K."""
    wl, cpu = table["workload"], table["cpu_s_per_request"]
    ks = list(table["binds_at"])
    per_node = wl["accelerators_per_node"] * wl["trajectories_per_s"] * (
        wl["puts_per_trajectory"] + wl["gets_per_trajectory"])
    spread = ("partitions spread evenly over the controllers" if table.get("partitions") is None
              else f"{table['partitions']} equally loaded partitions, whole partitions per controller")
    head = (f"Each node has {wl['accelerators_per_node']} accelerators, each producing "
            f"{wl['trajectories_per_s']:g} trajectories/s, each trajectory {wl['puts_per_trajectory']:g} put and "
            f"{wl['gets_per_trajectory']:g} get: {per_node:,.0f} controller requests/s per node. Controller CPU per "
            f"request: {cpu * 1e6:,.0f} us ({source}), so one controller, one core, sustains "
            f"{1 / cpu:,.0f} requests/s. Utilisation = requests/s on the busiest controller x CPU per request "
            f"({spread}); >= 1 means the controller binds.")
    bind_rows = [[k, f"{table['binds_at'][k]['nodes_exact']:,.1f}", str(table["binds_at"][k]["first_node_count"]),
                  f"{table['binds_at'][k]['first_node_count'] * wl['accelerators_per_node']:,}"] for k in ks]
    binds = _table(["controllers K", "binds at N (utilisation 1)", "first whole N that binds",
                    "accelerators there"], bind_rows)
    rows = []
    for r in table["rows"]:
        rows.append([f"{r['nodes']:,}", f"{r['accelerators']:,}", f"{r['requests_per_s']:,.0f}",
                     *[f"**{u:.2f}**" if u >= 1 else f"{u:.2f}" for u in (r["utilisation"][k] for k in ks)]])
    util = _table(["N", "accelerators", "requests/s", *[f"utilisation, K={k}" for k in ks]], rows)
    need = (f"At {table['largest_nodes']:,} nodes the busiest of K evenly loaded controllers stays below 1 only "
            f"with K >= {table['controllers_needed_at_largest']}.")
    return "\n\n".join([head, binds, util, need])


def plot_streaming(table: dict[str, Any], out_png: str | Path, *, title: str = "") -> Path | None:
    """Busiest-controller utilisation against N for each K (log-log), with the binding line at 1."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("[report] matplotlib is not installed; no plot. Install it with: pip install -e '.[plot]'")
        return None
    ns = [r["nodes"] for r in table["rows"]]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for k, b in table["binds_at"].items():
        ax.plot(ns, [r["utilisation"][k] for r in table["rows"]], marker="o", label=f"K={k} (binds at N~{b['nodes_exact']:,.0f})")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="utilisation 1: the controller binds")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.minorticks_off()
    ax.set_xlabel(f"nodes ({table['workload']['accelerators_per_node']} accelerators each)")
    ax.set_ylabel("busiest controller: CPU s per s")
    wl = table["workload"]
    ax.set_title(title or (f"streaming: {wl['trajectories_per_s']:g} trajectories/s per accelerator, "
                           f"{table['cpu_s_per_request'] * 1e6:,.0f} us controller CPU per request"), fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


# ------------------------------------------------------------------ plot


def plot(results: dict[str, Any], out_png: str | Path) -> Path | None:
    """Four panels: samples/s, the busiest warehouse's share of the bytes served, the busiest link's bytes
    (measured and model), all against N; and, at the largest N, the cluster's link capacity in use over one
    iteration of each layout."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("[report] matplotlib is not installed; no plot. Install it with: pip install -e '.[plot]'")
        return None
    runs = [r for r in main_runs(results) if r.get("status") == "ok"]
    fig, grid = plt.subplots(2, 2, figsize=(13, 9))
    axes = list(grid.ravel())
    for layout in LAYOUT_LABEL:
        rs = sorted((r for r in runs if r["layout"] == layout), key=lambda r: r["nodes"])
        if not rs:
            continue
        ns = [r["nodes"] for r in rs]
        kw = {"color": COLORS[layout], "marker": "o", "label": LAYOUT_LABEL[layout]}
        axes[0].plot(ns, [r["summary"]["samples_per_s"] for r in rs], **kw)
        share = [r["summary"]["per_warehouse_served"] / max(1, sum(r["summary"]["warehouse_served"].values()))
                 for r in rs]
        axes[1].plot(ns, share, **kw)
        axes[2].plot(ns, [r["summary"]["busiest_link_bytes"] / MB for r in rs], **kw)
        multi = [r for r in rs if r["nodes"] > 1]
        if layout != "ray" and multi:
            m = {"color": COLORS[layout], "linestyle": "--", "linewidth": 1, "alpha": 0.8,
                 "label": f"model, {layout} (links at cap)"}
            axes[0].plot([r["nodes"] for r in multi], [r["summary"]["model"]["samples_per_s"] for r in multi], **m)
            axes[2].plot(ns, [r["summary"]["model"]["busiest_link_bytes"] / MB for r in rs], **m)
    all_n = sorted({r["nodes"] for r in runs})
    if all_n:
        axes[1].plot(all_n, [1.0 / n for n in all_n], color="black", linestyle=":", label="1/N")
    titles = ("samples/s (one iteration = N x batch per node)", "busiest warehouse's share of the bytes served",
              "busiest link: MB per iteration (rx or tx)")
    for ax, title in zip(axes[:3], titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_n or [1])
        ax.set_xticklabels([str(n) for n in all_n] or ["1"])
        ax.minorticks_off()
        ax.set_xlabel("nodes")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    from matplotlib.ticker import FuncFormatter

    for ax in axes[:2]:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if all_n:
        axes[1].set_yticks([1.0 / n for n in all_n])
        axes[1].set_yticklabels(["1" if n == 1 else f"1/{n}" for n in all_n])
    _timeline_panel(axes[3], runs, results)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    cfg, mach = results.get("config", {}), results.get("machine", {})
    fig.suptitle(f"dockd multinode: {cfg.get('rate_mbit'):g} Mbit/s links each way, "
                 f"{human_bytes(cfg.get('sample_bytes'))} samples, {cfg.get('batch_per_node')} per node per "
                 f"iteration - {mach.get('cpus', '?')} CPUs", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def _timeline_panel(ax: Any, runs: list[dict[str, Any]], results: dict[str, Any]) -> None:
    top = max((r["nodes"] for r in runs), default=0)
    cap = float(results.get("config", {}).get("rate_mbit") or 1)
    drawn = 0
    for r in runs:
        if r["nodes"] != top or top < 2:
            continue
        measured = [i for i in r["iterations"] if not i["warmup"] and i.get("timeline", {}).get("t")]
        if not measured:
            continue
        tl = measured[len(measured) // 2]["timeline"]
        # what all links together deliver, as a fraction of what they could (N x cap, receive side)
        total = [sum(vals) / (top * cap) for vals in zip(*tl["rx_mbit"].values())]
        ax.stairs(total, [tl.get("t_start", 0.0), *tl["t"]], color=COLORS[r["layout"]], linewidth=1.5,
                  label=LAYOUT_LABEL[r["layout"]])
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no timeline: iterations shorter than the link sampling interval", ha="center",
                va="center", transform=ax.transAxes, fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds into one iteration (the median one)")
    ax.set_title(f"all {top} links together: fraction of their receive capacity in use", fontsize=10)
    ax.grid(True, alpha=0.3)
