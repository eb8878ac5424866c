"""Retrying a daemon that cannot be reached (yet): a starting daemon, a restarting controller, a
warehouse to re-home from. Attempts back off from 50 ms to 1 s until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from dockd.errors import DockClosed, DockConnectionError

T = TypeVar("T")

BACKOFF_MIN, BACKOFF_MAX = 0.05, 1.0


def retry(attempt: Callable[[], T], give_up: float, what: str, cause: Exception | None = None, *,
          stopped: Callable[[float], bool], refused_s: float | None = None) -> T:
    """Call `attempt` until it stops raising DockConnectionError or `give_up` (a time.monotonic()
    time) passes, then raise one naming `what` and the last error (`cause` until there is one); with
    `refused_s`, also once that many seconds passed in which every attempt was refused (nothing
    listens there). `stopped(seconds)` waits between attempts and says whether the client closed
    meanwhile (DockClosed)."""
    delay = BACKOFF_MIN
    started = time.monotonic()
    tries = refused = 0
    while True:
        tries += 1
        try:
            return attempt()
        except DockConnectionError as e:
            cause = e
            refused += e.refused
        took = time.monotonic() - started
        if refused_s is not None and refused == tries and took >= refused_s:
            raise DockConnectionError(
                f"cannot reach dockd at {what} (retried for {took:.1f}s, {tries} attempts, each refused): nothing "
                "listens there. Is `dockd serve` running, and is this its framed port (as its ready line prints)?"
            ) from None
        left = give_up - time.monotonic()
        if left <= 0:
            raise DockConnectionError(
                f"cannot reach dockd at {what} (retried for {took:.1f}s, {tries} attempts): {cause}"
            ) from None
        if stopped(min(delay, left)):
            raise DockClosed("the dock client was closed while reconnecting")
        delay = min(delay * 2, BACKOFF_MAX)
