"""TLS against plain TCP: put and get throughput in one run, as ratios (``python -m benchmarks.tls``).

Two docks on loopback, one with ``--tls-cert`` and one without, each a controller with its
warehouse; the client uses TCP (``DOCKD_TRANSPORT=tcp``) for both. Rounds alternate between
the two docks so that both see the same machine load; each round puts `--batch` samples of
one size per call and gets them back, and the medians over rounds are compared. Prints a
Markdown table (MB/s per side and the TLS/plain ratio) and, with ``--json``, writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import put_get_round

SIZES = {"1MiB": 1 << 20, "64KiB": 64 << 10}


def _cert(directory: Path) -> tuple[str, str]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    if shutil.which("openssl") is None:
        raise SystemExit("the openssl command is needed to make the benchmark's certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=dockd-bench"],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def _round(dock, size: int, batch: int, calls: int, tag: str) -> tuple[float, float]:
    """(put MB/s, get MB/s) for `calls` puts of `batch` samples of `size` bytes, then as many gets."""
    put, _, get = put_get_round(dock, size, batch, calls, f"tls-{tag}", timeout=60.0)
    return put, get


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per dock and size (default 5)")
    ap.add_argument("--mib-per-call", type=float, default=8.0, help="MiB of samples per put (default 8)")
    ap.add_argument("--calls", type=int, default=8, help="puts (and gets) per round (default 8)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)

    os.environ["DOCKD_TRANSPORT"] = "tcp"  # same host: the client would use shared memory otherwise
    os.environ.pop("DOCKD_TLS_CA", None)
    import dockd
    from dockd.local import spawn_node

    with tempfile.TemporaryDirectory() as tmp:
        cert, key = _cert(Path(tmp))
        base = ["--controller", "--port", "0", "--capacity", "2GiB", "--log-level", "WARNING"]
        procs = []
        try:
            plain, ready = spawn_node(base)
            procs.append(plain)
            secure, ready_tls = spawn_node([*base, "--tls-cert", cert, "--tls-key", key])
            procs.append(secure)
            docks = {"plain": dockd.connect(f"127.0.0.1:{ready['port']}"),
                     "tls": dockd.connect(f"127.0.0.1:{ready_tls['port']}", tls=cert)}
            rows = []
            for name, size in SIZES.items():
                batch = max(1, int(args.mib_per_call * (1 << 20)) // size)
                rates: dict[str, list[tuple[float, float]]] = {"plain": [], "tls": []}
                for side in ("plain", "tls"):  # warm-up: connections, receive buffers
                    _round(docks[side], size, batch, 2, side)
                for r in range(args.rounds):
                    for side in (("plain", "tls") if r % 2 == 0 else ("tls", "plain")):
                        rates[side].append(_round(docks[side], size, batch, args.calls, side))
                med = {side: (statistics.median(p for p, _ in v), statistics.median(g for _, g in v))
                       for side, v in rates.items()}
                rows.append({"size": name, "batch": batch, "rounds": args.rounds,
                             "put_plain_MBps": med["plain"][0], "put_tls_MBps": med["tls"][0],
                             "put_ratio": med["tls"][0] / med["plain"][0],
                             "get_plain_MBps": med["plain"][1], "get_tls_MBps": med["tls"][1],
                             "get_ratio": med["tls"][1] / med["plain"][1]})
            for d in docks.values():
                d.close()
        finally:
            for p in procs:
                p.terminate()
                p.wait()
                if p.stdout is not None:
                    p.stdout.close()

    print(f"TLS vs plain TCP on loopback ({os.cpu_count()} CPUs, medians of {args.rounds} alternating rounds)\n")
    print("| sample | samples/put | put plain MB/s | put TLS MB/s | put TLS/plain | get plain MB/s | get TLS MB/s "
          "| get TLS/plain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['batch']} | {r['put_plain_MBps']:.0f} | {r['put_tls_MBps']:.0f} | "
              f"{r['put_ratio']:.2f} | {r['get_plain_MBps']:.0f} | {r['get_tls_MBps']:.0f} | {r['get_ratio']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
