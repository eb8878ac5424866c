"""Warehouse membership on the controller: join, rejoin with an inventory, loss.

A warehouse is identified by its id and by `instance`, a random number its
process draws at start: the same id and instance after a reconnect is the
same process with the same data; a new instance at the same address is a
new process, and whatever the old one held is gone.

    joined        connected, registered, and answering heartbeats
    unresponsive  connected, but it left a heartbeat unanswered for
                  `heartbeat_timeout` seconds (a stopped, hung or overloaded
                  process): clients no longer choose it for puts, and gets of
                  its samples fail at once with DockTimeout instead of hanging.
                  Nothing is lost: requests to it wait on its connection, and
                  the first answer makes it `joined` again. It is never
                  declared lost while its connection stays open
    rejoining     its connection dropped (or the controller restarted and knows it
                  from the journal): its data is still served to clients that
                  fetch from it, and it has `grace` seconds to come back
    lost          it did not come back in time, or its address now refuses
                  connections or answers as another process: its samples are
                  lost (DockDataLost when a consumer meets them)
    left          it shut down on purpose

Heartbeats: every `heartbeat_interval` seconds the controller sends each
connected warehouse a Hello over its link (one at a time: the next goes once
the last is answered) and marks it unresponsive when one stays unanswered for
`heartbeat_timeout` seconds.

When a connection drops the controller probes the warehouse's address (again
after 0.05, 0.2 and 1 s while no probe could tell): a refused connection (the
process is gone) or another instance answering retires it at once; otherwise
it waits for the rejoin up to `grace`.

A registration never displaces a live member. One that claims the address of
a member that is still there (joined, unresponsive or rejoining), or that
rejoins under its id and instance from another address, is refused
(DockAuthError), and the member is left as it was, unless:
- it is the same process (same instance, same address) and the member's old
  connection is closed: the usual rejoin after a dropped connection;
- the member no longer answers over its connection (unresponsive, or its
  connection is closed) and a probe of the address is answered by the
  registering instance: the process now listening there is the one
  registering, so the old one is gone (a restart; it is retired as before).
The controller's own warehouse is never displaced. While such a probe runs the
registration is refused with DockTimeout and the warehouse retries (its link
does so by itself).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller.block_drops import drop_blocks
from dockd.controller.clock import Clock, Timer, Timers
from dockd.controller.core import Controller
from dockd.controller.member import WarehouseEntry
from dockd.controller.probes import AddressProbes, Probe, probe_instance
from dockd.controller.warehouses import DURABLE_REJOIN, Inventory
from dockd.errors import DockAuthError, DockConnectionError, DockError, DockTimeout, DockValueError, to_status
from dockd.net import wire
from dockd.net.peer import Peer
from dockd.terms import CommitOutcome

logger = logging.getLogger(__name__)

MAX_WAREHOUSES = 0xFFF0  # ids above are reserved markers (partition.LOST_WAREHOUSE, partition.NO_WAREHOUSE)
HEARTBEAT_INTERVAL = 1.0  # defaults of NodeConfig.heartbeat_interval / heartbeat_timeout
HEARTBEAT_TIMEOUT = 5.0
REPROBE_S = (0.05, 0.2, 1.0)  # after a probe that cannot tell who is at the address, another (see _probe)
_INFOS_KEPT = 4096  # sets of warehouses whose acquire_infos are kept


def inventory_of(req: pb.RegisterWarehouse, field: str = "inventory") -> dict[str, Inventory]:
    """The wire inventory (or another field of its kind: "lost") as index arrays (runs expanded)."""
    out = {}
    for p in getattr(req, field):
        cols = {}
        for c in p.columns:
            runs = np.asarray(c.runs, dtype=np.int64)
            if len(runs) % 2 or (runs[1::2] < runs[0::2]).any() or (runs < 0).any():
                raise DockValueError(f"inventory of partition {p.name!r} column {c.name!r} has malformed runs")
            cols[c.name] = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs.reshape(-1, 2)]) if len(runs) \
                else np.empty(0, np.int64)
        out[p.name] = Inventory(p.group_size or 1, p.nbytes, cols)
    return out


class Membership:
    """The warehouses of one dock. `on_change` is called when samples became lost or
    reachable again (waiting acquires are retried); `journal` may be None."""

    def __init__(self, core: Controller, journal, *, grace: float, on_change: Callable[[], None],
                 heartbeat_interval: float = HEARTBEAT_INTERVAL, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 clock: Clock = time.monotonic, timers: Timers | None = None,
                 probe: Probe | None = None,
                 numbering: tuple[int, int] = (0, 1)) -> None:
        """`clock`: the time grace, heartbeats and probes go by (timers set through `timers`, one of
        that clock: a service passes its own); `probe`: how an address is asked which instance
        answers there (probe_instance); `numbering`: (k, n), this controller's place among the dock's
        n controllers: it numbers new warehouses with ids k, k + n, k + 2n, ..., so that any of them
        can number one (another takes the id as given) and no two give the same id."""
        self.timers = timers if timers is not None else Timers(clock)
        self.clock = self.timers.clock
        self.probe = probe or probe_instance
        # (asked through self.probe, which a test may replace)
        self.addresses = AddressProbes(lambda host, port: self.probe(host, port), self.clock)
        self.core = core
        self.journal = journal
        self._rebuild_warned = False
        self.grace = grace
        self.on_change = on_change
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.entries: dict[int, WarehouseEntry] = {}
        self.numbering = numbering
        self._beat: Timer | None = None
        self._acquire_infos: dict[tuple, bytes] = {}  # (see acquire_infos)

    def get(self, wid: int) -> WarehouseEntry | None:
        return self.entries.get(wid)

    def away(self, but: int = -1) -> list[int]:
        """Members (other than `but`) that do not answer now: unresponsive, disconnected (rejoining),
        or gone. What they were committed may not have reached their storage."""
        return [i for i, e in self.entries.items() if i != but and not (e.state == "joined" and e.connected)]

    def infos(self, ids=None, *, usage: bool = True) -> list[pb.WarehouseInfo]:
        used = self.core.warehouse_bytes() if usage else {}
        ids = self.entries.keys() if ids is None else [i for i in ids if i in self.entries]
        return [self.entries[i].info(used.get(i, 0)) for i in ids]

    def acquire_infos(self, ids: list[int]) -> bytes:
        """`Frame(acquire_reply=AcquireReply(warehouses=infos(ids, usage=False)))`, serialized: appended to
        an acquire's reply frame, whose parse merges it in (protobuf parses concatenated messages as their
        merge). Kept per set of warehouses as they are now: building the infos cost a small get ~10 %."""
        entries = self.entries
        key = tuple(entries[i].key() for i in ids if i in entries)
        raw = self._acquire_infos.get(key)
        if raw is None:
            if len(self._acquire_infos) >= _INFOS_KEPT:
                self._acquire_infos.clear()
            raw = self._acquire_infos[key] = pb.Frame(acquire_reply=pb.AcquireReply(
                warehouses=self.infos(ids, usage=False))).SerializeToString()
        return raw

    def _save(self, entry: WarehouseEntry) -> None:
        if self.journal is not None:
            self.journal.warehouse(entry.record())

    # -- restart --------------------------------------------------------------------------
    def restore(self, records: dict[int, dict]) -> None:
        """Warehouses known from the journal: each gets `grace` seconds to rejoin."""
        for wid, r in records.items():
            entry = WarehouseEntry(wid, r["host"], r["port"], r["capacity"], r["unix"], r["instance"], r["state"])
            self.entries[wid] = entry
            if entry.state in ("joined", "rejoining"):
                self._away(entry, "the controller restarted")

    # -- joining ----------------------------------------------------------------------------
    def register(self, peer: Peer | None, req: pb.RegisterWarehouse,
                 commit: Callable[[pb.CommitRequest], CommitOutcome]) -> pb.RegisterReply:
        """A warehouse joins, or rejoins with what it holds and the commits it is still waiting on.
        Refused when it would displace a member that is still there (see the module docstring)."""
        displaced = []
        for e in list(self.entries.values()):
            if not e.reachable or (peer is not None and e.peer is peer):
                continue
            same_address = (e.host, e.port) == (req.host, req.port)
            if not same_address and not (req.rejoin and e.id == req.id and e.instance == req.instance):
                continue
            if peer is not None:  # (the controller's own warehouse listens at its address in this very process)
                self._may_take_over(e, req, same_address)
            if e.instance != req.instance:
                displaced.append(e)
        for e in displaced:
            self.retire(e, "a new process took over its address")
        if peer is not None:
            self._start_heartbeats()
        entry = self.entries.get(req.id) if req.rejoin or req.assigned else None
        earlier = None if req.rejoin else self._earlier_try(req)
        if earlier is not None and not req.assigned:
            entry = earlier  # its own first try, taken up again: the same id, not a second one
        elif earlier is not None and earlier.id != req.id:
            self.retire(earlier, f"the same process joined as warehouse {req.id}, numbered by another controller",
                        on_purpose=True)
        known = entry is not None and entry.instance == req.instance
        if entry is None or not known:
            if req.assigned:  # several controllers: another one numbered it
                if req.id >= MAX_WAREHOUSES:
                    raise DockValueError(f"warehouse id {req.id} is past the limit {MAX_WAREHOUSES}")
                wid = req.id
            elif req.rejoin and entry is None and req.id < MAX_WAREHOUSES:
                wid = req.id  # a controller without a journal: keep the id clients know it by
            else:
                wid = self._next_id()
            entry = self.entries[wid] = WarehouseEntry(wid, req.host, req.port, req.capacity, req.unix, req.instance)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        was = entry.state
        entry.host, entry.port, entry.capacity, entry.unix = req.host, req.port, req.capacity, req.unix
        entry.state, entry.peer, entry.local = "joined", peer, peer is None
        entry.beat_sent = None
        self._save(entry)
        reply = pb.RegisterReply(id=entry.id)
        if req.rejoin:
            reply.drop.extend(self._reconcile(entry, req, known, commit, reply))
            logger.info("[controller] warehouse rejoined id=%d address=%s:%d was=%s known=%s partitions=%d pending=%d",
                        entry.id, entry.host, entry.port, was if known else "unknown", known, len(req.inventory),
                        len(req.pending))
            self.on_change()
        else:
            logger.info("[controller] warehouse joined id=%d address=%s:%d capacity=%d", entry.id, entry.host, entry.port,
                        entry.capacity)
        return reply

    def _earlier_try(self, req: pb.RegisterWarehouse) -> WarehouseEntry | None:
        """The member this joining process became on an earlier try that it gave up on before the answer
        came (several controllers: it asks the next one after a few seconds): same instance, same
        address, still waited for and holding nothing. A first join is the only one not sent as a
        rejoin, so that entry can only be this process's own."""
        for e in self.entries.values():
            if (e.instance == req.instance and (e.host, e.port) == (req.host, req.port) and e.reachable
                    and not e.connected and not self.core.warehouse_bytes().get(e.id, 0)):
                return e
        return None

    def _next_id(self) -> int:
        """The id of a new warehouse: the next of this controller's own (see `numbering`)."""
        k, n = self.numbering
        wid = max((i for i in self.entries if i % n == k), default=k - n) + n
        if wid >= MAX_WAREHOUSES:
            raise DockValueError(f"too many warehouses registered (limit {MAX_WAREHOUSES})")
        return wid

    def _may_take_over(self, e: WarehouseEntry, req: pb.RegisterWarehouse, same_address: bool) -> None:
        """Raise unless registration `req` may replace member `e`, which it claims (its address, or its
        id and instance): only the same process coming back, or the one now answering at its address."""
        claim = f"{req.host}:{req.port} (instance {req.instance:x})"
        member = f"warehouse {e.id} at {e.host}:{e.port} (instance {e.instance:x}, {e.state})"
        if not same_address:
            raise DockAuthError(f"registration refused: {claim} rejoins as {member} from another address")
        if e.instance == req.instance and not e.connected:
            return  # the same process on a new connection: the usual rejoin
        if e.local:
            raise DockAuthError(f"registration refused: {claim} claims the address of {member}, the controller's own "
                                "warehouse")
        if e.state == "joined" and e.connected:
            self._send_beat(e)  # (a connection dead at the far end is noticed sooner)
            raise DockAuthError(f"registration refused: {claim} claims the address of {member}, a live member whose "
                                "connection is open and answering")
        done, instance = self.addresses.who_answers(req.host, req.port, req.instance)
        if not done:
            raise DockTimeout(f"registration of {claim} waits: the controller is checking which process answers at "
                              f"that address, held by {member}; retry shortly")
        if instance != req.instance:
            answer = ("nothing answers there" if not instance else
                      "the member itself answers there" if instance == e.instance else
                      f"instance {instance:x} answers there")
            raise DockAuthError(f"registration refused: {claim} claims the address of {member}, and {answer}")

    # -- heartbeats ---------------------------------------------------------------------------
    def _start_heartbeats(self) -> None:
        if self._beat is None and self.heartbeat_interval > 0:
            self._beat = self.timers.call_later(self.heartbeat_interval, self._heartbeat)

    def _heartbeat(self) -> None:
        self._beat = None
        now = self.clock()
        for entry in list(self.entries.values()):
            if not entry.alive or not isinstance(entry.peer, Peer) or entry.peer.closed:
                continue
            if entry.beat_sent is None:
                self._send_beat(entry)
            elif entry.state == "joined" and now - entry.beat_sent >= self.heartbeat_timeout:
                self._unresponsive(entry, now - entry.beat_sent)
        self._start_heartbeats()

    def _send_beat(self, entry: WarehouseEntry) -> None:
        peer = entry.peer
        if entry.beat_sent is not None or not isinstance(peer, Peer) or peer.closed:
            return
        entry.beat_sent = self.clock()
        fut = peer.request(pb.Frame(hello=pb.Hello(client="controller", protocol=wire.PROTOCOL_VERSION)))
        fut.add_done_callback(functools.partial(self._beat_answered, entry, peer))

    def _beat_answered(self, entry: WarehouseEntry, peer: Peer, fut: asyncio.Future) -> None:
        exc = None if fut.cancelled() else fut.exception()  # (always retrieved: no "never retrieved" warnings)
        if fut.cancelled() or entry.peer is not peer or entry.beat_sent is None:
            return
        sent, entry.beat_sent = entry.beat_sent, None
        if isinstance(exc, DockConnectionError):
            return  # its connection closed: connection_lost deals with it
        # any answer, even an error, shows the process runs
        if entry.state == "unresponsive":
            entry.state = "joined"
            logger.warning("[controller] warehouse answers again id=%d address=%s:%d silent=%.1fs", entry.id,
                           entry.host, entry.port, self.clock() - sent)
            self.on_change()

    def _unresponsive(self, entry: WarehouseEntry, silent: float) -> None:
        entry.state = "unresponsive"
        logger.warning("[controller] warehouse unresponsive id=%d address=%s:%d silent=%.1fs: its connection is open "
                       "but it answers nothing (a stopped, hung or overloaded process?); gets of its samples fail "
                       "with DockTimeout until it answers again", entry.id, entry.host, entry.port, silent)

    def _reconcile(self, entry: WarehouseEntry, req: pb.RegisterWarehouse, known: bool, commit, reply) -> list[str]:
        inventory = inventory_of(req)
        if not known and inventory and not self._rebuild_warned:
            self._rebuild_warned = True
            logger.warning(
                "[controller] rebuilding partitions from warehouse inventories without a state dir: consumer "
                "progress is forgotten (every sample is handed out again), and new samples put before every "
                "warehouse has rejoined can take indexes a late one holds, whose copies are then dropped. Run the "
                "controller with --state-dir to keep both")
        recall = self.core.catalog.recall if known else lambda warehouse, put_id: None
        for c in req.pending:
            done = recall(entry.id, c.put_id)
            if done is None:
                continue
            # applied before the restart: the warehouse is about to store it, count it as held
            held = inventory.setdefault(c.partition, Inventory(c.group_size or 1, 0, {}))
            held.nbytes += c.nbytes
            for name in c.columns:
                prev = held.columns.get(name)
                held.columns[name] = done if prev is None else np.union1d(prev, done)
        # a durable warehouse (a data dir) that restarted wrote every put it acknowledged: a value recorded on it
        # that it no longer holds was committed but never acknowledged, and becomes unwritten instead of lost
        how: bool | str = DURABLE_REJOIN if known and entry.durable else known
        # ... except values whose files it dropped as damaged at start (--drop-damaged-files): those are lost
        lost: dict[str, Inventory] | bool = True if req.lost_unknown else inventory_of(req, "lost")
        if lost and how != DURABLE_REJOIN:
            logger.error("[controller] warehouse %d dropped damaged files of its data dir at start, but this "
                         "controller does not know it as that member (it restarted without a state dir, or the "
                         "warehouse's identity changed): the samples of those files are not in the partitions "
                         "rebuilt from its inventory (the warehouse's log names them)", entry.id)
        drop = self.core.rejoin(entry.id, inventory, known=how, lost=lost)
        if self.journal is not None:
            self.journal.rejoin(entry.id, inventory, how, lost)
        for c in req.pending:
            c.warehouse = entry.id
            out = reply.pending.add()
            try:
                res = commit(c)  # a re-sent commit gets its first answer back
                out.indexes.extend(res.listed())
                out.stored, out.cleared = res.stored, res.cleared
            except DockError as e:
                to_status(e, out.status)
        return drop

    # -- leaving ------------------------------------------------------------------------------
    def leave(self, peer: Peer, wid: int) -> None:
        entry = self.entries.get(wid)
        if entry is not None and entry.peer is peer and entry.alive:
            self.retire(entry, "it shut down", on_purpose=True)

    def connection_lost(self, peer: Peer) -> None:
        for entry in self.entries.values():
            if entry.peer is peer and entry.alive:
                entry.peer = None
                self._away(entry, "its connection closed")

    def _away(self, entry: WarehouseEntry, why: str) -> None:
        entry.state = "rejoining"
        self._save(entry)
        logger.warning("[controller] warehouse away id=%d address=%s:%d reason=%r; waiting up to %gs for it to rejoin",
                       entry.id, entry.host, entry.port, why, self.grace)
        entry.timer = self.timers.call_later(self.grace, self._give_up, entry)
        self._start_probe(entry, 0)

    def _give_up(self, entry: WarehouseEntry) -> None:
        entry.timer = None
        if entry.state == "rejoining":
            self.retire(entry, f"it did not rejoin within {self.grace:g}s")

    async def _probe(self, entry: WarehouseEntry, attempt: int = 0) -> None:
        """Tell a dead warehouse from an unreachable one: refused, or another process answering, is dead.
        A probe that cannot tell is made again a few times (REPROBE_S): the address of a process just
        killed may take a connection and reset it rather than refuse it."""
        instance = await self.probe(entry.host, entry.port)
        if entry.state != "rejoining":
            return
        if instance is None and attempt < len(REPROBE_S):
            self.timers.call_later(REPROBE_S[attempt], self._start_probe, entry, attempt + 1)
        elif instance == 0 and entry.durable:
            logger.warning("[controller] warehouse id=%d address=%s:%d refuses connections, but it keeps a data dir: "
                           "waiting up to %gs for it to restart", entry.id, entry.host, entry.port, self.grace)
        elif instance == 0:
            self.retire(entry, "its address refuses connections")
        elif instance is not None and instance != entry.instance:
            self.retire(entry, "another process answers at its address")

    def _start_probe(self, entry: WarehouseEntry, attempt: int) -> None:
        """Probe the address of a warehouse still rejoining (`attempt`: the probes made before, see _probe)."""
        if entry.state == "rejoining":
            task = asyncio.ensure_future(self._probe(entry, attempt))
            _tasks.add(task)
            task.add_done_callback(_tasks.discard)

    def retire(self, entry: WarehouseEntry, why: str, *, on_purpose: bool = False) -> None:
        """A warehouse is gone: its samples become lost for every consumer that meets them."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.state = "left" if on_purpose else "lost"
        entry.peer = None
        held = self.core.warehouse_bytes().get(entry.id, 0)
        unwritten = self.core.warehouse_lost(entry.id)
        if self.journal is not None:
            self.journal.lost(entry.id, unwritten)
            self._save(entry)
        drop_blocks(self.core, self.journal, [b.id for b in self.core.blocks.of_owner(entry.id)],
                    f"warehouse {entry.id} {entry.state}")  # (its gets are woken below)
        level = logging.WARNING if held and not on_purpose else logging.INFO
        logger.log(level, "[controller] warehouse %s id=%d address=%s:%d bytes=%d reason=%r",
                   entry.state, entry.id, entry.host, entry.port, held, why)
        self.on_change()

    def close(self) -> None:
        for entry in self.entries.values():
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        self.addresses.close()


_tasks: set[asyncio.Task] = set()
