"""``sudo .venv/bin/python -m benchmarks.multinode [--quick] [--nodes 1,2,4,8] [--results DIR] ...``

Builds the simulated cluster for each node count, measures the layouts,
extrapolates with the analytic model and the in-process controller, and
writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` under ``--results``.
Without root (or without iproute2) it prints one line saying so and exits 0.
The exit code is 1 when the central or distributed layout failed somewhere.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..common import REPO_ROOT, machine, versions
from . import controller_cost
from .cluster import STARTED_PIDS
from .config import LAYOUTS, MultinodeConfig
from .model import controller_budget, extrapolate, traffic
from .netns import (
    NetnsError,
    alive,
    cleanup_leftovers,
    list_namespaces,
    missing_privileges,
    new_tag,
    remove_namespaces,
    root_links,
    shielded,
)
from .report import compute_checks, markdown_report, plot, throughput_table
from .runner import run_all, workload_of

logger = logging.getLogger("benchmarks.multinode")

DEFAULT_RESULTS = REPO_ROOT / "bench-results"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multinode", description=(
        "Simulated-cluster benchmark: N network namespaces on a bridge, rate-capped links; dockd central vs "
        "distributed vs a Ray-actor buffer. Needs root."))
    p.add_argument("--quick", action="store_true", help="N=1,2, tiny iterations (well under a minute)")
    p.add_argument("--nodes", type=_ints, default=None, help="node counts, e.g. 1,2,4,8")
    p.add_argument("--layouts", default=None, help=f"comma-separated subset of {','.join(LAYOUTS)}")
    p.add_argument("--rate-mbit", type=float, default=None, help="link cap each way in Mbit/s (default 50)")
    p.add_argument("--link-latency-ms", type=float, default=None,
                   help="tbf latency: the longest a packet waits in a link's queue (default 20)")
    p.add_argument("--sample-kib", type=int, default=None, help="KiB per sample, both columns (default 96)")
    p.add_argument("--batch-per-node", type=int, default=None, help="samples per node per iteration (default 32)")
    p.add_argument("--iterations", type=int, default=None,
                   help="least measured iterations per layout and N (default 4; more until 8 s are measured)")
    p.add_argument("--half-cap-nodes", type=int, default=None, help="N at which to rerun with half the cap (0: skip)")
    p.add_argument("--config", default=None, help="JSON file with MultinodeConfig overrides")
    p.add_argument("--results", default=None, help=f"output folder (default {DEFAULT_RESULTS})")
    p.add_argument("--name", default=None, help="file name stem (default multinode_<host>_<date>_dockd)")
    p.add_argument("--prefix", default=None, help="namespace name prefix (default dkmn)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--keep-logs", action="store_true", help="keep the daemons' and agents' logs (kept on failure)")
    p.add_argument("--cleanup", action="store_true", help="only remove namespaces left by dead runs, then exit")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="only redraw the report and plot of an earlier run's JSON (next to it; no root needed)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> MultinodeConfig:
    over: dict[str, Any] = json.loads(Path(args.config).read_text()) if args.config else {}
    for flag, field, conv in (("nodes", "nodes", None), ("rate_mbit", "rate_mbit", None),
                              ("batch_per_node", "batch_per_node", None), ("iterations", "iterations", None),
                              ("half_cap_nodes", "half_cap_nodes", None), ("prefix", "prefix", None),
                              ("link_latency_ms", "link_latency_ms", None),
                              ("sample_kib", "sample_bytes", lambda v: v * 1024),
                              ("layouts", "layouts", lambda v: tuple(x.strip() for x in v.split(",") if x.strip()))):
        v = getattr(args, flag)
        if v is not None:
            over[field] = conv(v) if conv else v
    return MultinodeConfig.quick_config(**over) if args.quick else MultinodeConfig.from_dict(over)


class _Stop(KeyboardInterrupt):
    """SIGINT / SIGTERM / SIGHUP: unwind like Ctrl-C so every finally block tears down."""


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stop(f"signal {signum}")


def extrapolation(cfg: MultinodeConfig) -> dict[str, Any]:
    wl = workload_of(cfg)
    link = cfg.rate_mbit * 1e6 / 8
    counts = sorted(set(cfg.nodes) | set(cfg.extrapolate_nodes))
    sims = controller_cost.measure(counts, wl, repeats=1 if cfg.quick else 3)
    for s in sims:
        t = traffic("distributed", s["nodes"], wl, link_bytes_per_s=link)
        s["budget"] = controller_budget(s["requests"], s["controller_s"], t["iteration_s"])
        # the per-link rate at which the link-bound iteration gets as short as the controller's work
        s["binds_above_gbit"] = (t["busiest_link_bytes"] * 8 / s["controller_s"] / 1e9
                                 if t["busiest_link_bytes"] and s["controller_s"] else None)
    return {"model": extrapolate(cfg.extrapolate_nodes, wl, link), "controller": sims,
            "workload": {"written_bytes_per_sample": wl.written_bytes, "read_bytes_per_sample": wl.read_bytes,
                         "link_bytes_per_s": link}}


def write_outputs(results: dict[str, Any], out_dir: Path, name: str, *, draw: bool = True) -> list[Path]:
    """The JSON (checks recomputed), the PNG and the Markdown report of one run."""
    results = json.loads(json.dumps(results))  # node indexes become string keys, as in the file
    results["checks"] = compute_checks(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(results, separators=(",", ":")))  # raw data, ~0.4 MB for a full run
    png = plot(results, out_dir / f"{name}.png") if draw else None
    md_path = out_dir / f"{name}.md"
    md_path.write_text(markdown_report(results, plot_name=png.name if png else None))
    print(throughput_table(results))
    return [p for p in (json_path, md_path, png) if p]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.render:
        src = Path(args.render)
        written = write_outputs(json.loads(src.read_text()), src.parent, src.stem, draw=not args.no_plot)
        print(f"[multinode] wrote {', '.join(map(str, written))}", file=sys.stderr)
        return 0
    try:
        cfg = build_config(args)
    except (ValueError, OSError) as e:
        print(f"benchmarks.multinode: error: {e}", file=sys.stderr)
        return 2
    reason = missing_privileges(cfg.prefix)
    if reason:
        print(f"benchmarks.multinode: skipped: {reason}")
        return 0
    if args.cleanup:
        removed = cleanup_leftovers(cfg.prefix)
        print(f"benchmarks.multinode: removed {len(removed)} leftover namespaces" + (f": {removed}" if removed else ""))
        return 0
    cleanup_leftovers(cfg.prefix)
    tag = new_tag(cfg.prefix)
    started = _dt.datetime.now(_dt.timezone.utc)
    name = args.name or f"multinode_{machine().get('hostname', 'host')}_{started:%Y-%m-%d}_dockd"
    out_dir = Path(args.results) if args.results else DEFAULT_RESULTS
    workdir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
    results: dict[str, Any] = {
        "schema": 1, "benchmark": "multinode", "tag": tag,
        "started_utc": started.isoformat(timespec="seconds"),
        "command": "python -m benchmarks.multinode " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "machine": machine(), "versions": versions(), "config": cfg.to_dict(),
    }
    # SIGINT too: a shell starts background jobs with it ignored, and `kill -INT` should still tear down
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    t0 = time.perf_counter()
    ok = False
    try:
        print(f"[multinode] run {tag}: nodes {list(cfg.nodes)}, layouts {list(cfg.layouts)}, "
              f"links {cfg.rate_mbit:g} Mbit/s; logs in {workdir}", file=sys.stderr, flush=True)
        results.update(run_all(cfg, tag, workdir))
        ok = True
    except KeyboardInterrupt as e:
        print(f"[multinode] interrupted ({e or 'Ctrl-C'}); tearing down", file=sys.stderr, flush=True)
        return 130
    except NetnsError as e:
        print(f"[multinode] cannot build the simulated cluster: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        with shielded():
            stray = [ns for ns in list_namespaces() if ns.startswith(tag)]
            if stray:
                remove_namespaces(stray)
        for s, h in old.items():
            signal.signal(s, h)
        failed = not ok or any(r.get("status") == "failed" for r in results.get("runs", []))
        if failed or args.keep_logs:
            print(f"[multinode] logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t0
    results["leftover_namespaces"] = results.get("leftover_namespaces", []) + [
        ns for ns in list_namespaces() if ns.startswith(tag)]
    results["leftover_root_links"] = root_links(tag)
    results["started_pids"] = list(STARTED_PIDS)
    results["leftover_pids"] = [p for p in STARTED_PIDS if alive(p)]
    if results["leftover_pids"] or results["leftover_namespaces"]:
        logger.error("left behind: processes %s, namespaces %s", results["leftover_pids"],
                     results["leftover_namespaces"])
    print("[multinode] controller at scale (in-process) ...", file=sys.stderr, flush=True)
    results["extrapolation"] = extrapolation(cfg)
    results["finished_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results["machine"]["loadavg_end"] = machine().get("loadavg")
    written = write_outputs(results, out_dir, name, draw=not args.no_plot)
    print(f"\n[multinode] wrote {', '.join(map(str, written))}", file=sys.stderr)
    bad = [f"{r['layout']} N={r['nodes']}" for r in results["runs"]
           if r["layout"] != "ray" and r.get("status") != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
