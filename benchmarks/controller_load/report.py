"""The load benchmark's Markdown report and plot (from its results dict), with the streaming model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..multinode.model import STREAMING_CPU_S_PER_REQUEST, Streaming, streaming_table
from ..multinode.report import _table, plot_streaming, streaming_markdown

logger = logging.getLogger(__name__)


def _f(v: Any, fmt: str = "{:,.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def sustained_step(k_result: dict[str, Any]) -> dict[str, Any] | None:
    s = k_result.get("sustained")
    return k_result["steps"][s["step_index"]] if s else None


def model_cpu_figure(results: dict[str, Any]) -> tuple[float, str]:
    """Controller CPU s/request for the streaming model: K=1's figure at its sustained step, else the default."""
    for r in results.get("ramps", []):
        if r["controllers"] == 1 and r.get("status") == "ok":
            st = sustained_step(r) or (r["steps"][0] if r.get("steps") else None)
            if st and st["controller_cpu_us_per_request"] > 0:
                where = "its sustained step" if sustained_step(r) else "its first step (no step passed)"
                return st["controller_cpu_us_per_request"] * 1e-6, (
                    f"measured by this run, K=1 at {where}: {st['offered_rps']:,.0f} requests/s offered")
    return STREAMING_CPU_S_PER_REQUEST, "the model's default; this run measured none"


def add_model(results: dict[str, Any], st: Streaming | None = None) -> dict[str, Any]:
    cpu, source = model_cpu_figure(results)
    results["streaming"] = streaming_table(st or Streaming(), cpu)
    results["streaming_cpu_s_per_request"] = cpu
    results["streaming_cpu_source"] = source
    return results


def steps_table(k_result: dict[str, Any], base: dict[str, Any]) -> str:
    tcp, unix = base["tcp"], base["unix"]
    rows = []
    for s in k_result["steps"]:
        rows.append([
            f"{s['offered_rps']:,.0f}", f"{s['achieved_rps']:,.0f}", f"{s['puts']:,} / {s['gets']:,}",
            _f(s["put_p50_ms"]), _f(s["put_p99_ms"]), _f(s["get_p50_ms"]), _f(s["get_p99_ms"]),
            _f(s["all_p99_ms"]),
            _f(s["all_p50_ms"] * 1e3 / tcp["p50_us"], "{:,.0f}x"),
            f"{s['controller_cpu_us_per_request']:,.0f}",
            _f(s["controller_cpu_us_per_request"] / tcp["server_cpu_us_per_round_trip"], "{:,.0f}x"),
            f"{s['controller_cores_busy']:.2f}",
            f"{s['warehouse_cpu_us_per_request']:,.0f}",
            _f(s["warehouse_cpu_us_per_request"] / unix["server_cpu_us_per_round_trip"], "{:,.0f}x"),
            f"{s['client_cpu_us_per_request']:,.0f}",
            _f(s["machine_busy_fraction"], "{:.0%}"),
            ("pass" if s["passed"] else "FAIL") + (f" ({sum(s['errors'].values())} errors)" if s["errors"] else "")
            + (f" ({s['late']} late)" if s["late"] else ""),
        ])
    return _table(["offered req/s", "answered req/s", "puts / gets", "put p50 ms", "put p99 ms", "get p50 ms",
                   "get p99 ms", "all p99 ms", "all p50 / TCP echo p50", "controller CPU us/req",
                   "/ TCP echo server CPU", "controller cores busy", "warehouses CPU us/req",
                   "/ Unix echo server CPU", "clients CPU us/req", "machine busy", "p99 <= bound"], rows)


def baseline_table(base: dict[str, Any]) -> str:
    rows = [[fam, f"{b['p50_us']:.1f}", f"{b['p99_us']:.1f}", f"{b['round_trips_per_s']:,.0f}",
             f"{b['server_cpu_us_per_round_trip']:.1f}", f"{b['client_cpu_us_per_round_trip']:.1f}",
             ", ".join(f"{x:.1f}" for x in b["round_p50_us"])] for fam, b in base.items()]
    return _table(["socket", "round trip p50 us", "p99 us", "round trips/s (one in flight)",
                   "echo server CPU us / round trip", "client CPU us / round trip", "p50 of each pair"], rows)


def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    base = results["baseline"]
    tcp, unix = base["tcp"], base["unix"]
    rows = []
    for r in results.get("ramps", []):
        k = r["controllers"]
        if r.get("status") != "ok":
            rows.append([str(k), r.get("status", "?").upper() + ": " + (r.get("reason") or r.get("error") or "")]
                        + ["-"] * 7)
            continue
        s = sustained_step(r)
        if not s:
            rows.append([str(k), f"no step met p99 <= {results['config']['p99_ms']:g} ms"] + ["-"] * 7)
            continue
        rows.append([
            str(k), f"{s['achieved_rps']:,.0f} (offered {s['offered_rps']:,.0f})",
            f"{s['all_p50_ms']:.2f} / {s['all_p99_ms']:.2f}",
            f"{s['all_p50_ms'] * 1e3 / tcp['p50_us']:,.0f}x / {s['all_p99_ms'] * 1e3 / tcp['p99_us']:,.0f}x",
            f"{s['controller_cpu_us_per_request']:,.0f}",
            f"{s['controller_cpu_us_per_request'] / tcp['server_cpu_us_per_round_trip']:,.0f}x",
            f"{s['warehouse_cpu_us_per_request']:,.0f}",
            f"{s['warehouse_cpu_us_per_request'] / unix['server_cpu_us_per_round_trip']:,.0f}x",
            f"{s['controller_cores_busy']:.2f}",
        ])
    return rows


def markdown_report(results: dict[str, Any], *, plot_names: dict[str, str] | None = None) -> str:
    cfg, mach, base = results["config"], results.get("machine", {}), results["baseline"]
    load = lambda v: "/".join(f"{x:.1f}" for x in v) if v else "?"  # noqa: E731
    ver = results.get("versions", {})
    head = [
        f"- when (UTC): {results.get('started_utc', '?')} ({results.get('wall_s', 0):.0f} s)",
        f"- machine: {mach.get('cpu_model', '?')}, {mach.get('cpus', '?')} CPUs, {mach.get('platform', '?')}; "
        f"load average at start {load(mach.get('loadavg'))}, at end {load(mach.get('loadavg_end'))}",
        f"- dockd {ver.get('packages', {}).get('dockd')} (git {ver.get('dockd_git')}"
        f"{', uncommitted changes' if ver.get('dockd_git_dirty') else ''}), Python {ver.get('python', '?')}",
        f"- command: `{results.get('command', '?')}`",
        f"- workload: {cfg['procs']} client processes carrying {cfg['rollouts']} rollout and {cfg['trainers']} "
        f"trainer AsyncDocks; {cfg['partitions']} stream partitions, {cfg['consumers']} consumer names each taking "
        f"every sample; a put is one trajectory (int32 tokens {cfg['tokens_bytes']:,} B, float32 log-probs "
        f"{cfg['logp_bytes']:,} B, a float reward) to the client's own warehouse; a get asks for 1..8 samples "
        f"(uniform, `allow_partial=True`): acquire, fetch, confirm. Gets per put {cfg['consumers']} x "
        f"{cfg['consume_fraction']:g} / 4.5 (the consumers take {cfg['consume_fraction']:.0%} of what is put; "
        f"{cfg['prefill']} samples per partition put beforehand). Open loop: arrivals at fixed intervals, "
        f"latency from the scheduled arrival to the answer; {cfg['step_s']:g} s per step; a step passes with "
        f"p99 (puts and gets together) <= {cfg['p99_ms']:g} ms, >= {cfg['achieved_min']:.0%} of the offered "
        f"requests answered in the step, no errors",
        f"- daemons: {'network namespaces (one per daemon, clients in their warehouse nodes)' if cfg['netns'] else 'plain loopback'}"
        f"; CPU pinning: controller {cfg['controller_cpus'] or 'none'}, warehouses {cfg['warehouse_cpus'] or 'none'}, "
        f"clients {cfg['client_cpus'] or 'none'}; CPU = utime + stime from /proc/<pid>/stat, read before each step "
        f"and after every client process has answered",
    ]
    parts = ["\n".join(head)]
    if plot_names and plot_names.get("ramp"):
        parts.append(f"![latency and CPU per request against offered rate]({plot_names['ramp']})")
    parts += ["### Sustained rate with p99 <= bound, per controller count K",
              _table(["K", "requests/s sustained", "p50 / p99 ms", "vs TCP echo p50 / p99",
                      "controller CPU us/req", "vs TCP echo server CPU/rt", "warehouses CPU us/req",
                      "vs Unix echo server CPU/rt", "controller cores busy"], summary_rows(results)),
              "### Same-run baseline: raw 64-byte echo round trip (best of fresh process pairs)",
              baseline_table(base)]
    for r in results.get("ramps", []):
        if r.get("status") == "ok":
            parts += [f"### K={r['controllers']}: every step ({r.get('layout', '')})", steps_table(r, base)]
            errs: dict[str, int] = {}
            for s in r["steps"]:
                for e, c in s["errors"].items():
                    errs[e] = errs.get(e, 0) + c
            if errs:
                parts.append("Errors: " + "; ".join(f"{c} x {e}" for e, c in errs.items()))
    if results.get("streaming"):
        parts += ["### Streaming model at up to 1,024 nodes x 8 accelerators",
                  streaming_markdown(results["streaming"], source=results.get("streaming_cpu_source", ""))]
        if plot_names and plot_names.get("model"):
            parts.append(f"![busiest controller utilisation against N per K]({plot_names['model']})")
    return "\n\n".join(p for p in parts if p) + "\n"


def plot_ramp(results: dict[str, Any], out_png: str | Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("[report] matplotlib is not installed; no plot")
        return None
    ramps = [r for r in results.get("ramps", []) if r.get("status") == "ok" and r.get("steps")]
    if not ramps:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    for r in ramps:
        x = [s["achieved_rps"] for s in r["steps"]]
        a1.plot(x, [s["all_p99_ms"] for s in r["steps"]], marker="o", label=f"K={r['controllers']} p99")
        a1.plot(x, [s["all_p50_ms"] for s in r["steps"]], marker=".", linestyle=":", label=f"K={r['controllers']} p50")
        a2.plot(x, [s["controller_cpu_us_per_request"] for s in r["steps"]], marker="o",
                label=f"K={r['controllers']} controller")
        a2.plot(x, [s["warehouse_cpu_us_per_request"] for s in r["steps"]], marker="s", linestyle="--",
                label=f"K={r['controllers']} warehouses")
        a2.plot(x, [s["client_cpu_us_per_request"] for s in r["steps"]], marker="^", linestyle=":",
                label=f"K={r['controllers']} clients")
    a1.axhline(results["config"]["p99_ms"], color="black", linestyle="--", linewidth=1, label="p99 bound")
    a1.set_yscale("log")
    a1.set_xlabel("answered requests/s")
    a1.set_ylabel("latency ms (scheduled arrival to answer)")
    a2.set_xlabel("answered requests/s")
    a2.set_ylabel("CPU us per request")
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"dockd controller load: {results.get('machine', {}).get('cpus', '?')} CPUs", fontsize=11)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def write_outputs(results: dict[str, Any], out_dir: Path, name: str, *, draw: bool = True,
                  report_path: Path | None = None) -> list[Path]:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(results, separators=(",", ":")))
    names: dict[str, str] = {}
    written = [json_path]
    md_path = report_path or out_dir / f"{name}.md"
    if draw:
        ramp = plot_ramp(results, md_path.parent / f"{md_path.stem}.png")
        model = plot_streaming(results["streaming"], md_path.parent / f"{md_path.stem}_model.png") \
            if results.get("streaming") else None
        for key, p in (("ramp", ramp), ("model", model)):
            if p:
                names[key] = p.name
                written.append(p)
    md_path.write_text(markdown_report(results, plot_names=names))
    written.append(md_path)
    return written
