"""Acquires: the request (every argument checked) and its reply made into a `Lease`."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dockd import ids, limits
from dockd._proto import dockd_pb2 as pb
from dockd.client import validate
from dockd.client.confirm import Confirms
from dockd.client.lease import Lease
from dockd.client.router import CallScope, Router
from dockd.errors import DockConnectionError, DockError, DockValueError
from dockd.net.pool import Pool
from dockd.net.transport import ANSWER_GRACE_S, Reply

logger = logging.getLogger(__name__)


def acquire_request(consumer: str, columns: Sequence[str], count: int, *, partition: str, timeout: float | None,
                    groups: bool, allow_partial: bool, shuffle: bool, seed: int | None, inline: bool,
                    lease_timeout: float | None, dp_rank: int | None, dp_size: int | None,
                    mp_group: tuple[int, int, int] | None, step: int | None, balance_by: str | Sequence[str] | None,
                    where: Mapping[str, Any] | None, order_by: str | None, prefer_local: bool,
                    max_staleness: int | None, home: int) -> pb.AcquireRequest:
    """An acquire's request, every argument checked (see Dock.get and Dock.acquire)."""
    validate.check_partition(partition)
    validate.consumer_and_columns(consumer, columns)
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 1:
        raise DockValueError(f"count must be a positive int, got {count!r}")
    if count > limits.MAX_SAMPLES:
        raise DockValueError(f"count must be at most {limits.MAX_SAMPLES} samples per get, got {count!r}")
    timeout = validate.seconds(timeout)
    req = pb.AcquireRequest(partition=partition, consumer=consumer, columns=list(columns), count=int(count),
                            groups=groups, allow_partial=allow_partial, shuffle=shuffle, inline=inline,
                            timeout=-1.0 if timeout is None else float(timeout))
    validate.rank_fields(req, dp_rank, dp_size, mp_group, step, balance_by)
    validate.acquire_options(req, seed=seed, where=where, max_staleness=max_staleness, order_by=order_by,
                             lease_timeout=lease_timeout)
    if prefer_local and home >= 0:
        if req.dp_size:
            raise DockValueError("prefer_local does not apply to rank-aware gets (dp_size or mp_group): a "
                                 "step's batch is one for all ranks")
        req.near = home + 1
    req.token = ids.random_bits(63) | 1  # a retried acquire gets the lease its lost reply carried
    return req


class Acquirer:
    """Sends acquires for a Dock and makes their replies into Leases."""

    def __init__(self, router: Router, confirms: Confirms) -> None:
        self._router = router
        self._confirms = confirms
        self._warned_recovered: set[str] = set()
        self._unmappable = False  # an inline device buffer could not be mapped here: ask for none again

    def acquire(self, req: pb.AcquireRequest, *, scope: CallScope | None, lazy: bool, device=None) -> Lease:
        """Send `req` (with this client's pending confirms) to the controller, re-sent after a
        reconnect with what is left of its timeout; an interrupted one gives back what it got.
        `device`: where inline device-tier values (req.device) are copied."""
        timeout = None if req.timeout < 0 else req.timeout
        req.device = req.device and not self._unmappable
        at = self._router.owner(req.partition)
        deadline = None if timeout is None else time.monotonic() + timeout
        confirms = self._confirms.take(at, deadline)
        req.confirm.extend(confirms)
        used: list[Pool] = []

        def send(pool: Pool):
            if deadline is not None:  # a retry after a reconnect waits only for what is left
                req.timeout = max(0.0, deadline - time.monotonic())
            used[:] = [pool]
            # (waited for as long as the controller answers probes: a stopped one is reconnected to)
            return pool.call(pb.Frame(acquire=req), scope=scope, alive=pool.answers,
                             timeout=ANSWER_GRACE_S if timeout is None else req.timeout + ANSWER_GRACE_S)

        try:
            reply, body, fds = self._router.controller(send, deadline=deadline, at=at)
        except DockConnectionError as e:
            self._confirms.put_back(confirms, at)
            if not e.retry:  # the answer came but could not be taken in (its descriptors were dropped):
                self._confirms.release_token(req.token, at)  # give back the lease it carried, now
            raise
        except BaseException as e:
            if not isinstance(e, DockError):  # interrupted (Ctrl-C, cancelled): a lease may be on its way to us
                self._confirms.release_token(req.token, at)
            raise
        try:
            lease = self._lease(req, Reply(reply, body, fds), used[0], lazy, device)
        except BaseException:  # its values could not be taken in (a device copy out of memory, a bad reply):
            self._confirms.release_token(req.token, at)  # the samples go back now, not when the lease expires
            raise
        lease.controller = at
        return lease

    def _lease(self, req: pb.AcquireRequest, reply: Reply, pool: Pool, lazy: bool, device=None) -> Lease:
        a = reply.frame.acquire_reply
        self._router.learn(a.warehouses)
        if a.recovered and req.partition not in self._warned_recovered:
            self._warned_recovered.add(req.partition)
            logger.warning(
                "[client] partition %r was rebuilt after a controller restart without a state dir: samples this "
                "consumer took before the restart can be handed out again (start the controller with --state-dir "
                "to keep consumer progress)", req.partition)
        idx = a.indexes[:]  # (lists: see dockd.net.wire)
        columns = req.columns[:]
        got = a.inline[:]
        try:
            values = pool.via.decode(got, reply, lazy=lazy, device=device, shared=a.device_buffers)
        except DockValueError as e:
            if not a.device_buffers:
                raise
            # device memory this process cannot map: every column is fetched (the device-tier ones as
            # host bytes, as a fetch falls back), and later acquires ask for no device-tier values inline
            logger.warning("[client] cannot map the device memory of the controller's warehouse (%s); fetching "
                           "instead", e)
            self._unmappable = True
            got, values = [], []
        inline = dict(zip((c.name for c in got), values))
        locs = None  # only needed to fetch what did not come inline
        if len(inline) < len(columns):
            locs = np.asarray(a.locations[:], dtype=np.int64).reshape(len(columns), len(idx))
        return Lease(a.lease, req.partition, columns, idx, locs, inline, bytes(a.ticket), a.step,
                     a.rank_weights[:])
