"""The node daemon (`dockd serve`): a warehouse, and with `controller=True` the controller too,
on one framed port, plus gRPC health/admin on a second port.

`Node` is the composition root: it builds the pieces and wires them together.

    listen.Listeners      the framed TCP port and the same-host Unix socket, the connections,
                          who may connect (uid, connection limit, descriptor budget)
    listen.Keys           the keys connections authenticate with (the client token, the daemon key)
    admission.Admission   room: the capacity queue, reservations, frees, where bodies are received
    put.PutPipeline       every put: admit (validate, reserve), receive, take device runs, check,
                          commit through a committer, store, answer
    commit.*Committer     the controller in this process, or over a `controller_link.ControllerLink`
    uplinks.Uplinks       the warehouse's links to the dock's controllers: joining them, numbering
    fetch.FetchPath       fetch replies and the values inlined into acquire replies
    dump.Checkpoints      dump/load of a partition's values
    dispatch.Dispatcher   one table from request kind to handler

A warehouse that is not co-hosted joins the controller over a framed connection
of its own (`controller_link.ControllerLink`), commits every put there before storing and
acknowledging it, and receives `free` requests on it. It outlives its
controller: it keeps its data and serves reads while the controller is away,
and rejoins when it is back.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import secrets
import signal
import sys
from collections.abc import Awaitable, Mapping

import numpy as np

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd._version import __version__
from dockd.config import NodeConfig
from dockd.controller.agreement import Agreement, refuse_spread
from dockd.controller.core import Controller
from dockd.controller.service import ControllerService
from dockd.errors import DockAuthError, DockError, DockValueError
from dockd.net import auth, memfd, mooncake, same_host
from dockd.net.device_transport import WarehouseLinks
from dockd.net.peer import Peer
from dockd.net.wire import PROTOCOL_VERSION, check_protocol
from dockd.node import controller_probe
from dockd.node.dispatch import WAREHOUSE_KINDS, Dispatcher, RequestHandler, controller_handlers, plain
from dockd.node.listen import Keys, Listeners, watch_pid
from dockd.node.metrics import Metrics, MetricsServer
from dockd.node.tasks import failed, reply_when_done, spawn
from dockd.node.uplinks import Uplinks
from dockd.warehouse import memory, readback
from dockd.warehouse.admission import Admission
from dockd.warehouse.commit import LocalCommitter, RemoteCommitter, RoutingCommitter
from dockd.warehouse.core import Warehouse
from dockd.warehouse.datadir import DataDir, dock_of
from dockd.warehouse.dump import Checkpoints
from dockd.warehouse.fetch import FetchPath
from dockd.warehouse.put import PutPipeline
from dockd.warehouse.replica_copy import Replicator
from dockd.warehouse.segments import Segments
from dockd.warehouse.spill import SpillTier
from dockd.warehouse.weights import WeightsService

logger = logging.getLogger(__name__)

class Node:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.instance = secrets.randbits(62) | 1  # (bit 62 is set only with a data dir: terms.DURABLE)
        self.metrics = Metrics()  # (each Peer times its requests here)
        self._metrics_server: MetricsServer | None = None
        self.metrics_port = 0
        self.grpc_port = 0
        self._grpc = None
        self.exit_code = 0
        self._stopping: asyncio.Event | None = None
        self.warehouse = Warehouse(cfg.capacity, cfg.device_capacity)
        self.data_dir = DataDir(cfg.data_dir, dock_of(cfg), drop_damaged=cfg.drop_damaged_files) \
            if cfg.data_dir else None  # opened by start()
        self.segments = Segments(keep_bytes=min(cfg.capacity // 4, 4 << 30), watch=watch_pid)
        self.keys = Keys(cfg)
        self.listeners = Listeners(cfg, self.keys, self, self.instance, on_unix_peer=self.segments.connected)
        self.links = WarehouseLinks()  # device links to readers on other nodes
        self.admission = Admission(self.warehouse, self.segments, lambda: self.wid)
        self.checkpoints = Checkpoints(self.warehouse, self.segments, wid=lambda: self.wid,
                                       check_warehouse=self._check_warehouse)
        self.spill = SpillTier(cfg.spill_dir, cfg.spill_capacity, warehouse=self.warehouse, admission=self.admission,
                               segments=self.segments, metrics=self.metrics) if cfg.spill_dir else None
        self.controller: ControllerService | None = None
        self.agreement: Agreement | None = None  # several controllers: whether they agree on their list
        if cfg.controller:
            self.controller = ControllerService(
                Controller(lease_timeout=cfg.lease_timeout, max_samples=cfg.max_samples), local=HostedWarehouse(self),
                state_dir=cfg.state_dir or None, warehouse_grace=cfg.warehouse_grace, daemon_timeout=cfg.daemon_timeout,
                checkpoint_root=cfg.checkpoint_root, controllers=cfg.controllers, replicas=cfg.replicas,
                own=owners.own_index(cfg.controllers, cfg.host, cfg.port, cfg.advertise) if cfg.controllers else 0,
                shards=cfg.shards,
            )
            if cfg.controllers:
                self.agreement = Agreement(cfg.controllers, cfg.controllers[self.controller.own], cfg.shards,
                                           cfg.replicas)
            members = self.controller.members  # heartbeats to the warehouses (see controller.membership)
            members.heartbeat_interval, members.heartbeat_timeout = cfg.heartbeat_interval, cfg.heartbeat_timeout
            local = LocalCommitter(self.controller)
            self.committer: LocalCommitter | RoutingCommitter = local if not cfg.controllers else RoutingCommitter(
                [local if k == self.controller.own else RemoteCommitter(None) for k in range(len(cfg.controllers))])
        else:  # (its links are made once this node listens and knows the dock's controllers)
            self.committer = RoutingCommitter([RemoteCommitter(None)])
        self.admission.on_clear = self._cleared
        self.uplinks = Uplinks(cfg, listeners=self.listeners, committer=self.committer,
                               inventory=self.warehouse.inventory, on_drop=self.admission.free,
                               controller=self.controller, data_dir=self.data_dir)
        self.replicator = Replicator(self.warehouse, self.listeners.make_link_peer, self.listeners.link_tls,
                                     timeout=cfg.daemon_timeout)
        self.weights = WeightsService(warehouse=self.warehouse, admission=self.admission, replicator=self.replicator,
                                      wid=lambda: self.wid, info=self._info, timeout=cfg.daemon_timeout,
                                      daemon=lambda peer: not self.keys.server_auth.roles or peer.role == auth.DAEMON,
                                      check_warehouse=self._check_warehouse, members=self.uplinks.members)
        self.puts = PutPipeline(warehouse=self.warehouse, segments=self.segments, admission=self.admission,
                                committer=self.committer, metrics=self.metrics, wid=lambda: self.wid,
                                check_warehouse=self._check_warehouse, replicator=self.replicator,
                                daemon=lambda peer: not self.keys.server_auth.roles or peer.role == auth.DAEMON,
                                data_dir=self.data_dir,
                                check_partition=lambda partition: refuse_spread(self.uplinks.shards, partition))
        self.fetches = FetchPath(warehouse=self.warehouse, segments=self.segments, links=self.links,
                                 committer=self.committer, metrics=self.metrics, wid=lambda: self.wid)
        self.dispatcher = Dispatcher(self._handlers(), self.keys.server_auth,
                                     from_controller=self.uplinks.from_a_controller,
                                     unpin=lambda peer, pins: self.segments.unpin(peer.pid, pins))

    @property
    def port(self) -> int:
        return self.listeners.port

    @property
    def unix_name(self) -> str:
        return self.listeners.unix_name

    @property
    def wid(self) -> int:
        """This node's warehouse id (-1: none, or not joined yet)."""
        return self.uplinks.wid

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.links.bind(loop)
        if self.data_dir is not None:  # stored puts of a previous process, and its identity
            self.instance = self.listeners.instance = self.data_dir.open()
            if not self.cfg.port:  # its controller and clients know it at the address it had
                self.cfg.port = self.data_dir.port
        self.listeners.budget_descriptors()
        await self.listeners.listen_tcp()
        self.keys.publish(self.port)
        if self.cfg.shm and same_host.available() and self.cfg.warehouse:
            self.admission.use_segments(memfd.segment_budget())
            self.listeners.listen_unix()
        if self.spill is not None:  # (before the data dir's puts come back: what exceeds --capacity spills)
            self.spill.open()
        if self.data_dir is not None:
            self.warehouse.keeper = self.data_dir
            readback.adopt(self.data_dir, self.warehouse, self.admission, self.puts.tokens)
        reg = pb.RegisterWarehouse(host=self.cfg.advertise or self.cfg.host, port=self.port, capacity=self.cfg.capacity,
                                   unix=self.unix_name, instance=self.instance, protocol=PROTOCOL_VERSION)
        if self.data_dir is not None:  # (files dropped as damaged at start: their samples are lost, not unwritten)
            readback.report(self.data_dir, reg)
        if self.controller is not None:
            self.controller.start()
        if self.data_dir is not None:  # (puts its files keep that were answered before their commit: sent again)
            self.puts.recover(self.data_dir.uncommitted)
            self.data_dir.uncommitted = []
        if self.agreement is not None:
            spawn(controller_probe.watch(self.agreement, self.listeners.make_probe_peer, self.listeners.link_tls,
                                         self.cfg.state_dir))
        if self.controller is None or self.cfg.warehouse:  # (a controller without a warehouse registers nothing)
            await self.uplinks.join(reg)
        from dockd.node.admin import start_grpc

        figures = Figures(self)
        self._grpc, self.grpc_port = start_grpc(figures, loop, host=self.cfg.host, port=self.port,
                                                grpc_port=self.cfg.grpc_port, server_auth=self.keys.server_auth)
        if self.cfg.metrics_port is not None:
            self._metrics_server = MetricsServer(figures)
            await self._metrics_server.start(self.cfg.metrics_host, self.cfg.metrics_port)
            self.metrics_port = self._metrics_server.port
        room = f" capacity={self.cfg.capacity}" if self.cfg.warehouse else ""
        if self.spill is not None:
            room += f" spill_dir={self.spill.path} spill_capacity={self.cfg.spill_capacity or 'disk'}"  # a controller-only node stores nothing
        logger.info(
            "[node] serving address=%s:%d grpc_port=%d metrics_port=%s controller=%s warehouse=%d%s state_dir=%s",
            self.cfg.host, self.port, self.grpc_port, self.metrics_port or "-", self.controller is not None, self.wid,
            room, self.cfg.state_dir or "-",
        )

    def ready_line(self) -> str:
        return json.dumps(
            {"event": "ready", "host": self.cfg.host, "port": self.port, "grpc_port": self.grpc_port,
             "metrics_port": self.metrics_port or None, "warehouse": self.wid, "controller": self.controller is not None,
             "version": __version__, **mooncake.ready_fields()}
        )

    async def serve_until_stopped(self) -> None:
        assert self._stopping is not None  # (made by start)
        await self._stopping.wait()
        await self.stop()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def stop(self) -> None:
        logger.info("[shutdown] stopping node warehouse=%d", self.wid)
        self.keys.unpublish()
        if self._grpc is not None:
            self._grpc.stop(grace=0.5)
        if self._metrics_server is not None:
            self._metrics_server.close()
        self.uplinks.close(leave=True)
        if self.controller is not None:
            self.controller.shutdown()
        self.admission.shutdown()
        self.weights.close()
        self.replicator.close()
        self.listeners.close()
        self.links.close()
        await self.listeners.wait_closed()

    # -- peer.Handler ---------------------------------------------------------------------------
    def on_request(self, peer: Peer, frame: pb.Frame, body, fds: list[int]) -> None:
        self.dispatcher.on_request(peer, frame, body, fds)

    def admit(self, peer: Peer, frame: pb.Frame, body_size: int) -> Awaitable[None] | None:
        if frame.WhichOneof("kind") == "weights_relay":  # (a relayed bucket of model weights)
            return self.weights.admit(peer, frame, body_size)
        if frame.WhichOneof("kind") != "put":
            return failed(DockValueError(f"a {frame.WhichOneof('kind')} request carries no body"))
        return self.puts.admit(peer, frame, body_size)

    def allocate(self, size: int):
        return self.admission.allocate(size)

    def on_abandoned(self, peer: Peer, frame: pb.Frame, body_size: int) -> None:
        """A client vanished while sending an admitted body: its reservation is free again."""
        if frame.WhichOneof("kind") in ("put", "weights_relay"):
            self.admission.release(unreserve=body_size)

    def on_authed(self, peer: Peer) -> None:
        if self.controller is not None:
            self.controller.on_authed(peer)

    def on_lost(self, peer: Peer) -> None:
        self.listeners.lost(peer)
        self.segments.disconnected(peer.pid)
        self.links.lost(peer)
        self.admission.lost(peer)
        self.uplinks.connection_lost(peer)
        if self.controller is not None:
            self.controller.on_lost(peer)

    # -- the request table ------------------------------------------------------------------------
    def _handlers(self) -> dict[str, RequestHandler]:
        table: dict[str, RequestHandler] = {
            "put": self.puts.on_put,
            "fetch": plain(self.fetches.fetch),
            "free": plain(self._free),
            "measure": plain(self._measure),
            "dump": plain(self._dump),
            "hello": plain(self._hello),
            "replicate": plain(self._replicate),
            "flush": plain(self._flush),
            "return_blocks": plain(self._return_blocks),
        }
        assert set(table) == WAREHOUSE_KINDS
        table.update(self.weights.handlers())  # (dockd.weights: the relay, and reads of a version's buckets)
        table.update(controller_handlers(self.controller, where=lambda: f"{self.cfg.host}:{self.port}", join=self.cfg.join,
                                         agreement=self.agreement, token=self.keys.token))
        return table

    def _cleared(self, partition: str) -> None:
        self.committer.cleared(partition)
        self.weights.cleared(partition)

    def _info(self) -> pb.WarehouseInfo:
        """How other warehouses reach this one."""
        return pb.WarehouseInfo(id=max(self.wid, 0), host=self.cfg.advertise or self.cfg.host, port=self.port)

    def _from_controller(self, peer: Peer, kind: str) -> None:
        if not self.uplinks.from_a_controller(peer):  # only this warehouse's controllers free, measure, dump its data
            raise DockAuthError(f"{kind} requests come from this warehouse's controller only")

    def _free(self, peer: Peer, frame: pb.Frame) -> None:
        self._from_controller(peer, "free")
        freed = self.admission.free(frame.free.partition, frame.free.indexes or None)
        peer.reply(frame, pb.Frame(free_reply=pb.FreeReply(nbytes=freed)))

    def _measure(self, peer: Peer, frame: pb.Frame) -> None:
        self._from_controller(peer, "measure")
        m = frame.measure
        values = self.warehouse.measure(m.partition, m.column, m.indexes)
        peer.reply(frame, pb.Frame(measure_reply=pb.MeasureReply(values=values.tolist())))

    def _dump(self, peer: Peer, frame: pb.Frame) -> None:
        self._from_controller(peer, "dump")
        spawn(reply_when_done(peer, frame, self.checkpoints.dump(frame.dump), "dump_reply"))

    def _replicate(self, peer: Peer, frame: pb.Frame) -> None:
        self._from_controller(peer, "replicate")
        spawn(reply_when_done(peer, frame, self._replicated(frame.replicate), "replicate_reply"))

    async def _replicated(self, req: pb.ReplicateRequest) -> pb.ReplicateReply:
        return pb.ReplicateReply(nbytes=await self.replicator.serve(req))

    def _flush(self, peer: Peer, frame: pb.Frame) -> None:
        """A writer's read-your-writes (--commit-window): answered once the commits of the puts this warehouse
        answered before their commit are applied."""
        self._check_warehouse()
        spawn(reply_when_done(peer, frame, self._flushed(frame.flush.partition), "flush_reply"))

    async def _flushed(self, partition: str) -> pb.FlushReply:
        await self.committer.flush(partition)
        return pb.FlushReply()

    def _return_blocks(self, peer: Peer, frame: pb.Frame) -> None:
        self._from_controller(peer, "return_blocks")
        spawn(reply_when_done(peer, frame, self._returned(frame.return_blocks.partition), "return_blocks_reply"))

    async def _returned(self, partition: str) -> pb.ReturnBlocksReply:
        return pb.ReturnBlocksReply(blocks=await self.committer.return_blocks(partition))

    def _hello(self, peer: Peer, frame: pb.Frame) -> None:
        check_protocol(frame.hello.protocol, f"the client {frame.hello.client or peer.name}")
        m, w = self.metrics, self.warehouse
        out = pb.HelloReply(protocol=PROTOCOL_VERSION, hosts_controller=self.controller is not None, warehouse_id=self.wid,
                            unix=self.unix_name, instance=self.instance,
                            joined=self.uplinks.joined(),
                            version=__version__, used=w.used, capacity=w.capacity,
                            put_bytes=sum(m.put_bytes.values()), get_bytes=sum(m.get_bytes.values()),
                            device_used=w.device_used, device_capacity=w.device_capacity,
                            metadata=w.meta, freed=w.freed, reclaimable=w.reclaimable, spilled=w.spilled)
        mooncake.hello(out)
        if self.agreement is not None:
            if frame.hello.controllers:
                self.agreement.check(frame.hello.controllers, f"{frame.hello.client or 'a client'} (from {peer.name})",
                                     frame.hello.shards)
            out.disagreement = self.agreement.refusal
        if self.controller is not None:
            out.warehouses.extend(self.controller.warehouse_infos())
            out.controller = f"{self.cfg.advertise or self.cfg.host}:{self.port}"
            out.controllers.extend(self.cfg.controllers)
            out.replicas = self.cfg.replicas
        else:
            out.controller = self.cfg.join or ""
        out.shards.extend(owners.shard_names(self.uplinks.shards))
        peer.reply(frame, pb.Frame(hello_reply=out))

    def _check_warehouse(self) -> None:
        if not self.cfg.warehouse:
            raise DockValueError(
                f"this daemon ({self.cfg.host}:{self.port}) runs the controller without a warehouse (--no-warehouse); "
                "put to a warehouse: dockd.connect() picks one unless warehouse= names this daemon"
            )


class HostedWarehouse:
    """This node's warehouse as the controller in the same process sees it
    (`dockd.controller.service.LocalWarehouse`)."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def free(self, partition: str, indexes: np.ndarray | None = None) -> int:
        return self._node.admission.free(partition, indexes)

    def measure(self, partition: str, column: str, indexes: np.ndarray) -> np.ndarray:
        return self._node.warehouse.measure(partition, column, indexes)

    async def dump(self, req: pb.DumpRequest) -> pb.DumpReply:
        return await self._node.checkpoints.dump(req)

    async def replicate(self, req: pb.ReplicateRequest) -> int:
        return await self._node.replicator.serve(req)

    def inline(self, peer: Peer, partition: str, columns: list[str], indexes: np.ndarray, locations: np.ndarray,
               device: bool = False):
        return self._node.fetches.inline(peer, partition, columns, indexes, locations, device)


class Figures:
    """What the metrics endpoint and the admin service read of a node (`dockd.node.metrics.NodeFigures`)."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self.metrics = node.metrics

    @property
    def wid(self) -> int:
        return self._node.wid

    @property
    def warehouse(self) -> Warehouse | None:
        return self._node.warehouse if self._node.cfg.warehouse else None

    @property
    def controller(self) -> ControllerService | None:
        return self._node.controller

    @property
    def connections(self) -> int:
        return len(self._node.listeners.peers)

    @property
    def device_links(self) -> int:
        return len(self._node.links)

    @property
    def auth_failures(self) -> Mapping[str, int]:
        return self._node.keys.server_auth.failures


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        logger.warning("[node] uvloop is not installed; using the stdlib event loop (slower bulk transfers)")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve(cfg: NodeConfig, *, announce=sys.stdout) -> int:
    """Run a node until SIGTERM/SIGINT; prints one JSON 'ready' line to `announce`."""
    import torch

    torch.set_num_threads(1)
    pool = memory.choose()

    logger.info("[node] starting version=%s python=%s torch=%s memory_pool=%s", __version__, sys.version.split()[0],
                torch.__version__, pool)

    async def main() -> int:
        node = Node(cfg)
        loop = asyncio.get_running_loop()
        starting = asyncio.ensure_future(node.start())
        for sig in (signal.SIGTERM, signal.SIGINT):  # also while a warehouse still waits for its controller
            loop.add_signal_handler(sig, lambda: node.request_stop() if starting.done() else starting.cancel())
        try:
            await starting
        except asyncio.CancelledError:
            logger.info("[node] stopped before it was ready")
            node.uplinks.close()
            return 0
        except (DockError, OSError) as e:
            logger.error("[node] cannot start: %s", e)
            return 2
        # The daemon holds many small long-lived objects (stored values, metadata) and
        # allocates a few per request: the default collector thresholds made cyclic GC
        # passes the largest cost of a small request. Freeze what startup created and
        # collect young objects less often.
        gc.freeze()
        gc.set_threshold(50_000, 50, 100)
        if announce is not None:
            print(node.ready_line(), file=announce, flush=True)
        await node.serve_until_stopped()
        return node.exit_code

    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(main())
