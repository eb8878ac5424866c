"""Where a client's requests go, and how it gets back when a daemon goes away.

A `Router` holds the connection pool to the controller, one pool per
warehouse it talks to, the warehouse table, and the home warehouse its puts
go to. Calls go through it:

- `controller(...)`: on a dropped or refused connection it reconnects to the
  controller's address (which must stay the same across a restart), learns the
  dock's warehouses again and re-sends the request. Every controller request
  is safe to re-send: acquires carry a token, so a retried acquire gets the
  lease its lost reply carried instead of a second one.
- `warehouse(...)`: the home warehouse. When it cannot be reached the client
  re-homes to another live warehouse (unless one was pinned with
  `warehouse=`) and re-sends the put; puts carry a token, so a warehouse
  that already applied one answers the retry without storing it twice.

With several controllers (dockd.owners) the first contact's Hello lists them
all; a request about a partition goes to its owner (`controller(...,
partition=)`), a lease call to the controller that granted the lease (`at=`),
each over a pool of its own, reconnected the same way.

Retries back off from 50 ms to 1 s and give up after `reconnect_timeout`
seconds (or the call's own deadline, if sooner) with a DockConnectionError
naming the daemon's host:port.

Each pool talks to its daemon over the best transport that works: the
router's `Dialer` opens it (trying `dockd.net.candidates` in order) and
closes them all with the client; the router never looks at which one it got.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.client.dialer import Dialer
from dockd.client.home import choose_home
from dockd.client.retry import retry
from dockd.errors import (
    DockClosed,
    DockConfigError,
    DockConnectionError,
    DockError,
    DockTimeout,
)
from dockd.net import tls, wire
from dockd.net.connection import Credentials, timed_out
from dockd.net.pool import Pool
from dockd.net.transport import Context, Endpoint

T = TypeVar("T")

logger = logging.getLogger(__name__)

REFUSED_RETRY_S = 3.0
"""Seconds the first connection retries an address where nothing listens (a daemon that is starting)
before it gives up, within connect_timeout; a daemon that accepts but is slow gets all of connect_timeout."""


class Router:
    def __init__(self, host: str, port: int, *, warehouse: int | str | None, connect_timeout: float,
                 reconnect_timeout: float, name: str, stop: threading.Event, prefer: str | None = None,
                 creds: Credentials | None = None, ctx: Context | None = None) -> None:
        self.ctx = ctx if ctx is not None else Context()
        self.dialer = Dialer(connect_timeout=connect_timeout, creds=creds if creds is not None else Credentials(),
                             ctx=self.ctx)
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout
        self.name = name
        self._stop = stop  # set when the client closes: retries end at once
        self.host, self.port = host, port
        self.pinned = warehouse if warehouse not in (None, "") else None
        self.prefer = prefer  # "host:port" to choose as home while it is live (e.g. this Ray node's)
        self.lock = threading.Lock()
        self._reconnecting = threading.Lock()
        self.pools: dict[int, Pool] = {}
        self.warehouses: dict[int, pb.WarehouseInfo] = {}
        self.replicas = 1  # warehouses holding each value (the controller's --replicas)
        self.ctrl = self.dialer.plain(Endpoint(host, port))
        self.home = -1
        self.reconnects = 0  # times the controller connection was made again (its sessions' leases may be gone)
        # several controllers (dockd.owners): every one's address in the dock's order, and the pools to the
        # others than the first contact, opened on first use
        self.controllers: list[str] = []
        self.shards: dict[str, int] = {}  # spread partitions (--shards) -> their shard counts
        self._others: dict[str, Pool] = {}
        # partition -> warehouses that answered a put of ours before its commit (--commit-window), since
        # this client's last controller call on that partition: flushed before the next (read-your-writes)
        self._unflushed: dict[str, set[int]] = {}

    def wrote(self, partition: str, wid: int) -> None:
        """Warehouse `wid` answered a put to `partition` that may not be committed yet."""
        with self.lock:
            self._unflushed.setdefault(partition, set()).add(wid)

    def flush_writes(self, partition: str | None, deadline: float | None = None) -> None:
        """Before a controller call on `partition` (None: on every partition): have each warehouse that
        answered a put of ours there before its commit apply those commits first, so that the call sees
        them. A warehouse that cannot be reached is passed over with a warning: what it answered and did
        not commit goes with it, as its stored values do."""
        if not self._unflushed:  # (every controller call passes here: no lock when there is nothing to flush)
            return
        with self.lock:
            todo = self._unflushed if partition is None else {partition: self._unflushed.pop(partition, set())}
            if partition is None:
                self._unflushed = {}
        for part, wids in todo.items():
            frame = pb.Frame(flush=pb.FlushRequest(partition=part))
            for wid in sorted(wids):
                limit = self.reconnect_timeout if deadline is None else max(0.1, deadline - time.monotonic())
                try:
                    self.pool(wid).call(frame, timeout=limit)
                except DockError as e:
                    logger.warning("[client] warehouse %s could not apply the commits of puts it answered before "
                                   "them (partition %r): %s; this call may not see them yet", self.address_of(wid),
                                   part, e)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _replace_ctrl(self, pool: Pool) -> None:
        """Send controller calls over `pool` from now on; the previous pool's calls in flight finish."""
        old, self.ctrl = self.ctrl, pool
        self.dialer.retire(old)

    @property
    def closed(self) -> bool:
        return self.dialer.closed

    def close(self) -> None:
        self.dialer.close()

    # -- connecting ------------------------------------------------------------------------
    def connect(self) -> None:
        """First contact: the controller (followed from a warehouse's address), the
        same-host transport, the warehouse table and the home warehouse. Waits up to
        connect_timeout for a daemon that is not up yet."""
        deadline = time.monotonic() + self.connect_timeout
        self.ctrl, hello = self._retry(lambda: self._hello_here(self.ctrl), deadline, self.address,
                                       refused_s=REFUSED_RETRY_S)
        if not hello.hosts_controller:
            if not hello.controller:
                raise DockConnectionError(f"{self.address} is a dockd warehouse that knows no controller")
            logger.info("[client] %s is a warehouse; following it to the controller at %s", self.address,
                        hello.controller)
            self.dialer.close_pool(self.ctrl)
            self.host, _, port = hello.controller.rpartition(":")
            self.port = int(port)
            self.ctrl = self.dialer.plain(Endpoint(self.host, self.port))
            self.ctrl, hello = self._retry(lambda: self._hello_here(self.ctrl), deadline, self.address,
                                           refused_s=REFUSED_RETRY_S)
        self._adopt(hello)
        try:
            self.home = self._choose_home(exclude=None, retrying=False)
        except DockConnectionError:  # no warehouse has joined yet: the first put picks one (or waits for it)
            logger.info("[client] the dock at %s has no live warehouse yet", self.address)

    def _hello(self, pool: Pool, timeout: float | None = None) -> pb.HelloReply:
        """A Hello on `pool`, answered within `timeout` (default connect_timeout), connecting included."""
        deadline = time.monotonic() + (self.connect_timeout if timeout is None else timeout)
        conn = pool.get(deadline - time.monotonic())
        try:
            reply, _, _ = conn.call(pb.Frame(hello=pb.Hello(client=self.name, protocol=wire.PROTOCOL_VERSION,
                                                            controllers=self.controllers,
                                                            shards=owners.shard_names(self.shards))),
                                    timeout=max(0.001, deadline - time.monotonic()))
        except BaseException:
            pool.discard(conn)
            raise
        pool.put(conn)
        hello = reply.hello_reply
        wire.check_protocol(hello.protocol, f"dockd at {pool.address}")
        if hello.disagreement:  # the dock's controllers were started with different lists: it refuses service
            raise DockConfigError(hello.disagreement)
        shards = owners.shard_names(self.shards)
        if hello.hosts_controller and self.controllers and owners.differs(self.controllers, hello.controllers, shards,
                                                                          hello.shards):
            raise DockConfigError(owners.disagreement(
                self.controllers, f"the controller this client reached first ({self.address})", hello.controllers,
                f"the controller at {pool.address}", shards, hello.shards))
        return hello

    def _hello_here(self, pool: Pool, timeout: float | None = None) -> tuple[Pool, pb.HelloReply]:
        """A Hello over `pool` (a new TCP pool to a controller), and the pool to go on with. A TLS daemon
        that this client has no TLS settings for is asked over its same-host socket instead when it runs
        on this host (its TLS preamble names the socket): that never leaves the host, so it needs no TLS."""
        try:
            return pool, self._hello(pool, timeout)
        except tls.NeedsTls as e:
            here = (self.dialer.better(Endpoint(pool.host, pool.port, e.same_host), pool.via, timeout)
                    if e.same_host else None)
            if here is None:  # (another host, or TCP only: TLS settings are what it takes)
                raise
        try:
            hello = self._hello(here, timeout)
        except BaseException:
            self.dialer.close_pool(here)
            raise
        self.dialer.close_pool(pool)
        return here, hello

    def _adopt(self, hello: pb.HelloReply) -> None:
        """Take a controller's hello: a better transport to it if it offers one, and the warehouse table."""
        better = self.dialer.better(Endpoint(self.host, self.port, hello.unix, advertised=hello), self.ctrl.via)
        if better is not None:
            self._replace_ctrl(better)
        if hello.controllers:
            self.controllers = list(hello.controllers)
            self.shards = owners.shards_from(hello.shards)
        self.replicas = hello.replicas or 1
        fresh = {w.id: w for w in hello.warehouses}
        with self.lock:
            stale = [wid for wid, pool in self.pools.items()
                     if wid not in fresh or not pool.via.matches(_endpoint(fresh[wid]))]
            gone = [self.pools.pop(wid) for wid in stale]
            self.warehouses = fresh
        for pool in gone:
            self.dialer.close_pool(pool)

    def _choose_home(self, exclude: int | None, *, retrying: bool) -> int:
        return choose_home(self.warehouses, pinned=self.pinned, prefer=self.prefer, exclude=exclude,
                           retrying=retrying, address=self.address)

    def pool(self, wid: int, timeout: float | None = None) -> Pool:
        """The connections to warehouse `wid`. The first use of a same-host one tries its shared-memory
        socket within `timeout` seconds (at most connect_timeout)."""
        pool = self.pools.get(wid)
        if pool is not None:
            return pool
        info = self.warehouses.get(wid)
        if info is None:
            raise DockConnectionError(f"warehouse {wid} is unknown to this client")
        new = self.dialer.better(_endpoint(info), None, timeout)
        assert new is not None  # with no current transport, the fallback (TCP) always gives a pool
        with self.lock:
            pool = self.pools.setdefault(wid, new)
        if pool is not new:
            self.dialer.close_pool(new)
        return pool

    def hello(self, wid: int, timeout: float | None = None) -> pb.HelloReply:
        """Ask warehouse `wid` about itself (one attempt: an unreachable one raises at once; one that
        does not answer within `timeout`, default connect_timeout, raises then)."""
        try:
            pool = self.pool(wid, timeout)
            return self._hello(pool, timeout)
        except DockConnectionError:
            self.forget(wid)
            raise

    def forget(self, wid: int) -> None:
        """Drop the connections to a warehouse that failed: the next call reconnects. Other threads'
        calls in flight on them finish on their own (their answer, or their own timeout): closing
        the connections under them would make a call to a live warehouse fail as if the client
        had been closed."""
        with self.lock:
            pool = self.pools.pop(wid, None)
        if pool is not None:
            self.dialer.retire(pool)

    def learn(self, infos) -> None:
        """Warehouses named by a controller reply: new ones are added; for known ones at the same
        address, the state (joined, unresponsive, ...) is brought up to date."""
        for w in infos[:]:  # (a list: see dockd.net.wire)
            known = self.warehouses.get(w.id)
            if known is None or (known.host, known.port) == (w.host, w.port):
                self.warehouses[w.id] = w

    def warehouse_state(self, wid: int) -> str:
        """The controller's word on warehouse `wid` now ("joined", "rejoining", ...; "" when it is
        no member, or the controller cannot say within a connect_timeout)."""
        try:
            hello, = self.controller(lambda pool: (self._hello(pool),), deadline=time.monotonic() + self.connect_timeout)
        except DockError:
            return ""
        self.learn(hello.warehouses)
        return next((w.state or "joined" for w in hello.warehouses if w.id == wid), "")

    def address_of(self, wid: int) -> str:
        info = self.warehouses.get(wid)
        return f"{info.host}:{info.port}" if info is not None else f"id {wid}"

    # -- calls ---------------------------------------------------------------------------------
    def owner(self, partition: str) -> str:
        """The address of the controller that owns `partition` ("" : the one this client first reached)."""
        if len(self.controllers) <= 1:
            return ""
        address = self.controllers[owners.owner_index(partition, len(self.controllers))]
        return "" if address == self.address else address

    def controller(self, call: Callable[[Pool], T], *, deadline: float | None = None, partition: str | None = None,
                   at: str = "") -> T:
        """Run `call(pool)` against the controller (with several: the one that owns `partition`, or the
        one at address `at`); on a lost connection, reconnect and run it again."""
        if partition is not None:
            at = self.owner(partition)
        if at and at != self.address:
            return self._calling(at, call, deadline, lambda limit: self._other_pool(at, limit),
                                 lambda pool, give_up, e: self._drop_other(at, pool))
        return self._calling(self.address, call, deadline, None, self._reconnect)

    def _calling(self, address: str, call: Callable[[Pool], T], deadline: float | None,
                 pool_of: Callable[[float], Pool] | None, recover: Callable[[Pool, float, Exception], None]) -> T:
        """Run `call(pool_of(limit))` (no pool_of: on `ctrl`) against the controller at `address`; on a lost
        connection, `recover` and run it again, for up to reconnect_timeout (and not past `deadline`)."""
        give_up = None
        while True:
            pool = self.ctrl if pool_of is None else pool_of(give_up or self._give_up(deadline))
            try:
                return call(pool)
            except DockConnectionError as e:
                if self.closed:
                    raise DockClosed("the dock client was closed while this call was in flight") from None
                if not e.retry:
                    raise
                if e.replaced:
                    continue  # (another thread reconnected: the call goes to the new connections)
                if give_up is None:
                    give_up = self._give_up(deadline)
                    if timed_out(e) and time.monotonic() >= give_up:
                        raise  # (silent past the call's time, and probed: a reconnect would be silent too)
                    logger.warning("[client] lost the controller at %s (%s); reconnecting", address, e)
                elif time.monotonic() >= give_up:
                    raise DockConnectionError(f"the dockd controller at {address} kept failing: {e}") from None
                recover(pool, give_up, e)

    def _other_pool(self, address: str, limit: float) -> Pool:
        """The pool to one of several controllers other than the first contact (opened, retried until `limit`)."""
        pool = self._others.get(address)
        return pool if pool is not None else self._retry(lambda: self._open_controller(address, self._within(limit)),
                                                         limit, address)

    def _drop_other(self, address: str, pool: Pool) -> None:
        with self.lock:
            if self._others.get(address) is pool:
                del self._others[address]
                self.reconnects += 1
        self.dialer.retire(pool)

    def _open_controller(self, address: str, timeout: float | None = None) -> Pool:
        """A pool to the controller at `address` over the best transport it offers (checked with a Hello
        answered within `timeout`, default connect_timeout)."""
        host, _, port = address.rpartition(":")
        plain = self.dialer.plain(Endpoint(host, int(port)))
        try:
            plain, hello = self._hello_here(plain, timeout)
            if not hello.hosts_controller:
                raise DockConnectionError(f"{address} does not host a dockd controller")
            better = self.dialer.better(Endpoint(host, int(port), hello.unix, advertised=hello), plain.via)
        except BaseException:
            self.dialer.close_pool(plain)
            raise
        if better is not None:
            self.dialer.close_pool(plain)
            plain = better
        with self.lock:
            pool = self._others.setdefault(address, plain)
        if pool is not plain:
            self.dialer.close_pool(plain)
        return pool

    def _give_up(self, deadline: float | None) -> float:
        """When to stop retrying a daemon that went away: reconnect_timeout from now (a call may have
        waited long before its connection dropped), and not past `deadline`."""
        later = time.monotonic() + self.reconnect_timeout
        return later if deadline is None else min(later, deadline)

    def _within(self, give_up: float) -> float:
        """Seconds a connection attempt may take: connect_timeout, and not past `give_up` (but at
        least half a second: an attempt that cannot succeed would hide the error that led to it)."""
        return max(0.5, min(self.connect_timeout, give_up - time.monotonic()))

    def _reconnect(self, failed: Pool, give_up: float, cause: Exception) -> None:
        # another thread reconnecting (the confirm flusher, say) may try for longer than this call may
        # wait: its lock is waited for only until this call gives up
        if not self._reconnecting.acquire(timeout=max(0.0, give_up - time.monotonic())):
            raise DockConnectionError(
                f"cannot reach dockd at {self.address} in the time this call had (another thread of this client "
                f"is still reconnecting): {cause}")
        try:
            if self.ctrl is not failed:
                return  # another thread already did
            fresh = self.dialer.plain(Endpoint(self.host, self.port))
            try:
                fresh, hello = self._retry(lambda: self._hello_here(fresh, self._within(give_up)), give_up, self.address,
                                           cause)
                if not hello.hosts_controller:
                    raise DockConnectionError(f"{self.address} no longer hosts the dockd controller")
            except BaseException:
                self.dialer.close_pool(fresh)
                raise
            self._replace_ctrl(fresh)
            self.reconnects += 1
            self._adopt(hello)
            logger.info("[client] reconnected to the controller at %s transport=%s", self.address, self.ctrl.transport)
        finally:
            self._reconnecting.release()

    def warehouse(self, call: Callable[[int, Pool], T], deadline: float | None = None) -> T:
        """Run `call(wid, pool)` against the home warehouse; if it is unreachable, re-home and run it again
        (for up to reconnect_timeout, and not past `deadline`)."""
        give_up = None
        if self.home < 0:
            first = give_up = self._give_up(deadline)
            self.home = self._retry(lambda: self._rehome(-1, first), first,
                                    f"a live warehouse of the dock at {self.address}")
        fresh = False  # a failure on a pooled connection is first retried on a new one to the same warehouse
        while True:
            wid = self.home
            try:
                return call(wid, self.pool(wid))
            except DockConnectionError as e:
                if self.closed:
                    raise DockClosed("the dock client was closed while this call was in flight") from None
                if not e.retry:
                    raise
                if e.replaced:
                    continue  # (another thread dropped these connections: the call goes to new ones)
                self.forget(wid)
                silent = timed_out(e)  # it answered neither the call nor a probe: stopped or hung
                if not fresh and not silent:  # e.g. the daemon closed an idle connection: the warehouse is fine
                    fresh = True
                    continue
                info = self.warehouses.get(wid)
                where = f"{info.host}:{info.port}" if info is not None else f"id {wid}"
                if give_up is None:
                    give_up = self._give_up(deadline)
                    logger.warning("[client] lost home warehouse %d at %s (%s); re-homing", wid, where, e)
                elif time.monotonic() >= give_up:
                    raise DockConnectionError(f"the dockd warehouse at {where} kept failing: {e}") from None
                self.home = self._retry(functools.partial(self._rehome, wid, give_up), give_up, where, e)
                if silent and self.home == wid:
                    raise DockTimeout(
                        f"the dockd warehouse {wid} at {where} did not answer ({e}) and there is no other live "
                        "warehouse to send the request to; it was not acknowledged. A put may still be applied "
                        "if that warehouse resumes (once). Check the warehouse (stopped? hung? `dockd status`)"
                    ) from None

    def _rehome(self, failed: int, give_up: float) -> int:
        hello, = self.controller(
            lambda pool: (self._hello(pool, self._within(give_up)),), deadline=give_up)
        self._adopt(hello)
        try:
            home = self._choose_home(exclude=failed if self.pinned is None else None, retrying=True)
        except DockConnectionError:  # no other live warehouse: the failed one, if the dock still lists it live
            home = self._choose_home(exclude=None, retrying=True)
        if home != failed:
            logger.info("[client] new home warehouse id=%d address=%s:%d", home, self.warehouses[home].host,
                        self.warehouses[home].port)
        return home

    def _retry(self, attempt: Callable[[], T], give_up: float, what: str, cause: Exception | None = None, *,
               refused_s: float | None = None) -> T:
        return retry(attempt, give_up, what, cause, stopped=self._stopped, refused_s=refused_s)

    def _stopped(self, seconds: float) -> bool:
        """Wait `seconds` between attempts; whether the client closed meanwhile."""
        return self._stop.wait(seconds) or self.closed


def _endpoint(info: pb.WarehouseInfo) -> Endpoint:
    return Endpoint(info.host, info.port, info.unix, info.id, advertised=info)
