"""Starting the dock's daemon actors: the controller on node 0, a warehouse on every other alive
node, and retiring the warehouses an earlier controller of the namespace left behind."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dockd._ray.actors import DaemonActor
from dockd._ray.common import (
    CONTROLLER_NAME,
    alive_nodes,
    get_actor,
    kill,
    logger,
    named,
    ray_module,
    remote,
    wait_unnamed,
    warehouse_name,
)
from dockd._ray.query import find, warehouses
from dockd.errors import DockConnectionError


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a warehouse needs to join the dock (passed to the watcher)."""

    namespace: str
    args: tuple[str, ...]  # `dockd serve` arguments shared by every daemon, without --host and role
    controller: str
    controller_node: str
    timeout: float
    num_cpus: float
    token: str = dataclasses.field(default="", repr=False)
    daemon_token: str = dataclasses.field(default="", repr=False)


class ControllerGone(Exception):
    """The controller a watcher starts warehouses for is no longer the namespace's controller."""


def node_affinity(node_id: str, *, soft: bool) -> Any:
    """Ray's scheduling strategy that places an actor on `node_id` (Ray is imported on first use)."""
    ray_module()  # the ImportError hint if Ray is missing
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=soft)


def daemon_actor(namespace: str, name: str, role: str, node: dict[str, Any], num_cpus: float) -> Any:
    """The named daemon actor on `node` (created if missing, found if another caller made it)."""
    node_id = node["NodeID"]
    cpus = min(num_cpus, float(node.get("Resources", {}).get("CPU", 0.0)))  # fits nodes without CPUs too
    return remote(DaemonActor).options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=cpus,
        max_restarts=0,
        scheduling_strategy=node_affinity(node_id, soft=False),
    ).remote(role, node_id)


def start_failure(role: str, node_id: str, exc: BaseException, timeout: float) -> str:
    """The message for a daemon actor that did not start: why, and where its logs are."""
    ray = ray_module()
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        why = (f"its actor was not running within {timeout:g}s (is the node out of the requested CPU? "
               "pass num_cpus=0 to launch())")
    else:
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return (f"could not start the dockd {role} on Ray node {node_id}: {why}. The daemon's own messages are in "
            "that node's Ray worker logs (`ray logs`, or /tmp/ray/session_latest/logs/worker-*.err there)")


def _start_warehouse_actors(spec: Spec, todo: list[dict[str, Any]], failed: dict[str, str]) -> list[str]:
    """Start a warehouse actor on each node of `todo` and wait for them; the node ids started on
    (the others' reasons go to `failed`)."""
    ray = ray_module()
    args = [*spec.args, "--join", spec.controller]
    pending: dict[str, tuple[Any, Any]] = {}
    for node in todo:
        nid = node["NodeID"]
        try:
            actor = daemon_actor(spec.namespace, warehouse_name(nid), "warehouse", node, spec.num_cpus)
            pending[nid] = (actor, actor.start.remote(args, spec.timeout, spec.token, spec.daemon_token))
        except ValueError as exc:  # the name still belongs to an actor that is dying
            failed[nid] = str(exc)
    deadline = time.monotonic() + spec.timeout + 30.0  # the actor's own start-up, then the daemon's
    started: list[str] = []
    for nid, (actor, ref) in pending.items():
        try:
            info = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except Exception as exc:
            kill(actor)  # frees the name, so that the next attempt starts clean
            failed[nid] = start_failure("warehouse", nid, exc, spec.timeout)
            continue
        started.append(nid)
        logger.info("[ray] started warehouse node=%s address=%s warehouse=%s", nid, info["address"],
                    info["warehouse"])
    return started


def ensure_warehouses(spec: Spec, *, names: set[str] | None = None, strict: bool) -> list[str]:
    """Start a warehouse actor on every alive node that has none; the node ids started on.

    strict: raise DockConnectionError if a node that is still alive failed (else log it
    and leave the node for the next call).
    """
    names = named(spec.namespace) if names is None else names
    todo = [n for n in alive_nodes()
            if n["NodeID"] != spec.controller_node and warehouse_name(n["NodeID"]) not in names]
    if not todo:
        return []
    if not strict and find(spec.namespace, timeout=spec.timeout) != spec.controller:
        raise ControllerGone(spec.controller)  # the watcher must not join warehouses to a dead controller
    failed: dict[str, str] = {}
    started = _start_warehouse_actors(spec, todo, failed)
    if failed:
        alive = {n["NodeID"] for n in alive_nodes()}
        for nid in [nid for nid in failed if nid not in alive]:
            logger.info("[ray] node=%s left the cluster while its warehouse started; skipped", nid)
            del failed[nid]
    if failed:
        if strict:
            raise DockConnectionError("; ".join(failed.values()))
        for nid, why in failed.items():
            logger.warning("[ray] warehouse not started node=%s (retried at the next poll): %s", nid, why)
    return started


def retire_stale_warehouses(spec: Spec) -> None:
    """Stop warehouse actors left over from an earlier controller of this namespace (one that
    died), so that `ensure_warehouses` gives their nodes warehouses of the new dock."""
    ray = ray_module()
    stale = [(node_id, info) for node_id, info in warehouses(spec.namespace, timeout=spec.timeout).items()
             if info["role"] == "warehouse" and info["controller"] != spec.controller]
    if not stale:
        return
    for node_id, info in stale:
        logger.warning("[ray] replacing warehouse node=%s address=%s: it belongs to controller=%s, not %s",
                       node_id, info["address"], info["controller"], spec.controller)
        actor = get_actor(warehouse_name(node_id), spec.namespace)
        if actor is None:
            continue
        try:
            ray.get(actor.stop.remote(), timeout=spec.timeout)
        except Exception as exc:  # killing the actor kills its daemon too
            logger.info("[ray] stale warehouse node=%s did not stop cleanly (%s)", node_id, type(exc).__name__)
        kill(actor)
    wait_unnamed(spec.namespace, {warehouse_name(node_id) for node_id, _ in stale}, spec.timeout)


def start_controller(namespace: str, node: dict[str, Any], args: list[str], num_cpus: float,
                     timeout: float, token: str, daemon_token: str) -> dict[str, Any]:
    """Start (or find started) the controller actor and its daemon on `node`; the daemon's info."""
    ray = ray_module()
    for attempt in (1, 2):
        controller = daemon_actor(namespace, CONTROLLER_NAME, "controller", node, num_cpus)
        try:
            return ray.get(controller.start.remote(args, timeout, token, daemon_token), timeout=timeout + 30.0)
        except ray.exceptions.RayActorError as exc:  # found a controller actor that was dying: once more
            if attempt == 2:
                raise DockConnectionError(start_failure("controller", node["NodeID"], exc, timeout)) from exc
            logger.info("[ray] the controller actor found was dying namespace=%s; starting a new one", namespace)
            wait_unnamed(namespace, {CONTROLLER_NAME}, timeout)
        except Exception as exc:
            kill(controller)
            raise DockConnectionError(start_failure("controller", node["NodeID"], exc, timeout)) from exc
    raise AssertionError("unreachable")


def node_zero() -> dict[str, Any]:
    """The node `launch` runs on, else the head node."""
    ray = ray_module()
    nodes = alive_nodes()
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
