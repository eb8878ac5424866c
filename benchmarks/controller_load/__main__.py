"""``.venv/bin/python -m benchmarks.controller_load [--quick] [--controllers 1,2,4] [--netns] ...``

Measures the same-run socket baselines, then for each controller count K
starts the daemons and the client processes and ramps the offered request
rate; writes ``NAME.json`` under ``--results`` and the Markdown report (with
its plots next to it) there or at ``--report``. ``--model-only JSON``
redraws the report of an earlier run (the streaming model included).
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
from . import baseline
from .report import add_model, summary_rows, write_outputs
from .run import LoadConfig, ramp_one

logger = logging.getLogger("benchmarks.controller_load")

DEFAULT_RESULTS = REPO_ROOT / "bench-results"


def _nums(text: str, conv: Any = float) -> tuple:
    return tuple(conv(x) for x in text.split(",") if x.strip())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.controller_load", description=(
        "Controller load: many AsyncDock clients streaming per-sample puts and small gets, open loop, at rising "
        "request rates; the rate sustained with p99 <= 10 ms and the daemons' CPU per request."))
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds): 1 client process, 2 short steps")
    p.add_argument("--controllers", default="1",
                   help="controller counts K to measure, e.g. 1,2,4 (K > 1 needs a dockd that supports it)")
    p.add_argument("--warehouses", type=int, default=None, help="warehouse daemons (default 2)")
    p.add_argument("--procs", type=int, default=None, help="client processes (default 3)")
    p.add_argument("--rollouts", type=int, default=None, help="rollout AsyncDocks in all (default 24)")
    p.add_argument("--trainers", type=int, default=None, help="trainer AsyncDocks in all (default 12)")
    p.add_argument("--partitions", type=int, default=None, help="stream partitions (default 8)")
    p.add_argument("--consumers", type=int, default=None, help="consumer names, each takes every sample (default 2)")
    p.add_argument("--rates", default=None, help="offered requests/s per step, e.g. 100,200,400")
    p.add_argument("--step-s", type=float, default=None, help="seconds per step (default 6)")
    p.add_argument("--p99-ms", type=float, default=None, help="latency bound (default 10)")
    p.add_argument("--netns", action="store_true",
                   help="each daemon in its own network namespace (needs root and iproute2)")
    p.add_argument("--controller-cpus", default=None, help="pin the controller daemon(s) to these CPUs, e.g. 0")
    p.add_argument("--warehouse-cpus", default=None, help="pin the warehouse daemons, e.g. 1-2")
    p.add_argument("--client-cpus", default=None, help="pin the client processes, e.g. 3-7")
    p.add_argument("--echo-round-trips", type=int, default=None, help="timed round trips per echo pair (default 30000)")
    p.add_argument("--results", default=None, help=f"folder for the JSON (default {DEFAULT_RESULTS})")
    p.add_argument("--name", default=None, help="file stem (default controller_load_<host>_<date>)")
    p.add_argument("--report", default=None, help="write the Markdown report (and its plots) here instead")
    p.add_argument("--model-only", metavar="JSON", default=None,
                   help="only redraw the report and the streaming model from an earlier run's JSON")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> LoadConfig:
    over: dict[str, Any] = {"controllers": _nums(args.controllers, int), "netns": bool(args.netns)}
    for flag in ("warehouses", "procs", "rollouts", "trainers", "partitions", "consumers", "step_s", "p99_ms",
                 "controller_cpus", "warehouse_cpus", "client_cpus"):
        v = getattr(args, flag)
        if v is not None:
            over[flag] = v
    if args.rates:
        over["rates"] = _nums(args.rates)
    return LoadConfig.quick_config(**over) if args.quick else LoadConfig(**over)


class _Stop(KeyboardInterrupt):
    pass


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stop(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_only:
        src = Path(args.model_only)
        results = add_model(json.loads(src.read_text()))
        report = Path(args.report) if args.report else None
        written = write_outputs(results, src.parent, src.stem, draw=not args.no_plot, report_path=report)
        print(f"[controller_load] wrote {', '.join(map(str, written))}", file=sys.stderr)
        return 0
    try:
        cfg = build_config(args)
    except (ValueError, OSError) as e:
        print(f"benchmarks.controller_load: error: {e}", file=sys.stderr)
        return 2
    started = _dt.datetime.now(_dt.timezone.utc)
    name = args.name or f"controller_load_{machine().get('hostname', 'host')}_{started:%Y-%m-%d}"
    out_dir = Path(args.results) if args.results else DEFAULT_RESULTS
    results: dict[str, Any] = {
        "schema": 1, "benchmark": "controller_load", "started_utc": started.isoformat(timespec="seconds"),
        "command": "python -m benchmarks.controller_load " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "machine": machine(), "versions": versions(), "config": cfg.to_dict(), "ramps": [],
    }
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="dkload-"))
    ok = False
    try:
        n_rt = args.echo_round_trips or (3000 if cfg.quick else 30000)
        print(f"[controller_load] baseline: 64-byte echo round trips, Unix and TCP ({n_rt} each) ...",
              file=sys.stderr, flush=True)
        results["baseline"] = baseline.measure(n_rt, rounds=1 if cfg.quick else 3)
        for fam, b in results["baseline"].items():
            print(f"[controller_load] {fam} echo: p50 {b['p50_us']:.1f} us, p99 {b['p99_us']:.1f} us, server CPU "
                  f"{b['server_cpu_us_per_round_trip']:.1f} us per round trip", file=sys.stderr, flush=True)
        for k in cfg.controllers:
            results["ramps"].append(ramp_one(k, cfg, workdir, log=lambda m: print(m, file=sys.stderr, flush=True)))
        ok = all(r["status"] != "failed" for r in results["ramps"])
    except KeyboardInterrupt as e:
        print(f"[controller_load] interrupted ({e or 'Ctrl-C'})", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"[controller_load] logs kept in {workdir}", file=sys.stderr)
    results["wall_s"] = time.perf_counter() - t0
    results["machine"]["loadavg_end"] = machine().get("loadavg")
    add_model(results)
    report = Path(args.report) if args.report else None
    written = write_outputs(results, out_dir, name, draw=not args.no_plot, report_path=report)
    for row in summary_rows(results):
        print("K=" + row[0] + ": " + " | ".join(row[1:]))
    print(f"[controller_load] wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
