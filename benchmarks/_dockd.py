"""How the benchmarks start dockd and pick a client data path. One place to adapt.

Paths: ``"auto"`` is what a plain ``dockd.connect(address)`` does on the
warehouse's host; ``"shm"`` and ``"socket"`` force the same-host
shared-memory path or the TCP socket path. The client chooses its transport
when it connects, from ``DOCKD_TRANSPORT`` (``auto``: shared memory to
same-host daemons; ``tcp``: sockets only), or from a ``transport=`` keyword
if the client has one. When the build offers no choice, the socket is the
only path: ``"socket"`` is then a plain connect and ``"shm"`` is reported as
unavailable with the reason. Which transport a connected client really uses
is read back and recorded in the JSON.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

TRANSPORT_KWARG = "transport"
TRANSPORT_ENV = "DOCKD_TRANSPORT"


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


def _has_transport_env() -> bool:
    try:
        from dockd.config import ENV_VARS
    except ImportError:
        return False
    return TRANSPORT_ENV in ENV_VARS


def _shm_supported() -> str | None:
    try:
        from dockd.net import same_host
    except ImportError:
        return "this dockd build has no shared-memory transport (no dockd.net.same_host module)"
    if not same_host.available():
        return "dockd's shared-memory transport is not available on this machine (dockd.net.same_host.available() is False)"
    return None


def path_unavailable(path: str) -> str | None:
    """``None`` when ``path`` can be measured with this dockd build, else why not."""
    if path in ("auto", "socket"):
        return None
    if path == "shm":
        if not (_has_transport_choice() or _has_transport_env()):
            return (
                "this dockd client offers no transport choice (no transport= option, no "
                f"{TRANSPORT_ENV}); same-host clients use the loopback socket"
            )
        return _shm_supported()
    return f"unknown path {path!r}"


def connect(address: str, path: str, **kwargs: Any) -> Any:
    """A ``dockd.Dock`` on the given path (see the module docstring)."""
    import dockd

    if path == "shm" and path_unavailable("shm"):
        raise RuntimeError(path_unavailable("shm"))
    if path == "auto" or not (_has_transport_choice() or _has_transport_env()):
        return dockd.connect(address, **kwargs)
    wanted = {"shm": "auto", "socket": "tcp"}[path]  # (dockd's names: auto = shared memory on this host)
    if _has_transport_choice():
        dock = dockd.connect(address, **kwargs, **{TRANSPORT_KWARG: wanted})
    else:
        old = os.environ.get(TRANSPORT_ENV)
        os.environ[TRANSPORT_ENV] = wanted  # read once, when the client connects
        try:
            dock = dockd.connect(address, **kwargs)
        finally:
            if old is None:
                os.environ.pop(TRANSPORT_ENV, None)
            else:
                os.environ[TRANSPORT_ENV] = old
    used = transport_in_use(dock)
    if path == "shm" and used not in (None, "shm"):
        dock.close()
        raise RuntimeError(f"asked for the shared-memory path but the client connected over {used!r}")
    return dock


def transport_in_use(dock: Any) -> str | None:
    """The transport of the client's pool to its home warehouse, when the client exposes it."""
    try:
        return str(dock._router.pool(dock.home).transport)
    except Exception:  # noqa: BLE001 - informational only
        return None


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
        "client_transport_choice": "keyword" if _has_transport_choice() else "env" if _has_transport_env() else None,
    }
