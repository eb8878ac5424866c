"""Confirms and releases of leases, and the controller calls that carry them.

Confirms of gets ride on the next acquire, or go out on their own after
CONFIRM_DELAY_S: a get then costs one wake-up of the controller, not two.
Until confirmed, the controller would give the samples back if this client
died, which is the safe direction. The same flusher thread reports the
segments of same-host daemons this process no longer maps (unpins).

A client that goes away on purpose confirms what its gets returned first
(`close`): on `Dock.close()`, when a `Dock` is collected, and at interpreter
exit for one still open, each within a bounded time. Only a client that dies
(SIGKILL, a crash, `os._exit`) leaves them to the controller, which hands its
samples out again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.client.lease import Lease
from dockd.client.router import Router
from dockd.client.scope import CallScope
from dockd.errors import DockConnectionError, DockError, DockLeaseError
from dockd.net.connection import forks
from dockd.net.pool import Pool

logger = logging.getLogger(__name__)

CONFIRM_DELAY_S = 0.02


class Confirms:
    """A Dock's pending confirms, its flusher, and its other lease calls to the controller."""

    def __init__(self, router: Router, *, connect_timeout: float, wake: threading.Event,
                 stop: threading.Event) -> None:
        self._router = router
        self._connect_timeout = connect_timeout
        # leases fetched but not yet confirmed, by the controller that granted them ("": the first contact)
        self._pending: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        # confirms another thread took and is sending, by controller; an acquire waits for them (`take`)
        self._sending: dict[str, int] = {}
        self._sent = threading.Condition(self._lock)
        self.wake = wake
        self._stop = stop
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._forks = forks()  # (a forked child's copy is its parent's to confirm)
        self._held: dict[int, Lease] = {}  # leases taken ahead (get(prefetch=...)), not handed out yet

    def ctrl_call(self, frame: pb.Frame, *, timeout: float | None = None, deadline: float | None = None,
                  scope: CallScope | None = None, partition: str | None = None,
                  at: str = "") -> tuple[pb.Frame, np.ndarray, list[int]]:
        """A controller request (to the one that owns `partition`, or the one at `at`), re-sent after a
        reconnect if the connection drops. Pending confirms are delivered first, so the call sees this
        client's own gets applied (those the flusher is sending too), and so are the commits of its puts
        answered before them (a call naming no partition: of every partition)."""
        self._router.flush_writes(partition, deadline)
        self.flush()
        with self._lock:
            self._settle(lambda: self._sending, deadline)
        def call(pool: Pool) -> tuple[pb.Frame, np.ndarray, list[int]]:
            if timeout is None:
                return pool.ask(frame, scope=scope)
            return pool.call(frame, timeout=timeout, scope=scope)

        return self._router.controller(call, deadline=deadline, partition=partition, at=at)

    # -- the queue -------------------------------------------------------------------------------
    def soon(self, lease_id: int, at: str = "") -> None:
        with self._lock:
            self._pending.setdefault(at, []).append(lease_id)
            if self._flusher is None:
                self._flusher = threading.Thread(target=_flush_loop, args=(weakref.ref(self), self.wake, self._stop),
                                                 name="dockd-confirm", daemon=True)
                self._flusher.start()
        if not self.wake.is_set():  # (set: the flusher has yet to clear it, and flushes after that, this one too)
            self.wake.set()

    def take(self, at: str = "", deadline: float | None = None) -> list[int]:
        """The pending confirms of the controller at `at`, once those that another thread (the flusher)
        is sending there are answered (waited for until `deadline`, at most connect_timeout). A request
        sent before them could overtake them: a rank-aware get would then be handed its last share
        again, its samples delivered twice."""
        with self._lock:
            if self._sending:
                self._settle(lambda: self._sending.get(at, 0), deadline)
            return self._pending.pop(at, [])

    def _settle(self, sending, deadline: float | None) -> None:
        """Wait, holding the lock, while `sending()` (until `deadline`, at most connect_timeout)."""
        limit = time.monotonic() + self._connect_timeout
        if deadline is not None:
            limit = min(limit, deadline)
        while sending() and self._sent.wait(max(0.0, limit - time.monotonic())):
            pass

    def put_back(self, leases: list[int], at: str = "") -> None:
        """Confirms that did not reach the controller go out again with the next request."""
        if leases:
            with self._lock:
                self._pending[at] = leases + self._pending.get(at, [])

    # -- leases taken ahead ------------------------------------------------------------------------
    def hold(self, leases: list[Lease]) -> None:
        """Leases taken ahead: released when the client goes, unless a get hands them out first."""
        with self._lock:
            self._held.update((lease.id, lease) for lease in leases)

    def serve(self, lease: Lease) -> None:
        """A lease taken ahead is a get's now: confirmed as that get's, no longer released at close."""
        with self._lock:
            self._held.pop(lease.id, None)

    def release_held(self, leases: list[Lease], timeout: float | None = None) -> None:
        """Give leases taken ahead back now, one request per controller (best effort, within `timeout`,
        default connect_timeout: a lease not given back expires, or goes back with this client's session)."""
        by_at: dict[str, list[int]] = {}
        with self._lock:
            for lease in leases:
                self._held.pop(lease.id, None)
                by_at.setdefault(lease.controller, []).append(lease.id)
        limit = self._connect_timeout if timeout is None else timeout
        for at, ids in by_at.items():
            frame = pb.Frame(release=pb.ReleaseRequest(lease=ids[0], leases=ids[1:]))
            try:
                self._router.controller(functools.partial(_call, frame=frame, timeout=limit), at=at,
                                        deadline=time.monotonic() + limit)
            except Exception as e:  # noqa: BLE001 - they expire instead
                logger.warning("[client] could not release %d lease(s) taken ahead (%s): their samples go back to the "
                               "pool when they expire or this client's connections close", len(ids), e)

    def flush(self, *, retry: bool = True, timeout: float | None = None) -> None:
        """Deliver every pending confirm, to each controller its own (without `retry`: one attempt
        each, answered within `timeout`, default connect_timeout)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            for at in pending:
                self._sending[at] = self._sending.get(at, 0) + 1
        items = list(pending.items())
        try:
            for k, (at, leases) in enumerate(items):
                try:
                    self.send(leases, at, retry=retry, timeout=timeout)  # (a failed send keeps its own pending)
                except BaseException:
                    for later, rest in items[k + 1:]:
                        self.put_back(rest, later)
                    raise
        finally:
            with self._lock:
                for at in pending:
                    self._sending[at] -= 1
                    if not self._sending[at]:
                        del self._sending[at]
                self._sent.notify_all()

    def send(self, leases: list[int], at: str = "", *, retry: bool = True, timeout: float | None = None) -> None:
        """Deliver confirms and wait for the controller's answer (a one-way frame to a controller
        that just died would vanish without an error); on failure they stay pending."""
        if not leases:
            return
        frame = pb.Frame(confirm=pb.ConfirmRequest(leases=leases))
        limit = self._connect_timeout if timeout is None else timeout
        try:
            if retry:
                reply, _, _ = self._router.controller(lambda pool: pool.ask(frame), at=at)
            elif at:
                reply, _, _ = self._router.controller(lambda pool: pool.call(frame, timeout=limit), at=at,
                                                      deadline=time.monotonic() + limit)
            else:
                reply, _, _ = self._router.ctrl.call(frame, timeout=limit)
        except BaseException:
            self.put_back(leases, at)
            raise
        _warn_late(reply.confirm_reply, len(leases))

    def close(self, timeout: float) -> None:
        """The client goes (Dock.close, its collection, interpreter exit): deliver what its gets
        fetched, those another thread is sending included, within `timeout` seconds, one attempt
        each. Runs once; afterwards nothing is pending. A controller that cannot take them now
        gets the samples back when this client's connections close (at-least-once), as from a
        client that died. Waits on locks only for `timeout` too: it must never hang an exit."""
        deadline = time.monotonic() + timeout
        if threading.current_thread() is self._flusher:  # (a Dock in a reference cycle, collected by a pass of the
            return  # collector that the flusher's own allocation started: it may hold the locks a send takes)
        if self._closed or self._forks != forks() or not self._lock.acquire(timeout=timeout):
            return
        try:
            self._closed = True
            self._settle(lambda: self._sending, deadline)
            held, self._held = list(self._held.values()), {}
        finally:
            self._lock.release()
        if held:  # (first: the other clients of their consumers take them now)
            self.release_held(held, timeout=max(0.001, deadline - time.monotonic()))
        try:
            self.flush(retry=False, timeout=max(0.001, deadline - time.monotonic()))
        except DockError as e:
            with self._lock:
                lost, self._pending = sum(map(len, self._pending.values())), {}
            logger.warning("[client] could not confirm the samples of %d get(s) as the client closed (%s): unless "
                           "the controller still reads that confirm, it hands them out again", lost, e)

    # -- one lease -------------------------------------------------------------------------------
    def confirm(self, lease: Lease) -> None:
        """Dock.confirm: DockLeaseError when the lease is gone or another client's without its ticket."""
        self.send(self.take(lease.controller), lease.controller)
        frame = pb.Frame(confirm=pb.ConfirmRequest(leases=[lease.id], tickets=[lease.ticket]))
        reply, _, _ = self._router.controller(lambda pool: pool.ask(frame), at=lease.controller)
        r = reply.confirm_reply
        if r.refused:
            raise DockLeaseError(f"lease {lease.id} belongs to another client: hand it over with its ticket")
        if r.unknown:
            raise DockLeaseError(
                f"lease {lease.id} expired or was released before this confirm: its {len(lease.indexes)} samples "
                "were handed out again. Confirm sooner, extend it (dock.extend, or acquire(lease_timeout=...)), or "
                "raise the daemon's --lease-timeout."
            )

    def confirm_now(self, lease: Lease, took: float) -> None:
        """Confirm a get's lease before its values are returned; DockLeaseError if it is gone (expired,
        or released with this client's session), so samples handed out again are never returned.
        A controller that cannot be reached leaves the confirm pending, as for any get."""
        leases = [*self.take(lease.controller), lease.id]
        frame = pb.Frame(confirm=pb.ConfirmRequest(leases=leases))
        limit = self._connect_timeout
        try:
            reply, _, _ = self._router.controller(lambda pool: pool.call(frame, timeout=limit),
                                                  deadline=time.monotonic() + limit, at=lease.controller)
        except DockConnectionError as e:
            logger.warning("[client] could not confirm lease=%d (%s); it goes out with the next request", lease.id, e)
            self.put_back(leases, lease.controller)
            self.wake.set()
            return
        r = reply.confirm_reply
        _warn_late(r, len(leases) - 1, but=lease.id)
        if lease.id in r.refused:
            raise DockLeaseError(
                f"this get's lease {lease.id} on {len(lease.indexes)} samples of partition {lease.partition!r} was "
                "refused as another client's: the controller did not count this connection in the session that "
                "took it, so the samples are not returned here; they go out again when the lease ends"
            )
        if lease.id in r.unknown:
            raise DockLeaseError(
                f"this get's lease {lease.id} on {len(lease.indexes)} samples of partition {lease.partition!r} expired "
                f"or was released while the get took {took:.1f}s: the samples were handed out again, so they are not "
                "returned here (nothing is lost: another get received them). Raise the daemon's --lease-timeout or "
                "read smaller batches."
            )

    def release(self, lease: Lease) -> int:
        """Dock.release: the lease's samples go back to the pool; how many the controller gave back."""
        frame = pb.Frame(release=pb.ReleaseRequest(lease=lease.id, ticket=lease.ticket))
        reply, _, _ = self.ctrl_call(frame, at=lease.controller)
        return reply.release_reply.released

    def release_now(self, lease: Lease) -> None:
        """Give back the lease of a get that failed, within connect_timeout (best effort: the controller
        also frees it when the lease expires or this client goes away)."""
        frame = pb.Frame(release=pb.ReleaseRequest(lease=lease.id, ticket=lease.ticket))
        limit = self._connect_timeout
        try:
            self._router.controller(lambda pool: pool.call(frame, timeout=limit), deadline=time.monotonic() + limit,
                                    at=lease.controller)
        except Exception as e:  # noqa: BLE001 - never mask the error that made the get fail
            logger.warning("[client] could not release lease=%d after a failed fetch: %s", lease.id, e)

    def release_token(self, token: int, at: str = "") -> None:
        """Give back whatever lease an interrupted acquire got, so no sample stays leased to a call
        nobody waits for (best effort: otherwise the lease expires)."""
        frame = pb.Frame(release=pb.ReleaseRequest(token=token))
        try:
            if at:
                limit = self._connect_timeout
                self._router.controller(lambda pool: pool.call(frame, timeout=limit), at=at,
                                        deadline=time.monotonic() + limit)
            else:
                self._router.ctrl.call(frame, timeout=self._connect_timeout)
        except BaseException as e:  # noqa: BLE001 - never mask the interruption itself
            logger.debug("[client] could not release an interrupted acquire: %s", e)

    def send_unpins(self) -> None:
        """Tell daemons which of the segments they lent this process it no longer maps (one-way;
        a lost one only keeps a segment from being reused until this process exits)."""
        for pool in list(self._router.dialer.pools):
            pool.via.idle()  # (replies whose values are gone that no call unmapped yet: their unpins too)
            sids = pool.via.take_unpins()
            if not sids:
                continue
            try:
                conn = pool.get()
                try:
                    conn.post(pb.Frame(oneway=True, unpin=sids))
                finally:
                    pool.put(conn)
            except DockError as e:
                logger.debug("[client] could not send unpins: %s", e)


def _call(pool: Pool, *, frame: pb.Frame, timeout: float) -> tuple[pb.Frame, np.ndarray, list[int]]:
    return pool.call(frame, timeout=timeout)


def _flush_loop(ref: weakref.ref, wake: threading.Event, stop: threading.Event) -> None:
    """The confirm flusher of one Dock; holds its confirms only weakly so a dropped Dock can be collected."""
    while not stop.is_set():
        wake.wait()
        wake.clear()
        stop.wait(CONFIRM_DELAY_S)  # gather the confirms of a burst of gets
        confirms = ref()
        if confirms is None:
            return
        try:
            confirms.flush()  # reconnects if a controller restarted
        except DockError as e:  # gone for good, or closing: unconfirmed leases expire and are handed out again
            logger.warning("[client] could not confirm fetched leases: %s", e)
        confirms.send_unpins()
        del confirms


def _warn_late(r: pb.ConfirmReply, sent: int, but: int | None = None) -> None:
    """Say which confirms of gets that returned already came too late (their samples go out again):
    expired or released (`unknown`), or refused as another client's (`refused`: this client's session
    does not own them, which a lease it took over any of its connections never is)."""
    unknown = sum(1 for i in r.unknown if i != but)
    refused = sum(1 for i in r.refused if i != but)
    if unknown:
        logger.warning("[client] %d of %d leases expired before their confirm reached the controller: their "
                       "samples were handed out again (consider a longer --lease-timeout)", unknown, sent)
    if refused:
        logger.warning("[client] %d of %d confirms were refused as another client's: the controller does not count "
                       "this connection in the session that took them, and hands their samples out again", refused,
                       sent)
