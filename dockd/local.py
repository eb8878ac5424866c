"""The embedded default: real `dockd serve` processes on loopback, no configuration.

    with dockd.start_local(num_warehouses=2) as cluster:
        dock = dockd.connect(cluster.address)

Node 0 hosts the controller and a warehouse; nodes 1..N-1 are warehouses that
join it. Ports are picked by the daemons and read from their ready lines. With
`controllers=K`, nodes 0..K-1 each host one of K controllers (and a warehouse)
that share the metadata (dockd.owners); they listen on free ports picked here,
since each must know the others' addresses when it starts.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence

from dockd import owners
from dockd.config import parse_size
from dockd.errors import DockConnectionError, DockValueError

logger = logging.getLogger(__name__)


class LocalCluster:
    """Daemons started by `start_local`; closing it stops them (terminate, then kill)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[dict] = []
        self.controllers: list[str] = []  # the controllers' "host:port", the dock's order (node 0's first)
        self._finalizer = weakref.finalize(self, _stop_all, self.procs)

    @property
    def address(self) -> str:
        """The controller's "host:port"; pass it to dockd.connect()."""
        n = self.nodes[0]
        return f"{n['host']}:{n['port']}"

    @property
    def warehouses(self) -> list[str]:
        return [f"{n['host']}:{n['port']}" for n in self.nodes]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalCluster(address={self.address!r}, warehouses={len(self.nodes)})"


def _stop_all(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """Stop warehouses before the controller they joined, each SIGTERM then SIGKILL."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("[local] daemon pid=%d ignored SIGTERM for %.0fs; killing it", p.pid, grace)
                p.kill()
                p.wait()
        if p.stdout:
            p.stdout.close()


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free on `host` right now (held open together while they are picked)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn_node(args: list[str], *, timeout: float = 60.0, env: dict | None = None,
               prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, dict]:
    """Start `dockd serve ARGS` (behind a `prefix` such as `ip netns exec NS`) and wait for
    its ready line; fails fast if it exits."""
    cmd = [*prefix, sys.executable, "-m", "dockd", "serve", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    return proc, read_ready(proc, timeout=timeout)


def read_ready(proc: subprocess.Popen, *, timeout: float = 60.0) -> dict:
    """Wait for the JSON ready line of a `dockd serve` process started with stdout=PIPE
    (a warehouse prints it once it has joined its controller); fails fast if it exits."""
    cmd = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    out = proc.stdout
    assert out is not None  # (started with stdout=PIPE)
    sel = selectors.DefaultSelector()
    sel.register(out, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            proc.kill()
            proc.wait()
            out.close()
            raise DockConnectionError(f"`{' '.join(cmd)}` did not report ready within {timeout:g}s")
        chunk = out.readline()
        if not chunk:
            code = proc.wait()
            out.close()
            raise DockConnectionError(f"`{' '.join(cmd)}` exited unexpectedly with code {code} before it was ready (see its stderr above)")
        line += chunk
    sel.close()
    return json.loads(line)


def start_local(num_warehouses: int = 1, *, capacity: int | str = "4GiB", lease_timeout: float | None = None,
                host: str = "127.0.0.1", log_level: str = "WARNING", timeout: float = 60.0,
                token_file: str | None = None, extra_args: list[str] | None = None,
                controllers: int = 1, replicas: int = 1, shards: dict[str, int] | None = None) -> LocalCluster:
    """Start a controller and `num_warehouses` warehouses as local processes.

    `controllers=K` (at most num_warehouses): the first K daemons each host one of K
    controllers that share the dock's partitions (dockd.owners); `LocalCluster.controllers`
    lists their addresses. Clients connect to any of them (`cluster.address` is the first).
    `replicas=2`: each put's values are kept on two warehouses (`dockd serve --replicas 2`).
    `shards={"name": S}`: partition `name` is spread over S of the controllers (`dockd serve --shards
    name=S` on each; needs controllers >= S).

    Without `token_file` clients need no token (loopback only); the daemons still
    share a per-dock secret, handed to them here, that proves the daemon role to
    each other, so a client cannot send daemon-to-daemon messages."""
    if not isinstance(num_warehouses, int) or num_warehouses < 1:
        raise DockValueError(f"num_warehouses must be a positive int, got {num_warehouses!r}")
    if not isinstance(controllers, int) or not 1 <= controllers <= num_warehouses:
        raise DockValueError(f"controllers must be an int in 1..num_warehouses ({num_warehouses}), got {controllers!r}")
    ctl = ["--replicas", str(replicas)] if replicas != 1 else []
    if shards:
        if controllers < max(shards.values()):
            raise DockValueError(f"shards={shards!r} spreads a partition over {max(shards.values())} controllers, one "
                                 f"shard on each: start_local needs controllers >= {max(shards.values())}, got "
                                 f"{controllers}")
        listed = ",".join(f"{name}={count}" for name, count in shards.items())
        owners.check_shards(owners.parse_shards(listed), controllers)  # (checked here, before any daemon starts)
        ctl += ["--shards", listed]
    cap = parse_size(capacity)
    common = ["--host", host, "--port", "0", "--grpc-port", "0", "--capacity", str(cap), "--log-level", log_level]
    if lease_timeout is not None:
        common += ["--lease-timeout", str(lease_timeout)]
    if token_file is not None:
        common += ["--token-file", str(token_file)]
    common += list(extra_args or ())
    cluster = LocalCluster()
    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET=secrets.token_hex(32))
    try:
        if controllers == 1:
            proc, ready = spawn_node([*common, "--controller", *ctl], timeout=timeout, env=env)
            cluster.procs.append(proc)
            cluster.nodes.append(ready)
            cluster.controllers.append(cluster.address)
        else:
            ports = free_ports(host, controllers)
            cluster.controllers = [f"{host}:{p}" for p in ports]
            listed = ",".join(cluster.controllers)
            for port in ports:  # (each numbers its own warehouse; they register with one another in the background)
                args = list(common)
                args[args.index("--port") + 1] = str(port)
                proc, ready = spawn_node([*args, "--controller", "--controllers", listed, *ctl], timeout=timeout,
                                         env=env)
                cluster.procs.append(proc)
                cluster.nodes.append(ready)
        for _ in range(num_warehouses - controllers):
            proc, ready = spawn_node([*common, "--join", cluster.address], timeout=timeout, env=env)
            cluster.procs.append(proc)
            cluster.nodes.append(ready)
    except BaseException:
        cluster.close()
        raise
    logger.info("[local] started controller=%s warehouses=%d", cluster.address, num_warehouses)
    return cluster

