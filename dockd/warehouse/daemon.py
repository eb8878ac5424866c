"""The node daemon (`dockd serve`): a warehouse, and with `controller=True` the
controller too, on one framed port, plus gRPC health/admin on a second port.

Requests are routed by kind: put/fetch/free go to the warehouse, the rest to
the controller. A warehouse that is not co-hosted joins the controller over a
framed connection of its own (`link.ControllerLink`), commits every put there
before acknowledging it, and receives `free` requests on it. It outlives its
controller: it keeps its data and serves reads while the controller is away,
and rejoins when it is back.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import collections
import functools
import resource
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable

import numpy as np
import pyarrow as pa

from dockd import auth, codec, device_share, limits, shm
from dockd._version import __version__
from dockd._proto import dockd_pb2 as pb
from dockd.config import NodeConfig
from dockd.controller.core import Controller
from dockd.controller.service import ControllerService
from dockd.logutil import Throttle
from dockd.errors import DockAuthError, DockError, DockFull, DockNotFound, DockProtocolError, DockValueError
from dockd.metrics import MetricsServer, Metrics
from dockd.peer import Peer
from dockd.warehouse.core import Warehouse
from dockd.warehouse.link import ControllerLink, keepalive
from dockd.warehouse.links import Links
from dockd.warehouse.segments import Segments
from dockd.wire import PROTOCOL_VERSION, check_protocol

logger = logging.getLogger(__name__)
_refusals = Throttle()  # connections refused (limits, other users): one line per 10 s

_CONTROLLER_KINDS = {"acquire", "confirm", "release", "extend", "clear", "stats", "register", "commit", "locate",
                     "leave", "partition"}
_DAEMON_KINDS = {"register", "commit", "leave", "free", "measure", "dump"}  # only daemons of this dock may send these
_PUT_TOKENS_KEPT = 4096
_INLINE_CELLS = 1 << 20  # sample-columns an acquire reply carries inline at most (each may be a run of its own)


class Node:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.instance = secrets.randbits(63) | 1
        self.metrics = Metrics()
        self._metrics_server: MetricsServer | None = None
        self.metrics_port = 0
        self.warehouse = Warehouse(cfg.capacity, cfg.device_capacity)
        self.segments = Segments(keep_bytes=min(cfg.capacity // 4, 4 << 30), watch=self._watch_pid)
        self.controller: ControllerService | None = None
        if cfg.controller:
            self.controller = ControllerService(
                Controller(lease_timeout=cfg.lease_timeout, max_samples=cfg.max_samples), local=_Local(self),
                state_dir=cfg.state_dir or None, warehouse_grace=cfg.warehouse_grace, daemon_timeout=cfg.daemon_timeout,
                checkpoint_root=cfg.checkpoint_root,
            )
            members = self.controller.members  # heartbeats to the warehouses (see controller.membership)
            members.heartbeat_interval, members.heartbeat_timeout = cfg.heartbeat_interval, cfg.heartbeat_timeout
        self.link: ControllerLink | None = None
        self._token = auth.load_token(cfg.token_file) if cfg.token_file else None
        self._secret_file = None
        # The daemon role is never proven with the clients' token: every client holds that one. It
        # takes the daemon token (--daemon-token-file), else a per-dock secret that only the dock's
        # own daemons hold (handed down by start_local, or written by the controller to a file of
        # its user's that warehouses on its host read). Only --insecure without a token has no roles.
        daemon_token = auth.load_token(cfg.daemon_token_file, "daemon token") if cfg.daemon_token_file else None
        if daemon_token is None and not (cfg.insecure and self._token is None):
            env = os.environ.get("DOCKD_DAEMON_SECRET")
            daemon_token = bytes.fromhex(env) if env else (secrets.token_bytes(32) if cfg.controller else None)
        self._daemon_key = daemon_token  # a joining warehouse without one reads its controller's secret file
        self._no_daemon_key_warned = False
        self.server_auth = auth.ServerAuth(client_key=self._token, daemon_key=daemon_token)
        Peer.handshake_timeout, Peer.stall_timeout = cfg.handshake_timeout, cfg.stall_timeout
        Peer.min_rate = cfg.min_rate
        Peer.idle_timeout = cfg.idle_timeout
        self.port = 0
        self.grpc_port = 0
        self._puts_done: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # token -> indexes
        self._puts_running: dict[int, list[tuple[Peer, pb.Frame]]] = {}  # token -> retries waiting on it
        self._server: asyncio.base_events.Server | None = None
        self._peers: set[Peer] = set()
        self._capacity_waiters: list[tuple[int, asyncio.Future, Peer]] = []  # (bytes, admitted, whose put)
        self._pending: dict[str, int] = {}  # partition -> puts committed, not stored yet
        # partition -> [put id, cleared] of its puts waiting on the controller (see _put_remote)
        self._committing: dict[str, list[list]] = {}
        self._landed = asyncio.Condition()
        self._stopping: asyncio.Event | None = None
        self._grpc = None
        self._unix: socket.socket | None = None
        self.unix_name = ""
        self._segment_budget = 0  # segments (descriptor + mapping each) this process may hold
        self._over_budget_warned = False
        self.exit_code = 0
        self._wid = -1
        self.links = Links()  # device links to readers on other nodes
        self._max_connections = cfg.max_connections
        self._accept_delay = 0.0  # backoff of the same-host accept loop while descriptors run out

    @property
    def device_links(self) -> int:
        return len(self.links)

    @property
    def _link_peer(self) -> Peer | None:
        return self.link.peer if self.link is not None else None

    @property
    def connections(self) -> int:
        return len(self._peers)

    @property
    def wid(self) -> int:
        """This node's warehouse id (-1: none, or not joined yet)."""
        return self.link.wid if self.link is not None else self._wid

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.links = Links(loop)
        self._budget_descriptors()
        self._server = await loop.create_server(self._make_peer, self.cfg.host, self.cfg.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.controller is not None and self._daemon_key is not None and not self.cfg.daemon_token_file \
                and not os.environ.get("DOCKD_DAEMON_SECRET"):
            # warehouses started by hand on this host prove the daemon role with this secret
            self._secret_file = auth.write_daemon_secret(self.port, self._daemon_key)
        if self.cfg.shm and shm.available() and self.cfg.warehouse:
            self._listen_unix(loop)
        reg = pb.RegisterWarehouse(host=self.cfg.advertise or self.cfg.host, port=self.port, capacity=self.cfg.capacity,
                                   unix=self.unix_name, instance=self.instance, protocol=PROTOCOL_VERSION)
        if self.controller is not None:
            self.controller.start()
            if self.cfg.warehouse:
                self._wid = self.controller.register(None, reg).id
        else:
            self.link = ControllerLink(self.cfg.join, make_peer=self._make_link_peer, registration=reg,
                                       inventory=self.warehouse.inventory, on_drop=self._free,
                                       grace=self.cfg.controller_grace)
            await self.link.start(self.cfg.join_timeout)
        from dockd.warehouse.admin import start_grpc

        self._grpc, self.grpc_port = start_grpc(self, loop)
        if self.cfg.metrics_port is not None:
            self._metrics_server = MetricsServer(self)
            await self._metrics_server.start(self.cfg.metrics_host, self.cfg.metrics_port)
            self.metrics_port = self._metrics_server.port
        logger.info(
            "[node] serving address=%s:%d grpc_port=%d metrics_port=%s controller=%s warehouse=%d capacity=%d "
            "state_dir=%s", self.cfg.host, self.port, self.grpc_port, self.metrics_port or "-",
            self.controller is not None, self.wid, self.cfg.capacity, self.cfg.state_dir or "-",
        )

    def _listen_unix(self, loop) -> None:
        """Same-host clients: frames on an abstract Unix socket, payloads as memfd descriptors."""
        self._segment_budget = shm.segment_budget()
        self.segments.keep_count = max(4, self._segment_budget // 8)  # idle segments hold descriptors too
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = shm.unix_name(self.port)
        sock.bind(shm.unix_address(name))
        sock.listen(128)
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept_unix)
        self._unix, self.unix_name = sock, name
        if shm.huge_pages_state() in ("never", "deny"):
            logger.info(
                "[shm] transparent huge pages are off for shared memory: large same-host puts and first reads "
                "run several times slower. To enable (as root): "
                "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled"
            )

    def _budget_descriptors(self) -> None:
        """Share the descriptor limit (raised to the hard limit) among connections (a quarter),
        descriptors in flight on them (an eighth) and stored segments (`shm.segment_budget`), so
        that no use of one starves the others."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:  # every shared-memory put body holds one descriptor
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        self._max_connections = min(self.cfg.max_connections, max(8, soft // 4))
        Peer.fd_budget = max(64, soft // 8)
        if self._max_connections < self.cfg.max_connections:
            logger.info("[node] at most %d connections: a quarter of the descriptor limit (%d); raise it "
                        "(ulimit -n, LimitNOFILE=) for the %d of --max-connections", self._max_connections, soft,
                        self.cfg.max_connections)

    def _accept_unix(self) -> None:
        while True:
            try:
                conn, _ = self._unix.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors or memory: pause accepting instead of spinning on it
                self._accept_delay = min(max(2 * self._accept_delay, 0.05), 1.0)
                _refusals.log(logger, logging.WARNING, "[node] same-host accept failed (%s); accepting again in %.2fs",
                              e, self._accept_delay)
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._unix.fileno())
                loop.call_later(self._accept_delay, self._resume_accept)
                return
            self._accept_delay = 0.0
            pid, uid = shm.peer_cred(conn) or (None, None)
            if uid not in (os.getuid(), 0):  # the abstract socket has no permissions of its own
                self.server_auth.failed("uid")
                _refusals.log(logger, logging.WARNING,
                              "[auth] refused a same-host connection from uid=%s (this daemon runs as uid=%d)",
                              uid, os.getuid())
                conn.close()
                continue
            peer = self._make_peer()
            peer.pid = pid  # who pins the segments lent on this connection
            self.segments.connected(pid)
            shm.UnixTransport(asyncio.get_running_loop(), conn, peer)

    def _resume_accept(self) -> None:
        if self._unix is not None and not self._stopping.is_set():
            asyncio.get_running_loop().add_reader(self._unix.fileno(), self._accept_unix)

    def _watch_pid(self, pid: int, exited) -> None:
        """Call `exited` when process `pid` ends (a pidfd becomes readable)."""
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already (or no pidfd): treat as exited
            loop.call_soon(exited)
            return

        def done() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            exited()

        loop.add_reader(fd, done)

    def _make_peer(self) -> Peer:
        """An accepted connection: it must authenticate first."""
        peer = Peer(self, max_body=self.cfg.max_frame, on_connect=self._connected, accept=self.server_auth,
                    instance=self.instance)
        self._peers.add(peer)
        return peer

    def _make_link_peer(self) -> Peer:
        """This warehouse's connection to its controller: it proves the daemon role."""
        no_roles = self.cfg.insecure and self._token is None
        key = self._daemon_key if self._daemon_key is not None or no_roles else self._controller_secret
        peer = Peer(self, max_body=self.cfg.max_frame, on_connect=keepalive, prove=(auth.DAEMON, key, b""))
        self._peers.add(peer)
        return peer

    def _controller_secret(self) -> bytes | None:
        """The daemon secret of a controller on this host (None, said once, when there is none)."""
        key = auth.read_daemon_secret(int(self.cfg.join.rpartition(":")[2]))
        if key is not None:
            self.server_auth.daemon_key = key  # and this daemon asks the same of whoever claims the role
        elif not self._no_daemon_key_warned:
            self._no_daemon_key_warned = True
            logger.error(
                "[auth] this warehouse has no daemon token to prove to the controller at %s: give it "
                "--daemon-token-file FILE, the file the controller was started with (clients never get it). The "
                "dock's token alone does not make a daemon; only a warehouse on the controller's own host finds the "
                "controller's secret by itself", self.cfg.join)
        return key

    def _connected(self, transport) -> None:
        keepalive(transport)
        if self._token is None:  # tokenless: loopback TCP is as private as the same-host socket
            sock = transport.get_extra_info("socket")
            uid = auth.loopback_peer_uid(sock) if sock is not None and sock.family != socket.AF_UNIX else None
            if uid is not None and uid not in (os.getuid(), 0):
                self.server_auth.failed("uid")
                _refusals.log(logger, logging.WARNING,
                              "[auth] refused a loopback connection from uid=%s: this dock has no token, so only its "
                              "own user (uid=%d) may use it; give the dock a token (--token-file) to share it",
                              uid, os.getuid())
                transport.abort()
                return
        if len(self._peers) > self._max_connections:
            _refusals.log(logger, logging.WARNING,
                          "[node] refusing a connection: %d open, the limit is %d (--max-connections, and a quarter "
                          "of the descriptor limit)", len(self._peers) - 1, self._max_connections)
            transport.close()

    def ready_line(self) -> str:
        return json.dumps(
            {"event": "ready", "host": self.cfg.host, "port": self.port, "grpc_port": self.grpc_port,
             "metrics_port": self.metrics_port or None, "warehouse": self.wid, "controller": self.controller is not None,
             "version": __version__}
        )

    async def serve_until_stopped(self) -> None:
        await self._stopping.wait()
        await self.stop()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def stop(self) -> None:
        logger.info("[shutdown] stopping node warehouse=%d", self.wid)
        if self._secret_file is not None:
            self._secret_file.unlink(missing_ok=True)
        if self._grpc is not None:
            self._grpc.stop(grace=0.5)
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._unix is not None:
            asyncio.get_running_loop().remove_reader(self._unix.fileno())
            self._unix.close()
        if self.link is not None:
            self.link.close(leave=True)
        if self.controller is not None:
            self.controller.shutdown()
        for _, fut, _ in self._capacity_waiters:
            if not fut.done():
                fut.set_exception(DockError("the warehouse is shutting down"))
        self._server.close()
        for peer in list(self._peers):
            peer.close()
        self.links.close()
        await self._server.wait_closed()

    # -- Handler ------------------------------------------------------------------------------
    def on_lost(self, peer: Peer) -> None:
        self._peers.discard(peer)
        self.segments.disconnected(peer.pid)
        self.links.lost(peer)
        if any(p is peer for _, _, p in self._capacity_waiters):  # its waiting puts leave the queue
            for _, fut, p in self._capacity_waiters:
                if p is peer and not fut.done():
                    fut.cancel()
            self._admit_waiters()
        if self.link is not None:
            self.link.connection_lost(peer)
        if self.controller is not None:
            self.controller.on_lost(peer)

    def admit(self, peer: Peer, frame: pb.Frame, body_size: int) -> Awaitable[None] | None:
        if frame.WhichOneof("kind") != "put":
            return _failed(DockValueError(f"a {frame.WhichOneof('kind')} request carries no body"))
        try:
            limits.check(frame)
            self._check_warehouse()
            Warehouse.validate_put(frame.put)
            return self._reserve(peer, body_size, frame.put.timeout)
        except DockError as e:
            return _failed(e)

    def _reserve(self, peer: Peer, size: int, timeout: float) -> asyncio.Future | None:
        """Reserve room for a put: None when done, else a future that resolves once it fits (or DockFull)."""
        self.warehouse.check_fits(size)
        if not self._capacity_waiters and self.warehouse.reserve(size):
            return None
        fut = asyncio.get_running_loop().create_future()
        self._capacity_waiters.append((size, fut, peer))
        if timeout >= 0:
            asyncio.get_running_loop().call_later(timeout, self._capacity_timeout, fut, size)
        return fut

    def allocate(self, size: int):
        """Where a frame body is received: shared memory when big enough to be worth passing by descriptor."""
        if self._unix is not None and size >= shm.SHM_MIN_BODY and self._segment_room():
            return self.segments.take(size)
        return pa.allocate_buffer(size)

    def _segment_room(self) -> bool:
        """Whether one more stored segment fits the descriptor budget (warns once when it does not)."""
        if shm.Segment.live < self._segment_budget:
            return True
        if not self._over_budget_warned:
            self._over_budget_warned = True
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            logger.warning(
                "[shm] this warehouse holds %d shared-memory segments, the most its descriptor limit (%d) allows; "
                "further puts are copied into private memory (one more copy, and same-host reads of them are "
                "copies too). Raise the limit for full speed (ulimit -n, or LimitNOFILE= in a systemd unit).",
                shm.Segment.live, soft,
            )
        return False

    def on_request(self, peer: Peer, frame: pb.Frame, body, fds: list[int]) -> None:
        kind = frame.WhichOneof("kind")
        if frame.unpin:
            self.segments.unpin(peer.pid, frame.unpin)
            if kind is None:  # a frame that only gives pins back
                return
        if fds and (kind != "put" or len(fds) > 1):
            for fd in fds:
                os.close(fd)
            raise DockProtocolError(f"a {kind} request cannot carry {len(fds)} file descriptors")
        if kind in _DAEMON_KINDS and self.server_auth.roles and peer.role != auth.DAEMON and peer is not self._link_peer:
            self.server_auth.failed("daemon_message")
            raise DockAuthError(f"a {kind} request is a daemon-to-daemon message; this connection is a client's")
        if body is None:  # (a frame with a body was checked when it was admitted)
            limits.check(frame)
        if kind in _CONTROLLER_KINDS:
            self._controller_request(peer, frame, kind)
        elif kind == "put":
            self._put(peer, frame, body, fds)
        elif kind == "fetch":
            self._fetch(peer, frame)
        elif kind == "free":
            if peer is not self._link_peer:  # only this warehouse's controller frees its data
                raise DockAuthError("free requests come from this warehouse's controller only")
            freed = self._free(frame.free.partition, frame.free.indexes or None)
            peer.reply(frame, pb.Frame(free_reply=pb.FreeReply(nbytes=freed)))
        elif kind == "measure":
            if peer is not self._link_peer:
                raise DockAuthError("measure requests come from this warehouse's controller only")
            m = frame.measure
            values = self.warehouse.measure(m.partition, m.column, m.indexes)
            peer.reply(frame, pb.Frame(measure_reply=pb.MeasureReply(values=values.tolist())))
        elif kind == "dump":
            if peer is not self._link_peer:
                raise DockAuthError("dump requests come from this warehouse's controller only")
            _spawn(self._reply_async(peer, frame, self._dump(frame.dump), "dump_reply"))
        elif kind == "hello":
            check_protocol(frame.hello.protocol, f"the client {frame.hello.client or peer.name}")
            peer.reply(frame, pb.Frame(hello_reply=self._hello()))
        else:
            raise DockValueError(f"unexpected request kind {kind!r}")

    def _check_warehouse(self) -> None:
        if not self.cfg.warehouse:
            raise DockValueError(
                f"this daemon ({self.cfg.host}:{self.port}) runs the controller without a warehouse (--no-warehouse); "
                "put to a warehouse: dockd.connect() picks one unless warehouse= names this daemon"
            )

    def _hello(self) -> pb.HelloReply:
        m = self.metrics
        out = pb.HelloReply(protocol=PROTOCOL_VERSION, hosts_controller=self.controller is not None, warehouse_id=self.wid,
                            unix=self.unix_name, instance=self.instance,
                            joined=self.link.joined.is_set() if self.link is not None else self.wid >= 0,
                            version=__version__, used=self.warehouse.used, capacity=self.warehouse.capacity,
                            put_bytes=sum(m.put_bytes.values()), get_bytes=sum(m.get_bytes.values()),
                            device_used=self.warehouse.device_used, device_capacity=self.warehouse.device_capacity,
                            metadata=self.warehouse.meta, freed=self.warehouse.freed,
                            reclaimable=self.warehouse.reclaimable)
        if self.controller is not None:
            out.warehouses.extend(self.controller.warehouse_infos())
            out.controller = f"{self.cfg.advertise or self.cfg.host}:{self.port}"
        else:
            out.controller = self.cfg.join or ""
        return out

    def _controller_request(self, peer: Peer, frame: pb.Frame, kind: str) -> None:
        ctl = self.controller
        if ctl is None:
            raise DockValueError(
                f"this daemon ({self.cfg.host}:{self.port}) is a warehouse without the controller; "
                f"connect clients to the controller at {self.cfg.join}"
            )
        if kind == "acquire":
            ctl.acquire(peer, frame)
        elif kind == "confirm":
            peer.reply(frame, pb.Frame(confirm_reply=ctl.confirm(peer, frame.confirm)))
        elif kind == "release":
            peer.reply(frame, pb.Frame(release_reply=pb.ReleaseReply(released=ctl.release(peer, frame.release))))
        elif kind == "extend":
            peer.reply(frame, pb.Frame(extend_reply=ctl.extend(peer, frame.extend)))
        elif kind == "commit":
            idx = ctl.commit(frame.commit, functools.partial(_commit_answer, peer, frame))  # (None: paced, answered later)
            if idx is not None:
                peer.reply(frame, pb.Frame(commit_reply=pb.CommitReply(indexes=idx.tolist())))
        elif kind == "stats":
            peer.reply(frame, pb.Frame(stats_reply=ctl.stats()))
        elif kind == "locate":
            peer.reply(frame, ctl.locate(frame.locate))
        elif kind == "leave":
            ctl.leave(peer, frame.leave)
        elif kind == "register":
            check_protocol(frame.register.protocol, f"the warehouse at {frame.register.host}:{frame.register.port}")
            peer.reply(frame, pb.Frame(register_reply=ctl.register(peer, frame.register)))
        elif kind == "clear":
            _spawn(self._clear(peer, frame))
        elif kind == "partition":
            op = frame.partition.WhichOneof("op")
            if op in ("save", "load"):
                _spawn(self._reply_async(peer, frame, getattr(ctl, op)(frame.partition), "partition_reply"))
            else:
                peer.reply(frame, pb.Frame(partition_reply=ctl.partition(frame.partition)))

    async def _clear(self, peer: Peer, frame: pb.Frame) -> None:
        try:
            n = await self.controller.clear(frame.clear)
        except Exception as e:
            peer.reply_error(frame, e)
        else:
            peer.reply(frame, pb.Frame(clear_reply=pb.ClearReply(samples=n)))

    @staticmethod
    async def _reply_async(peer: Peer, frame: pb.Frame, work, field: str) -> None:
        try:
            out = await work
        except Exception as e:
            peer.reply_error(frame, e)
        else:
            peer.reply(frame, pb.Frame(**{field: out}))

    async def _dump(self, req: pb.DumpRequest) -> pb.DumpReply:
        """Write what this warehouse holds of a partition to a checkpoint file, or (load) store a
        file's samples; the file work runs in a thread, stored buffers kept from reuse meanwhile."""
        loop = asyncio.get_running_loop()
        if not req.load:
            dump = self.warehouse.dump(req.partition)
            self.segments.hold(dump.segments)
            try:
                await loop.run_in_executor(None, dump.write, req.path)
            finally:
                self.segments.unhold(dump.segments)
            return pb.DumpReply(samples=dump.samples, nbytes=dump.nbytes)
        self._check_warehouse()
        entries, group_size = await loop.run_in_executor(None, Warehouse.load, req.path, req.limit or None)
        total = sum(n for *_, n in entries)
        if not self.warehouse.reserve(total):
            raise DockFull(f"warehouse {self.wid} has no room for the {total} bytes of {req.path}: "
                           f"{self.warehouse.used} of {self.warehouse.capacity} bytes are in use")
        for idx, col, buf, n in entries:
            self.warehouse.store(req.partition, idx, [col], buf, n, None, group_size)
        samples = len(np.unique(np.concatenate([idx for idx, *_ in entries]))) if entries else 0
        logger.info("[warehouse] checkpoint loaded partition=%s file=%s samples=%d bytes=%d", req.partition,
                    req.path, samples, total)
        return pb.DumpReply(samples=samples, nbytes=total)

    # -- capacity -------------------------------------------------------------------------------
    def _free(self, partition: str, indexes=None) -> int:
        """Free a partition, or some of its samples; returns the bytes freed."""
        if indexes is not None:
            n, segs = self.warehouse.free_samples(partition, indexes)
            if n:
                logger.debug("[warehouse] samples freed partition=%s samples=%d bytes=%d", partition, len(indexes), n)
        else:
            segs = self.warehouse.segments_of(partition)
            n = self.warehouse.free(partition)
            for entry in self._committing.get(partition, ()):
                # A put whose commit was answered before this free (the link delivers both in order)
                # was applied before the clear: it must not land after it.
                entry[1] = entry[1] or self.link.answered(entry[0])
        for seg in segs:  # back to the pool once no reader maps them
            self.segments.release(seg)
        self._admit_waiters()
        return n

    def _release_room(self, *, unreserve: int = 0, unreserve_device: int = 0, seg=None) -> None:
        """Give back room a failed put held (and its segment, to the pool), and let waiting puts in."""
        if seg is not None:
            self.segments.release(seg)
        if unreserve:
            self.warehouse.unreserve(unreserve)
        if unreserve_device:
            self.warehouse.device_unreserve(unreserve_device)
        self._admit_waiters()

    def on_abandoned(self, peer: Peer, frame: pb.Frame, body_size: int) -> None:
        """A client vanished while sending an admitted body: its reservation is free again."""
        if frame.WhichOneof("kind") == "put":
            self._release_room(unreserve=body_size)

    def _admit_waiters(self) -> None:
        while self._capacity_waiters:
            size, fut, _ = self._capacity_waiters[0]
            if fut.done():
                self._capacity_waiters.pop(0)
                continue
            if not self.warehouse.reserve(size):
                break
            self._capacity_waiters.pop(0)
            fut.set_result(None)

    def _capacity_timeout(self, fut: asyncio.Future, size: int) -> None:
        if fut.done():
            return
        fut.set_exception(
            DockFull(
                f"warehouse {self.wid} stayed full: {size} bytes did not fit next to {self.warehouse.used} stored (and "
                f"{self.warehouse.meta} of their bookkeeping) and {self.warehouse.reserved} in flight of "
                f"{self.warehouse.capacity} within the put timeout. Clear "
                "finished partitions, consume faster, or raise --capacity."
            )
        )
        self._admit_waiters()

    # -- data path --------------------------------------------------------------------------------
    def _put(self, peer: Peer, frame: pb.Frame, body, fds: list[int]) -> None:
        if not self.cfg.warehouse:
            for fd in fds:
                os.close(fd)
            self._check_warehouse()
        req = frame.put
        if isinstance(body, shm.Segment):  # a body received into a segment of ours: complete, so seal it
            body.seal()
        if req.staging:  # a same-host put: the payload waits in the writer's staging buffer
            if body is not None:
                raise DockProtocolError("a staged put carries no body")
            staged = self.segments.staging(peer.pid, req.staging, fds[0] if fds else None, req.shm_size)
            Warehouse.validate_put(req)
            wait = self._reserve(peer, req.shm_size, req.timeout)
            if wait is not None:
                _spawn(self._put_when_admitted(wait, peer, frame, staged))
                return
            body = self._copy_in(staged, req.shm_size)
        elif fds:
            for fd in fds:
                os.close(fd)
            raise DockProtocolError("a put passes a descriptor only to register a staging buffer")
        elif body is None:  # admit() (validation, reservation) only runs for frames with a body
            Warehouse.validate_put(req)
            wait = self._reserve(peer, 0, req.timeout)  # a put's bookkeeping counts: a full warehouse waits
            if wait is not None:
                _spawn(self._put_when_admitted(wait, peer, frame, None))
                return
        self._put_reserved(peer, frame, body)

    def _copy_in(self, staged, size: int):
        """Copy a staged payload into storage of ours: a warm pool segment (or private memory past
        the descriptor budget)."""
        if size >= shm.SHM_MIN_BODY and self._segment_room():
            seg = self.segments.take(size)
            seg.writable()[:] = memoryview(staged)[:size]
            seg.seal()
            return seg
        buf = pa.allocate_buffer(size)
        memoryview(buf).cast("B")[:] = memoryview(staged)[:size]
        return buf

    async def _put_when_admitted(self, wait, peer: Peer, frame: pb.Frame, staged) -> None:
        try:
            await wait
        except asyncio.CancelledError:  # its client went away while it waited for room
            return
        except Exception as e:
            peer.reply_error(frame, e)
            return
        try:
            body = self._copy_in(staged, frame.put.shm_size) if staged is not None else None
            self._put_reserved(peer, frame, body)
        except Exception as e:
            peer.reply_error(frame, e)

    def _put_reserved(self, peer: Peer, frame: pb.Frame, body) -> None:
        """Store and commit a put whose size is already reserved."""
        req = frame.put
        seg = body if isinstance(body, shm.Segment) else None
        buf = seg.buffer if seg is not None else body
        size = buf.size if buf is not None else 0  # payload bytes (a segment's buffer excludes its padding)
        if req.token and self._put_again(peer, frame, size):
            return
        dev, spilled = [], 0
        try:
            if req.device_buffers:
                buf, seg, size, dev, spilled = self._take_device(peer, req, buf, seg, size)
            Warehouse.validate_put(req, size, [int(t.numel()) for t in dev])
            codec.check_msgpack(req.columns, buf)
            if req.indexes:
                self.warehouse.check_absent(req.partition, req.indexes, (c.name for c in req.columns))
        except Exception as e:
            self._release_room(unreserve=size, unreserve_device=sum(int(t.numel()) for t in dev))
            self._put_done(req.token, None, e)
            raise
        commit = pb.CommitRequest(
            partition=req.partition, indexes=req.indexes, new_count=req.new_count, group_size=req.group_size or 1,
            columns=[c.name for c in req.columns], warehouse=self.wid, nbytes=size, tags=req.tags,
        )
        if not req.indexes:  # new samples may wait for the partition's consumers (max_pending), as long as the put may
            commit.has_timeout, commit.timeout = True, req.timeout
        if self.controller is not None:
            try:
                self._put_local(peer, frame, buf, seg, commit, size, dev, spilled)
            except Exception as e:
                self._put_done(req.token, None, e)
                raise
        else:
            _spawn(self._put_remote(peer, frame, buf, seg, commit, size, dev, spilled))

    def _take_device(self, peer: Peer, req: pb.PutRequest, buf, seg, size: int):
        """A put's device runs (put(device="keep")), out of the writer's memory before the put is
        answered: into the device tier (copies of the warehouse's own, on the writer's device),
        or, when it is full or absent, into host memory after the body (spilled, counted, said
        in the reply). Returns the body, its segment, its size, the device copies, the bytes spilled."""
        if not peer.passes_fds:
            raise DockValueError("put(device='keep') shares device memory by handle, which needs a same-host "
                                 "connection to the warehouse (this one is TCP); put host tensors instead")
        opened = [device_share.open_buffer(d) for d in req.device_buffers]
        used = codec.spans(req.columns, "device_buffer")
        spans = [used.get(k, (0, 0)) for k in range(1, len(opened) + 1)]
        for src, (_, hi) in zip(opened, spans):
            if hi > src.numel():
                raise DockProtocolError(f"device runs end at byte {hi} of a {src.numel()}-byte device buffer")
        total = sum(hi - lo for lo, hi in spans)
        w = self.warehouse
        if w.device_capacity and w.device_reserve(total):
            dev = []
            try:
                for src, (lo, hi) in zip(opened, spans):
                    own = device_share.allocate(hi - lo, src.device)
                    own.copy_(src[lo:hi])
                    dev.append(own)
                for own in dev:
                    device_share.synchronize(own)
            except BaseException:
                w.device_unreserve(total)
                raise
            for c in req.columns:
                for r in c.runs:
                    if r.device_buffer:
                        r.offset -= spans[r.device_buffer - 1][0]
            return buf, seg, size, dev, 0
        at, end = [], size
        for lo, hi in spans:  # each spilled buffer 64-byte aligned after the body
            start = -(-end // 64) * 64
            at.append(start)
            end = start + hi - lo
        if not w.reserve(end - size):
            why = "is full" if w.device_capacity else "is off (--device-capacity 0)"
            raise DockFull(f"the device tier {why} and host memory has no room for the {total} bytes it would "
                           f"spill ({w.used} of {w.capacity} bytes in use)")
        try:
            out = pa.allocate_buffer(end)
            mv = memoryview(out).cast("B")
            if size:
                mv[:size] = memoryview(buf).cast("B")[:size]
            for src, (lo, hi), start in zip(opened, spans, at):
                if hi > lo:
                    mv[start : start + hi - lo] = src[lo:hi].cpu().numpy().data
        except BaseException:
            w.unreserve(end - size)
            raise
        for c in req.columns:
            for r in c.runs:
                if r.device_buffer:
                    r.offset = at[r.device_buffer - 1] + r.offset - spans[r.device_buffer - 1][0]
                    r.device_buffer = 0
        del req.device_buffers[:]
        if seg is not None:  # the body now lives in `out`
            self.segments.release(seg)
        self.metrics.spilled_bytes += total
        logger.info("[warehouse] device put spilled to host partition=%s bytes=%d reason=%s", req.partition, total,
                    "device tier full" if w.device_capacity else "no device tier")
        return out, None, end, [], total

    def _put_again(self, peer: Peer, frame: pb.Frame, size: int) -> bool:
        """A put re-sent with a token already seen (the client lost the reply): answer it, store nothing."""
        tok = frame.put.token
        done = self._puts_done.get(tok)
        waiting = self._puts_running.get(tok)
        if done is None and waiting is None:
            self._puts_running[tok] = []
            return False
        self._release_room(unreserve=size)
        if done is not None:
            peer.reply(frame, pb.Frame(put_reply=pb.PutReply(indexes=done)))
        else:
            waiting.append((peer, frame))
        return True

    def _put_done(self, token: int, indexes: list[int] | None, exc: BaseException | None = None) -> None:
        """Answer the retries that waited on a put's first attempt, and remember its outcome."""
        if not token:
            return
        for peer, frame in self._puts_running.pop(token, ()):
            if exc is not None:
                peer.reply_error(frame, exc)
            else:
                peer.reply(frame, pb.Frame(put_reply=pb.PutReply(indexes=indexes)))
        if exc is None:
            self._puts_done[token] = indexes
            if len(self._puts_done) > _PUT_TOKENS_KEPT:
                self._puts_done.popitem(last=False)

    # A put is committed first and stored after: the controller checks that explicit indexes
    # exist (and that their columns are unwritten) before any memory is spent on them, so a put
    # naming index 2**40 is refused without growing the index maps. Stores cannot fail after
    # the checks in _put_reserved. A fetch that arrives between the two waits for the store.
    def _put_local(self, peer, frame, buf, seg, commit, size, dev=(), spilled=0) -> None:
        req = frame.put
        dev_n = sum(int(t.numel()) for t in dev)

        def paced(res) -> None:  # a commit that waited for the partition's consumers (max_pending), applied or failed
            if isinstance(res, BaseException):
                self._release_room(unreserve=size, unreserve_device=dev_n, seg=seg)
                self._put_done(req.token, None, res)
                peer.reply_error(frame, res)
                return
            try:
                self._put_local(peer, frame, buf, seg, res, size, dev, spilled)
            except Exception as e:  # noqa: BLE001 - the put's answer
                self._put_done(req.token, None, e)
                peer.reply_error(frame, e)

        if isinstance(commit, np.ndarray):  # (applied already: store it)
            idx = commit
        else:
            try:
                idx = self.controller.commit(commit, paced, peer)
            except Exception:
                self._release_room(unreserve=size, unreserve_device=dev_n, seg=seg)
                raise
            if idx is None:
                return
        self.warehouse.store(req.partition, idx, req.columns, buf, size, seg, _group_size(req), device=dev)
        out = idx.tolist()
        self._put_done(req.token, out)
        self.metrics.put(peer.passes_fds, len(out), size + dev_n)
        peer.reply(frame, pb.Frame(put_reply=pb.PutReply(indexes=out, spilled_bytes=spilled)))

    async def _put_remote(self, peer, frame, buf, seg, commit, size, dev=(), spilled=0) -> None:
        req = frame.put
        dev_n = sum(int(t.numel()) for t in dev)
        self._pending[req.partition] = self._pending.get(req.partition, 0) + 1
        answer = self.link.commit(commit, req.timeout)
        entry = [commit.put_id, False]
        committing = self._committing.setdefault(req.partition, [])
        committing.append(entry)
        try:
            try:
                idx = await answer
            except Exception:
                self._release_room(unreserve=size, unreserve_device=dev_n, seg=seg)
                raise
            finally:
                committing.remove(entry)
                if not committing and self._committing.get(req.partition) is committing:
                    del self._committing[req.partition]
            if entry[1]:  # cleared after the controller applied it: answered, and gone as the clear says
                self._release_room(unreserve=size, unreserve_device=dev_n, seg=seg)
            else:
                self.warehouse.store(req.partition, idx, req.columns, buf, size, seg, _group_size(req), device=dev)
        except Exception as e:
            self._put_done(req.token, None, e)
            peer.reply_error(frame, e)
            return
        finally:
            self._pending[req.partition] -= 1
            if not self._pending[req.partition]:
                del self._pending[req.partition]
            async with self._landed:
                self._landed.notify_all()
        idx = list(idx)
        self._put_done(req.token, idx)
        self.metrics.put(peer.passes_fds, len(idx), size + dev_n)
        peer.reply(frame, pb.Frame(put_reply=pb.PutReply(indexes=idx, spilled_bytes=spilled)))

    def _fetch(self, peer: Peer, frame: pb.Frame) -> None:
        req = frame.fetch
        wanted = [(c.name, list(c.indexes)) for c in req.columns]
        try:
            found = self.warehouse.fetch(req.partition, wanted)
        except DockNotFound:
            if req.partition in self._pending:
                # The controller made a put visible before its commit reply reached us.
                _spawn(self._fetch_after_landing(peer, frame, wanted))
                return
            raise
        self._reply_fetch(peer, frame, found)

    async def _fetch_after_landing(self, peer: Peer, frame: pb.Frame, wanted) -> None:
        async with self._landed:
            await self._landed.wait_for(
                lambda: frame.fetch.partition not in self._pending or self.warehouse.has(frame.fetch.partition, wanted)
            )
        try:
            found = self.warehouse.fetch(frame.fetch.partition, wanted)
        except DockError as e:
            peer.reply_error(frame, e)
            return
        self._reply_fetch(peer, frame, found)

    def _reply_fetch(self, peer: Peer, frame: pb.Frame, found) -> None:
        req = frame.fetch
        reply = pb.FetchReply()
        link = None
        shared: list | None = None
        if req.device and peer.passes_fds:
            shared = []
        elif req.HasField("link"):
            devices = list({b.device.device: 0 for _, slices in found for b, _, _ in slices if b.device is not None})
            if devices:
                link = self.links.open(peer, req.link, devices, reply)
                shared = [] if link is not None else None
        cols, body, segs = self._encode(peer, found, max((len(c.indexes) for c in req.columns), default=0),
                                        shared, link)
        reply.columns.extend(cols)
        reply.device_buffers.extend(d for d, _ in shared or ())
        peer.reply(frame, pb.Frame(pins=[s.sid for s in segs], fetch_reply=reply), body.buffers, body.size, segs)
        if link is not None and shared:  # each buffer's used span, in buffer order, after the reply
            spans = codec.spans(reply.columns, "device_buffer")
            self.links.send(bytes(req.link.id), [_flat(shared[k - 1][1])[lo:hi] for k, (lo, hi) in sorted(spans.items())])

    def _encode(self, peer: Peer, found, samples: int, shared: list | None = None,
                link=None) -> tuple[list[pb.ColumnData], codec.Body, list]:
        """A reply's columns (of `samples` samples) from stored slices: one run per slice; big slices
        of shared-memory segments go by descriptor to same-host peers (pinned for the peer's
        process), the rest as body bytes (no copy). Device-tier slices, when `shared` is given,
        are shared by handle with a same-node reader, or with `link` named for sending over that
        device link (those on its kind of device; the link stages the others onto its own device):
        (descriptor, tensor) pairs appended to `shared`.
        Otherwise they are copied to host bytes."""
        body = codec.Body()
        segs: list = []
        index: dict[int, int] = {}
        exported: dict[tuple, int] = {}
        by_fd = peer.passes_fds
        out = []
        nbytes = 0
        for name, slices in found:
            col = pb.ColumnData(name=name)
            for batch, r0, r1 in slices:
                run = batch.run(r0, r1)
                nbytes += run.nbytes
                lo, _ = batch.span(r0, r1)
                if batch.device is not None and shared is not None and (link is None or batch.device.device.type == link.device.type):
                    key = (str(batch.device.device), batch.device.untyped_storage().data_ptr())
                    k = exported.get(key)
                    if k is None:  # one buffer per storage, whatever the number of its slices
                        desc = device_share.export(batch.device)[0] if link is None else \
                            pb.DeviceBuffer(type=link.backend, nbytes=batch.device.untyped_storage().nbytes())
                        shared.append((desc, batch.device))
                        k = exported[key] = len(shared)
                    run.device_buffer, run.offset = k, batch.device.storage_offset() + lo
                    col.runs.append(run)
                    if link is None:
                        self.metrics.device_shared_bytes += run.nbytes
                    else:
                        self.metrics.device_linked_bytes += run.nbytes
                    continue
                seg = batch.segment
                if by_fd and seg is not None and run.nbytes >= shm.SHM_MIN_VALUE:
                    k = index.get(id(seg))
                    if k is None and len(segs) < shm.MAX_FDS:
                        segs.append(seg)
                        k = index[id(seg)] = len(segs)
                    if k is not None:  # the run's place in that segment: where its batch starts, plus lo
                        run.segment, run.offset = k, batch.data.address - seg.buffer.address + lo
                        col.runs.append(run)
                        continue
                run.offset = body.add(memoryview(batch.host(lo, run.nbytes)))
                col.runs.append(run)
            out.append(col)
        if segs:
            self.segments.lend(peer.pid, segs)
        self.metrics.get(by_fd, samples, nbytes)
        return out, body, segs

    def _inline_values(self, peer: Peer, partition: str, columns: list[str], indexes: np.ndarray, locations: np.ndarray):
        """For an acquire: the whole columns this node's warehouse holds, so the client needs no fetch for them."""
        if self.wid < 0:
            return [], codec.Body(), []
        wanted = [(c, indexes.tolist()) for c, row in zip(columns, locations) if (row == self.wid).all()]
        if not wanted or len(indexes) * len(wanted) > _INLINE_CELLS:  # big gets fetch: their reply stays small
            return [], codec.Body(), []
        try:
            found = self.warehouse.fetch(partition, wanted)
        except DockError:
            return [], codec.Body(), []
        # device-tier columns are fetched: the reader then chooses device memory or host bytes
        found = [(name, slices) for name, slices in found if all(b.device is None for b, _, _ in slices)]
        return self._encode(peer, found, len(indexes))


class _Local:
    """This node's warehouse as its controller sees it (controller.service.LocalWarehouse)."""

    def __init__(self, node: Node) -> None:
        self.free = node._free
        self.measure = node.warehouse.measure
        self.dump = node._dump
        self.inline = node._inline_values


def _commit_answer(peer: Peer, frame: pb.Frame, res) -> None:
    """The late answer to a commit that waited for its partition's consumers (max_pending)."""
    if isinstance(res, BaseException):
        peer.reply_error(frame, res)
    else:
        peer.reply(frame, pb.Frame(commit_reply=pb.CommitReply(indexes=res.tolist())))


def _group_size(req: pb.PutRequest) -> int:
    """The group size a put tells its warehouse (0: a put of existing samples says nothing)."""
    return 0 if req.indexes else req.group_size or 1


def _flat(t):
    """The whole storage under a device-tier tensor, as flat bytes (run offsets index into it)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _failed(exc: BaseException) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


_tasks: set[asyncio.Task] = set()


def _spawn(coro) -> None:
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


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

    logger.info("[node] starting version=%s python=%s torch=%s pid=%d", __version__, sys.version.split()[0],
                torch.__version__, os.getpid())

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
            if node.link is not None:
                node.link.close()
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
