"""TCP plus device links: device-tier data from a warehouse on another node, device to device.

Frames go over TCP as with `tcp`. A fetch for a get that names a device
(`get(device="cuda:0")`), from a warehouse with a device tier, goes through
this client's device link to that warehouse (`dockd.net.device_reader_links`, over
`dockd.net.device_link`: NCCL on CUDA, HCCL on NPUs, gloo for the CPU stand-in):
the reply's device runs arrive on the link into fresh device memory
(`Reply.received`), the rest in the body. Without a device, or from a
warehouse without a device tier, a fetch is a plain TCP one.
"""

from __future__ import annotations

from dockd._proto import dockd_pb2 as pb
from dockd.net.tcp import TcpTransport
from dockd.net.transport import Context, Endpoint, Reply


class DeviceLinkTransport(TcpTransport):
    name = "tcp"  # (frames are TCP; the link is per fetch)
    priority = 10

    @classmethod
    def applies(cls, endpoint: Endpoint, ctx: Context) -> bool:
        return endpoint.warehouse is not None and ctx.links is not None

    def fetch(self, pool, wid: int, req: pb.FetchRequest, device, timeout: float | None) -> Reply:

        if device is None or not self.ctx.device_tier(wid):
            return super().fetch(pool, wid, req, device, timeout)
        if device.type != "cpu" and device.index is None:  # a link is bound to one device
            import torch

            device = torch.device(device.type, getattr(torch, device.type).current_device())

        def call(frame: pb.Frame):
            return pool.call(frame, timeout=timeout, stall=timeout)

        assert self.ctx.links is not None  # applies() chose this transport only where there are links
        return Reply(*self.ctx.links.fetch(wid, self.endpoint.host, device, req, call))
