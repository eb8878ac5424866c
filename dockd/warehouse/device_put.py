"""put(device="keep"): a put's device runs, taken out of the writer's memory before it is answered.

They go into the device tier (copies of the warehouse's own, on the writer's
device), or, when it is full or absent, into host memory after the body
(spilled, counted, said in the reply).
"""

from __future__ import annotations

import logging

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockFull, DockProtocolError, DockValueError
from dockd.net import device_share
from dockd.net.peer import Peer
from dockd.node.metrics import Metrics
from dockd.warehouse import memory
from dockd.warehouse.core import Warehouse
from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)


def take_device(peer: Peer, req: pb.PutRequest, buf, seg, size: int, w: Warehouse, segments: Segments,
                metrics: Metrics):
    """Take a put's device runs (see the module docstring). Returns the body, its segment, its size,
    the device copies, the bytes spilled."""
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
    if w.device_capacity and w.device_reserve(total):
        return buf, seg, size, _copy_to_tier(req, opened, spans, total, w), 0
    out, end = _spill(req, opened, spans, buf, size, total, w)
    if seg is not None:  # the body now lives in `out`
        segments.release(seg)
    metrics.spilled_bytes += total
    logger.info("[warehouse] device put spilled to host partition=%s bytes=%d reason=%s", req.partition, total,
                "device tier full" if w.device_capacity else "no device tier")
    return out, None, end, [], total


def _copy_to_tier(req: pb.PutRequest, opened, spans, total: int, w: Warehouse) -> list:
    """Copies of the used spans in the device tier (reserved already); the runs now point into them."""
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
    return dev


def _spill(req: pb.PutRequest, opened, spans, buf, size: int, total: int, w: Warehouse):
    """The body with the used device spans after it (each 64-byte aligned), the runs moved there."""
    at, end = [], size
    for lo, hi in spans:
        start = -(-end // 64) * 64
        at.append(start)
        end = start + hi - lo
    if not w.reserve(end - size):
        why = "is full" if w.device_capacity else "is off (--device-capacity 0)"
        raise DockFull(f"the device tier {why} and host memory has no room for the {total} bytes it would "
                       f"spill ({w.used} of {w.capacity} bytes in use)")
    try:
        out = memory.allocate(end)
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
    return out, end
