"""Finding the dock running on Ray: its address, daemons, token and this node's warehouse.

Nothing here starts an actor or imports the client, so the client may use `home_for`."""

from __future__ import annotations

import time
from typing import Any

from dockd._ray.common import (
    CONTROLLER_NAME,
    WAREHOUSE_PREFIX,
    get_actor,
    initialized_ray,
    logger,
    named,
    ray_initialized,
    ray_module,
    warehouse_name,
)


def find(namespace: str = "dockd", *, timeout: float = 60.0) -> str | None:
    """The address of the dock running in `namespace`, or None if there is none."""
    ray = initialized_ray("find")
    actor = get_actor(CONTROLLER_NAME, namespace)
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
    ray = initialized_ray("warehouses")
    names = sorted(n for n in named(namespace) if n == CONTROLLER_NAME or n.startswith(WAREHOUSE_PREFIX))
    refs = []
    for name in names:
        actor = get_actor(name, namespace)
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
    ray = initialized_ray("token")
    actor = get_actor(CONTROLLER_NAME, namespace)
    if actor is None:
        return None
    try:
        return ray.get(actor.token.remote(), timeout=timeout) or None
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def node_warehouse(namespace: str) -> str | None:
    """The "host:port" of the warehouse on this process's Ray node, or None."""
    ray = ray_module()
    node_id = ray.get_runtime_context().get_node_id()
    actor = get_actor(warehouse_name(node_id), namespace)
    if actor is not None:
        try:
            return ray.get(actor.address.remote(), timeout=30.0)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None
    controller = get_actor(CONTROLLER_NAME, namespace)
    if controller is None:
        return None
    try:
        info = ray.get(controller.info.remote(), timeout=30.0)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
    return info["address"] if info["node_id"] == node_id and info["running"] else None


def home_for(address: str, namespace: str = "dockd") -> tuple[str | None, str | None]:
    """For `dockd.connect` inside a Ray process, when the dock at `address` is the one `launch`
    started in `namespace`: ("host:port" of the warehouse on this Ray node, the dock's token).
    (None, None) otherwise."""
    if not ray_initialized():
        return None, None
    try:
        if find(namespace, timeout=10.0) != address:
            return None, None
        return node_warehouse(namespace), token(namespace)
    except Exception as exc:  # a convenience only: never fail a connect over it
        logger.debug("[ray] cannot tell this node's warehouse: %s", exc)
        return None, None
