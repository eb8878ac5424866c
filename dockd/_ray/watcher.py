"""The Watcher actor: gives every Ray node that joins after `launch` (or replaces one) a warehouse."""

from __future__ import annotations

import threading
from typing import Any

from dockd._ray.common import CONTROLLER_NAME, WATCHER_NAME, logger, named, ray_module, remote
from dockd._ray.starting import ControllerGone, Spec, ensure_warehouses, node_affinity


class Watcher:
    """Starts a warehouse on every alive node without one, every `interval` seconds (a Ray actor)."""

    def __init__(self) -> None:
        self._spec: Spec | None = None
        self._interval = 2.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._polls = 0
        self._started: list[str] = []
        self._last_error = ""

    def start(self, spec: Spec, interval: float) -> bool:
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

    def _loop(self, spec: Spec, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            try:
                names = named(spec.namespace)
                if CONTROLLER_NAME not in names:
                    logger.warning("[ray] watcher: the controller actor is gone namespace=%s; no more warehouses "
                                   "are started (dockd.ray.launch() starts a new dock)", spec.namespace)
                    return
                started = ensure_warehouses(spec, names=names, strict=False)
                self._started.extend(started)
                self._polls += 1
            except ControllerGone:
                logger.warning("[ray] watcher: controller=%s no longer runs namespace=%s; no more warehouses are "
                               "started for it", spec.controller, spec.namespace)
                return
            except Exception as exc:  # keep watching: a failed poll is retried at the next one
                self._last_error = f"{type(exc).__name__}: {exc}"
                logger.warning("[ray] watcher poll failed namespace=%s error=%s", spec.namespace, self._last_error)


def start_watcher(spec: Spec, interval: float, timeout: float) -> None:
    """Start (or find running) the namespace's watcher actor on the controller's node, polling every
    `interval` seconds for `spec`'s dock."""
    ray = ray_module()
    watcher = remote(Watcher).options(
        name=WATCHER_NAME, namespace=spec.namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=0, scheduling_strategy=node_affinity(spec.controller_node, soft=True),
    ).remote()
    ray.get(watcher.start.remote(spec, interval), timeout=timeout + 30.0)
