"""gRPC admin surface of a node: the standard grpc.health.v1 service and dockd.v1.Admin/Stats.

It runs on its own threads; requests that need node state hop onto the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dockd._proto import dockd_pb2 as pb
from dockd._proto import dockd_pb2_grpc

logger = logging.getLogger(__name__)


class _Admin(dockd_pb2_grpc.AdminServicer):
    def __init__(self, node, loop: asyncio.AbstractEventLoop) -> None:
        self.node = node
        self.loop = loop

    def Stats(self, request, context):  # noqa: N802 - gRPC method name
        async def collect() -> pb.StatsReply:
            if self.node.controller is not None:
                return self.node.controller.stats()
            w = self.node.warehouse
            return pb.StatsReply(warehouses=[pb.WarehouseInfo(
                id=self.node.wid, host=self.node.cfg.host, port=self.node.port, alive=True, capacity=w.capacity, used=w.used)])

        return asyncio.run_coroutine_threadsafe(collect(), self.loop).result(timeout=10)


def start_grpc(node, loop: asyncio.AbstractEventLoop) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="dockd-grpc"))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    dockd_pb2_grpc.add_AdminServicer_to_server(_Admin(node, loop), server)
    port = server.add_insecure_port(f"{node.cfg.host}:{node.cfg.grpc_port}")
    if port == 0:
        raise OSError(f"cannot bind the gRPC port {node.cfg.host}:{node.cfg.grpc_port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("dockd.v1.Admin", health_pb2.HealthCheckResponse.SERVING)
    return server, port
