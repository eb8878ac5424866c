"""Logging helpers for lines that an attacker or a failing client could repeat without end."""

from __future__ import annotations

import logging
import time


class Throttle:
    """At most one line per `every` seconds for one kind of event; the lines held back are
    counted and said with the next one that goes out."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._next = 0.0
        self._held = 0

    def log(self, logger: logging.Logger, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        self._next = now + self.every
        if self._held:
            msg += " (and %d more like it in the last %gs)"
            args = (*args, self._held, self.every)
            self._held = 0
        logger.log(level, msg, *args)
