"""Entry point of one scenario process: ``python -m benchmarks._child NAME CONFIG.json OUT.json``.

The runner starts one of these per scenario, so that no scenario inherits
another's threads, caches, Ray sessions or page-cache-warm buffers. It writes
``{"status": "ok" | "skipped" | "error", ...}`` to OUT.json and exits 0 unless
the scenario raised.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import SCENARIOS
from .common import BenchConfig

logger = logging.getLogger("benchmarks")


def run_scenario(name: str, config: BenchConfig) -> dict[str, Any]:
    by_name = {s.name: s for s in SCENARIOS}
    if name not in by_name:
        raise ValueError(f"Unknown scenario {name!r}. Valid scenarios are: {sorted(by_name)}")
    try:
        module = importlib.import_module(by_name[name].module)
    except ImportError as exc:
        return {"status": "skipped", "reason": f"cannot import {by_name[name].module}: {exc}"}
    if not callable(getattr(module, "run", None)):
        if callable(getattr(module, "main", None)):
            return _run_main_style(module, name)
        return {"status": "skipped", "reason": f"{by_name[name].module} has no run(config) or main(argv) function"}
    check = getattr(module, "requirements", None)
    reason = check() if callable(check) else None
    if reason:
        return {"status": "skipped", "reason": reason}
    t0 = time.perf_counter()
    result = module.run(config)
    wall = time.perf_counter() - t0
    rows = result.pop("rows", [])
    return {"status": "ok", "title": getattr(module, "TITLE", name), "wall_s": wall, "rows": rows, "info": result}


def _run_main_style(module: Any, name: str) -> dict[str, Any]:
    """A module with its own ``main(argv)`` that writes JSON to ``--out``: keep that JSON as its report."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"dockd-bench-{name}-") as tmp:
        out = Path(tmp) / "out.json"
        t0 = time.perf_counter()
        code = module.main(["--out", str(out)])
        wall = time.perf_counter() - t0
        if code:
            raise RuntimeError(f"{module.__name__}.main exited with code {code}")
        report = json.loads(out.read_text()) if out.exists() else None
    return {"status": "ok", "title": getattr(module, "TITLE", name), "wall_s": wall, "rows": [],
            "info": {"report": report, "note": "own report format; see info.report"}}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print("usage: python -m benchmarks._child NAME CONFIG.json OUT.json", file=sys.stderr)
        return 2
    name, config_path, out_path = args
    logging.basicConfig(
        level=os.environ.get("DOCKD_BENCH_LOG", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    config = BenchConfig.from_dict(json.loads(Path(config_path).read_text()))
    try:
        result = run_scenario(name, config)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the runner, then re-raised as exit code
        logger.error("[bench] scenario=%s failed: %s", name, exc)
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        code = 1
    Path(out_path).write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Peers leave non-daemon threads and Ray workers behind; the result is
    # already on disk, so leave without waiting for them.
    os._exit(status)
