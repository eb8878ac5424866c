"""gRPC admin surface of a node: the standard grpc.health.v1 service and dockd.v1.Admin/Stats.
Every answer carries the daemon's version in the `x-dockd-version` header, and its framed port
(the one clients connect to) in `x-dockd-port`: a client pointed here by mistake says which it is.

It runs on its own threads; requests that need node state hop onto the event loop.
With a token, every call but the health check must carry `dockd.net.auth.grpc_metadata`
(an HMAC over the method and a fresh timestamp and nonce); the health service stays
open because orchestrators' probes cannot sign. Requests are capped at 64 KiB.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dockd._proto import dockd_pb2 as pb
from dockd._proto import dockd_pb2_grpc
from dockd._version import __version__
from dockd.errors import DockAuthError
from dockd.net import auth
from dockd.node.listen import bind_error
from dockd.node.metrics import NodeFigures

logger = logging.getLogger(__name__)


class _Admin(dockd_pb2_grpc.AdminServicer):
    def __init__(self, node: NodeFigures, address: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.node = node
        self.address = address  # (host, port) of the daemon's framed port
        self.loop = loop

    def Stats(self, request, context):  # noqa: N802 - gRPC method name
        async def collect() -> pb.StatsReply:
            node = self.node
            if node.controller is not None:
                return node.controller.stats()
            w = node.warehouse
            host, port = self.address
            return pb.StatsReply(version=__version__, warehouses=[pb.WarehouseInfo(
                id=node.wid, host=host, port=port, alive=True, capacity=w.capacity if w is not None else 0,
                used=w.used if w is not None else 0)])

        return asyncio.run_coroutine_threadsafe(collect(), self.loop).result(timeout=10)


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses calls without a valid token proof (see dockd.net.auth.grpc_metadata)."""

    def __init__(self, token: bytes, server_auth: auth.ServerAuth) -> None:
        self.token = token
        self.server_auth = server_auth
        self.nonces = auth.GrpcNonces()
        self.lock = threading.Lock()

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        value = dict(details.invocation_metadata or ()).get(auth.GRPC_HEADER)
        try:
            with self.lock:
                self.nonces.check(self.token, details.method, value)
        except DockAuthError as e:
            with self.lock:
                self.server_auth.failed("grpc")
            logger.warning("[auth] refused a gRPC call method=%s reason=%s", details.method, e)
            message = f"dockd: {e}; sign calls with dockd.net.auth.grpc_metadata(token, method)"

            def deny(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            return grpc.unary_unary_rpc_method_handler(deny)
        return continuation(details)


class _VersionHeader(grpc.ServerInterceptor):
    """Every answer (the health check's too) carries `x-dockd-version` and `x-dockd-port` (the framed
    port) in its initial metadata."""

    def __init__(self, port: int) -> None:
        self.HEADER = (("x-dockd-version", __version__), ("x-dockd-port", str(port)))

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        inner = handler.unary_unary or handler.unary_stream

        def tagged(request, context):
            context.send_initial_metadata(self.HEADER)
            return inner(request, context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
        return make(tagged, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def start_grpc(node: NodeFigures, loop: asyncio.AbstractEventLoop, *, host: str, port: int, grpc_port: int,
               server_auth: auth.ServerAuth) -> tuple[grpc.Server, int]:
    """Serve health and admin on `host:grpc_port` (0: any free port); returns the server and its port.
    `port` is the daemon's framed port (what Stats reports)."""
    token = server_auth.client_key
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="dockd-grpc"),
        interceptors=[_VersionHeader(port), *([_TokenCheck(token, server_auth)] if token is not None else [])],
        options=[("grpc.max_receive_message_length", 64 << 10)],
        maximum_concurrent_rpcs=32,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    dockd_pb2_grpc.add_AdminServicer_to_server(_Admin(node, (host, port), loop), server)
    try:
        bound = server.add_insecure_port(f"{host}:{grpc_port}")
    except RuntimeError:  # (grpc says only that it failed)
        bound = 0
    if bound == 0:
        raise bind_error(host, grpc_port, "--grpc-port", "the gRPC health and admin port")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("dockd.v1.Admin", health_pb2.HealthCheckResponse.SERVING)
    return server, bound
