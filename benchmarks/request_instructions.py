"""Instructions the daemon executes per request: a figure that does not move with the machine's noise.

    python -m benchmarks.request_instructions [--count N] [--vs DIR] [--json PATH]

One `dockd serve --controller` daemon (controller and warehouse in one process)
runs under valgrind's callgrind with instrumentation off; a client in this
process warms each case up, then instrumentation is switched on
(`callgrind_control -i on`) for `count` requests and the window is dumped.
Per case, the daemon's instructions per request (Ir), and the same without
the C library's memcpy/memmove/memset (whose count under valgrind follows the
bytes copied, not the work around them):

- ``put1``: put of one 64-byte sample;
- ``get1``: get of one 64-byte sample (acquire with its value inline; the
  confirm the client sends soon after is counted with it);
- ``put_grpo``: put of 64 GRPO-shaped samples (`columnar.grpo_samples`: six
  ragged tensor columns, a float, a string);
- ``get4k``: get of 64 samples of 4 KiB (one column);
- ``ping``: an empty confirm, the floor of any request.

On a shared VM, timings of the same build differ by 20 % from run to run;
these counts repeat to about 0.1 %, so a change of a few per cent in the
daemon's work per request shows (for CPU-bound work instructions track time
closely, though not exactly: cache misses and exceptions cost more than their
count). `--vs DIR` runs the same cases with the daemon's code taken from
another checkout (a `git worktree` of an older commit: the wire must be the
same) and adds the ratio this tree / DIR. Needs valgrind (`apt install
valgrind`); the daemon runs ~50x slower under it, so the default counts keep
a run to a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

CASES = ("put1", "get1", "put_grpo", "get4k", "ping")
_MEM = re.compile(r"__(memcpy|memmove|memset)")


def requirements() -> str | None:
    missing = [t for t in ("valgrind", "callgrind_control", "callgrind_annotate") if shutil.which(t) is None]
    return f"needs {', '.join(missing)} (apt install valgrind)" if missing else None


def _totals(path: str) -> tuple[int, int]:
    """(all instructions, those outside memcpy/memmove/memset) of one callgrind dump."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", path], capture_output=True, text=True,
                         check=True).stdout
    return totals(out)


def totals(annotated: str) -> tuple[int, int]:
    """(all instructions, those outside memcpy/memmove/memset) from `callgrind_annotate --threshold=100`."""
    total = mem = 0
    for line in annotated.splitlines():
        m = re.match(r"\s*([\d,]+)\s", line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in line:
            total = n
        elif _MEM.search(line):
            mem += n
    return total, total - mem


def _ctl(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=120)


def run_cases(count: int, src: str | None = None, keep: str | None = None) -> dict[str, dict[str, float]]:
    """Instructions per request of each case, with the daemon's code from `src` (default: this tree);
    `keep`: a directory that keeps the callgrind dumps (cg.PID.K, K the case's place in CASES)."""
    import secrets

    import torch

    import dockd
    from dockd._proto import dockd_pb2 as pb
    from dockd.local import LocalCluster, spawn_node

    from .columnar import grpo_samples

    out_dir = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="dockd-callgrind-")
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET=secrets.token_hex(32), PYTHONHASHSEED="0")
    cwd = os.getcwd()
    if src is not None:  # (`python -m dockd` looks in its working directory first)
        env["PYTHONPATH"] = os.path.abspath(src)
        os.chdir(src)
    prefix = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_dir}/cg.%p",
              f"--log-file={out_dir}/valgrind.log"]  # (it warns of each pidfd_open it does not know)
    cluster = LocalCluster()
    try:
        proc, ready = spawn_node(["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--capacity", str(8 << 30),
                                  "--log-level", "WARNING", "--controller"], timeout=900, env=env, prefix=prefix)
    finally:
        os.chdir(cwd)
    cluster.procs.append(proc)
    cluster.nodes.append(ready)
    pid = str(proc.pid)
    res: dict[str, dict[str, float]] = {}
    try:
        with dockd.connect(cluster.address) as d:
            tiny = torch.zeros(1, 64, dtype=torch.uint8)
            grpo = grpo_samples(64)
            page = torch.zeros(64, 4096, dtype=torch.uint8)
            empty = pb.Frame(confirm=pb.ConfirmRequest())
            warm = 20  # requests of each case before its window
            for _ in range(count + warm):  # (every get finds its samples ready)
                d.put({"x": tiny}, partition="get1")
            for _ in range(count // 4 + warm):
                d.put({"x": page}, partition="get4k")
            ops = {
                "put1": (count, lambda: d.put({"x": tiny}, partition="put1")),
                "get1": (count, lambda: d.get("c", ["x"], 1, partition="get1", timeout=600)),
                "put_grpo": (count // 4, lambda: d.put(grpo, partition="put_grpo")),
                "get4k": (count // 4, lambda: d.get("c", ["x"], 64, partition="get4k", timeout=600)),
                "ping": (count, lambda: d._router.controller(lambda pool: pool.call(empty))),
            }
            for k, name in enumerate(CASES, start=1):
                n, op = ops[name]
                for _ in range(warm):
                    op()
                time.sleep(1.0)  # (the warm-up's confirms go out before the window)
                _ctl("-z", pid)
                _ctl("-i", "on", pid)
                for _ in range(n):
                    op()
                time.sleep(1.0)  # (the window's confirms, sent soon after their gets)
                _ctl("-i", "off", pid)
                _ctl("-d", pid)
                dump = f"{out_dir}/cg.{pid}.{k}"
                deadline = time.monotonic() + 60
                while not os.path.exists(dump) and time.monotonic() < deadline:
                    time.sleep(0.1)
                total, rest = _totals(dump)
                res[name] = {"count": n, "instructions": total / n, "instructions_no_memcpy": rest / n}
    finally:
        cluster.close()
        if not keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    return res


def table(res: dict[str, Any]) -> str:
    vs = res.get("vs")
    head = "| request | instructions per request | without memcpy/memset |"
    rule = "|---|---|---|"
    if vs:
        head += f" baseline ({vs['src']}) without memcpy | this tree ÷ baseline |"
        rule += "---|---|"
    lines = [head, rule]
    for name in CASES:
        f = res["cases"][name]
        row = f"| {name} | {f['instructions'] / 1e3:,.0f}k | {f['instructions_no_memcpy'] / 1e3:,.0f}k |"
        if vs:
            b = vs["cases"][name]
            row += f" {b['instructions_no_memcpy'] / 1e3:,.0f}k | {f['instructions_no_memcpy'] / b['instructions_no_memcpy']:.3f} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.request_instructions", description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=200, help="requests per case (a quarter of it for the 64-sample cases)")
    ap.add_argument("--vs", metavar="DIR", help="also run the daemon from this checkout and give the ratio")
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    ap.add_argument("--keep", metavar="DIR", help="keep this tree's callgrind dumps here (for callgrind_annotate)")
    args = ap.parse_args(argv)
    why = requirements()
    if why:
        print(f"request_instructions: skipped: {why}", file=sys.stderr)
        return 2
    res: dict[str, Any] = {"cases": run_cases(args.count, keep=args.keep), "count": args.count}
    if args.vs:
        res["vs"] = {"src": args.vs, "cases": run_cases(args.count, args.vs)}
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
