"""The switch: ``import transfer_queue`` resolves to dockd's module here and in Ray workers.

`install` puts `dockd.trainer_plugins.verl.transfer_queue` into ``sys.modules`` as
``transfer_queue`` and returns the Ray ``runtime_env`` (``DOCKD_ADDRESS``, ``DOCKD_TRANSFER_QUEUE=1``
and a ``worker_process_setup_hook``) that does the same in every Ray worker.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Any

from dockd.config import env
from dockd.trainer_plugins.verl.tq import FACADE
from dockd.trainer_plugins.verl.tq.runtime import ENV_ADDRESS, close

logger = logging.getLogger(FACADE)

ENV_ENABLE = "DOCKD_TRANSFER_QUEUE"


def _facade() -> ModuleType:
    return importlib.import_module(FACADE)


def install(address: str | None = None) -> dict[str, Any]:
    """Make ``import transfer_queue`` resolve to this module here and in Ray workers.

    Returns a Ray ``runtime_env`` to pass to ``ray.init`` (or to the job's actors when Ray
    is already initialised). Call before verl imports ``transfer_queue`` (verl imports it
    at module import time in the modules that use it).

    Args:
        address: the dock's ``host:port``. Default: ``DOCKD_ADDRESS``, else, when Ray is
            initialised in this process, the dock running on Ray (`dockd.ray.find`) or a
            newly launched one (`dockd.ray.launch`).
    """
    if address:
        os.environ[ENV_ADDRESS] = address
    if not env(ENV_ADDRESS):
        from dockd import ray as dock_ray

        if dock_ray.ray_initialized():
            os.environ[ENV_ADDRESS] = dock_ray.find_or_launch()
            logger.info("[tq] no dock address configured; using the dock on Ray address=%s", env(ENV_ADDRESS))
    if not env(ENV_ADDRESS):
        raise ValueError(
            f"use_dockd_transfer_queue needs the dock address: pass it, set {ENV_ADDRESS}, "
            "or call ray.init() first so that the dock on the Ray cluster is found (or launched)"
        )
    facade = _facade()
    existing = sys.modules.get("transfer_queue")
    if existing is not None and existing is not facade:
        logger.warning("[tq] replacing the already imported transfer_queue module %r with dockd's", existing)
    sys.modules["transfer_queue"] = facade
    os.environ[ENV_ENABLE] = "1"
    return {
        "env_vars": {ENV_ADDRESS: env(ENV_ADDRESS), ENV_ENABLE: "1"},
        "worker_process_setup_hook": f"{FACADE}._ray_worker_setup",
    }


def _ray_worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: alias ``transfer_queue`` to this module in a worker."""
    if env(ENV_ENABLE) == "1":
        sys.modules["transfer_queue"] = _facade()


def uninstall() -> None:
    if sys.modules.get("transfer_queue") is _facade():
        del sys.modules["transfer_queue"]
    os.environ.pop(ENV_ENABLE, None)
    close()
