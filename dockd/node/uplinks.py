"""A warehouse's links to the dock's controllers (`Uplinks`): joining them when the node starts (the one
that numbers the warehouse first, the others in the background), and which link a connection is.

With several controllers (`dockd.owners`) the warehouse joins every one of them: each commits the puts
of the partitions it owns and frees, measures and dumps their data over its link. A warehouse whose
controller runs in its own process commits to it directly (`commit.LocalCommitter`) and has a link to
the others only.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.config import NodeConfig
from dockd.controller.service import ControllerService
from dockd.errors import DockAuthError, DockConfigError, DockConnectionError, DockError, DockProtocolError
from dockd.net import tls, wire
from dockd.net.peer import Peer
from dockd.net.wire import PROTOCOL_VERSION
from dockd.node.controller_link import BACKOFF_MAX, BACKOFF_MIN, ControllerLink
from dockd.node.dial import open_link
from dockd.node.listen import Listeners
from dockd.warehouse.commit import LocalCommitter, RemoteCommitter, RoutingCommitter
from dockd.warehouse.datadir import DataDir

logger = logging.getLogger(__name__)

NUMBER_TRY_S = 3.0
"""With several controllers, how long a new warehouse waits for one to number it before it asks the next."""


class Uplinks:
    """The links of this node's warehouse to the dock's controllers.

    Args:
        listeners: where links are made (`make_link_peer`, `link_tls`) and the port the warehouse is at.
        committer: the node's committer; the links are handed to its remote committers.
        inventory: what the warehouse holds (a rejoin's inventory, less the given uncommitted puts).
        on_drop: frees a partition a controller no longer has.
        controller: the controller in this process, if any (it numbers the warehouse itself).
        data_dir: the warehouse's data dir, if any (a restart rejoins under its id).
    """

    def __init__(self, cfg: NodeConfig, *, listeners: Listeners, committer: LocalCommitter | RoutingCommitter,
                 inventory: Callable[[list[pb.CommitRequest]], list[pb.InventoryPartition]],
                 on_drop: Callable[[str], object], controller: ControllerService | None,
                 data_dir: DataDir | None) -> None:
        self.cfg = cfg
        self.listeners = listeners
        self.committer = committer
        self.inventory = inventory
        self.on_drop = on_drop
        self.controller = controller
        self.data_dir = data_dir
        self.link: ControllerLink | None = None  # to the controller that numbers warehouses (with several: the first)
        self.others: dict[int, ControllerLink] = {}  # several controllers: to each of the others, by index
        self.shards: dict[str, int] = dict(cfg.shards)  # the dock's spread partitions (learned at join)
        self._hosted_wid = -1  # the id the controller in this process gave the warehouse

    @property
    def wid(self) -> int:
        """This node's warehouse id (-1: none, or not joined yet)."""
        return self.link.wid if self.link is not None else self._hosted_wid

    def all(self) -> list[ControllerLink]:
        return ([self.link] if self.link is not None else []) + list(self.others.values())

    def from_a_controller(self, peer: Peer) -> bool:
        """Whether `peer` is one of these links (a controller, which frees, measures, dumps the warehouse's data)."""
        return any(peer is link.peer for link in self.all())

    def joined(self) -> bool:
        """Whether the warehouse is joined to a controller (one of its links is, or the one in this process
        numbered it)."""
        return any(link.joined.is_set() for link in self.all()) if self.link is not None else self.wid >= 0

    def close(self, leave: bool = False) -> None:
        for link in self.all():
            link.close(leave=leave)

    def connection_lost(self, peer: Peer) -> None:
        for link in self.all():
            link.connection_lost(peer)

    async def join(self, reg: pb.RegisterWarehouse) -> None:
        """Register this node's warehouse with the dock's controllers (learned from the first of the
        addresses --join gives, or a restart's data dir remembers, that answers). One of them numbers
        it: with one controller that one; with several, the one in this process if there is one, else
        the first that answers, tried in the dock's order (each numbers its own ids, so one that is
        down keeps no new warehouse out); the others take that id. Each commits the puts of the
        partitions it owns (dockd.owners); links to the others are made in the background (one that
        is down stalls only its partitions' puts)."""
        timeout = self.cfg.join_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.controller is not None:
            controllers, own = list(self.cfg.controllers), self.controller.own
        else:
            addresses = self.cfg.join_addresses
            if self.data_dir is not None:  # a restart also asks the controllers the last process knew
                addresses += [a for a in self.data_dir.controllers if a not in addresses]
            controllers, self.shards = await discover_controllers(self.listeners.make_link_peer, addresses,
                                                                  self.listeners.link_tls, timeout)
            own = -1
            if len(controllers) > 1:
                reg.controllers.extend(controllers)
                reg.shards.extend(owners.shard_names(self.shards))
                assert isinstance(self.committer, RoutingCommitter)  # (a joining node routes; see __init__)
                self.committer.committers = [RemoteCommitter(None) for _ in controllers]
        n = len(controllers)
        if own >= 0:  # this process numbers its warehouse (the only controller, or one of several)
            assert self.controller is not None
            self._hosted_wid = self.controller.register(None, reg).id
            numbered_by = own
        elif n == 1 or (self.data_dir is not None and self.data_dir.wid >= 0):
            # one controller, or a restart on its data dir, which knows its id and needs no number:
            # with several controllers each is joined in the background (one that is down stalls
            # only its own partitions, also across this warehouse's restart)
            numbered_by = 0
            self.link = self._link_to(controllers[0], 0, n, reg)
            if n > 1:
                self.link.start_in_background()
            else:
                await self.link.start(None if deadline is None else max(0.1, deadline - time.monotonic()))
        else:
            numbered_by, self.link = await self._numbered(controllers, reg, deadline)
        if self.data_dir is not None and self.wid >= 0:
            self.data_dir.joined(self.wid, self.listeners.port, controllers)
        for k in range(n):
            if k == numbered_by:
                continue
            assigned = pb.RegisterWarehouse()
            assigned.CopyFrom(reg)
            assigned.id, assigned.assigned = self.wid, True
            link = self.others[k] = self._link_to(controllers[k], k, n, assigned)
            link.start_in_background()
        if n > 1:
            logger.info("[node] warehouse=%d registers with controllers=%s (numbered by %s)", self.wid,
                        ",".join(controllers), controllers[numbered_by])

    async def _numbered(self, controllers: list[str], reg: pb.RegisterWarehouse,
                        deadline: float | None) -> tuple[int, ControllerLink]:
        """A new warehouse of a dock with several controllers joins the first that answers, each
        tried for NUMBER_TRY_S in the dock's order and again until `deadline`: (its index, the link)."""
        n, k, tries = len(controllers), 0, 0
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DockConnectionError(
                    f"none of the dock's controllers ({', '.join(controllers)}) answered within "
                    f"{self.cfg.join_timeout:g}s to number this warehouse; start one, or check the addresses (--join)")
            link = self._link_to(controllers[k], k, n, reg)
            try:
                await link.start(NUMBER_TRY_S if left is None else max(0.1, min(NUMBER_TRY_S, left)))
                return k, link
            except DockConnectionError as e:
                if tries < n:  # (the first round says which are down; later rounds go on quietly)
                    logger.warning("[node] %s; asking the next controller", e)
                tries += 1
                k = (k + 1) % n

    def _link_to(self, address: str, k: int, n: int, reg: pb.RegisterWarehouse) -> ControllerLink:
        """The link to controller `k` of `n`: its commits, and a rejoin inventory of its partitions only."""
        def owned(pending: list[pb.CommitRequest]) -> list[pb.InventoryPartition]:
            return [p for p in self.inventory(pending) if owners.owner_index(p.name, n) == k]

        link = ControllerLink(address, make_peer=self.listeners.make_link_peer, registration=reg,
                              inventory=owned if n > 1 else self.inventory, on_drop=self.on_drop,
                              grace=self.cfg.controller_grace, window=self.cfg.commit_window,
                              token=self.listeners.keys.token)
        if self.data_dir is not None:  # a restart rejoins each controller under its id, with its partitions' inventory
            link.resume(self.data_dir.wid, self.data_dir.seq)
        committer = self.committer.committers[k] if isinstance(self.committer, RoutingCommitter) else self.committer
        assert isinstance(committer, RemoteCommitter)  # (a controller of another process)
        committer.link = link
        return link

    async def members(self) -> dict[int, pb.WarehouseInfo]:
        """The dock's warehouses as its controller lists them (the one in this process, or over the link)."""
        if self.controller is not None:
            infos = self.controller.warehouse_infos(usage=False)
        else:
            peer = self.link.peer if self.link is not None else None
            if peer is None or peer.closed:
                raise DockConnectionError("this warehouse is not connected to its controller right now")
            hello = pb.Frame(hello=pb.Hello(client="weights relay", protocol=PROTOCOL_VERSION))
            reply, _ = await asyncio.wait_for(peer.request(hello), self.cfg.daemon_timeout)
            infos = reply.hello_reply.warehouses
        return {w.id: w for w in infos}


async def discover_controllers(make_peer: Callable[[], Peer], addresses: list[str], link_tls: tls.LinkTls | None,
                               timeout: float | None) -> tuple[list[str], dict[str, int]]:
    """The dock's controllers and spread partitions (--shards), asked of the first of `addresses` that
    answers (a Hello), trying them in turn for up to `timeout` seconds (None: as long as it takes)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay, waiting_logged = BACKOFF_MIN, 0.0
    while True:
        errors = []
        for address in addresses:
            host, _, port = address.rpartition(":")
            waited = "connecting"
            try:
                _, peer = await asyncio.wait_for(open_link(make_peer, host, int(port), link_tls), 5.0)
                try:
                    assert peer.authed is not None  # (an outgoing connection's, made once it connected)
                    waited = "its handshake"
                    await asyncio.wait_for(peer.authed, 10.0)
                    waited = "its answer"
                    reply, _ = await asyncio.wait_for(
                        peer.request(pb.Frame(hello=pb.Hello(client="warehouse", protocol=wire.PROTOCOL_VERSION))), 10.0)
                finally:
                    peer.close()
                hello = reply.hello_reply  # (no controllers: the dock's only controller)
                if not hello.hosts_controller:
                    raise DockConfigError(
                        f"--join {address}: that is a dockd warehouse, not a controller; "
                        + (f"join its controller: --join {hello.controller}" if hello.controller
                           else "join the controller's HOST:PORT"))
                return list(hello.controllers) or [address], owners.shards_from(hello.shards)
            except (DockAuthError, DockConfigError):
                raise
            except DockProtocolError as e:  # it answered, but not as a dockd daemon of this version: it never will
                raise DockProtocolError(f"--join {address}: {e}; is it a dockd controller's --port?") from None
            except asyncio.TimeoutError:  # (a dockd daemon greets a connection at once, and answers a Hello)
                errors.append(f"{address}: no dockd greeting within 5 s (it accepted the connection, or never "
                              "answered it): is it a dockd controller's --port?" if waited == "connecting" else
                              f"{address}: no answer to {waited} within 10 s")
            except (DockError, OSError) as e:
                errors.append(f"{address}: {e or type(e).__name__}" if len(addresses) > 1 else str(e or type(e).__name__))
        now = time.monotonic()
        which = (f"the controller at {addresses[0]}" if len(addresses) == 1 else
                 f"any of the controllers at {', '.join(addresses)}")
        if now - waiting_logged > 30:
            waiting_logged = now
            logger.warning("[link] waiting for %s (%s); retrying", which, "; ".join(errors))
        if deadline is not None and now + delay > deadline:
            raise DockConnectionError(
                f"cannot reach {which} to join within {timeout:g}s ({'; '.join(errors)}); start it, or check the "
                "address (--join)") from None
        await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, BACKOFF_MAX)
