"""Leases taken ahead: `get(prefetch=n)`.

A get with prefetch=n asks the controller for n gets' worth of samples in one
acquire, handed out as n leases of `count` samples each (AcquireRequest.per_lease),
and keeps the ones it does not return now in a window for the next gets with the
same arguments: the controller sees one acquire per window instead of one per get.

Each get served from a window is one lease, fetched when it is served and
confirmed as any get's (with the next request, or by the flusher within
CONFIRM_DELAY_S), so what a get returned is taken exactly as without prefetch.
What a window still holds is leased to this client: other clients of the same
consumer name do not see those samples until they are released or expire. A
window serves only while its leases have at least half their timeout left; then,
and when the client closes (close, collection, interpreter exit), what it holds
is released at once, and a client that dies has it released when its
connections close (the controller's rule for every lease of a session).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from dockd import codec
from dockd.client.acquirer import Acquirer
from dockd.client.confirm import Confirms
from dockd.client.lease import Lease
from dockd.client.options import GetOptions
from dockd.client.scope import CallScope
from dockd.errors import DockTimeout


@dataclasses.dataclass(slots=True)
class _Window:
    leases: collections.deque[Lease]
    until: float  # monotonic: none is served after this (half of the leases' time left)


def key(opts: GetOptions) -> str:
    """Which gets a window serves: those with the same arguments, but the timeout."""
    where = sorted(opts.where.items()) if opts.where else None
    return repr((opts.partition, opts.consumer, tuple(opts.columns), opts.count, opts.groups, opts.allow_partial,
                 opts.shuffle, opts.seed, where, opts.order_by, opts.prefer_local, opts.max_staleness))


def split(lease: Lease, per: int) -> list[Lease]:
    """The leases an acquire with per_lease granted, each with its samples, locations and inline values
    (received runs cut to its samples: views of the same bytes, nothing decoded or copied). They are cut
    as the controller cut them: `per` samples each (its AcquireReply.per_lease), the last what is left.
    A cut of its own (even parts) would confirm, as one lease's, samples the controller holds under the
    next: with 12 ready and per 8, leases of 8 and 4, not 6 and 6."""
    if not lease.parts:
        return [lease]
    out = []
    for k, lid in enumerate(lease.parts):
        a, b = k * per, (k + 1) * per
        locs = None if lease.locations is None else lease.locations[:, a:b]
        out.append(Lease(lid, lease.partition, lease.columns, lease.indexes[a:b], locs,
                         {c: cut(v, a, b) for c, v in lease.inline.items()}, b"", lease.step, [],
                         lease.controller, seconds=lease.seconds))
    return out


def cut(values: Any, a: int, b: int) -> Any:
    """Samples [a, b) of a column that came inline: a list's slice, or its received runs cut to those
    samples (`Runs.cut`: a jagged or stacked column of the lease stays one view of the reply's bytes)."""
    if not isinstance(values, codec.Runs):
        return values[a:b]
    part = values.cut(a, b)
    return part if part is not None else values.values()[a:b]  # (a run without its values' sizes: sliced)


class Ahead:
    """A Dock's windows of leases taken ahead, one per kind of get."""

    def __init__(self, acquirer: Acquirer, confirms: Confirms) -> None:
        self._acquirer = acquirer
        self._confirms = confirms
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def lease(self, opts: GetOptions, n: int, scope: CallScope | None) -> Lease:
        """One get's lease: from its window, else from an acquire of up to n gets' worth (the rest
        kept). A get that is not partial takes a window only of what is ready now; when fewer than
        `count` samples are, it waits for its own `count` as a get without prefetch does."""
        k = key(opts)
        now = time.monotonic()
        with self._lock:
            stale = [name for name, w in self._windows.items() if w.until <= now]
            dropped = [lease for name in stale for lease in self._windows.pop(name).leases]
            w = self._windows.get(k)
            lease = w.leases.popleft() if w is not None and w.leases else None
        if dropped:
            self._confirms.release_held(dropped)  # (their time is half gone: back to the pool for anyone)
        if lease is not None:
            self._confirms.serve(lease)
            return lease
        started = time.monotonic()
        wide = dataclasses.replace(opts, count=opts.count * n, allow_partial=True, per_lease=opts.count,
                                   timeout=opts.timeout if opts.allow_partial else 0.0)
        try:
            window = self._acquirer.acquire(wide, scope=scope, lazy=True)
            got = split(window, window.per or opts.count)  # (a controller that does not say cuts by count)
        except DockTimeout:
            if opts.allow_partial:
                raise
            got = []  # none ready now: the get waits as one without prefetch
        if not opts.allow_partial:
            short = [lease for lease in got if len(lease.indexes) < opts.count]
            if short:
                self._confirms.release_held(short)  # (at most the last one, or the only one)
                got = [lease for lease in got if len(lease.indexes) == opts.count]
            if not got:
                return self._acquirer.acquire(opts, scope=scope, lazy=True)
        first, rest = got[0], got[1:]
        if rest:
            until = started + got[0].seconds / 2
            self._confirms.hold(rest)
            with self._lock:
                w = self._windows.setdefault(k, _Window(collections.deque(), until))
                w.leases.extend(rest)
                w.until = min(w.until, until)
        return first
