"""`Dialer`: a client's pools of connections to daemons, each over the best transport that works.

Every pool the client opens is opened here and kept (`pools`) until it is closed or retired, so
that closing the client closes them all; one opened after that is closed at once. The transports
to a daemon are `dockd.net.candidates`' list for it, best first; the last (TCP) always works.
"""

from __future__ import annotations

import logging
import threading

from dockd.errors import DockAuthError, DockConnectionError
from dockd.net.candidates import candidates
from dockd.net.connection import Credentials, timed_out
from dockd.net.pool import Pool
from dockd.net.transport import Context, Endpoint, Transport

logger = logging.getLogger(__name__)


class Dialer:
    """Opens, retires and closes a client's pools (see the module's docstring)."""

    def __init__(self, *, connect_timeout: float, creds: Credentials, ctx: Context) -> None:
        self.connect_timeout = connect_timeout
        self.creds = creds
        self.ctx = ctx
        self._lock = threading.Lock()
        self.pools: list[Pool] = []  # every pool open
        self.closed = False

    def open(self, transport: Transport) -> Pool:
        pool = Pool(transport, connect_timeout=self.connect_timeout, creds=self.creds)
        with self._lock:
            self.pools.append(pool)
            if self.closed:
                pool.close()
        return pool

    def plain(self, endpoint: Endpoint) -> Pool:
        """A pool to `endpoint` over the transport that always works (TCP)."""
        return self.open(next(c for c in candidates(endpoint, self.ctx) if c.fallback)(endpoint, self.ctx))

    def better(self, endpoint: Endpoint, current: Transport | None = None, timeout: float | None = None) -> Pool | None:
        """A pool over the best transport to `endpoint` that works and is better than `current`
        (None: none is). Each candidate but the fallback is tried with one connection made within
        `timeout` seconds (at most connect_timeout); one that fails is skipped, but a daemon that
        accepts and does not answer raises: it is there, only stopped or busy, and TCP would not
        answer either."""
        for cls in candidates(endpoint, self.ctx):
            if current is not None and cls is type(current):
                return None
            if cls.fallback:
                return None if current is not None else self.open(cls(endpoint, self.ctx))
            pool = self.open(cls(endpoint, self.ctx))
            try:
                pool.put(pool.get(timeout))
            except (DockConnectionError, DockAuthError) as e:  # (refused: another user at the same-host socket)
                self.close_pool(pool)
                if timed_out(e):
                    raise
                logger.info("[client] %s transport to %s:%d unavailable (%s); trying the next", cls.name,
                            endpoint.host, endpoint.port, e)
                continue
            return pool
        return None

    def close_pool(self, pool: Pool) -> None:
        pool.close()
        with self._lock:
            if pool in self.pools:
                self.pools.remove(pool)

    def retire(self, pool: Pool) -> None:
        """A pool that another takes the place of: its calls in flight finish first (see Pool.retire;
        closing it would cut off answers to requests the daemon applied)."""
        pool.retire()
        with self._lock:
            self.pools = [p for p in self.pools if not p.closed]

    def close(self) -> None:
        with self._lock:
            self.closed = True
            pools, self.pools = list(self.pools), []
        for pool in pools:
            pool.close()
