"""A warehouse's link to its controller: join, commit, and rejoin after losing it.

The warehouse outlives its controller. When the connection drops it keeps
its data and keeps serving fetches; it reconnects with backoff and rejoins
with its id, its instance (random per process: the controller tells a
restarted warehouse from one that only lost its connection), what it holds
(the inventory) and the commits it is still waiting on. A warehouse may also
start before its controller: it waits for it the same way. The controller
sends heartbeats over the link (Hello requests, answered like any client's);
a warehouse that stops answering them is shown `unresponsive` until it does.
A registration that would displace a live member is refused; a restarted
warehouse is accepted once the controller has seen it answer at its address.

Commits carry a per-warehouse sequence number (`put_id`), so a commit whose
reply was lost to the outage is re-sent in the rejoin and applied once. A
put whose commit cannot reach the controller for `grace` seconds fails with
DockConnectionError (the client can retry it).

A controller that refuses this warehouse (it cannot prove the daemon role there: another daemon
token or secret; or the two were started with different --controllers lists) is not hammered: the
link logs the reason (at most once a minute), tries again every REFUSED_RETRY_S seconds, and the puts
that wait for it fail at once with that reason rather than after the grace period with "unreachable".

On a dock with TLS (`--tls-cert`) the link reads the controller's TLS preamble and
runs the TLS handshake before the dockd one (`dial.open_link`); a warehouse whose TLS
settings do not match its controller's stops at its first join with the reason.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import math
import random
import time
from collections.abc import Callable

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.config import commits_in_flight, env
from dockd.errors import (
    DockAuthError,
    DockConfigError,
    DockConnectionError,
    DockError,
    DockProtocolError,
    DockStateFull,
    DockTimeout,
)
from dockd.net import auth, tls
from dockd.net.peer import Peer
from dockd.node.dial import open_link
from dockd.node.link_commits import Pending, expire, free_cleared, hold, outcome_of
from dockd.terms import CommitOutcome
from dockd.warehouse.blocks import Blocks

logger = logging.getLogger(__name__)

BACKOFF_MIN, BACKOFF_MAX = 0.05, 1.0
REFUSED_RETRY_S = 10.0  # seconds between joins of a controller that refused this warehouse (auth, --controllers)
BATCH_BYTES = 4 << 20  # bytes of commits a batch collects before it goes (besides MAX_COMMIT_BATCH of them)
#: DOCKD_COMMIT_BATCH=0: every commit goes to the controller at once, alone (the baseline benchmarks.commit_batch
#: measures coalescing against); unset or 1: coalesced
COALESCE = env("DOCKD_COMMIT_BATCH", "1") != "0"



class ControllerLink:
    """Owns the connection from a warehouse to its controller.

    Args:
        address: the controller's "host:port".
        make_peer: builds the framed connection (the node handles requests on it, e.g. free).
        registration: the node's RegisterWarehouse (host, port, capacity, unix, instance).
        inventory: builds the rejoin inventory (excluding the given uncommitted puts).
        on_drop: frees a partition the controller no longer has.
        grace: seconds a put waits for an unreachable controller before failing.
        window: --commit-window: seconds the commits of puts answered before their commit wait to go
            together (0: every put is answered after its commit).
    """

    def __init__(self, address: str, *, make_peer: Callable[[], Peer], registration: pb.RegisterWarehouse,
                 inventory: Callable[[list[pb.CommitRequest]], list[pb.InventoryPartition]],
                 on_drop: Callable[[str], object], grace: float, link_tls: tls.LinkTls | None = None,
                 window: float = 0.0, token: bytes | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.address, self.host, self.port = address, host, int(port)
        self.make_peer = make_peer
        # TLS to the controller: given, else that of the daemon whose make_link_peer this is (Listeners.link_tls)
        self.tls = link_tls if link_tls is not None else getattr(getattr(make_peer, "__self__", None), "link_tls", None)
        self.registration = registration
        self.token = token  # the dock's client token (--token-file): the controller checks it is its own
        self.inventory = inventory
        self.on_drop = on_drop
        self.grace = grace
        self.window = window
        self.blocks = Blocks()  # blocks of new indexes this warehouse hands out (--commit-window)
        self.grants = False     # the controller grants blocks (RegisterReply.blocks)
        self._window: list[Pending] = []  # commits of answered puts, waiting for the window to go
        self._window_at: asyncio.TimerHandle | None = None
        self.peer: Peer | None = None
        self.wid = -1
        self._joined_once = False  # a join of this process was answered (a later one is a rejoin after a lost link)
        self.joined = asyncio.Event()
        self._lost = asyncio.Event()
        self._pending: dict[int, Pending] = {}  # put_id -> commit waiting for its reply, in order
        self._queue: collections.deque[Pending] = collections.deque()  # joined: not sent yet (the next batch)
        self._held = 0  # commits at the head of _queue held for a full state dir (`_hold`)
        self._flush_at: asyncio.Handle | None = None
        self.in_flight = commits_in_flight()  # (read at start: a bad value stops the daemon there, with its name)
        self._out: set[asyncio.Future] = set()  # commit messages sent by _flush, not answered yet (in_flight)
        self._ids = itertools.count(1)  # put ids of commits (`next_put_id`)
        self._task: asyncio.Task | None = None
        self._closing = False
        self._down_since: float | None = time.monotonic()
        self.refused: DockError | None = None  # why the controller refused this warehouse's last join, if it did
        self._refused_logged = ("", 0.0)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self, timeout: float | None) -> None:
        """Join the controller, waiting for it up to `timeout` seconds (None: as long as it takes)."""
        self._task = asyncio.ensure_future(self._run())
        joined = asyncio.ensure_future(self.joined.wait())
        done, _ = await asyncio.wait({self._task, joined}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done and not self._task.cancelled() and self._task.exception() is not None:
            joined.cancel()
            self.close()
            raise self._task.exception()  # type: ignore[misc]  # (a TLS mismatch with the controller)
        if joined not in done:
            joined.cancel()
            self.close()
            if self.refused is not None:  # it answered, and refused this warehouse: that is why
                raise self.refused
            raise DockConnectionError(
                f"cannot reach the controller at {self.address} to join it within {timeout:g}s; start it, or "
                "check the address (--join)"
            ) from None

    def resume(self, wid: int, seq: int) -> None:
        """A warehouse restarted on its data dir: it rejoins as `wid` (if it had one), and numbers its
        commits above `seq` (the put ids the last process may have used)."""
        self._ids = itertools.count(seq + 1)
        if wid >= 0:
            self.wid = wid

    def start_in_background(self) -> None:
        """Join the controller whenever it is there, without waiting for it (one of several
        controllers that is not up yet stalls only the puts of the partitions it owns)."""
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("[link] gave up joining the controller at %s: %s", self.address, task.exception())

    def close(self, leave: bool = False) -> None:
        self._closing = True
        if leave and self.peer is not None and not self.peer.closed and self.joined.is_set():
            self.peer.send(pb.Frame(leave=pb.LeaveRequest(id=self.wid), oneway=True))
        if self._task is not None:
            self._task.cancel()
        if self._window_at is not None:
            self._window_at.cancel()
        early = 0
        for p in self._pending.values():
            if p.timer is not None:
                p.timer.cancel()
            if p.windowed:  # (answered already: it goes with the warehouse's values, nothing to answer)
                early += not p.fut.done()
                p.fut.cancel()
            elif not p.fut.done():
                p.fut.set_result(CommitOutcome(error=DockConnectionError("the warehouse is shutting down")))
        if early:
            logger.warning("[link] %d puts answered before their commit were not committed to the controller at %s: "
                           "they go with this warehouse's values", early, self.address)
        self._pending.clear()
        self._queue.clear()
        self._held = 0
        self._window.clear()

    def connection_lost(self, peer: Peer) -> None:
        if peer is self.peer:
            self._lost.set()

    # -- the connection loop ------------------------------------------------------------------
    async def _run(self) -> None:
        delay, waiting_logged = BACKOFF_MIN, 0.0
        while not self._closing:
            try:
                _, peer = await asyncio.wait_for(open_link(self.make_peer, self.host, self.port, self.tls), 5.0)
            except DockAuthError as e:  # TLS settings that do not match the controller's
                if self.wid < 0:
                    raise  # never joined: the warehouse stops with the reason
                logger.error("[link] cannot rejoin the controller at %s: %s", self.address, e)
                await asyncio.sleep(BACKOFF_MAX)
                continue
            except (OSError, asyncio.TimeoutError, DockProtocolError) as e:
                now = time.monotonic()
                if now - waiting_logged > 30:
                    waiting_logged = now
                    logger.warning("[link] waiting for the controller at %s (%s); retrying", self.address,
                                   e or "timed out")
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            self.peer, self._lost = peer, asyncio.Event()
            assert peer.authed is not None  # (an outgoing connection's, made once it connected)
            try:
                await asyncio.wait_for(peer.authed, 10.0)
                await self._register(peer)
            except (DockAuthError, DockConfigError) as e:  # refused: another daemon key, or another controller list
                peer.close()
                self._refuse(e)
                await asyncio.sleep(REFUSED_RETRY_S)
                continue
            except (DockError, OSError, asyncio.TimeoutError) as e:
                # DockTimeout: the controller is checking that this process is the one at its address
                # (it replaces a member registered there); anything else is worth a warning
                logger.log(logging.INFO if isinstance(e, DockTimeout) else logging.WARNING,
                           "[link] joining the controller at %s failed: %s; retrying", self.address,
                           e if str(e) else type(e).__name__)
                peer.close()
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            delay, waiting_logged = BACKOFF_MIN, 0.0
            self._down_since = None
            if self.refused is not None:
                logger.warning("[link] the controller at %s accepts this warehouse again", self.address)
                self.refused = None
            self.joined.set()
            for p in self._pending.values():  # made before the first join, or while this (re)join was answered
                if p.timer is not None:
                    p.timer.cancel()
                    p.timer = None
                if p.sent is None:
                    self._enqueue(p)
            await self._lost.wait()
            self.joined.clear()
            if self._closing:
                return
            self._down_since = time.monotonic()
            logger.warning("[link] lost the controller at %s; keeping this warehouse's data and serving reads, "
                           "rejoining when it is back", self.address)
            for p in self._pending.values():
                self._arm(p)

    def _refuse(self, e: DockError) -> None:
        """The controller refused this warehouse: say why (once a minute at most) and fail the puts
        waiting for it with that reason."""
        text = str(e)
        if isinstance(e, DockAuthError):
            e = DockConnectionError(
                f"the warehouse cannot join the controller at {self.address}: {text}. Without "
                "--daemon-token-file each controller on a host shares its daemon secret with that host's "
                "daemons only: give every daemon of the dock the same --daemon-token-file")
            e.retry = False
        self.refused = e
        now = time.monotonic()
        if self._refused_logged[0] != text or now - self._refused_logged[1] > 60:
            self._refused_logged = (text, now)
            logger.error("[link] the controller at %s refuses this warehouse: %s (trying again every %gs)",
                         self.address, e, REFUSED_RETRY_S)
        for p in list(self._pending.values()):
            if p.timer is not None:
                p.timer.cancel()
                p.timer = None
            if not p.windowed:  # (an answered put's commit waits for the controller to take this warehouse back)
                self._resolve(p, CommitOutcome(error=e))

    async def _register(self, peer: Peer) -> None:
        reg = pb.RegisterWarehouse()
        reg.CopyFrom(self.registration)
        assert peer.challenge is not None  # (authenticated: it came first)
        reg.token_told, reg.token_proof = True, auth.token_proof(peer.challenge, self.token)
        rejoin = self.wid >= 0
        pending = list(self._pending.items())
        if rejoin:
            reg.rejoin, reg.id = True, self.wid
            reg.pending.extend(p.req for _, p in pending)
            reg.inventory.extend(self.inventory([p.req for _, p in pending]))
            reg.blocks.extend(sorted(set(self.blocks.ids()) | {p.req.block for _, p in pending if p.req.block}))
        reply, _ = await asyncio.wait_for(peer.request(pb.Frame(register=reg)), 60.0)
        out = reply.register_reply
        if rejoin and out.id != self.wid:
            logger.warning("[link] the controller gave this warehouse a new id old=%d new=%d", self.wid, out.id)
            self.blocks.clear()
        if self.window and not out.blocks and (self.grants or not rejoin):
            logger.warning("[link] --commit-window %gs: the controller at %s grants no blocks of indexes (no --state-dir, "
                           "or --replicas 2): puts are answered after their commit", self.window, self.address)
        self.grants = bool(out.blocks) and self.window > 0
        if not self.grants:
            self.blocks.clear()
        self.wid = out.id
        self.registration.id = out.id
        self.registration.ClearField("lost")  # (files its data dir dropped at start: told to the first answered
        self.registration.lost_unknown = False  # join only; a later rejoin must not lose values written since)
        logger.info("[link] joined controller=%s warehouse=%d rejoin=%s", self.address, out.id, rejoin)
        free_cleared(out.drop, self.on_drop, restarted=rejoin and not self._joined_once)
        self._joined_once = True
        if rejoin:
            self._queue.clear()  # (every commit queued before the rejoin went with it)
            self._held = 0
            self._window.clear()
            for (_, p), res in zip(pending, out.pending):
                if p.timer is not None:
                    p.timer.cancel()
                self._resolve(p, outcome_of(res))
        self._out.clear()  # (what was on its way went over the connection lost)

    # -- commits ----------------------------------------------------------------------------------
    def commit(self, req: pb.CommitRequest, limit: float) -> asyncio.Future:
        """Commit a put's metadata; resolves to its outcome (failures included). Waits (up to `limit`
        seconds, and at most `grace`) while the controller is unreachable; re-sent on rejoin if its reply
        was lost."""
        req.put_id = self.next_put_id()
        fut = asyncio.get_running_loop().create_future()
        p = Pending(req, fut, min(limit, self.grace) if limit >= 0 else self.grace)
        self._pending[req.put_id] = p
        if self.joined.is_set():
            self._enqueue(p)
        elif self.refused is not None:
            self._resolve(p, CommitOutcome(error=self.refused))
        else:
            self._arm(p)
        return fut

    def _enqueue(self, p: Pending) -> None:
        """Queue a commit for the batch that goes at the end of this turn of the loop, with every other
        commit of the puts read in the same turn, or (in_flight batches unanswered) with the next answer."""
        if not COALESCE:
            self._send_alone(p)
            return
        self._queue.append(p)
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the queued commits as one CommitBatch (up to MAX_COMMIT_BATCH of them; one alone)."""
        self._flush_at = None
        peer = self.peer
        if not self.joined.is_set() or peer is None:
            return  # the rejoin sends them (RegisterWarehouse.pending)
        if self.in_flight and len(self._out) >= self.in_flight:
            return  # they go once one of those is answered (_sent_answered)
        out: list[Pending] = []
        size = 0
        while self._queue and len(out) < limits.MAX_COMMIT_BATCH and size < BATCH_BYTES:
            p = self._queue.popleft()
            if self._pending.get(p.req.put_id) is p and p.sent is None and not p.fut.done():
                p.req.warehouse = self.wid
                size += p.req.ByteSize()
                out.append(p)
        if self._queue:  # (more than one batch holds)
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)
        if len(out) < 2:
            for p in out:  # (one commit goes as it did before coalescing)
                self._send_alone(p)
                self._track(p.sent)
            return
        sent = peer.request(pb.Frame(commits=pb.CommitBatch(commits=[p.req for p in out])))
        for slot, p in enumerate(out):
            p.sent, p.slot = sent, slot
        sent.add_done_callback(functools.partial(self._batch_answered, out))
        self._track(sent)

    def _track(self, sent: asyncio.Future | None) -> None:
        """Count a commit message `_flush` sent among those on their way (in_flight)."""
        if self.in_flight and sent is not None:
            self._out.add(sent)
            sent.add_done_callback(self._sent_answered)

    def _sent_answered(self, sent: asyncio.Future) -> None:
        """A commit message was answered (or its connection lost): the commits queued meanwhile go now."""
        self._out.discard(sent)
        if self._queue and self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)

    def _batch_answered(self, out: list[Pending], f: asyncio.Future) -> None:
        exc = f.exception() if not f.cancelled() else DockConnectionError("commit cancelled")
        if not isinstance(exc, DockConnectionError):  # (the link is down: they go out again with the rejoin)
            results = f.result()[0].commits_reply.results if exc is None else ()
            if exc is None and len(results) != len(out):
                exc = DockProtocolError(f"the controller answered {len(results)} of a batch of {len(out)} commits")
            for slot, p in enumerate(out):
                if exc is not None:
                    self._resolve(p, CommitOutcome(error=exc))
                elif results[slot].wait:  # its partition paces puts: sent alone, it waits at the controller
                    self._send_alone(p)
                else:
                    self._resolve(p, outcome_of(results[slot]))

    def _send_alone(self, p: Pending) -> None:
        assert self.peer is not None  # (joined, or its batch was just answered on it)
        p.slot = -1
        p.req.warehouse = self.wid
        p.sent = self.peer.request(pb.Frame(commit=p.req))
        p.sent.add_done_callback(functools.partial(self._committed, p))

    def _resolve(self, p: Pending, outcome: CommitOutcome) -> None:
        if p.windowed and isinstance(outcome.error, DockStateFull):
            return hold(self, p, outcome.error)
        if self._pending.get(p.req.put_id) is p:
            del self._pending[p.req.put_id]
        if not p.fut.done():
            p.fut.set_result(outcome)

    def answered(self, put_id: int) -> bool:
        """Whether the controller's answer to commit `put_id` has been read from the connection (its
        future resolves a moment later): requests read after it were sent after it was applied."""
        p = self._pending.get(put_id)
        if p is None:
            return True
        sent = p.sent
        if sent is None or not sent.done() or sent.cancelled() or sent.exception() is not None:
            return False
        if p.slot < 0:
            return True
        results = sent.result()[0].commits_reply.results
        return p.slot < len(results) and not results[p.slot].wait and results[p.slot].status.code == pb.OK

    def _committed(self, p: Pending, f: asyncio.Future) -> None:
        exc = f.exception() if not f.cancelled() else DockConnectionError("commit cancelled")
        if isinstance(exc, DockConnectionError):
            return  # the link is down: it stays pending and goes out again with the rejoin
        self._resolve(p, CommitOutcome(error=exc) if exc is not None else outcome_of(f.result()[0].commit_reply))

    def _arm(self, p: Pending) -> None:
        if p.timer is None and not p.fut.done() and not p.windowed:
            p.timer = asyncio.get_running_loop().call_later(p.limit, expire, self, p)

    # -- puts answered before their commit (--commit-window) -------------------------------------------
    def commit_windowed(self, req: pb.CommitRequest) -> asyncio.Future:
        """Commit an answered put's metadata (put id given already, if its data dir file keeps it) in the next
        window; resolves to its outcome. It waits for the controller as long as it takes, re-sent on rejoin."""
        req.put_id = req.put_id or self.next_put_id()
        fut = asyncio.get_running_loop().create_future()
        p = Pending(req, fut, math.inf, windowed=True)
        self._pending[req.put_id] = p
        self._window.append(p)
        if len(self._window) >= limits.MAX_COMMIT_BATCH:
            self._release_window()
        elif self._window_at is None:
            self._window_at = asyncio.get_running_loop().call_later(self.window, self._release_window)
        return fut

    def next_put_id(self) -> int:  # (above those of the last process on this data dir: `resume`)
        return next(self._ids)

    def _release_window(self) -> None:
        """The window's commits go now (with the next commit message this link may send)."""
        if self._window_at is not None:
            self._window_at.cancel()
            self._window_at = None
        window, self._window = self._window, []
        if not self.joined.is_set():
            return  # (they wait in _pending and go with the rejoin)
        self._queue.extend(window)
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)

    def windowed(self, partition: str) -> list[asyncio.Future]:
        """The outcomes of the commits of answered puts (of `partition`; "": all) not applied yet; they go now."""
        futs = [p.fut for p in self._pending.values() if p.windowed and (not partition or p.req.partition == partition)]
        if futs:
            self._release_window()
        return futs
