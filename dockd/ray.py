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

import secrets
import time
from typing import Any

import dockd
from dockd import config
from dockd._ray.common import (
    CONTROLLER_NAME,
    WAREHOUSE_PREFIX,
    WATCHER_NAME,
    alive_nodes,
    get_actor,
    initialized_ray,
    kill,
    logger,
    named,
    ray_initialized,
    wait_unnamed,
)
from dockd._ray.query import find, home_for, node_warehouse, token, warehouses
from dockd._ray.starting import Spec, ensure_warehouses, node_zero, retire_stale_warehouses, start_controller
from dockd._ray.watcher import start_watcher
from dockd.errors import DockConnectionError, DockValueError

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


def _serve_args(capacity: int | str, lease_timeout: float | None, port: int, watch_interval: float,
                num_cpus: float, shm: bool, log_level: str, timeout: float) -> list[str]:
    """The `dockd serve` arguments every daemon of the dock shares, after checking `launch`'s arguments."""
    cap = config.parse_size(capacity)
    if cap <= 0:
        raise DockValueError(f"capacity must be positive, got {capacity!r}")
    if lease_timeout is not None and lease_timeout <= 0:
        raise DockValueError(f"lease_timeout must be a positive number of seconds, got {lease_timeout!r}")
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise DockValueError(f"port must be an int in 0..65535, got {port!r}")
    if watch_interval <= 0 or num_cpus < 0 or timeout <= 0:
        raise DockValueError("watch_interval and timeout must be positive, num_cpus must be >= 0")
    args = ["--port", str(port), "--grpc-port", "0", "--capacity", str(cap), "--log-level", log_level]
    if lease_timeout is not None:
        args += ["--lease-timeout", str(lease_timeout)]
    if not shm:
        args.append("--no-shm")
    return args


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
    replicas: int = 1,
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
        replicas: 2 keeps every put's values on two warehouses (``dockd serve --replicas 2``), so a
            node that dies loses nothing; 1: one.
    """
    ray = initialized_ray("launch")
    args = _serve_args(capacity, lease_timeout, port, watch_interval, num_cpus, shm, log_level, timeout)
    existing = find(namespace)
    if existing is not None:
        logger.info("[ray] dock already running namespace=%s address=%s", namespace, existing)
        return existing

    node0 = node_zero()
    t0 = time.monotonic()
    token, daemon_token = secrets.token_hex(32), secrets.token_hex(32)
    info = start_controller(namespace, node0, [*args, "--controller", "--replicas", str(replicas)], num_cpus, timeout, token, daemon_token)
    address: str = info["address"]
    # another launch may have started this controller first: warehouses join whichever runs, with its tokens
    controller = get_actor(CONTROLLER_NAME, namespace)
    if controller is None:  # it reported ready just now: only a shutdown racing this launch removes it
        raise DockConnectionError(f"the dockd controller actor of namespace {namespace!r} went away as it started")
    token, daemon_token = ray.get([controller.token.remote(), controller.daemon_token.remote()], timeout=timeout)
    spec = Spec(namespace=namespace, args=tuple(args), controller=address, controller_node=info["node_id"],
                timeout=timeout, num_cpus=num_cpus, token=token, daemon_token=daemon_token)
    logger.info("[ray] started controller node=%s address=%s namespace=%s", info["node_id"], address, namespace)
    try:
        retire_stale_warehouses(spec)
        ensure_warehouses(spec, strict=True)
        if watch:
            start_watcher(spec, watch_interval, timeout)
    except BaseException:
        logger.error("[ray] launch failed namespace=%s; stopping what it started", namespace)
        shutdown(namespace)
        raise
    logger.info("[ray] dock ready namespace=%s address=%s nodes=%d watch=%s in %.1fs", namespace, address,
                len(alive_nodes()), watch, time.monotonic() - t0)
    return address


def connect(address: str | None = None, *, namespace: str = "dockd", **kwargs: Any) -> dockd.Dock:
    """Connect to the dock from a driver or any Ray task/actor; puts go to this node's warehouse.

    Args:
        address: the controller's "host:port"; default: the dock running in `namespace`.
        namespace: the Ray namespace the dock was launched in.
        kwargs: passed to `dockd.connect`. An explicit ``warehouse=`` (or ``$DOCKD_WAREHOUSE``)
            wins over this node's warehouse.
    """
    initialized_ray("connect")
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
    if kwargs.get("warehouse") is None and not config.env("DOCKD_WAREHOUSE") and address == running:
        home = node_warehouse(namespace)
        if home is not None:
            kwargs["warehouse"] = home
        else:
            logger.info("[ray] no warehouse on this node yet namespace=%s; dockd picks one", namespace)
    return dockd.connect(address, **kwargs)


def find_or_launch(namespace: str = "dockd", **launch_kwargs: Any) -> str:
    """The address of the dock running in `namespace`, launching one (`launch`) if none runs."""
    address = find(namespace)
    if address is not None:
        return address
    return launch(namespace=namespace, **launch_kwargs)


def shutdown(namespace: str = "dockd", *, timeout: float = 60.0) -> None:
    """Stop the dock in `namespace`: the watcher, every warehouse, then the controller, and
    kill their actors. Does nothing if none runs."""
    ray = initialized_ray("shutdown")
    names = named(namespace)
    ours = [n for n in names if n in (WATCHER_NAME, CONTROLLER_NAME) or n.startswith(WAREHOUSE_PREFIX)]
    if not ours:
        return
    deadline = time.monotonic() + timeout

    def stop_all(group: list[str]) -> None:
        handles = [(n, a) for n in group if (a := get_actor(n, namespace)) is not None]
        refs = [(name, actor.stop.remote()) for name, actor in handles]  # in parallel
        for name, ref in refs:
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # dead already, or stuck: killing the actor kills its daemon
                logger.info("[ray] %s.stop failed (%s); killing the actor", name, type(exc).__name__)
        for _, actor in handles:
            kill(actor)

    stop_all([n for n in ours if n == WATCHER_NAME])
    whs = [n for n in ours if n.startswith(WAREHOUSE_PREFIX)]
    stop_all(whs)
    stop_all([n for n in ours if n == CONTROLLER_NAME])
    # names are released once Ray has processed the deaths: wait, so a launch() right after starts clean
    left = wait_unnamed(namespace, set(ours), max(1.0, deadline - time.monotonic()))
    if left:
        logger.warning("[ray] actors still registered after shutdown namespace=%s names=%s", namespace, sorted(left))
    logger.info("[ray] dock shut down namespace=%s warehouses=%d controller=%s", namespace, len(whs),
                CONTROLLER_NAME in ours)
