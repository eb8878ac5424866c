"""Processes inside the simulated nodes: dockd daemons, Ray nodes and the per-node agents.

Everything here is started behind ``ip netns exec <node namespace>`` in its
own session (so a Ctrl-C in the terminal reaches only the runner, which then
stops everything in order), with its stderr in a log file of the run's work
directory. Stopping is SIGTERM, then SIGKILL after a grace period; the
topology's teardown kills whatever is still inside the namespaces anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dockd.local import spawn_node

from ..common import REPO_ROOT, spawn_env
from .backends import RAY_NODE0_RESOURCE
from .netns import SimNode, Topology, kill_processes

logger = logging.getLogger(__name__)

STARTED_PIDS: list[int] = []
"""Every daemon and agent this process started (Ray's own processes carry the run's work directory in their
command lines instead); the results list them so a test can check that none outlived the run."""


def _session_prefix(node: SimNode, log: Path) -> list[str]:
    """Run in a new session inside the node's namespace with stderr appended to ``log``; the pid is kept
    (``setsid`` and ``sh -c exec`` replace themselves)."""
    prefix = ["setsid"] if shutil.which("setsid") else []
    return [*prefix, "sh", "-c", 'exec "$@" 2>>"$0"', str(log), *node.exec_prefix]


def log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning("[cluster] pid %d ignored SIGTERM for %.0fs; killing it", proc.pid, grace)
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


class AgentError(RuntimeError):
    """An agent failed a command, died, or did not answer in time."""


class AgentProc:
    """One node agent process and its line protocol (`module`: the agent's, run with -m)."""

    def __init__(self, node: SimNode, workdir: Path, tag: str, *, log_level: str = "WARNING",
                 env_extra: dict[str, str] | None = None, module: str = "benchmarks.multinode.agent") -> None:
        self.node = node
        self.log = workdir / f"agent-node{node.index}.log"
        cmd = [*_session_prefix(node, self.log), sys.executable, "-m", module,
               "--node", str(node.index), "--ip", node.ip, "--run-tag", tag, "--log-level", log_level]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(REPO_ROOT),
                                     env=dict(spawn_env(), **(env_extra or {})), bufsize=0)
        STARTED_PIDS.append(self.proc.pid)
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        except (BrokenPipeError, OSError) as e:
            raise AgentError(f"agent on node {self.node.index} is gone ({e}); its log ends with:\n"
                             f"{log_tail(self.log)}") from None

    def receive(self, timeout: float, what: str = "reply") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError(f"agent on node {self.node.index} sent no {what} within {timeout:g}s; its log ends "
                                 f"with:\n{log_tail(self.log)}")
            if b"\n" not in self._buf:
                if not self._sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    code = self.proc.wait()
                    raise AgentError(f"agent on node {self.node.index} exited with code {code}; its log ends with:\n"
                                     f"{log_tail(self.log)}")
                self._buf += chunk
                continue
            line, self._buf = self._buf.split(b"\n", 1)
            reply = json.loads(line)
            if not reply.get("ok"):
                raise AgentError(f"agent on node {self.node.index}: {reply.get('error')}")
            return reply

    def call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.send(msg)
        return self.receive(timeout, what=f"reply to {msg.get('cmd')}")

    def close(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"cmd": "exit"}, timeout)
            except AgentError as e:
                logger.warning("[cluster] agent on node %d did not exit cleanly: %s", self.node.index, e)
        self._sel.close()
        stop_process(self.proc)


class Agents:
    """The agents of nodes 0..N-1, driven together."""

    def __init__(self, nodes: list[SimNode], workdir: Path, tag: str, *, timeout: float,
                 env_extra: dict[str, str] | None = None, module: str = "benchmarks.multinode.agent") -> None:
        self.agents: list[AgentProc] = []
        try:
            for node in nodes:
                self.agents.append(AgentProc(node, workdir, tag, env_extra=env_extra, module=module))
            for a in self.agents:
                a.receive(timeout, what="hello (start-up)")
        except BaseException:
            self.close()
            raise

    def broadcast(self, msgs: list[dict[str, Any]] | dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """Send to every agent first, then collect every reply (the agents work in parallel)."""
        per = msgs if isinstance(msgs, list) else [msgs] * len(self.agents)
        for a, m in zip(self.agents, per):
            a.send(m)
        return [a.receive(timeout, what=f"reply to {m.get('cmd')}") for a, m in zip(self.agents, per)]

    def __getitem__(self, i: int) -> AgentProc:
        return self.agents[i]

    def __len__(self) -> int:
        return len(self.agents)

    def pids(self) -> list[int]:
        return [a.proc.pid for a in self.agents]

    def close(self) -> None:
        for a in self.agents:
            a.close()
        self.agents = []


def dock_token(workdir: Path) -> dict[str, str]:
    """For dockd builds that authenticate (``dockd serve --token-file``, required to bind beyond loopback):
    a fresh token for this run, in a file only this user can read, as the environment that the daemons and
    the clients read it from (``DOCKD_TOKEN_FILE``). Empty for builds without authentication."""
    from dockd.config import NodeConfig

    if "token_file" not in {f.name for f in dataclasses.fields(NodeConfig)}:
        return {}
    path = workdir / "dock.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return {"DOCKD_TOKEN_FILE": str(path)}


class DockdNodes:
    """``dockd serve`` on every node: node 0 hosts the controller (``replicas``: its --replicas), the others
    join it."""

    def __init__(self, topo: Topology, n: int, workdir: Path, *, capacity: str, timeout: float,
                 env_extra: dict[str, str] | None = None, replicas: int = 1) -> None:
        self.procs: list[subprocess.Popen] = []
        self.ready: list[dict[str, Any]] = []
        env = dict(spawn_env(), PYTHONUNBUFFERED="1", **(env_extra or {}))
        env.setdefault("DOCKD_DAEMON_SECRET", secrets.token_hex(32))  # the daemon role: the daemons only
        common = ["--port", "0", "--grpc-port", "0", "--capacity", capacity, "--log-level", "WARNING"]
        if env_extra and env_extra.get("DOCKD_TOKEN_FILE"):
            common += ["--token-file", env_extra["DOCKD_TOKEN_FILE"]]
        try:
            for node in topo.nodes[:n]:
                log = workdir / f"dockd-node{node.index}.log"
                role = ["--controller", "--replicas", str(replicas)] if node.index == 0 else ["--join", self.controller]
                try:
                    proc, ready = spawn_node(["--host", node.ip, *common, *role], timeout=timeout, env=env,
                                             prefix=_session_prefix(node, log))
                except Exception as e:
                    raise RuntimeError(f"dockd on node {node.index} did not start: {e}\n{log_tail(log)}") from e
                STARTED_PIDS.append(proc.pid)
                self.procs.append(proc)
                self.ready.append(ready)
        except BaseException:
            self.close()
            raise
        logger.info("[cluster] dockd on %d nodes, controller %s", n, self.controller)

    @property
    def controller(self) -> str:
        r = self.ready[0]
        return f"{r['host']}:{r['port']}"

    def warehouse_ids(self) -> list[int]:
        return [int(r["warehouse"]) for r in self.ready]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for p in reversed(self.procs):  # warehouses before the controller they joined
            stop_process(p)
        self.procs = []


class RayNodes:
    """A Ray cluster over the simulated nodes: the head (GCS) on node 0, one raylet per node.

    Each agent then connects as a driver to the raylet of its own node, so
    actor calls travel straight between the worker processes over the
    simulated links, the way Ray actors on separate hosts talk (Ray Client,
    the alternative, proxies every call through one server process on the
    head and was CPU-bound here long before the links were)."""

    PORT = 6379

    def __init__(self, topo: Topology, n: int, workdir: Path, *, object_store_bytes: int, timeout: float) -> None:
        self.ray = str(Path(sys.executable).with_name("ray"))
        if not os.access(self.ray, os.X_OK):
            raise RuntimeError(f"the `ray` command is not next to {sys.executable}; install ray in this environment")
        self.nodes = topo.nodes[:n]
        self.temp_dir = workdir / "ray"
        self.started: list[SimNode] = []
        self.head = f"{self.nodes[0].ip}:{self.PORT}"
        common = ["--disable-usage-stats", f"--object-store-memory={object_store_bytes}"]
        try:
            head = self.nodes[0]
            self._wait([self._start(head, ["--head", f"--port={self.PORT}", f"--temp-dir={self.temp_dir}",
                                           "--num-cpus=1", "--include-dashboard=false",
                                           f"--resources={json.dumps({RAY_NODE0_RESOURCE: 1})}", *common],
                                    workdir)], timeout)
            # one at a time: `ray start` gives a raylet 30 s to register, which several starting at once on two
            # cores can miss
            for node in self.nodes[1:]:
                self._wait([self._start(node, [f"--address={self.head}", "--num-cpus=0", *common], workdir)], timeout)
        except BaseException:
            self.close()
            raise
        logger.info("[cluster] Ray on %d nodes, head %s", n, self.head)

    def _start(self, node: SimNode, args: list[str], workdir: Path) -> tuple[SimNode, subprocess.Popen, Path]:
        log = workdir / f"ray-start-node{node.index}.log"
        self.started.append(node)
        with open(log, "ab") as f:
            proc = subprocess.Popen([*node.exec_prefix, self.ray, "start", f"--node-ip-address={node.ip}", *args],
                                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO_ROOT),
                                    env=spawn_env(), start_new_session=True)
        return node, proc, log

    @staticmethod
    def _wait(started: list[tuple[SimNode, subprocess.Popen, Path]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        errors = []
        for node, proc, log in started:
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                errors.append(f"`ray start` on node {node.index} did not finish within {timeout:g}s:\n{log_tail(log)}")
                continue
            if code != 0:
                errors.append(f"`ray start` on node {node.index} failed ({code}):\n{log_tail(log)}")
        if errors:
            raise RuntimeError("\n".join(errors))

    def close(self) -> None:
        """Stop every Ray process of this cluster: all of them live in the nodes' namespaces, where nothing
        else of this run is left by now. (``ray stop`` is not used: it kills Ray processes by name on the
        whole machine, other users' included.)"""
        if self.started:
            n = kill_processes([node.ns for node in reversed(self.started)], grace=3.0)
            logger.info("[cluster] stopped %d Ray processes", n)
        self.started = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def system_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return float(total - idle), float(total)
