"""Same-run baselines: a raw 64-byte echo round trip over a Unix socket and over loopback TCP.

An echo server in a child process (``multiprocessing`` spawn, blocking
socket, ``recv_into`` a preallocated buffer, ``sendall`` back) and the
client here, ping-pong, one message in flight: the round trip (p50/p99) and
the server's CPU per round trip, which the server measures itself with its
process CPU clock over the timed round trips (the load benchmark reads the
daemons' ``/proc`` counters, but those tick at 10 ms, and a few thousand
round trips of a fast echo can cost less than one tick). As in
``benchmarks.ceilings.measure_rtt`` (which measures the TCP round trip alone),
the best of a few fresh process pairs is kept: on a small VM the round trip
is bimodal, depending on where the scheduler puts the two processes. The
same TCP echo is also served by a compiled server (``echo.c``, built with the
machine's C compiler when it has one): its CPU per round trip is the kernel's
share alone, the floor under any server's.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..ceilings import _recv_exact

MSG_BYTES = 64

logger = logging.getLogger(__name__)


def _echo_server(family: str, address: Any, ready: Any, warmup: int) -> None:
    """Echo 64-byte messages on one connection; when its client goes, send back the CPU seconds this
    process spent after the first `warmup` messages (``time.process_time``: to the nanosecond, where
    /proc's counters tick at 10 ms, and a few thousand fast round trips cost less than a tick)."""
    fam = socket.AF_UNIX if family == "unix" else socket.AF_INET
    listener = socket.socket(fam, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)
    ready.send(listener.getsockname())
    conn, _ = listener.accept()
    listener.close()
    if fam == socket.AF_INET:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(MSG_BYTES)
    view = memoryview(buf)
    seen, cpu0 = 0, time.process_time()
    try:
        while True:
            _recv_exact(conn, view)
            conn.sendall(view)
            seen += 1
            if seen == warmup:
                cpu0 = time.process_time()
    except (ConnectionError, OSError):
        pass
    finally:
        conn.close()
        ready.send(time.process_time() - cpu0)


def echo_round(family: str, count: int, warmup: int = 500, client_cpus: set[int] | None = None) -> dict[str, Any]:
    """One fresh server process: ``count`` timed round trips; latencies and the server's CPU. The server
    inherits this process's CPUs; `client_cpus`: the CPUs this side then runs on, until it returns."""
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="dkload-echo-")
    address: Any = os.path.join(tmp, "echo.sock") if family == "unix" else ("127.0.0.1", 0)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_server, args=(family, address, child, warmup), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError(f"{family} echo server did not start")
        bound = parent.recv()
        if client_cpus is not None:
            os.sched_setaffinity(0, client_cpus)
        fam = socket.AF_UNIX if family == "unix" else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        sock.connect(bound if family == "unix" else tuple(bound))
        out = _ping_pong(sock, count, warmup)
        if not parent.poll(10):
            raise RuntimeError(f"{family} echo server did not report its CPU")
        out["server_cpu_us_per_round_trip"] = parent.recv() / count * 1e6
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        try:
            os.unlink(address) if family == "unix" else None
            os.rmdir(tmp)
        except OSError:
            pass
    return {"family": family, **out}


def compiled_echo_round(count: int, warmup: int = 500) -> dict[str, Any] | None:
    """As ``echo_round`` over TCP, the server compiled from ``echo.c`` (None without a C compiler
    that builds it): a server that spends next to nothing in user space, so its CPU per round trip is
    the kernel's share, the floor under any server's, the controller's included."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="dkload-cecho-") as tmp:
        exe = os.path.join(tmp, "echo")
        built = subprocess.run([cc, "-O2", "-o", exe, str(Path(__file__).with_name("echo.c"))], capture_output=True,
                               text=True)
        if built.returncode:
            logger.warning("no compiled echo baseline: %s failed: %s", cc, built.stderr.strip()[-500:])
            return None
        with subprocess.Popen([exe, str(warmup)], stdout=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stdout is not None
                port = int(proc.stdout.readline())
                out = _ping_pong(socket.create_connection(("127.0.0.1", port)), count, warmup)
                # (it exits when its client goes, printing its CPU after the warm-up, in ns)
                out["server_cpu_us_per_round_trip"] = int(proc.stdout.readline()) / 1e3 / count
            finally:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return {"family": "tcp", "server": "c", **out}


def _ping_pong(sock: socket.socket, count: int, warmup: int) -> dict[str, Any]:
    """``count`` timed 64-byte round trips on ``sock`` (closed after): latencies and the client's CPU (the
    server measures its own)."""
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(MSG_BYTES))
    with sock:
        for _ in range(warmup):
            sock.sendall(view)
            _recv_exact(sock, view)
        lat = []
        own0 = time.process_time()
        t_start = time.perf_counter()
        for _ in range(count):
            t0 = time.perf_counter()
            sock.sendall(view)
            _recv_exact(sock, view)
            lat.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        client_cpu = time.process_time() - own0
    lat.sort()
    return {
        "round_trips": count,
        "p50_us": lat[len(lat) // 2] * 1e6,
        "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
        "mean_us": statistics.fmean(lat) * 1e6,
        "round_trips_per_s": count / wall,
        "client_cpu_us_per_round_trip": client_cpu / count * 1e6,
    }


def measure(count: int = 20000, rounds: int = 3) -> dict[str, Any]:
    """Unix and TCP echo, and the compiled TCP echo (``tcp_compiled``, where a C compiler is found):
    the round with the lowest p50 of ``rounds`` fresh process pairs, per kind."""
    out: dict[str, Any] = {}
    kinds: dict[str, Any] = {"unix": lambda: echo_round("unix", count), "tcp": lambda: echo_round("tcp", count),
                             "tcp_compiled": lambda: compiled_echo_round(count)}
    for kind, run in kinds.items():
        runs = [r for r in (run() for _ in range(rounds)) if r is not None]
        if not runs:
            continue
        best = min(runs, key=lambda r: r["p50_us"])
        best["round_p50_us"] = [r["p50_us"] for r in runs]
        best["round_server_cpu_us"] = [r["server_cpu_us_per_round_trip"] for r in runs]
        out[kind] = best
    return out
