"""Gets and reads: samples out of the dock.

A get is one acquire (the values the controller's own warehouse holds come
inline with the lease), the fetch of the rest from the warehouses that hold
them, in parallel, then the confirm: with this client's next request, or at
once when the get took long enough for its lease to be gone. A read locates
samples by index instead of taking them, then fetches the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.client import spread_calls, spread_io, validate
from dockd.client.acquirer import Acquirer
from dockd.client.ahead import Ahead
from dockd.client.batch import Batch
from dockd.client.confirm import Confirms
from dockd.client.fetch import Fetcher, maps_device, to_device
from dockd.client.lease import Lease
from dockd.client.options import GetOptions
from dockd.client.router import Router
from dockd.client.scope import CallScope
from dockd.client.spread import Spread, of
from dockd.errors import DockClosed, DockTypeError, DockValueError

FETCH_MIN_S = 1.0
"""Seconds a get's fetch may take at least, even when its acquire used up the get's timeout
(a get(timeout=0) of ready samples still gets this long to read them)."""
CONFIRM_NOW_AFTER_S = 0.1
"""A get that took longer than this (from its acquire to the end of its fetch) confirms its lease
before returning, and returns nothing if the lease is gone: its samples were handed out again."""


class Getter:
    """A Dock's gets (`Dock.get`) and reads (`Dock.read`)."""

    def __init__(self, router: Router, acquirer: Acquirer, fetcher: Fetcher, confirms: Confirms) -> None:
        self._router = router
        self._acquirer = acquirer
        self._fetcher = fetcher
        self._confirms = confirms
        self._ahead = Ahead(acquirer, confirms)
        self._turns: dict[str, int] = {}  # spread partition -> the shard this client's next get starts at

    def get(self, opts: GetOptions, device: Any, scope: CallScope | None, prefetch: int = 0,
            spread: Spread | None = None) -> Batch:
        """Dock.get: `opts` acquired (with `prefetch` > 1 from this client's leases taken ahead, see
        dockd.client.ahead), fetched and confirmed; the values on `device` if one is given.
        `scope`: an AsyncDock get's, which cancelling it closes. `spread`: opts.partition is that spread
        partition, served by one of its shards (dockd.client.spread_io)."""
        target = None if device is None else validate.device(device)
        mapped = target if target is not None and maps_device(target) else None  # device-tier data by handle, copied once
        started = time.monotonic()
        reconnects = self._router.reconnects
        if spread is not None:
            first = self._turns.get(spread.name)
            if first is None:  # (the first get of a spread partition starts at the home shard)
                first = spread_io.home_shard(self._router, spread.count)
            self._turns[spread.name] = (first + 1) % spread.count
            k, lease = spread_io.take(spread, opts, first, lambda shard: self._lease(shard, scope, prefetch, mapped),
                                      scope)
        else:
            lease = self._lease(opts, scope, prefetch, mapped)
        if scope is not None and scope.cancelled:  # cancelled as the lease arrived: give it back, take nothing
            self._confirms.release(lease)
            raise DockClosed("the get was cancelled")
        if opts.timeout is None:
            left = self._fetcher.fetch_timeout
        else:
            left = max(FETCH_MIN_S, started + opts.timeout - time.monotonic())
        try:
            values = self._fetcher.fetch(lease, lazy=True, device=mapped, deadline=time.monotonic() + left)
        except BaseException:
            self._confirms.release_now(lease)
            raise
        if lease.id:  # (0: a share every reader of it already confirmed; nothing to confirm)
            if time.monotonic() - started > CONFIRM_NOW_AFTER_S or self._router.reconnects != reconnects:
                self._confirms.confirm_now(lease, time.monotonic() - started)  # the lease may be gone: check first
            else:
                self._confirms.soon(lease.id, lease.controller)
        indexes = lease.indexes if spread is None else spread.outward(k, lease.indexes)
        batch = Batch(opts.partition, indexes, values, step=lease.step, rank_weights=lease.rank_weights)
        if target is not None:
            batch = Batch(opts.partition, indexes, {c: to_device(batch[c], target) for c in lease.columns},
                          step=lease.step, rank_weights=lease.rank_weights)
        return batch

    def _lease(self, opts: GetOptions, scope: CallScope | None, prefetch: int, mapped: Any) -> Lease:
        if prefetch > 1 and opts.dp_size is None and opts.mp_group is None:  # (a rank's share is one step's)
            return self._ahead.lease(opts, prefetch, scope)
        return self._acquirer.acquire(opts, scope=scope, lazy=True, device=mapped)

    def read(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> Batch:
        """Dock.read: the samples located by the controller that owns the partition, then fetched.
        A spread partition's are read from each shard they name (dockd.client.spread_calls.read)."""
        validate.check_partition(partition)
        if isinstance(columns, str) or not columns:
            raise DockTypeError(f"columns must be a non-empty list of column names, got {columns!r}")
        idx = validate.int_list("indexes", indexes)
        if not idx:
            raise DockValueError("indexes is empty")
        spread = of(self._router.shards, partition)
        if spread is not None:
            return Batch(partition, idx, spread_calls.read(spread, idx, lambda name, local: self._read(name, local, columns)))
        return Batch(partition, idx, self._read(partition, idx, columns))

    def _read(self, partition: str, idx: list[int], columns: Sequence[str]) -> dict[str, Any]:
        """The values of samples `idx` of an ordinary partition (lazily decoded runs or lists, by column)."""
        req = pb.LocateRequest(partition=partition, indexes=idx, columns=list(columns))
        reply, _, _ = self._confirms.ctrl_call(pb.Frame(locate=req), partition=partition)
        loc = reply.locate_reply
        self._router.learn(loc.warehouses)
        locs = np.asarray(loc.locations, dtype=np.int64).reshape(len(columns), len(idx))
        return self._fetcher.fetch(Lease(0, partition, list(columns), idx, locs), lazy=True)
