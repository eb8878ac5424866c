"""How the benchmarks start dockd and pick a client data path. One place to adapt.

Paths: ``"auto"`` is what a plain ``dockd.connect(address)`` does on the
warehouse's host; ``"shm"`` and ``"socket"`` force the same-host
shared-memory path or the socket path, when the client offers the choice
(``dockd.connect(address, transport=...)``). When it does not, the socket is
the client's only path: ``"socket"`` is then a plain connect and ``"shm"`` is
reported as unavailable with the reason.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

TRANSPORT_KWARG = "transport"


def requirements() -> str | None:
    try:
        import dockd

        dockd.start_local  # noqa: B018 - probe the API
        dockd.connect  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return f"dockd is not importable here ({exc}); run from a checkout with `pip install -e .`"
    return None


def _has_transport_choice() -> bool:
    from dockd.client.dock import Dock

    try:
        return TRANSPORT_KWARG in inspect.signature(Dock.__init__).parameters
    except (TypeError, ValueError):
        return False


def path_unavailable(path: str) -> str | None:
    """``None`` when ``path`` can be measured with this dockd build, else why not."""
    if path in ("auto", "socket"):
        return None
    if path == "shm":
        if _has_transport_choice():
            return None
        return (
            "this dockd client has no same-host shared-memory path yet "
            f"(Dock has no {TRANSPORT_KWARG}= option); same-host clients use the loopback socket"
        )
    return f"unknown path {path!r}"


def connect(address: str, path: str, **kwargs: Any) -> Any:
    import dockd

    if path != "auto" and _has_transport_choice():
        kwargs[TRANSPORT_KWARG] = path
    elif path == "shm":
        raise RuntimeError(path_unavailable("shm"))
    return dockd.connect(address, **kwargs)


def start(num_warehouses: int, *, capacity: str = "6GiB") -> Any:
    import dockd

    cluster = dockd.start_local(num_warehouses=num_warehouses, capacity=capacity)
    logger.info("[dockd] started local dock address=%s warehouses=%d", cluster.address, num_warehouses)
    return cluster


def describe(cluster: Any, num_warehouses: int) -> dict[str, Any]:
    import dockd

    return {
        "dockd": getattr(dockd, "__version__", None),
        "layout": "central (controller + one warehouse in one daemon)" if num_warehouses == 1
        else f"controller daemon hosting warehouse 0, plus {num_warehouses - 1} warehouse daemon(s)",
        "warehouses": num_warehouses,
        "address": getattr(cluster, "address", None),
        "client_transport_choice": _has_transport_choice(),
    }
