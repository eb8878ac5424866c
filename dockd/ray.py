"""Run a dock on a Ray cluster: one warehouse per Ray node, found by name from anywhere.

    import ray, dockd.ray
    ray.init()
    address = dockd.ray.launch(capacity="64GiB")      # controller + one warehouse per node
    dock = dockd.ray.connect()                         # in the driver or any Ray task/actor:
    dock.put({"x": [...]}, partition="step-0")         # puts go to this node's warehouse
    dockd.ray.shutdown()

Actor layout, in the Ray namespace given as ``namespace`` (default ``"dockd"``):

    dockd-controller              node 0 (the node `launch` is called from, else the head):
                                  owns `dockd serve --controller`, which is also node 0's warehouse
    dockd-warehouse-<node_id>     every other alive node: owns `dockd serve --join CONTROLLER`
    dockd-watcher                 polls ``ray.nodes()`` and starts a warehouse actor on every
                                  alive node that has none (nodes that join later, replacements)

Every daemon actor is a small detached actor (``num_cpus=0.01`` by default, hard node
affinity) that runs its daemon as a child process with `dockd.local.spawn_node` and
binds it on its node's IP (``ray.util.get_node_ip_address()``). Actor and daemon live
and die together:

- the daemon is started through a tiny exec wrapper that sets
  ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` before it becomes ``python -m dockd serve``, so
  the kernel kills it when its actor's process ends, however it ends (``ray.kill``
  sends SIGKILL; a node's raylet may too). Linux only; elsewhere `shutdown` is the
  only thing that stops the daemons.
- a monitor thread in the actor waits on the daemon; if the daemon exits without
  being asked to, the actor's process exits too, which frees the actor's name, and
  the watcher starts a fresh warehouse on that node at its next poll. If the
  controller's actor dies, `find` returns None and the watcher stops; the next
  `launch` starts a new controller and replaces the warehouses that belonged to
  the old one.

Actors are detached: the dock outlives the driver that launched it, and every
process of the Ray cluster finds it by name (`find`, `connect`). Daemons bind
their node's address, so the dock needs a token: `launch` draws a random one,
each daemon actor keeps it in a private file for its daemon (``--token-file``),
and Ray processes get it from the controller's actor (`token`): a dock launched
on Ray trusts the processes of that Ray cluster, and nobody else. A second random
token, the daemon token (``--daemon-token-file``), proves the daemon role between
the daemons; `token()` and `connect()` never hand it out. Ray must already
be initialised (``ray.init``) in the calling process. Ray is imported on first use,
so ``import dockd`` and ``import dockd.ray`` work without it (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from types import ModuleType
from typing import Any

import dockd
from dockd.config import parse_size
from dockd.errors import DockConnectionError, DockValueError

logger = logging.getLogger(__name__)

__all__ = [
    "CONTROLLER_NAME",
    "WAREHOUSE_PREFIX",
    "WATCHER_NAME",
    "connect",
    "find",
    "find_or_launch",
    "home_for",
    "launch",
    "ray_initialized",
    "shutdown",
    "token",
    "warehouses",
]

CONTROLLER_NAME = "dockd-controller"
"""Name of the actor that owns the controller daemon (node 0's warehouse too)."""
WAREHOUSE_PREFIX = "dockd-warehouse-"
"""Prefix of the warehouse actors' names; the Ray node id follows."""
WATCHER_NAME = "dockd-watcher"
"""Name of the actor that starts warehouses on nodes that join later."""

_PR_SET_PDEATHSIG = 1
# Run as `python -c CODE PARENT_PID PROGRAM ARGS...`: arm "kill me when my parent dies",
# make sure the parent did not die before that, then become PROGRAM. The setting survives
# execve, so it holds for the daemon itself.
_DEATH_TIE = (
    "import ctypes, os, signal, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({_PR_SET_PDEATHSIG}, int(signal.SIGKILL), 0, 0, 0) != 0:\n"
    "    sys.exit('dockd.ray: prctl(PR_SET_PDEATHSIG) failed: errno %d' % ctypes.get_errno())\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('dockd.ray: the owning actor exited before its daemon started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


# -- Ray, imported on first use ----------------------------------------------------------
def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"dockd.ray needs Ray, which could not be imported ({exc}). Install it with: "
            "pip install -e '.[ray]' from the root of a dockd checkout"
        ) from exc
    return ray


def _initialized_ray(what: str) -> ModuleType:
    ray = _ray()
    if not ray.is_initialized():
        raise RuntimeError(
            f"dockd.ray.{what} needs a connected Ray: call ray.init() (or ray.init(address=...)) "
            "in this process first"
        )
    return ray


_actor_classes: dict[str, Any] = {}


def _remote(cls: type) -> Any:
    """`ray.remote(cls)`, made once per process."""
    remote = _actor_classes.get(cls.__name__)
    if remote is None:
        remote = _actor_classes[cls.__name__] = _ray().remote(cls)
    return remote


def _named(namespace: str) -> set[str]:
    """Names of the live named actors in `namespace`."""
    ray = _ray()
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def _get_actor(name: str, namespace: str) -> Any | None:
    try:
        return _ray().get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in _ray().nodes() if n.get("Alive")]


def _wait_unnamed(namespace: str, names: set[str], timeout: float) -> set[str]:
    """Wait until none of `names` is a live actor of `namespace`; the ones still there."""
    deadline = time.monotonic() + timeout
    while (left := names & _named(namespace)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _warehouse_name(node_id: str) -> str:
    return f"{WAREHOUSE_PREFIX}{node_id}"


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- the actors --------------------------------------------------------------------------
class _DaemonActor:
    """Owns one `dockd serve` process on its node (a Ray actor; see the module docstring)."""

    def __init__(self, role: str, node_id: str) -> None:
        here = _ray().get_runtime_context().get_node_id()
        if here != node_id:  # cannot happen with hard node affinity; guards the one-per-node layout
            raise RuntimeError(f"dockd {role} actor meant for Ray node {node_id} was placed on node {here}")
        self._role = role
        self._node_id = here
        self._proc: subprocess.Popen | None = None
        self._ready: dict[str, Any] = {}
        self._joined = ""  # the controller this daemon belongs to
        self._token = ""
        self._daemon_token = ""
        self._stopping = False
        self._lock = threading.Lock()

    def start(self, args: list[str], timeout: float, token: str = "", daemon_token: str = "") -> dict[str, Any]:
        """Start the daemon with `args` (bound on this node's IP) unless it runs already; its info."""
        from dockd.local import spawn_node

        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._info()
            ray = _ray()
            host = ray.util.get_node_ip_address()
            self._stopping = False
            if token:
                self._token = token
                args = [*args, "--token-file", self._token_file(token)]
            if daemon_token:
                self._daemon_token = daemon_token
                args = [*args, "--daemon-token-file", self._token_file(daemon_token)]
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            # Forked from the actor's main thread, where Ray runs a default (max_concurrency=1)
            # actor's methods: PR_SET_PDEATHSIG fires when the forking *thread* ends, and that
            # thread lives as long as the actor's process.
            proc, ready = spawn_node(["--host", host, *args], timeout=timeout, env=env, prefix=_death_tie_prefix())
            self._proc, self._ready = proc, ready
            self._joined = args[args.index("--join") + 1] if "--join" in args else self._address()
            threading.Thread(target=self._monitor, args=(proc,), name="dockd-daemon-monitor", daemon=True).start()
            logger.info("[ray] started %s node=%s address=%s pid=%d warehouse=%s", self._role, self._node_id,
                        self._address(), proc.pid, ready.get("warehouse"))
            return self._info()

    def token(self) -> str:
        """The dock's token (Ray processes of this cluster are trusted with it)."""
        return self._token

    def daemon_token(self) -> str:
        """The token the dock's daemons prove to each other (for warehouses started later; clients
        never get it)."""
        return self._daemon_token

    def _token_file(self, token: str) -> str:
        import tempfile

        folder = tempfile.mkdtemp(prefix="dockd-ray-")  # mode 700
        path = os.path.join(folder, "token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)
        return path

    def address(self) -> str | None:
        """The daemon's "host:port" while it runs, else None."""
        with self._lock:
            return self._address() if self._running() else None

    def info(self) -> dict[str, Any]:
        """Role, node, address, process ids and state of the daemon."""
        with self._lock:
            return self._info()

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop the daemon (SIGTERM, then SIGKILL after `grace` seconds); its exit code."""
        with self._lock:
            self._stopping = True
            proc = self._proc
            if proc is None:
                return None
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    logger.warning("[ray] %s daemon pid=%d ignored SIGTERM for %.0fs; killing it",
                                   self._role, proc.pid, grace)
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            logger.info("[ray] stopped %s node=%s pid=%d code=%s", self._role, self._node_id, proc.pid,
                        proc.returncode)
            return proc.returncode

    # -- helpers (called with the lock held) --
    def _running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _address(self) -> str:
        return _format_address(self._ready["host"], int(self._ready["port"]))

    def _info(self) -> dict[str, Any]:
        proc = self._proc
        return {
            "role": self._role,
            "node_id": self._node_id,
            "address": self._address() if self._ready else None,
            "grpc_port": self._ready.get("grpc_port"),
            "warehouse": self._ready.get("warehouse"),
            "controller": self._joined or None,
            "pid": proc.pid if proc is not None else None,
            "actor_pid": os.getpid(),
            "running": self._running(),
            "exit_code": proc.poll() if proc is not None else None,
        }

    def _monitor(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping or proc is not self._proc:
            return
        logger.error("[ray] %s daemon exited unexpectedly node=%s pid=%d code=%d; ending its actor so that "
                     "the dock notices (see the daemon's messages above in this worker's log)",
                     self._role, self._node_id, proc.pid, code)
        sys.stderr.flush()
        os._exit(1)


def _death_tie_prefix() -> list[str]:
    """The `spawn_node` prefix that kills the daemon when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        logger.warning("[ray] PR_SET_PDEATHSIG is Linux-only: on %s a daemon outlives its actor if the actor is "
                       "killed; stop the dock with dockd.ray.shutdown()", sys.platform)
        return []
    return [sys.executable, "-I", "-c", _DEATH_TIE, str(os.getpid())]


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What a warehouse needs to join the dock (passed to the watcher)."""

    namespace: str
    args: tuple[str, ...]  # `dockd serve` arguments shared by every daemon, without --host and role
    controller: str
    controller_node: str
    timeout: float
    num_cpus: float
    token: str = dataclasses.field(default="", repr=False)
    daemon_token: str = dataclasses.field(default="", repr=False)


class _Watcher:
    """Starts a warehouse on every alive node without one, every `interval` seconds (a Ray actor)."""

    def __init__(self) -> None:
        self._spec: _Spec | None = None
        self._interval = 2.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._polls = 0
        self._started: list[str] = []
        self._last_error = ""

    def start(self, spec: _Spec, interval: float) -> bool:
        """Begin polling (no-op if already polling for the same controller); True if a loop started."""
        if self._thread is not None and self._thread.is_alive():
            if self._spec == spec:
                return False
            self.stop()
        self._spec, self._interval = spec, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(spec, interval, self._stop),
                                        name="dockd-node-watcher", daemon=True)
        self._thread.start()
        logger.info("[ray] watcher started namespace=%s interval=%.1fs controller=%s",
                    spec.namespace, interval, spec.controller)
        return True

    def stop(self) -> None:
        """Stop polling (waits for a poll in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def status(self) -> dict[str, Any]:
        return {
            "running": self._thread is not None and self._thread.is_alive(),
            "polls": self._polls,
            "started": list(self._started),
            "last_error": self._last_error,
        }

    def _loop(self, spec: _Spec, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            try:
                names = _named(spec.namespace)
                if CONTROLLER_NAME not in names:
                    logger.warning("[ray] watcher: the controller actor is gone namespace=%s; no more warehouses "
                                   "are started (dockd.ray.launch() starts a new dock)", spec.namespace)
                    return
                started = _ensure_warehouses(spec, names=names, strict=False)
                self._started.extend(started)
                self._polls += 1
            except _ControllerGone:
                logger.warning("[ray] watcher: controller=%s no longer runs namespace=%s; no more warehouses are "
                               "started for it", spec.controller, spec.namespace)
                return
            except Exception as exc:  # keep watching: a failed poll is retried at the next one
                self._last_error = f"{type(exc).__name__}: {exc}"
                logger.warning("[ray] watcher poll failed namespace=%s error=%s", spec.namespace, self._last_error)


# -- starting daemons ----------------------------------------------------------------------
def _daemon_actor(namespace: str, name: str, role: str, node: dict[str, Any], num_cpus: float) -> Any:
    """The named daemon actor on `node` (created if missing, found if another caller made it)."""
    _ray()  # the ImportError hint if Ray is missing
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node["NodeID"]
    cpus = min(num_cpus, float(node.get("Resources", {}).get("CPU", 0.0)))  # fits nodes without CPUs too
    return _remote(_DaemonActor).options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=cpus,
        max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(role, node_id)


def _start_failure(role: str, node_id: str, exc: BaseException, timeout: float) -> str:
    ray = _ray()
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        why = (f"its actor was not running within {timeout:g}s (is the node out of the requested CPU? "
               "pass num_cpus=0 to launch())")
    else:
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return (f"could not start the dockd {role} on Ray node {node_id}: {why}. The daemon's own messages are in "
            "that node's Ray worker logs (`ray logs`, or /tmp/ray/session_latest/logs/worker-*.err there)")


def _kill(actor: Any) -> None:
    try:
        _ray().kill(actor, no_restart=True)
    except Exception as exc:  # already gone
        logger.debug("[ray] kill: %s", exc)


class _ControllerGone(Exception):
    """The controller a watcher starts warehouses for is no longer the namespace's controller."""


def _ensure_warehouses(spec: _Spec, *, names: set[str] | None = None, strict: bool) -> list[str]:
    """Start a warehouse actor on every alive node that has none; the node ids started on.

    strict: raise DockConnectionError if a node that is still alive failed (else log it
    and leave the node for the next call).
    """
    ray = _ray()
    names = _named(spec.namespace) if names is None else names
    todo = [n for n in _alive_nodes()
            if n["NodeID"] != spec.controller_node and _warehouse_name(n["NodeID"]) not in names]
    if not todo:
        return []
    if not strict and find(spec.namespace, timeout=spec.timeout) != spec.controller:
        raise _ControllerGone(spec.controller)  # the watcher must not join warehouses to a dead controller
    args = [*spec.args, "--join", spec.controller]
    pending: dict[str, tuple[Any, Any]] = {}
    failed: dict[str, str] = {}
    for node in todo:
        nid = node["NodeID"]
        try:
            actor = _daemon_actor(spec.namespace, _warehouse_name(nid), "warehouse", node, spec.num_cpus)
            pending[nid] = (actor, actor.start.remote(args, spec.timeout, spec.token, spec.daemon_token))
        except ValueError as exc:  # the name still belongs to an actor that is dying
            failed[nid] = str(exc)
    deadline = time.monotonic() + spec.timeout + 30.0  # the actor's own start-up, then the daemon's
    started: list[str] = []
    for nid, (actor, ref) in pending.items():
        try:
            info = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except Exception as exc:
            _kill(actor)  # frees the name, so that the next attempt starts clean
            failed[nid] = _start_failure("warehouse", nid, exc, spec.timeout)
            continue
        started.append(nid)
        logger.info("[ray] started warehouse node=%s address=%s warehouse=%s", nid, info["address"],
                    info["warehouse"])
    if failed:
        alive = {n["NodeID"] for n in _alive_nodes()}
        for nid in [nid for nid in failed if nid not in alive]:
            logger.info("[ray] node=%s left the cluster while its warehouse started; skipped", nid)
            del failed[nid]
    if failed:
        if strict:
            raise DockConnectionError("; ".join(failed.values()))
        for nid, why in failed.items():
            logger.warning("[ray] warehouse not started node=%s (retried at the next poll): %s", nid, why)
    return started


def _retire_stale_warehouses(spec: _Spec) -> None:
    """Stop warehouse actors left over from an earlier controller of this namespace (one that
    died), so that `_ensure_warehouses` gives their nodes warehouses of the new dock."""
    ray = _ray()
    stale = [(node_id, info) for node_id, info in warehouses(spec.namespace, timeout=spec.timeout).items()
             if info["role"] == "warehouse" and info["controller"] != spec.controller]
    if not stale:
        return
    for node_id, info in stale:
        logger.warning("[ray] replacing warehouse node=%s address=%s: it belongs to controller=%s, not %s",
                       node_id, info["address"], info["controller"], spec.controller)
        actor = _get_actor(_warehouse_name(node_id), spec.namespace)
        if actor is None:
            continue
        try:
            ray.get(actor.stop.remote(), timeout=spec.timeout)
        except Exception as exc:  # killing the actor kills its daemon too
            logger.info("[ray] stale warehouse node=%s did not stop cleanly (%s)", node_id, type(exc).__name__)
        _kill(actor)
    _wait_unnamed(spec.namespace, {_warehouse_name(node_id) for node_id, _ in stale}, spec.timeout)


def _start_controller(namespace: str, node: dict[str, Any], args: list[str], num_cpus: float,
                      timeout: float, token: str, daemon_token: str) -> dict[str, Any]:
    """Start (or find started) the controller actor and its daemon on `node`; the daemon's info."""
    ray = _ray()
    for attempt in (1, 2):
        controller = _daemon_actor(namespace, CONTROLLER_NAME, "controller", node, num_cpus)
        try:
            return ray.get(controller.start.remote(args, timeout, token, daemon_token), timeout=timeout + 30.0)
        except ray.exceptions.RayActorError as exc:  # found a controller actor that was dying: once more
            if attempt == 2:
                raise DockConnectionError(_start_failure("controller", node["NodeID"], exc, timeout)) from exc
            logger.info("[ray] the controller actor found was dying namespace=%s; starting a new one", namespace)
            _wait_unnamed(namespace, {CONTROLLER_NAME}, timeout)
        except Exception as exc:
            _kill(controller)
            raise DockConnectionError(_start_failure("controller", node["NodeID"], exc, timeout)) from exc
    raise AssertionError("unreachable")


def _node_zero() -> dict[str, Any]:
    """The node `launch` runs on, else the head node."""
    ray = _ray()
    nodes = _alive_nodes()
    if not nodes:
        raise DockConnectionError("the Ray cluster reports no alive node")
    here = ray.get_runtime_context().get_node_id()
    for n in nodes:
        if n["NodeID"] == here:
            return n
    for n in nodes:
        if "node:__internal_head__" in n.get("Resources", {}):
            return n
    return nodes[0]


# -- public API ----------------------------------------------------------------------------
def launch(
    capacity: int | str = "8GiB",
    *,
    namespace: str = "dockd",
    lease_timeout: float | None = None,
    port: int = 0,
    watch: bool = True,
    watch_interval: float = 2.0,
    num_cpus: float = 0.01,
    shm: bool = True,
    log_level: str = "WARNING",
    timeout: float = 120.0,
) -> str:
    """Start a dock on the Ray cluster (or find the one running); its controller's "host:port".

    Starts the controller on node 0 (this process's node, else the head) and one
    warehouse on every other alive node, each owned by a detached named actor (see the
    module docstring). If a dock already runs in `namespace`, returns its address and
    starts nothing.

    Args:
        capacity: bytes each warehouse holds before puts wait ("64GiB", "512MiB", an int).
        namespace: the Ray namespace of the dock's actors; one dock per namespace.
        lease_timeout: seconds a leased sample waits for its fetch (daemon default if None).
        port: the framed data port of every daemon (it must be free on every node); 0 lets
            each daemon pick a free one, which several Ray nodes on one machine need.
        watch: start a watcher that gives nodes joining later a warehouse.
        watch_interval: seconds between the watcher's polls of ``ray.nodes()``.
        num_cpus: Ray CPUs each daemon actor reserves on its node (at most what the node
            has). 0.01 keeps it out of the way of fractional requests; use 0 if whole-CPU
            actors must fill every CPU of a node.
        shm: serve same-host clients over shared memory (False: TCP only, ``--no-shm``).
        log_level: the daemons' log level; their logs go to the Ray worker logs.
        timeout: seconds each daemon may take to report ready.
    """
    ray = _initialized_ray("launch")
    cap = parse_size(capacity)
    if cap <= 0:
        raise DockValueError(f"capacity must be positive, got {capacity!r}")
    if lease_timeout is not None and lease_timeout <= 0:
        raise DockValueError(f"lease_timeout must be a positive number of seconds, got {lease_timeout!r}")
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise DockValueError(f"port must be an int in 0..65535, got {port!r}")
    if watch_interval <= 0 or num_cpus < 0 or timeout <= 0:
        raise DockValueError("watch_interval and timeout must be positive, num_cpus must be >= 0")
    existing = find(namespace)
    if existing is not None:
        logger.info("[ray] dock already running namespace=%s address=%s", namespace, existing)
        return existing

    args = ["--port", str(port), "--grpc-port", "0", "--capacity", str(cap), "--log-level", log_level]
    if lease_timeout is not None:
        args += ["--lease-timeout", str(lease_timeout)]
    if not shm:
        args.append("--no-shm")
    node0 = _node_zero()
    t0 = time.monotonic()
    token, daemon_token = secrets.token_hex(32), secrets.token_hex(32)
    info = _start_controller(namespace, node0, [*args, "--controller"], num_cpus, timeout, token, daemon_token)
    address: str = info["address"]
    # another launch may have started this controller first: warehouses join whichever runs, with its tokens
    controller = _get_actor(CONTROLLER_NAME, namespace)
    token, daemon_token = ray.get([controller.token.remote(), controller.daemon_token.remote()], timeout=timeout)
    spec = _Spec(namespace=namespace, args=tuple(args), controller=address, controller_node=info["node_id"],
                 timeout=timeout, num_cpus=num_cpus, token=token, daemon_token=daemon_token)
    logger.info("[ray] started controller node=%s address=%s namespace=%s", info["node_id"], address, namespace)
    try:
        _retire_stale_warehouses(spec)
        _ensure_warehouses(spec, strict=True)
        if watch:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            watcher = _remote(_Watcher).options(
                name=WATCHER_NAME, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
                max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(info["node_id"], soft=True),
            ).remote()
            ray.get(watcher.start.remote(spec, watch_interval), timeout=timeout + 30.0)
    except BaseException:
        logger.error("[ray] launch failed namespace=%s; stopping what it started", namespace)
        shutdown(namespace)
        raise
    logger.info("[ray] dock ready namespace=%s address=%s nodes=%d watch=%s in %.1fs", namespace, address,
                len(_alive_nodes()), watch, time.monotonic() - t0)
    return address


def find(namespace: str = "dockd", *, timeout: float = 60.0) -> str | None:
    """The address of the dock running in `namespace`, or None if there is none."""
    ray = _initialized_ray("find")
    actor = _get_actor(CONTROLLER_NAME, namespace)
    if actor is None:
        return None
    try:
        return ray.get(actor.address.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        logger.warning("[ray] the controller actor did not answer within %gs namespace=%s", timeout, namespace)
        return None
    except ray.exceptions.RayActorError:  # died or is being killed
        return None


def warehouses(namespace: str = "dockd", *, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Every daemon of the dock in `namespace` by Ray node id, the controller's (node 0's
    warehouse) included: role, address, warehouse id, the controller it belongs to, pids,
    running."""
    ray = _initialized_ray("warehouses")
    names = sorted(n for n in _named(namespace) if n == CONTROLLER_NAME or n.startswith(WAREHOUSE_PREFIX))
    refs = []
    for name in names:
        actor = _get_actor(name, namespace)
        if actor is not None:
            refs.append(actor.info.remote())
    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    for ref in refs:
        try:
            info = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue
        out[info["node_id"]] = info
    return out


def token(namespace: str = "dockd", *, timeout: float = 60.0) -> str | None:
    """The token of the dock running in `namespace` (None if none runs)."""
    ray = _initialized_ray("token")
    actor = _get_actor(CONTROLLER_NAME, namespace)
    if actor is None:
        return None
    try:
        return ray.get(actor.token.remote(), timeout=timeout) or None
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def _node_warehouse(namespace: str) -> str | None:
    """The "host:port" of the warehouse on this process's Ray node, or None."""
    ray = _ray()
    node_id = ray.get_runtime_context().get_node_id()
    actor = _get_actor(_warehouse_name(node_id), namespace)
    if actor is not None:
        try:
            return ray.get(actor.address.remote(), timeout=30.0)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None
    controller = _get_actor(CONTROLLER_NAME, namespace)
    if controller is None:
        return None
    try:
        info = ray.get(controller.info.remote(), timeout=30.0)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
    return info["address"] if info["node_id"] == node_id and info["running"] else None


def connect(address: str | None = None, *, namespace: str = "dockd", **kwargs: Any) -> dockd.Dock:
    """Connect to the dock from a driver or any Ray task/actor; puts go to this node's warehouse.

    Args:
        address: the controller's "host:port"; default: the dock running in `namespace`.
        namespace: the Ray namespace the dock was launched in.
        kwargs: passed to `dockd.connect`. An explicit ``warehouse=`` (or ``$DOCKD_WAREHOUSE``)
            wins over this node's warehouse.
    """
    _initialized_ray("connect")
    running = find(namespace)
    if address is None:
        if running is None:
            raise DockConnectionError(
                f"no dock is running in Ray namespace {namespace!r}: start one with dockd.ray.launch() "
                "(or pass address='host:port' of a dock started another way)"
            )
        address = running
    if address == running and kwargs.get("token") is None:
        kwargs["token"] = token(namespace)
    if kwargs.get("warehouse") is None and not os.environ.get("DOCKD_WAREHOUSE") and address == running:
        home = _node_warehouse(namespace)
        if home is not None:
            kwargs["warehouse"] = home
        else:
            logger.info("[ray] no warehouse on this node yet namespace=%s; dockd picks one", namespace)
    return dockd.connect(address, **kwargs)


def home_for(address: str, namespace: str = "dockd") -> tuple[str | None, str | None]:
    """For `dockd.connect` inside a Ray process, when the dock at `address` is the one `launch`
    started in `namespace`: ("host:port" of the warehouse on this Ray node, the dock's token).
    (None, None) otherwise."""
    if not ray_initialized():
        return None, None
    try:
        if find(namespace, timeout=10.0) != address:
            return None, None
        return _node_warehouse(namespace), token(namespace)
    except Exception as exc:  # a convenience only: never fail a connect over it
        logger.debug("[ray] cannot tell this node's warehouse: %s", exc)
        return None, None


def ray_initialized() -> bool:
    """Whether Ray is imported and initialised in this process. Never imports Ray."""
    ray = sys.modules.get("ray")
    is_initialized = getattr(ray, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False


def find_or_launch(namespace: str = "dockd", **launch_kwargs: Any) -> str:
    """The address of the dock running in `namespace`, launching one (`launch`) if none runs."""
    address = find(namespace)
    if address is not None:
        return address
    return launch(namespace=namespace, **launch_kwargs)


def shutdown(namespace: str = "dockd", *, timeout: float = 60.0) -> None:
    """Stop the dock in `namespace`: the watcher, every warehouse, then the controller, and
    kill their actors. Does nothing if none runs."""
    ray = _initialized_ray("shutdown")
    names = _named(namespace)
    ours = [n for n in names if n in (WATCHER_NAME, CONTROLLER_NAME) or n.startswith(WAREHOUSE_PREFIX)]
    if not ours:
        return
    deadline = time.monotonic() + timeout

    def stop_all(group: list[str]) -> None:
        handles = [(n, a) for n in group if (a := _get_actor(n, namespace)) is not None]
        refs = [(name, actor.stop.remote()) for name, actor in handles]  # in parallel
        for name, ref in refs:
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # dead already, or stuck: killing the actor kills its daemon
                logger.info("[ray] %s.stop failed (%s); killing the actor", name, type(exc).__name__)
        for _, actor in handles:
            _kill(actor)

    stop_all([n for n in ours if n == WATCHER_NAME])
    whs = [n for n in ours if n.startswith(WAREHOUSE_PREFIX)]
    stop_all(whs)
    stop_all([n for n in ours if n == CONTROLLER_NAME])
    # names are released once Ray has processed the deaths: wait, so a launch() right after starts clean
    left = _wait_unnamed(namespace, set(ours), max(1.0, deadline - time.monotonic()))
    if left:
        logger.warning("[ray] actors still registered after shutdown namespace=%s names=%s", namespace, sorted(left))
    logger.info("[ray] dock shut down namespace=%s warehouses=%d controller=%s", namespace, len(whs),
                CONTROLLER_NAME in ours)
