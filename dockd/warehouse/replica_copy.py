"""Copies of stored values to another warehouse of the dock (`--replicas 2`).

A put's home warehouse stores it, then sends its values to the warehouse the controller
named in the commit's answer (`CommitReply.replica`), as a put of those indexes marked
`replica`. That warehouse runs it through its own put pipeline (room, data dir, spill) and
commits it to the controller as the values' replica; only then does the home answer the
writer. The controller's repairs (`ReplicateRequest`) send values the same way.

The copy is read back from the store (one path for every way a put's bytes arrived; device-tier
values go as host bytes). The connections to other warehouses are daemon links (they prove
the daemon role, over TLS when the dock uses it), one per warehouse, opened on first use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from dockd import codec, ids
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError
from dockd.net.peer import Peer
from dockd.node.dial import open_link
from dockd.warehouse.core import Warehouse

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0


class Replicator:
    def __init__(self, warehouse: Warehouse, make_peer: Callable[[], Peer], link_tls, *, timeout: float) -> None:
        """`make_peer`: a daemon link's connection; `timeout`: seconds a copy may take (room on the
        far warehouse included)."""
        self.warehouse = warehouse
        self.make_peer = make_peer
        self.link_tls = link_tls
        self.timeout = timeout
        self._peers: dict[tuple[str, int], asyncio.Future] = {}  # address -> its connection (being opened)
        self.copies = 0
        self.copied_bytes = 0
        self.failed = 0

    async def copy(self, partition: str, indexes: Sequence[int], columns: Sequence[str],
                   target: pb.WarehouseInfo) -> int:
        """Send stored values to `target` as their replica; returns the bytes sent once it holds them."""
        idx = list(indexes)
        found = self.warehouse.fetch(partition, [(c, idx) for c in columns])
        cols, body = encode(found)
        req = pb.PutRequest(partition=partition, indexes=idx, columns=cols, replica=True,
                            token=ids.random_bits(63) or 1, timeout=self.timeout)
        try:
            peer = await self._peer(target)
            await asyncio.wait_for(peer.request(pb.Frame(put=req), body.buffers, body.size), self.timeout + 5.0)
        except BaseException:
            self.failed += 1
            raise
        self.copies += 1
        self.copied_bytes += body.size
        return body.size

    async def serve(self, req: pb.ReplicateRequest) -> int:
        """The controller's repair: copy values held here to req.target."""
        return await self.copy(req.partition, req.indexes, req.columns, req.target)

    async def link(self, target: pb.WarehouseInfo) -> Peer:
        """The daemon link to warehouse `target` (opened on first use; the weights relay's too)."""
        return await self._peer(target)

    async def _peer(self, target: pb.WarehouseInfo) -> Peer:
        key = (target.host, target.port)
        fut = self._peers.get(key)
        if fut is not None and fut.done() and (fut.exception() is not None or fut.result().closed):
            fut = None
        if fut is None:
            fut = self._peers[key] = asyncio.ensure_future(self._open(target))
        return await asyncio.shield(fut)

    async def _open(self, target: pb.WarehouseInfo) -> Peer:
        try:
            _, peer = await asyncio.wait_for(open_link(self.make_peer, target.host, target.port, self.link_tls),
                                             CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as e:
            raise DockConnectionError(f"cannot reach warehouse {target.id} at {target.host}:{target.port} to copy "
                                      f"values to it: {e or 'timed out'}") from None
        assert peer.authed is not None  # (an outgoing connection's)
        await asyncio.wait_for(peer.authed, 10.0)
        return peer

    def close(self) -> None:
        for fut in self._peers.values():
            if fut.done() and fut.exception() is None:
                fut.result().close()
            else:
                fut.cancel()
        self._peers.clear()


def encode(found) -> tuple[list[pb.ColumnData], codec.Body]:
    """Stored slices (`Warehouse.fetch`) as a put's columns and body: one run per slice, host bytes."""
    body = codec.Body()
    out = []
    for name, slices in found:
        col = pb.ColumnData(name=name)
        for batch, r0, r1 in slices:
            run, lo = batch.add_run(col.runs, r0, r1)
            run.offset = body.add(memoryview(batch.host(lo, run.nbytes)))
        out.append(col)
    return out, body
