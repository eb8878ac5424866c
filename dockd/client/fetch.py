"""Fetches: reading a lease's values from the warehouses that hold them, in parallel.

Each warehouse gets one fetch request for the columns (and samples) it holds;
its pool's transport carries it and builds the reply's buffers (body, mapped
segments, device memory), and `dockd.codec.decode_reply` turns them into
values. A warehouse that does not answer in time raises DockTimeout naming
it; one that cannot be reached raises DockDataLost naming what it held
(DockTimeout when its data comes back: a data dir's restart, or replicas).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.client.lease import Lease
from dockd.client.router import Router
from dockd.errors import DockConnectionError, DockDataLost, DockTimeout, DockValueError
from dockd.net import device_share
from dockd.net.connection import timed_out
from dockd.net.device_transport import LinkFailed

logger = logging.getLogger(__name__)

UNRESPONSIVE_TRY_S = 0.5
"""Seconds a fetch waits for a warehouse the controller reports unresponsive (one that just resumed
answers at once; a stopped one makes the get raise DockTimeout after this, whatever its timeout)."""

Plan = dict[int, list[tuple[str, np.ndarray | None]]]  # warehouse -> (column, positions in the lease or None: all)


class Fetcher:
    """A Dock's reads from warehouses."""

    def __init__(self, router: Router, *, fetch_timeout: float) -> None:
        self._router = router
        self.fetch_timeout = fetch_timeout
        self._executor: ThreadPoolExecutor | None = None  # fetches from several warehouses at once
        self._lock = threading.Lock()
        self._device_tiers: dict[int, bool] = {}  # warehouse -> whether it has a device tier

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dockd-fetch")
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def device_tier(self, wid: int) -> bool:
        """Whether warehouse `wid` has a device tier (asked once, then remembered)."""
        tier = self._device_tiers.get(wid)
        if tier is None:
            tier = self._device_tiers[wid] = self._router.hello(wid).device_capacity > 0
        return tier

    def fetch(self, lease: Lease, *, lazy: bool, device=None, deadline: float | None = None) -> dict[str, Any]:
        """Values per column: lists, or with `lazy` the received runs where a column came whole
        from one place (made into a list only when asked for; see Batch). Each warehouse has until
        `deadline` (default: fetch_timeout from now) to answer, else DockTimeout."""
        if deadline is None:
            deadline = time.monotonic() + self.fetch_timeout
        plan = _plan(lease)
        wids = list(plan)
        if not wids:
            results = []
        elif len(wids) == 1:
            results = [self._one(lease, plan[wids[0]], wids[0], lazy, device, deadline)]
        else:
            results = list(self._pool().map(
                lambda wid: self._one(lease, plan[wid], wid, lazy, device, deadline), wids))
        return _merge(lease, plan, wids, results, lazy)

    def _one(self, lease: Lease, parts, wid: int, lazy: bool, device, deadline: float) -> list[Any]:
        """The values of `parts` from warehouse `wid`; on a failed device path, again as host bytes."""
        started = time.monotonic()
        until = deadline
        info = self._router.warehouses.get(wid)
        silent = info is not None and info.state == "unresponsive"  # (as the controller said with this lease)
        if silent:  # a short try: one that just resumed answers at once
            until = min(until, started + UNRESPONSIVE_TRY_S)

        def left() -> float:
            return max(0.001, until - time.monotonic())

        req = pb.FetchRequest(partition=lease.partition)
        for col, pos in parts:
            req.columns.add(name=col, indexes=lease.indexes if pos is None else _at(lease, pos))
        try:
            try:
                pool = self._router.pool(wid, left())
                reply = pool.send(pool.via.fetch_request(wid, req, device, left()))
            except DockConnectionError as e:  # a stale pooled connection: one more try on a fresh one
                if timed_out(e) or until <= time.monotonic():
                    raise
                if not e.replaced:  # (else another thread dropped that pool already)
                    self._router.forget(wid)
                pool = self._router.pool(wid, left())
                reply = pool.send(pool.via.fetch_request(wid, req, device, left()))
        except LinkFailed as e:
            logger.warning("[client] %s; reading that data through host memory", e)
            return self._one(lease, parts, wid, lazy, None, deadline)
        except DockConnectionError as e:
            raise self._failed(lease, parts, wid, e, silent, time.monotonic() - started) from None
        r = reply.frame.fetch_reply
        try:
            return pool.via.decode(r.columns, reply, lazy=lazy, device=device,
                                   shared=r.device_buffers if reply.received is None else ())
        except DockValueError as e:  # device memory this process cannot map: take it as bytes instead
            if not r.device_buffers or reply.received is not None:
                raise
            logger.warning("[client] cannot map warehouse %d's device memory (%s); reading it as host bytes", wid, e)
            return self._one(lease, parts, wid, lazy, None, deadline)

    def _failed(self, lease: Lease, parts, wid: int, e: DockConnectionError, silent: bool, took: float):
        """The error of a fetch from `wid` that failed: DockTimeout for one that is there but silent
        (its connections are dropped, so a late answer is never read) or that keeps its data across a
        restart (--data-dir) and is still a member, or whose dock keeps replicas, else DockDataLost."""
        cols = [c for c, _ in parts]
        samples = sorted({i for _, pos in parts for i in (lease.indexes if pos is None else _at(lease, pos))})
        if not timed_out(e) and self._router.replicas > 1:
            self._router.forget(wid)
            return DockTimeout(  # (the controller moves its values to their replicas once it declares it lost)
                f"cannot read columns {cols} of {len(samples)} samples of partition {lease.partition!r} from warehouse "
                f"{wid} at {self._router.address_of(wid)} ({e}); the dock keeps a replica of each value (--replicas "
                f"{self._router.replicas}), read once the controller declares the warehouse lost. They stay in the "
                "dock (a get's lease is released, so they are handed out again); retry")
        if not timed_out(e):
            known = self._router.warehouses.get(wid)
            state = self._router.warehouse_state(wid) if known is not None and known.durable else ""
            if state not in ("rejoining", "joined", "unresponsive"):
                return DockDataLost(f"cannot read columns {cols} of {len(samples)} samples from warehouse {wid}: {e}",
                                    indexes=samples, columns=cols)
            self._router.forget(wid)
            return DockTimeout(  # (a warehouse with a data dir restarting: the controller waits for it)
                f"cannot read columns {cols} of {len(samples)} samples of partition {lease.partition!r} from warehouse "
                f"{wid} at {self._router.address_of(wid)} ({e}), but it keeps its data across restarts (--data-dir) "
                f"and the controller still counts it as a member ({state}): its restart brings the samples back. "
                "They stay in the dock (a get's lease is released, so they are handed out again); retry later"
            )
        self._router.forget(wid)
        why = (f"the controller reports that it stopped answering, and it did not answer within {took:.1f}s either"
               if silent else f"it did not answer within {took:.1f}s")
        return DockTimeout(
            f"cannot read columns {cols} of {len(samples)} samples of partition {lease.partition!r} from warehouse "
            f"{wid} at {self._router.address_of(wid)}: {why} (a stopped, hung or overloaded process?). The samples "
            "stay in the dock (a get's lease is released, so they are handed out again); retry later, or see "
            "`dockd status` for the warehouse's state"
        )


def _at(lease: Lease, pos: np.ndarray) -> list[int]:
    return np.asarray(lease.indexes, dtype=np.int64)[pos].tolist()


def _plan(lease: Lease) -> Plan:
    """Which warehouse holds what: a column held whole by one warehouse is one part; a column
    spread over several is one part per warehouse, with the positions it holds."""
    plan: Plan = {}
    for ci, col in enumerate(lease.columns):
        if col in lease.inline:
            continue
        assert lease.locations is not None  # None only when every column came inline
        row = lease.locations[ci]
        first = int(row[0])
        if (row == first).all():
            plan.setdefault(first, []).append((col, None))
            continue
        for wid in np.unique(row).tolist():
            plan.setdefault(wid, []).append((col, np.flatnonzero(row == wid)))
    return plan


def _merge(lease: Lease, plan: Plan, wids: list[int], results: list[list[Any]], lazy: bool) -> dict[str, Any]:
    """The columns in the lease's order: inline ones, whole ones, and spread ones put together."""
    out: dict[str, Any] = dict(lease.inline)
    if not lazy:
        out = {c: v.values() if isinstance(v, codec.Runs) else v for c, v in out.items()}
    n = len(lease.indexes)
    for wid, cols in zip(wids, results):
        for (col, pos), values in zip(plan[wid], cols):
            if pos is None:
                out[col] = values
            else:  # a column spread over warehouses: put each part in its place
                dst = out.setdefault(col, [None] * n)
                for p, v in zip(pos.tolist(), values.values() if isinstance(values, codec.Runs) else values):
                    dst[p] = v
    return {c: out[c] for c in lease.columns}


# -- results on a device ------------------------------------------------------------------------------
def maps_device(target) -> bool:
    """Whether a get for `target` takes device-tier data as shared device memory (copied once, device
    to device) rather than as host bytes."""
    return target is not None and device_share.tiered(target.type)


def _on(t, dev) -> bool:
    return t.device.type == dev.type and (dev.index is None or t.device.index == dev.index)


def to_device(values: list[Any], dev) -> list[Any]:
    """A column's tensors on `dev`: one pinned host buffer and one copy per dtype, then views.
    Non-tensor values, and tensors already there (from the device tier), stay as they are."""
    import torch

    if dev.type == "cpu":
        return [v.to(dev) if isinstance(v, torch.Tensor) else v for v in values]
    out = list(values)
    by_dtype: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and not _on(v, dev):
            by_dtype.setdefault(v.dtype, []).append(i)
    for dtype, pos in by_dtype.items():
        sizes = [values[i].numel() for i in pos]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
        codec.cat_into([values[i].reshape(-1) for i in pos], sizes, host)
        flat = host.to(dev, non_blocking=True)
        for i, part in zip(pos, torch.split(flat, sizes)):
            out[i] = part.view(values[i].shape)
    if by_dtype:
        getattr(torch, dev.type).current_stream(dev).synchronize()  # (the pinned buffers may go now)
    return out
