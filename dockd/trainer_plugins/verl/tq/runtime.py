"""The process's connection to the dock and the controller settings read at `init`.

One `store._Client` per process, made on first use from ``DOCKD_ADDRESS`` (which `init` sets),
shared by the module-level KV API, `get_client` and the checkpoints. The settings `init` reads
from ``conf.controller`` (`_polling_mode`, `_sampler`) are module attributes: read them as
``runtime._sampler``, since `init` rebinds them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from dockd.config import env
from dockd.trainer_plugins.verl.tq.samplers import (
    BaseSampler,
    SequentialSampler,
    _as_sampler,
)
from dockd.trainer_plugins.verl.tq.store import _Client

ENV_ADDRESS = "DOCKD_ADDRESS"
ENV_METRICS = "DOCKD_METRICS_ENDPOINT"

_client: _Client | None = None
_client_lock = threading.Lock()
_polling_mode = False  # conf.controller.polling_mode at init (TransferQueue's default: False)
_sampler: BaseSampler = SequentialSampler()  # conf.controller.sampler at init


def _controller_conf(conf: Any) -> tuple[bool, BaseSampler]:
    """(polling_mode, sampler) from a TransferQueue-style config's ``controller`` section."""
    ctrl = conf.get("controller", None) if conf is not None and hasattr(conf, "get") else None
    if ctrl is None:
        return False, SequentialSampler()
    return bool(ctrl.get("polling_mode", False)), _as_sampler(ctrl.get("sampler", None))


def _dockd_conf(conf: Any) -> Any:
    """A TransferQueue-style config's ``dockd`` section (``address``, ``metrics_endpoint``), or None."""
    return conf.get("dockd", None) if hasattr(conf, "get") else None


def _get() -> _Client:
    global _client
    with _client_lock:
        if _client is None:
            address = env(ENV_ADDRESS)
            if not address:
                raise RuntimeError(
                    "dockd transfer_queue is not initialised: call transfer_queue.init() with "
                    f"conf.dockd.address set, or set {ENV_ADDRESS} to the dock's host:port"
                )
            _client = _Client(address)
        return _client


def init(conf: Any = None, *, address: str | None = None) -> Any:
    """Connect to the dock. Address: `address`, else ``conf.dockd.address``, else ``DOCKD_ADDRESS``.

    ``conf.controller.polling_mode`` and ``conf.controller.sampler`` are read as TransferQueue
    reads them (see `DockTQClient.get_meta`)."""
    global _client, _polling_mode, _sampler
    if conf is not None:
        _polling_mode, _sampler = _controller_conf(conf)
    if address is None and conf is not None:
        dockd_conf = _dockd_conf(conf)
        if dockd_conf is not None:
            address = dockd_conf.get("address", None)
            if dockd_conf.get("metrics_endpoint", None):
                os.environ[ENV_METRICS] = str(dockd_conf.get("metrics_endpoint"))
    if address:
        os.environ[ENV_ADDRESS] = address
    with _client_lock:
        if _client is not None and address and _client.address != address:
            _client.close()
            _client = None
    _get()
    return conf


def close() -> None:
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None
