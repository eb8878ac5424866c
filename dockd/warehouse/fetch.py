"""The read path: fetch replies, encoded from stored slices, and values inlined into acquire replies.

A reply carries one run per stored slice. Big slices of shared-memory segments
go by descriptor to same-host readers (pinned for the reader's process until
it gives them back); device-tier slices are shared by handle with a same-node
reader or sent over a device link to one on another node; everything else is
body bytes (no copy). A reader that asks for a Mooncake answer (`FetchRequest.mooncake`) gets the
registered segment spans its runs use named instead, and reads them itself (`dockd.net.mooncake`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockError, DockNotFound
from dockd.net import device_share, mooncake, same_host
from dockd.net.device_transport import WarehouseLinks
from dockd.net.peer import Peer
from dockd.node.metrics import Metrics
from dockd.node.tasks import spawn
from dockd.warehouse.commit import Committer
from dockd.warehouse.core import SMALL_READ, Warehouse
from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)

INLINE_CELLS = 1 << 20  # sample-columns an acquire reply carries inline at most (each may be a run of its own)


class FetchPath:
    """Fetch requests, and the inline values of acquires answered in this process.

    Args:
        committer: tells whether a partition has puts in flight (a fetch waits for them to land).
        links: this warehouse's device links to readers on other nodes.
        wid: this node's warehouse id.
    """

    def __init__(self, *, warehouse: Warehouse, segments: Segments, links: WarehouseLinks, committer: Committer,
                 metrics: Metrics, wid: Callable[[], int]) -> None:
        self.warehouse = warehouse
        self.segments = segments
        self.links = links
        self.committer = committer
        self.metrics = metrics
        self._wid = wid
        self.mooncake = mooncake.attach(segments)  # (None: this daemon runs no Mooncake engine)

    def fetch(self, peer: Peer, frame: pb.Frame) -> None:
        req = frame.fetch
        if req.mooncake_done:  # Mooncake answers this reader has read: unpin their segments
            if self.mooncake is not None:
                self.mooncake.done(peer, req.mooncake_done, self.segments)
            if not req.columns:
                peer.reply(frame, pb.Frame(fetch_reply=pb.FetchReply()))
                return
        wanted = [(c.name, c.indexes[:]) for c in req.columns[:]]  # ([:]: see dockd.net.wire)
        try:
            found = self.warehouse.fetch(req.partition, wanted)
        except DockNotFound:
            if self.committer.in_flight(req.partition):
                # The controller made a put visible before its commit reply reached us.
                spawn(self._after_landing(peer, frame, wanted))
                return
            raise
        self._reply(peer, frame, found)

    async def _after_landing(self, peer: Peer, frame: pb.Frame, wanted) -> None:
        partition = frame.fetch.partition
        await self.committer.landed(partition, lambda: self.warehouse.has(partition, wanted))
        try:
            found = self.warehouse.fetch(partition, wanted)
        except DockError as e:
            peer.reply_error(frame, e)
            return
        self._reply(peer, frame, found)

    def _reply(self, peer: Peer, frame: pb.Frame, found) -> None:
        req = frame.fetch
        if req.mooncake and not peer.passes_fds and not req.device and not req.HasField("link"):
            self._reply_mooncake(peer, frame, found)
            return
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
        cols, body, segs = self.encode(peer, found, max((len(c.indexes) for c in req.columns), default=0),
                                       shared, link)
        reply.columns.extend(cols)
        reply.device_buffers.extend(d for d, _ in shared or ())
        peer.reply(frame, pb.Frame(pins=[s.sid for s in segs], fetch_reply=reply), body.buffers, body.size, segs)
        if link is not None and shared:  # each buffer's used span, in buffer order, after the reply
            spans = codec.spans(reply.columns, "device_buffer")
            self.links.send(bytes(req.link.id), [_flat(shared[k - 1][1])[lo:hi] for k, (lo, hi) in sorted(spans.items())])

    def _reply_mooncake(self, peer: Peer, frame: pb.Frame, found) -> None:
        """A Mooncake answer: runs of registered segments (big enough) as remote spans the reader reads
        with its engine, pinned until it names the loan read; the rest (small runs, private memory,
        device-tier data as host bytes) in the body. Without an engine: all in the body, and why."""
        req = frame.fetch
        samples = max((len(c.indexes) for c in req.columns), default=0)
        eng = self.mooncake
        if eng is None:
            cols, body, lent = self.encode(peer, found, samples)
            reply = pb.FetchReply(mooncake_refused=f"this warehouse serves remote readers over the socket "
                                                   f"({mooncake.why()})")
            reply.columns.extend(cols)
            peer.reply(frame, pb.Frame(pins=[s.sid for s in lent], fetch_reply=reply), body.buffers, body.size, lent)
            return
        body = codec.Body()
        segs: list = []
        bases: list[int] = []
        index: dict[int, int] = {}
        out = []
        nbytes = remote = 0
        for name, slices in found:
            col = pb.ColumnData(name=name)
            for batch, r0, r1 in slices:
                run, lo = batch.add_run(col.runs, r0, r1)
                nbytes += run.nbytes
                seg = batch.segment
                addr = eng.remote(seg) if seg is not None and batch.device is None and \
                    run.nbytes >= same_host.SHM_MIN_VALUE else None
                if addr is None:
                    run.offset = body.add(memoryview(batch.host(lo, run.nbytes)))
                else:
                    k = index.get(id(seg))
                    if k is None:
                        segs.append(seg)
                        bases.append(addr)
                        k = index[id(seg)] = len(segs)
                    run.segment, run.offset = k, batch.data.address - seg.buffer.address + lo
                    remote += run.nbytes
            out.append(col)
        reply = pb.FetchReply(columns=out)
        if segs:
            for k, (lo, hi) in sorted(codec.spans(out, "segment").items()):
                reply.remote_segments.add(address=bases[k - 1] + lo, nbytes=hi - lo, offset=lo)
            reply.mooncake_session, reply.mooncake_protocol = eng.session, eng.protocol
            reply.mooncake_loan = eng.lend(peer, segs, self.segments)
        self.metrics.got("mooncake" if remote else "tcp", samples, remote or nbytes)
        if remote and nbytes > remote:
            self.metrics.got("tcp", 0, nbytes - remote)
        peer.reply(frame, pb.Frame(fetch_reply=reply), body.buffers, body.size)

    def encode(self, peer: Peer, found, samples: int, shared: list | None = None,
               link=None) -> tuple[list[pb.ColumnData], codec.Body, list]:
        """A reply's columns (of `samples` samples) from stored slices: one run per slice, except that
        consecutive slices sent as body bytes whose batches share kind, dtype and shape go as one run
        (a get of samples put one at a time is one run per column to decode, not one per put); big slices
        of shared-memory segments go by descriptor to same-host peers (pinned for the peer's
        process) when the reply has more than SHM_COPY_REPLY bytes of them, the rest as body bytes (no copy
        here). A mapping costs the reader more than copying a few hundred KiB (a get of 64 values of 4 KiB:
        98-100k samples/s mapped, 105-111k copied), and a put's runs share one mapping; a large body fills
        the socket's buffer and makes both sides wait (a GRPO get of 64 samples, ~2 MB, with its runs below
        512 KiB copied: 26-43k samples/s, against 64k mapped). Device-tier slices, when `shared` is given,
        are shared by handle with a same-node reader, or with `link` named for sending over that
        device link (those on its kind of device; the link stages the others onto its own device):
        (descriptor, tensor) pairs appended to `shared`.
        Otherwise they are copied to host bytes."""
        body = codec.Body()
        segs: list = []
        index: dict[int, int] = {}
        exported: dict[tuple, int] = {}
        same_host = peer.passes_fds
        by_fd = same_host and _worth_mapping(found)
        out = []
        nbytes = 0
        for name, slices in found:
            col = pb.ColumnData(name=name)
            # the column's last run sent as body bytes, and its batch's (kind, dtype, shape): the next
            # slice continues that run when it goes as body bytes too and its batch has the same key
            last, key = None, None
            for batch, r0, r1 in slices:
                if last is not None and batch.device is None and (batch.kind, batch.dtype, batch.shape) == key:
                    lo, hi = batch.span(r0, r1)
                    if not (by_fd and _lendable(batch, hi - lo)):
                        last.count += r1 - r0  # (one run for slices of many puts: one for the reader to decode)
                        if batch.lengths is not None:
                            last.lengths.extend(batch.lengths[r0:r1].tolist())
                        last.nbytes += hi - lo
                        body.extend(memoryview(batch.host(lo, hi - lo)))
                        nbytes += hi - lo
                        continue
                run, lo = batch.add_run(col.runs, r0, r1)
                size = run.nbytes
                nbytes += size
                last = None
                if batch.device is not None and shared is not None and (link is None or batch.device.device.type == link.device.type):
                    self._share(batch, run, lo, shared, exported, link)
                elif not (by_fd and self._by_descriptor(batch, run, lo, segs, index)):
                    run.offset = body.add(memoryview(batch.host(lo, size)))
                    last, key = run, (batch.kind, batch.dtype, batch.shape)
            out.append(col)
        if segs:
            self.segments.lend(peer.pid, segs)
        self.metrics.get(same_host, samples, nbytes)
        return out, body, segs

    def _share(self, batch, run: pb.Run, lo: int, shared: list, exported: dict, link) -> None:
        """A device-tier run, shared by handle (same node) or named for a device link."""
        key = (str(batch.device.device), batch.device.untyped_storage().data_ptr())
        k = exported.get(key)
        if k is None:  # one buffer per storage, whatever the number of its slices
            desc = device_share.export(batch.device)[0] if link is None else \
                pb.DeviceBuffer(type=link.backend, nbytes=batch.device.untyped_storage().nbytes())
            shared.append((desc, batch.device))
            k = exported[key] = len(shared)
        run.device_buffer, run.offset = k, batch.device.storage_offset() + lo
        if link is None:
            self.metrics.device_shared_bytes += run.nbytes
        else:
            self.metrics.device_linked_bytes += run.nbytes

    @staticmethod
    def _by_descriptor(batch, run: pb.Run, lo: int, segs: list, index: dict) -> bool:
        """Point a run into its shared-memory segment, passed by descriptor (False: it goes as bytes)."""
        if not _lendable(batch, run.nbytes):
            return False
        seg = batch.segment
        k = index.get(id(seg))
        if k is None and len(segs) < same_host.MAX_FDS:
            segs.append(seg)
            k = index[id(seg)] = len(segs)
        if k is None:
            return False
        run.segment, run.offset = k, batch.data.address - seg.buffer.address + lo  # where its batch starts, plus lo
        return True

    def inline(self, peer: Peer, partition: str, columns: list[str], indexes: np.ndarray, locations: np.ndarray,
               device: bool = False):
        """For an acquire: the whole columns this node's warehouse holds, so the client needs no fetch
        for them, and the device buffers their device-tier runs are in. Device-tier columns come only
        to a same-node reader that maps device memory (`device`), shared by handle as a fetch would;
        for any other reader they are fetched, so that it chooses device memory or host bytes."""
        wid = self._wid()
        if wid < 0:
            return [], codec.Body(), [], []
        if len(indexes) <= SMALL_READ:  # (scalar compares: gets are mostly small)
            idx = indexes.tolist()  # (one list for every column)
            wanted = [(c, idx) for c, row in zip(columns, locations.tolist()) if row.count(wid) == len(row)]
        else:
            wanted = [(c, indexes) for c, here in zip(columns, (locations == wid).all(axis=1).tolist()) if here]
        if not wanted or len(indexes) * len(wanted) > INLINE_CELLS:  # big gets fetch: their reply stays small
            return [], codec.Body(), [], []
        try:
            found = self.warehouse.fetch(partition, wanted)
        except DockError:
            return [], codec.Body(), [], []
        shared: list | None = [] if device and peer.passes_fds else None
        if shared is None and any(b.device is not None for _, slices in found for b, _, _ in slices):
            found = [(name, slices) for name, slices in found if all(b.device is None for b, _, _ in slices)]
        cols, body, segs = self.encode(peer, found, len(indexes), shared)
        return cols, body, segs, [d for d, _ in shared] if shared else []


def _lendable(batch, nbytes: int) -> bool:
    """Whether `nbytes` of a batch may go to a same-host reader by descriptor: they are in a shared-memory
    segment, and enough of them to be worth a mapping."""
    return batch.segment is not None and nbytes >= same_host.SHM_MIN_VALUE


def _worth_mapping(found) -> bool:
    """Whether the slices that could go by descriptor come to more than SHM_COPY_REPLY bytes."""
    total = 0
    for _, slices in found:
        for batch, r0, r1 in slices:
            if batch.segment is None or batch.device is not None or batch.data is None \
                    or batch.data.size < same_host.SHM_MIN_VALUE:  # (none of its slices can be lent)
                continue
            lo, hi = batch.span(r0, r1)
            if _lendable(batch, hi - lo):
                total += hi - lo
                if total > same_host.SHM_COPY_REPLY:
                    return True
    return False


def _flat(t):
    """The whole storage under a device-tier tensor, as flat bytes (run offsets index into it)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
