"""Checkpoints of what a warehouse holds of a partition: dump to a file, or load a file's samples.

The file work runs in a thread; the stored buffers being written are kept from
reuse meanwhile. A load reserves the file's bytes at once (DockFull when they
do not fit) and stores its samples as they were.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockFull
from dockd.warehouse.core import Warehouse
from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, warehouse: Warehouse, segments: Segments, *, wid: Callable[[], int],
                 check_warehouse: Callable[[], None]) -> None:
        self.warehouse = warehouse
        self.segments = segments
        self._wid = wid
        self.check_warehouse = check_warehouse

    async def dump(self, req: pb.DumpRequest) -> pb.DumpReply:
        """Write what this warehouse holds of a partition to a checkpoint file, or (req.load) store a file's samples."""
        if req.load:
            return await self._load(req)
        dump = self.warehouse.dump(req.partition)
        self.segments.hold(dump.segments)
        try:
            await asyncio.get_running_loop().run_in_executor(None, dump.write, req.path)
        finally:
            self.segments.unhold(dump.segments)
        return pb.DumpReply(samples=dump.samples, nbytes=dump.nbytes)

    async def _load(self, req: pb.DumpRequest) -> pb.DumpReply:
        self.check_warehouse()
        w = self.warehouse
        entries, group_size = await asyncio.get_running_loop().run_in_executor(None, Warehouse.load, req.path,
                                                                               req.limit or None)
        total = sum(n for *_, n in entries)
        if not w.reserve(total):
            raise DockFull(f"warehouse {self._wid()} has no room for the {total} bytes of {req.path}: "
                           f"{w.used} of {w.capacity} bytes are in use")
        for idx, col, buf, n in entries:
            w.store(req.partition, idx, [col], buf, n, None, group_size)
        samples = len(np.unique(np.concatenate([idx for idx, *_ in entries]))) if entries else 0
        logger.info("[warehouse] checkpoint loaded partition=%s file=%s samples=%d bytes=%d", req.partition,
                    req.path, samples, total)
        return pb.DumpReply(samples=samples, nbytes=total)
