"""Acquires: a get's options sent to the controller as one request, and its reply made into a `Lease`."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.client.confirm import Confirms
from dockd.client.lease import Lease
from dockd.client.options import GetOptions
from dockd.client.router import Router
from dockd.client.scope import CallScope
from dockd.errors import DockConnectionError, DockError, DockValueError
from dockd.net.pool import Pool
from dockd.net.transport import ANSWER_GRACE_S, Reply

logger = logging.getLogger(__name__)


class Acquirer:
    """Sends acquires for a Dock and makes their replies into Leases."""

    def __init__(self, router: Router, confirms: Confirms) -> None:
        self._router = router
        self._confirms = confirms
        self._warned_recovered: set[str] = set()
        self._unmappable = False  # an inline device buffer could not be mapped here: ask for none again

    def acquire(self, opts: GetOptions, *, scope: CallScope | None = None, lazy: bool = False,
                device: Any = None) -> Lease:
        """Send the acquire `opts` asks for (with this client's pending confirms) to the controller,
        re-sent after a reconnect with what is left of its timeout; an interrupted one gives back what
        it got. `lazy`: inline values as received runs (see Batch); `device`: with opts.inline, the
        device-tier values come inline too, shared by handle, and are copied there."""
        frame = opts.frame(self._router.home)
        req = frame.acquire
        if device is not None and opts.inline and not self._unmappable:
            req.device = True
        timeout = None if req.timeout < 0 else req.timeout
        at = self._router.owner(opts.partition)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._router.flush_writes(opts.partition, deadline)  # (sees this client's puts answered before their commit)
        confirms = self._confirms.take(at, deadline)
        req.confirm.extend(confirms)
        used: list[Pool] = []

        def send(pool: Pool):
            if deadline is not None:  # a retry after a reconnect waits only for what is left
                req.timeout = max(0.0, deadline - time.monotonic())
            used[:] = [pool]
            # (waited for as long as the controller answers probes: a stopped one is reconnected to)
            return pool.call(frame, scope=scope, alive=pool.answers,
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
                     a.rank_weights[:], parts=a.leases[:], seconds=a.lease_seconds, per=a.per_lease)
