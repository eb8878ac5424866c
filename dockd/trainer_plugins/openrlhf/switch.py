"""Switching an OpenRLHF run over to `DockReplayBuffer` (see `dockd.trainer_plugins.openrlhf`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Any

from dockd.config import env
from dockd.trainer_plugins.openrlhf.buffer import (
    ENV_ADDRESS,
    ENV_CONFIG,
    PACKAGE,
    DockBufferConfig,
    _dock_replay_buffer_class,
    _DockReplayBufferImpl,
    _openrlhf,
)

logger = logging.getLogger(__name__)

# -- switching OpenRLHF over ---------------------------------------------------------
_PATCH_SITES = (
    "openrlhf.trainer.ppo_utils",
    "openrlhf.trainer.ppo_utils.replay_buffer",
    "openrlhf.trainer.ray.ppo_actor",
    "openrlhf.trainer.ray.ppo_critic",
)
_originals: dict[str, Any] = {}


def install(address: str | None = None, config: DockBufferConfig | None = None, **fields: Any) -> dict[str, Any]:
    """Make OpenRLHF build a `DockReplayBuffer` wherever it builds ``NaiveReplayBuffer``.

    Patches this process (``openrlhf.trainer.ppo_utils`` and the actor/critic modules that
    imported the class) and returns a Ray ``runtime_env`` that repeats the patch in every
    Ray worker process; pass it to ``ray.init(runtime_env=...)`` before OpenRLHF's ``train``.

    Args:
        address: dock address ``host:port``. Default: ``config.address``, else
            ``DOCKD_ADDRESS``, else, when Ray is initialised in this process, the dock
            running on Ray (`dockd.ray.find`) or a newly launched one (`dockd.ray.launch`).
        config: a `DockBufferConfig`; `fields` override single fields of it.
    """
    cfg = dataclasses.replace(config or DockBufferConfig(), **fields)
    if address:
        cfg = dataclasses.replace(cfg, address=address)
    if not cfg.address and not env(ENV_ADDRESS):
        on_ray = _dock_on_ray()
        if on_ray is None:
            raise ValueError(
                "install() has no dock address: pass install('host:port') (or config.address), set the "
                f"{ENV_ADDRESS} environment variable, or call ray.init() first so that install() uses the dock "
                "running on the Ray cluster (launching one if there is none)"
            )
        cfg = dataclasses.replace(cfg, address=on_ray)
    cfg.resolved_address()  # fail now, not inside a Ray actor
    _install_local(cfg)
    payload = json.dumps({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    os.environ[ENV_CONFIG] = payload
    return {
        "env_vars": {ENV_CONFIG: payload, ENV_ADDRESS: cfg.resolved_address()},
        "worker_process_setup_hook": f"{PACKAGE}._ray_worker_setup",
    }


def _dock_on_ray() -> str | None:
    """With Ray initialised here: the dock on Ray (found, else launched); else None."""
    from dockd import ray as dock_ray

    if not dock_ray.ray_initialized():
        return None
    address = dock_ray.find_or_launch()
    logger.info("[openrlhf] no dock address configured; using the dock on Ray address=%s", address)
    return address


def _install_local(cfg: DockBufferConfig) -> type:
    ppo_utils = _openrlhf("openrlhf.trainer.ppo_utils")
    installed = type(
        "DockReplayBuffer", (_dock_replay_buffer_class(),), {"_default_config": cfg, "__module__": PACKAGE}
    )
    for site in _PATCH_SITES:
        module: Any = ppo_utils if site == "openrlhf.trainer.ppo_utils" else sys.modules.get(site)  # (patched)
        if module is None and site.endswith("replay_buffer"):
            module = _openrlhf(site)
        if module is None:  # imported later: it reads the patched ppo_utils attribute then
            continue
        current = getattr(module, "NaiveReplayBuffer", None)
        if current is not None and not issubclass(current, _DockReplayBufferImpl):
            _originals.setdefault(site, current)
        module.NaiveReplayBuffer = installed
    logger.info("[openrlhf] NaiveReplayBuffer -> DockReplayBuffer address=%s name=%s", cfg.address, cfg.name)
    return installed


def _ray_worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: repeat `install` inside a worker process."""
    payload = env(ENV_CONFIG)
    if not payload:
        return
    try:
        _openrlhf("openrlhf.trainer.ppo_utils")
    except ImportError:  # a worker that never runs OpenRLHF code
        return
    _install_local(DockBufferConfig(**json.loads(payload)))


def uninstall() -> None:
    """Undo `install` in this process."""
    for site, original in _originals.items():
        module: Any = sys.modules.get(site)  # an OpenRLHF module, patched
        if module is not None:
            module.NaiveReplayBuffer = original
    _originals.clear()
    os.environ.pop(ENV_CONFIG, None)
