"""Ray, imported on first use, and the names and lookups every part of `dockd.ray` shares."""

from __future__ import annotations

import logging
import sys
import time
from types import ModuleType
from typing import Any

logger = logging.getLogger("dockd.ray")

CONTROLLER_NAME = "dockd-controller"
"""Name of the actor that owns the controller daemon (node 0's warehouse too)."""
WAREHOUSE_PREFIX = "dockd-warehouse-"
"""Prefix of the warehouse actors' names; the Ray node id follows."""
WATCHER_NAME = "dockd-watcher"
"""Name of the actor that starts warehouses on nodes that join later."""


def ray_module() -> ModuleType:
    """The `ray` module, imported now; an ImportError naming the extra if Ray is missing."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"dockd.ray needs Ray, which could not be imported ({exc}). Install it with: "
            "pip install -e '.[ray]' from the root of a dockd checkout"
        ) from exc
    return ray


def initialized_ray(what: str) -> ModuleType:
    """`ray_module()`, refusing a process that has not called ray.init (`what`: the calling function)."""
    ray = ray_module()
    if not ray.is_initialized():
        raise RuntimeError(
            f"dockd.ray.{what} needs a connected Ray: call ray.init() (or ray.init(address=...)) "
            "in this process first"
        )
    return ray


def ray_initialized() -> bool:
    """Whether Ray is imported and initialised in this process. Never imports Ray."""
    ray = sys.modules.get("ray")
    is_initialized = getattr(ray, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False


_actor_classes: dict[str, Any] = {}


def remote(cls: type) -> Any:
    """`ray.remote(cls)`, made once per process."""
    made = _actor_classes.get(cls.__name__)
    if made is None:
        made = _actor_classes[cls.__name__] = ray_module().remote(cls)
    return made


def named(namespace: str) -> set[str]:
    """Names of the live named actors in `namespace`."""
    ray = ray_module()
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def get_actor(name: str, namespace: str) -> Any | None:
    """The named actor, or None if there is none."""
    try:
        return ray_module().get_actor(name, namespace=namespace)
    except ValueError:
        return None


def kill(actor: Any) -> None:
    """Kill the actor for good (it may be gone already)."""
    try:
        ray_module().kill(actor, no_restart=True)
    except Exception as exc:  # already gone
        logger.debug("[ray] kill: %s", exc)


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray_module().nodes() if n.get("Alive")]


def wait_unnamed(namespace: str, names: set[str], timeout: float) -> set[str]:
    """Wait until none of `names` is a live actor of `namespace`; the ones still there."""
    deadline = time.monotonic() + timeout
    while (left := names & named(namespace)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def warehouse_name(node_id: str) -> str:
    return f"{WAREHOUSE_PREFIX}{node_id}"


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
