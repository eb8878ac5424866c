"""Leases on the wire: client sessions (leases belong to a session, and go back to the pool when
its last connection closes), tickets (the proof that hands a lease over to another process),
confirm, release and extend as clients ask them, and lease expiry on the service's clock."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pathlib
import secrets

from dockd._proto import dockd_pb2 as pb
from dockd.controller.clock import Timer, Timers
from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.controller.lease_table import Lease
from dockd.controller.pacing import Pacer
from dockd.controller.waiters import Waiters
from dockd.controller.warehouse_calls import WarehouseCalls
from dockd.errors import DockLeaseError, DockValueError
from dockd.net.peer import Peer

logger = logging.getLogger(__name__)


def ticket_key(state_dir: pathlib.Path) -> bytes:
    """The controller's key for lease tickets, kept in its state dir so tickets outlive a restart."""
    path = state_dir / "lease-secret"
    try:
        raw = path.read_bytes()
        if len(raw) == 32:
            return raw
    except OSError:
        pass
    raw = os.urandom(32)
    tmp = state_dir / "lease-secret.tmp"
    try:
        with open(tmp, "wb", opener=lambda name, flags: os.open(name, flags, 0o600)) as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        logger.warning("[controller] cannot keep the lease-ticket key in %s (%s): tickets handed out now will not "
                       "be honoured after a restart", state_dir, e)
    return raw


class Leasing:
    """The leases of one controller's clients, journaled in `journal` (None: none kept), their
    deadlines on `timers`. A lease that ends wakes the gets `waiting` on its partition; a taken
    one lets the puts paced on it in (`pacer`) and may leave frees for the warehouses (`calls`)."""

    def __init__(self, core: Controller, journal: Journal | None, timers: Timers, *, waiting: Waiters,
                 pacer: Pacer, calls: WarehouseCalls) -> None:
        self.core = core
        self.journal = journal
        self.timers = timers
        self.waiting = waiting
        self.pacer = pacer
        self.calls = calls
        self.sessions: dict[bytes, set[Peer]] = {}  # client session -> its connections (leases belong to sessions)
        self._keyed = hashlib.blake2b(key=secrets.token_bytes(32), digest_size=16)  # (see `ticket`)
        self.expired = 0  # leases that expired unconfirmed
        self._expiry: Timer | None = None
        self._expiry_at = float("inf")

    # -- sessions and tickets -------------------------------------------------------------------
    def session(self, peer: Peer) -> bytes:
        """The session a client connection belongs to (a connection without one is its own)."""
        sid = peer.sid
        if sid is None:  # registered at authentication (ControllerService.on_authed), or here at its first request
            # A connection without a session gets one nobody can name (a claimed session never
            # starts with a zero byte), so no other client can act on its leases.
            own = peer.session and not peer.session.startswith(b"\0")
            sid = peer.sid = peer.session if own else b"\0" + secrets.token_bytes(15)
            self.sessions.setdefault(sid, set()).add(peer)
        return sid

    def set_ticket_key(self, key: bytes) -> None:
        """Sign tickets with `key` (one kept in the state dir, so that tickets outlive a restart)."""
        self._keyed = hashlib.blake2b(key=key, digest_size=16)

    def ticket(self, lease_id: int) -> bytes:
        """The hand-over proof for a lease: whoever holds it may confirm, release or extend it (a keyed
        blake2b of its id: the keyed state is made once and copied, ~0.3 us less a lease than keying anew)."""
        h = self._keyed.copy()
        h.update(lease_id.to_bytes(8, "little"))
        return h.digest()

    def owned(self, peer: Peer, lease_id: int, ticket: bytes) -> Lease | None:
        """The lease if this peer may act on it; None if it is gone; raises DockLeaseError if it is another's."""
        lease = self.core.leases.get(lease_id)
        if lease is None:
            return None
        sid = self.session(peer)
        if lease.owner == sid or (lease.holders is not None and sid in lease.holders) or (
                ticket and hmac.compare_digest(ticket, self.ticket(lease_id))):
            return lease
        raise DockLeaseError(f"lease {lease_id} belongs to another client; hand it over with its ticket "
                             "(Lease.ticket) to confirm, release or extend it from here")

    def peer_lost(self, peer: Peer) -> list[Lease]:
        """A connection closed; the leases released because it was its session's last one."""
        sid = peer.sid
        if sid is None:
            return []
        conns = self.sessions.get(sid)
        if conns is None:
            return []
        conns.discard(peer)
        if conns:
            return []
        del self.sessions[sid]  # the client's last connection: it is gone, its leases go back to the pool
        released = self.core.release_owner(sid)
        if self.journal is not None:
            for lease in released:
                self.journal.release(lease.id, applied=True)
        return released

    # -- what clients ask -----------------------------------------------------------------------
    def confirm(self, peer: Peer, leases, tickets, out: pb.ConfirmReply | None = None, *, hold: bool = False) -> None:
        """Confirm leases this peer may act on; the rest are reported in `out`. `hold`: their journal record
        goes with the request's next one (the caller flushes the journal before it answers)."""
        if not leases:
            return
        core = self.core
        done, unknown, refused, sealed, mine = [], [], [], set(), []
        for k, lid in enumerate(leases[:]):  # ([:]: see dockd.net.wire)
            try:
                lease = self.owned(peer, lid, tickets[k] if k < len(tickets) else b"")
            except DockLeaseError:
                refused.append(lid)
                continue
            if lease is None:
                # (a clear took its samples, or this confirm is a re-send of one applied: nothing was handed out again)
                if lid not in core.cleared_leases and lid not in core.book.taken:
                    unknown.append(lid)
                continue
            member = lease.holders.get(self.session(peer)) if lease.holders else None
            mine.append((lease, member))
            # (as Controller.confirm decides: a share read by several ranks ends with its last reader's confirm)
            if lease.need <= 1 or member is None or (lease.confirmed | 1 << member).bit_count() >= lease.need:
                done.append(lid)
        if done and self.journal is not None:
            self.journal.confirm(done, hold=hold)  # written ahead: confirms the journal cannot take are not applied
        for lease, member in mine:
            if core.confirm(lease.id, member):
                part = core.partitions.get(lease.partition)
                if part is not None and part.sealed and lease.partition in self.waiting.by_partition:
                    sealed.add(lease.partition)  # the last leased samples taken: waiting gets may be at the end
        if done:
            self.calls.schedule_frees()  # (retirement)
            if self.pacer.paced:
                for lease, _ in mine:
                    self.pacer.soon(lease.partition)
        for name in sealed:
            self.waiting.wake(name)
        if unknown or refused:
            logger.warning("[controller] confirms refused peer=%s expired_or_released=%d another_clients=%d",
                           peer.name, len(unknown), len(refused))
        if out is not None:
            out.unknown.extend(unknown)
            out.refused.extend(refused)

    def extend(self, peer: Peer, req: pb.ExtendRequest) -> pb.ExtendReply:
        lease = self.owned(peer, req.lease, req.ticket)
        if lease is None:
            if req.lease in self.core.cleared_leases:
                raise DockLeaseError(f"lease {req.lease} ended when its partition was cleared")
            raise DockLeaseError(f"lease {req.lease} expired or was released: its samples were handed out again")
        seconds = req.seconds if req.seconds > 0 else self.core.lease_timeout
        if not seconds <= 7 * 86400:
            raise DockValueError(f"a lease is extended by at most a week, got {req.seconds}s")
        if self.journal is not None:
            self.journal.extend(lease.id, seconds)
        self.core.extend(lease.id, self.timers.clock() + seconds)
        self.schedule_expiry()
        return pb.ExtendReply(seconds=seconds)

    def release(self, peer: Peer, req: pb.ReleaseRequest) -> int:
        """Give leases back (the one named or its acquire's token's, and `req.leases`); how many
        samples went back to the pool. The gets waiting on their partitions are tried at once."""
        ids = [req.lease or self.core.lease_tokens.get(req.token, 0), *req.leases[:]]  # ([:]: see dockd.net.wire)
        released, woken = 0, set()
        for k, lease_id in enumerate(ids):
            lease = self.owned(peer, lease_id, req.ticket if k == 0 else b"")
            if lease is None or lease.need > 1:  # (a share other model-parallel ranks read: it expires if unconfirmed)
                continue
            if self.journal is not None:
                self.journal.release(lease_id)  # written ahead
            lease = self.core.release(lease_id)
            if lease is not None:
                released += len(lease.indexes)
                woken.add(lease.partition)
        for name in woken:
            self.waiting.wake(name)
        return released

    # -- expiry ---------------------------------------------------------------------------------
    def schedule_expiry(self) -> None:
        deadline = self.core.next_lease_deadline()
        if deadline is None or deadline >= self._expiry_at:
            return
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = deadline
        self._expiry = self.timers.call_at(deadline, self._on_expiry)

    def _on_expiry(self) -> None:
        self._expiry, self._expiry_at = None, float("inf")
        expired = self.core.expire_leases(self.timers.clock())
        if self.journal is not None:
            for lease in expired:
                self.journal.release(lease.id, applied=True)
        self.expired += len(expired)
        if expired:
            logger.warning("[controller] leases expired unconfirmed count=%d; their samples return to the pool",
                           len(expired))
        for part in {l.partition for l in expired}:
            self.waiting.wake(part)
        self.schedule_expiry()

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
