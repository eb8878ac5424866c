"""The daemons under load: controller(s) and warehouses, each its own ``dockd serve`` process.

K = 1 (what dockd supports today): ``dockd serve --controller --no-warehouse``
(the controller alone, so its CPU counter holds controller work only) and W
warehouse daemons that ``--join`` it. Clients connect to the controller and
put to a warehouse of their own (``warehouse=``).

K > 1 (being built): ``dockd serve --controller --controllers HOST:PORT,... --port P
--state-dir DIR`` per controller, and ``dockd.start_local(num_warehouses=N, controllers=K)``.
:func:`multi_controller_support` says whether the installed dockd has either;
when the CLI has ``--controllers`` the K controllers are started that way
(``--no-warehouse`` each, ports picked here) and the warehouses join the first;
when only ``start_local`` has it, that is used, and the controller daemons are
the first K processes it started (they may host warehouses too: the report says
so). Without either, K > 1 is reported as not available and skipped.

``--netns``: every daemon in a network namespace of its own (the multinode
benchmark's ``Topology``: one bridge, links capped high enough not to matter),
the client processes in the warehouses' namespaces. ``pin``: CPU sets per role
(``sched_setaffinity``), so that each daemon gets its own cores where the
machine has enough of them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dockd.local import spawn_node

from ..common import spawn_env

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _serve_help() -> str:
    try:
        out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--help"], capture_output=True, text=True,
                             timeout=60, env=spawn_env())
        return out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        return ""


def multi_controller_support() -> tuple[str | None, str]:
    """(how, why): how is "cli" (``dockd serve --controllers``), "start_local" (``start_local(controllers=)``)
    or None, with a sentence saying what was found."""
    import dockd

    has_local = "controllers" in inspect.signature(dockd.start_local).parameters
    has_cli = "--controllers" in _serve_help()
    if has_cli:
        return "cli", "`dockd serve` has --controllers"
    if has_local:
        return "start_local", "dockd.start_local accepts controllers= (the CLI has no --controllers)"
    return None, ("not available in the installed dockd: dockd.start_local has no `controllers` parameter and "
                  "`dockd serve` has no --controllers option")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_cpus(text: str | None) -> set[int] | None:
    """"0,2-3" -> {0, 2, 3}; None or "" -> None."""
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of ``pid`` (and what it starts later) on ``cpus``."""
    if not cpus:
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError as e:
            logger.warning("[daemons] cannot pin %d to %s: %s", tid, sorted(cpus), e)


class Daemons:
    """The controller(s) and warehouses of one run; ``close`` stops them (warehouses first)."""

    def __init__(self, *, controllers: int, warehouses: int, capacity: str, netns: bool = False,
                 controller_cpus: set[int] | None = None, warehouse_cpus: set[int] | None = None,
                 workdir: Path | None = None, timeout: float = 60.0, listed: bool = False) -> None:
        """`listed`: start even one controller with ``--controllers`` and a ``--state-dir``, as K > 1 are
        (so that K = 1 and K > 1 differ only in K)."""
        self.k = controllers
        self.n_warehouses = warehouses
        self.procs: list[subprocess.Popen] = []
        self.controller_pids: list[int] = []
        self.warehouse_pids: list[int] = []
        self.controller_addresses: list[str] = []
        self.warehouse_ids: list[int] = []
        self.warehouse_addresses: list[str] = []
        self.layout = ""
        self.topo: Any = None
        self.local: Any = None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="dkload-"))
        self.env = dict(spawn_env(), PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET=secrets.token_hex(32))
        self.common = ["--grpc-port", "0", "--capacity", capacity, "--log-level", "WARNING"]
        self.client_env: dict[str, str] = {}
        try:
            if netns:
                from ..multinode.cluster import dock_token

                self.client_env = dock_token(self.workdir)  # daemons on a bridge address need a token
                self.env.update(self.client_env)
                self.common += ["--token-file", self.client_env["DOCKD_TOKEN_FILE"]]
                self._build_netns()
            how = None
            if controllers > 1 or listed:
                how, why = multi_controller_support()
                if how is None:
                    raise RuntimeError(why)
            if how == "start_local":
                if netns:
                    raise RuntimeError("K > 1 through start_local runs on loopback only; drop --netns")
                self._start_with_start_local()
            else:
                self._start_controllers(cli_multi=how == "cli")
                self._start_warehouses()
            for pid in self.controller_pids:
                pin(pid, controller_cpus)
            for pid in self.warehouse_pids:
                pin(pid, warehouse_cpus)
        except BaseException:
            self.close()
            raise

    # -- namespaces -------------------------------------------------------------------------
    def _build_netns(self) -> None:
        from ..multinode.netns import Topology, cleanup_leftovers, missing_privileges, new_tag

        reason = missing_privileges("dkld")
        if reason:
            raise RuntimeError(f"--netns: {reason}")
        cleanup_leftovers("dkld")
        self.topo = Topology(self.k + self.n_warehouses, 100_000.0, tag=new_tag("dkld"), latency_ms=50.0).create()

    def _node(self, i: int) -> tuple[str, list[str]]:
        """(host, command prefix) of simulated node i (controllers first, then warehouses)."""
        if self.topo is None:
            return "127.0.0.1", []
        node = self.topo.nodes[i]
        return node.ip, node.exec_prefix

    def client_prefix(self, j: int) -> list[str]:
        """Command prefix for client process j: the namespace of the warehouse it puts to."""
        if self.topo is None:
            return []
        return self.topo.nodes[self.k + j % self.n_warehouses].exec_prefix

    # -- daemons ----------------------------------------------------------------------------
    def _spawn(self, args: list[str], prefix: list[str], name: str) -> dict[str, Any]:
        log = self.workdir / f"{name}.log"
        sh = ["sh", "-c", 'exec "$@" 2>>"$0"', str(log), *prefix]
        proc, ready = spawn_node(args, env=self.env, prefix=sh)
        self.procs.append(proc)
        ready["pid"] = proc.pid
        return ready

    def _start_controllers(self, *, cli_multi: bool) -> None:
        hosts = [self._node(i)[0] for i in range(self.k)]
        if cli_multi:
            ports = [_free_port(h) if self.topo is None else 7450 for h in hosts]
            peers = ",".join(f"{h}:{p}" for h, p in zip(hosts, ports))
            for i in range(self.k):
                state = self.workdir / f"controller{i}-state"
                state.mkdir(parents=True, exist_ok=True)
                r = self._spawn(["--host", hosts[i], "--port", str(ports[i]), *self.common, "--controller",
                                 "--no-warehouse", "--controllers", peers, "--state-dir", str(state)],
                                self._node(i)[1], f"controller{i}")
                self.controller_pids.append(r["pid"])
                self.controller_addresses.append(f"{r['host']}:{r['port']}")
            self.layout = f"{self.k} controllers (`dockd serve --controllers`, no warehouse each)"
        else:
            r = self._spawn(["--host", hosts[0], "--port", "0", *self.common, "--controller", "--no-warehouse"],
                            self._node(0)[1], "controller0")
            self.controller_pids.append(r["pid"])
            self.controller_addresses.append(f"{r['host']}:{r['port']}")
            self.layout = "1 controller (`dockd serve --controller --no-warehouse`)"

    def _start_warehouses(self) -> None:
        for j in range(self.n_warehouses):
            host, prefix = self._node(self.k + j)
            r = self._spawn(["--host", host, "--port", "0", *self.common, "--join", self.controller_addresses[0]],
                            prefix, f"warehouse{j}")
            self.warehouse_pids.append(r["pid"])
            self.warehouse_addresses.append(f"{r['host']}:{r['port']}")
            self.warehouse_ids.append(int(r["warehouse"]) if "warehouse" in r else j)
        self.layout += f" + {self.n_warehouses} warehouse daemon(s)"

    def _start_with_start_local(self) -> None:
        import dockd

        self.local = dockd.start_local(num_warehouses=self.n_warehouses, controllers=self.k)  # type: ignore[call-arg]
        pids = [p.pid for p in self.local.procs]
        self.controller_pids = pids[: self.k]
        self.warehouse_pids = pids[self.k:]
        self.controller_addresses = [self.local.address]
        self.warehouse_addresses = list(self.local.warehouses)[-self.n_warehouses:]
        self.warehouse_ids = list(range(self.n_warehouses))
        self.layout = (f"dockd.start_local(num_warehouses={self.n_warehouses}, controllers={self.k}); the first "
                       f"{self.k} processes counted as the controllers (they may host warehouses too)")

    @property
    def address(self) -> str:
        return self.controller_addresses[0]

    def close(self) -> None:
        from ..multinode.cluster import stop_process

        if self.local is not None:
            self.local.close()
            self.local = None
        for p in reversed(self.procs):
            stop_process(p)
        self.procs = []
        if self.topo is not None:
            self.topo.destroy()
            self.topo = None
