"""Runner: ``python -m benchmarks [--quick] [--only NAME[,NAME]] [--json OUT] [--plot PNG] [--versions]``.

Each scenario runs in a fresh ``python -m benchmarks._child`` process. The
runner collects their JSON, computes the target ratios from values measured
in this run (``benchmarks/report.py``), prints the table, writes one JSON
file with machine, versions and the full config, and draws a PNG plot.
``dockd bench ARGS`` calls :func:`main` with the same arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import SCENARIOS, scenario_names
from .common import REPO_ROOT, BenchConfig, machine, spawn_env, versions
from .report import compute_targets, markdown_report, plot, render

logger = logging.getLogger("benchmarks")

DEFAULT_JSON = REPO_ROOT / "bench-results" / "results.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="dockd sample-flow benchmarks: ceilings, dockd, peers, controller scale.",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (for tests and smoke runs; numbers mean nothing)")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help=f"run only these scenarios (repeatable). Known: {', '.join(scenario_names())}",
    )
    p.add_argument("--skip", action="append", default=[], metavar="NAME[,NAME]", help="leave these scenarios out")
    p.add_argument("--json", dest="json_out", default=None, help=f"where to write the results JSON (default {DEFAULT_JSON})")
    p.add_argument("--plot", dest="plot_out", default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--report-md", default=None, metavar="PATH",
                   help="also write a Markdown report (machine, versions, command, targets, tables, plot link)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per case (default 5, quick 2)")
    p.add_argument("--config", default=None, help="JSON file with BenchConfig overrides")
    p.add_argument("--timeout", type=float, default=None, help="seconds per scenario process")
    p.add_argument("--versions", action="store_true", help="print machine and package versions as JSON and exit")
    p.add_argument("--list", action="store_true", help="list the scenarios, whether each can run here, and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="show scenario logs as they run")
    return p.parse_args(argv)


def _names(values: list[str]) -> list[str]:
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def select(only: list[str], skip: list[str]) -> list[str]:
    known = scenario_names()
    for n in only + skip:
        if n not in known:
            raise SystemExit(f"Unknown scenario {n!r}. Valid scenarios are: {known}")
    chosen = only or scenario_names(include_optional=False)
    return [n for n in known if n in chosen and n not in skip]


def build_config(args: argparse.Namespace) -> BenchConfig:
    overrides: dict[str, Any] = {}
    if args.config:
        overrides.update(json.loads(Path(args.config).read_text()))
    if args.repeats is not None:
        overrides["repeats"] = args.repeats
    if args.timeout is not None:
        overrides["scenario_timeout_s"] = args.timeout
    if args.quick:
        return BenchConfig.quick_config(**overrides)
    base = BenchConfig().to_dict()
    base.update(overrides)
    return BenchConfig.from_dict(base)


def run_child(name: str, config: BenchConfig, workdir: Path, *, verbose: bool) -> dict[str, Any]:
    """Run one scenario in a fresh process and return its result dict."""
    cfg_path = workdir / f"{name}.config.json"
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    cfg_path.write_text(json.dumps(config.to_dict()))
    cmd = [sys.executable, "-m", "benchmarks._child", name, str(cfg_path), str(out_path)]
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=str(REPO_ROOT),
            env=spawn_env(),
            stdout=log,
            stderr=None if verbose else subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=config.scenario_timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
    wall = time.perf_counter() - t0
    tail = _tail(log_path)
    if code is None:
        return {"status": "error", "error": f"timed out after {config.scenario_timeout_s:.0f} s", "log_tail": tail,
                "runner_wall_s": wall}
    try:
        result = json.loads(out_path.read_text())
    except (OSError, ValueError):
        return {"status": "error", "error": f"scenario process exited with code {code} and wrote no result",
                "log_tail": tail, "runner_wall_s": wall}
    result["runner_wall_s"] = wall
    if result.get("status") != "ok":
        result["log_tail"] = tail
    return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _readiness(module: str) -> str:
    """'runnable', or why the scenario would be skipped here (its ``requirements()``)."""
    import importlib

    try:
        mod = importlib.import_module(module)
        check = getattr(mod, "requirements", None)
        reason = check() if callable(check) else None
    except Exception as exc:  # noqa: BLE001 - reported, as the child process would
        reason = f"cannot import {module}: {type(exc).__name__}: {exc}"
    return "runnable" if not reason else f"would be skipped: {reason}"


def _tail(path: Path, n: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.list:
        for s in SCENARIOS:
            print(f"{s.name:22s} {s.module:34s} {_readiness(s.module)}{'' if s.default else '  (only with --only)'}")
        return 0
    if args.versions:
        print(json.dumps({"machine": machine(), "versions": versions()}, indent=2))
        return 0
    names = select(_names(args.only), _names(args.skip))
    config = build_config(args)
    json_out = Path(args.json_out) if args.json_out else DEFAULT_JSON
    results: dict[str, Any] = {
        "schema": 1,
        "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "machine": machine(),
        "versions": versions(),
        "config": config.to_dict(),
        "scenarios": {},
    }
    with tempfile.TemporaryDirectory(prefix="dockd-bench-") as tmp:
        for name in names:
            print(f"[bench] running {name} ...", file=sys.stderr, flush=True)
            res = run_child(name, config, Path(tmp), verbose=args.verbose)
            results["scenarios"][name] = res
            status = res.get("status")
            extra = res.get("reason") or res.get("error") or f"{res.get('runner_wall_s', 0):.0f} s"
            print(f"[bench] {name}: {status} ({extra})", file=sys.stderr, flush=True)
            if status == "error" and res.get("log_tail"):
                print(res["log_tail"][-1500:], file=sys.stderr)
    results["finished_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results["machine"]["loadavg_end"] = machine().get("loadavg")
    results["targets"] = compute_targets(results)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(results, indent=1))
    print(render(results, markdown=args.markdown))
    print(f"\n[bench] JSON written to {json_out}", file=sys.stderr)
    png = None
    if not args.no_plot:
        png = plot(results, Path(args.plot_out) if args.plot_out else json_out.with_suffix(".png"))
        if png:
            print(f"[bench] plot written to {png}", file=sys.stderr)
    if args.report_md:
        md_path = Path(args.report_md)
        plot_name = None
        if png:
            try:
                plot_name = str(Path(png).resolve().relative_to(md_path.resolve().parent))
            except ValueError:
                plot_name = str(Path(png).resolve())
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown_report(results, plot_name=plot_name))
        print(f"[bench] Markdown report written to {md_path}", file=sys.stderr)
    failed = [n for n, r in results["scenarios"].items() if r.get("status") == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
