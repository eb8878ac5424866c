"""Operations on a partition as clients ask them: create (its options), set the policy version,
delete samples, seal, reserve, drop a consumer, set tags, list, and clear. Each change is written in
the journal ahead of it (an operation the journal cannot take is not applied, and one the
controller refuses is cut off again: `journal.ahead`); then the gets and puts waiting on the
partition are tried again, and the frees it left go to the warehouses."""

from __future__ import annotations

import logging

import numpy as np

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd._version import __version__
from dockd.controller.changes import list_changes
from dockd.controller.core import Controller
from dockd.controller.grants import where_of
from dockd.controller.journal import Journal, ahead
from dockd.controller.pacing import Pacer
from dockd.controller.waiters import Waiters
from dockd.controller.warehouse_calls import WarehouseCalls
from dockd.errors import DockClosed, DockNotFound, DockValueError

logger = logging.getLogger(__name__)


class PartitionOps:
    """The partition requests of one controller. `loading`: the partitions a checkpoint's load is
    filling (no operation on them until it returns)."""

    def __init__(self, core: Controller, journal: Journal | None, *, waiting: Waiters, pacer: Pacer,
                 calls: WarehouseCalls, loading: set[str]) -> None:
        self.core = core
        self.journal = journal
        self.waiting = waiting
        self.pacer = pacer
        self.calls = calls
        self.loading = loading
        self._ops = {"create": self._create, "set_version": self._set_version, "delete": self._delete,
                     "seal": self._seal, "reserve": self._reserve, "drop_consumer": self._drop_consumer,
                     "set_tags": self._set_tags}

    def apply(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        name, op, out = req.partition, req.WhichOneof("op"), pb.PartitionReply()
        if op == "list":  # reads only: nothing to journal, nobody to wake
            return self._list(name, req.list, out)
        do = self._ops.get(op or "")
        if do is None:
            raise DockValueError(f"partition operation {op!r} is not supported by this controller (version "
                                 f"{__version__})")
        if name in self.loading:
            raise DockValueError(f"partition {name!r} is being loaded from a checkpoint; try again once the load "
                                 "returned")
        if self.journal is not None and op in ("create", "reserve", "set_tags"):
            self.journal.room()
        with ahead(self.journal):
            do(name, req, out)
        self.calls.schedule_frees()
        self.waiting.wake(name)  # a delete, a seal or new tags can end or serve waiting gets
        self.pacer.soon(name)  # ... and a delete or new options can let waiting puts in
        return out

    async def clear(self, partition: str) -> int:
        """Forget a partition: its waiting gets and puts fail, and every warehouse frees it."""
        if self.journal is not None and partition in self.core.partitions:
            self.journal.clear(partition)  # written ahead
        n = self.core.clear(partition)
        logger.info("[controller] partition cleared partition=%s samples=%d", partition, n)
        self.waiting.fail(partition, DockClosed(f"partition {partition!r} was cleared while this get waited"))
        self.pacer.fail(partition, DockClosed(f"partition {partition!r} was cleared while this put waited "
                                              "for its consumers (max_pending)"))
        await self.calls.free_everywhere(partition)
        return n

    def _list(self, name: str, ls: pb.ListSamples, out: pb.PartitionReply) -> pb.PartitionReply:
        limit = min(ls.limit or 1000, limits.MAX_SAMPLES)
        if ls.changes:
            return self._list_changes(name, ls, limit, out)
        idx, listed = self.core.list_samples(name, consumer=ls.consumer, where=where_of(ls), limit=limit,
                                             start=ls.start)
        out.indexes.extend(idx.tolist())
        out.tags.extend(pb.Tag(name=t, values=v.tolist()) for t, v in listed.items())
        out.version = self.core.partitions[name].version
        return out

    def _list_changes(self, name: str, ls: pb.ListSamples, limit: int, out: pb.PartitionReply) -> pb.PartitionReply:
        if ls.consumer or ls.start:
            raise DockValueError("a listing of changes (since=) takes neither consumer nor start: it lists every "
                                 "sample changed since the cursor")
        ch = list_changes(self.core.catalog, name, ls.since, where=where_of(ls), limit=limit)
        out.indexes.extend(ch.indexes.tolist())
        out.tags.extend(pb.Tag(name=t, values=v.tolist()) for t, v in ch.tags.items())
        out.deleted.extend(ch.deleted.tolist())
        out.cursor, out.full, out.more = ch.cursor, ch.full, ch.more
        out.version = self.core.partitions[name].version
        return out

    def _create(self, name: str, req: pb.PartitionRequest, out: pb.PartitionReply) -> None:
        c = req.create
        gs, retire = c.group_size or 1, list(c.retire_when_consumed_by)
        opts = dict(max_staleness=c.max_staleness - 1 if c.max_staleness else -1, retire_stale=c.retire_stale,
                    max_pending=c.max_pending)
        if self.journal is not None:
            self.journal.create(name, gs, retire, **opts)
        self.core.create_partition(name, group_size=gs, retire=retire, **opts)
        logger.info("[controller] partition options partition=%s group_size=%d retire_when_consumed_by=%s "
                    "max_staleness=%s retire_stale=%s max_pending=%s", name, gs, ",".join(retire) or "-",
                    opts["max_staleness"] if c.max_staleness else "-", c.retire_stale, c.max_pending or "-")

    def _set_version(self, name: str, req: pb.PartitionRequest, out: pb.PartitionReply) -> None:
        v = req.set_version.version
        if name not in self.core.partitions:
            raise DockNotFound(f"partition {name!r} does not exist; create it (create_partition) before setting "
                               "its policy version")
        if self.journal is not None:
            self.journal.set_version(name, v)
        out.samples = self.core.set_version(name, v)
        out.version = v
        if out.samples:
            logger.info("[controller] stale samples retired partition=%s version=%d samples=%d", name, v,
                        out.samples)

    def _delete(self, name: str, req: pb.PartitionRequest, out: pb.PartitionReply) -> None:
        idx = np.asarray(req.delete.indexes, dtype=np.int64)
        if self.journal is not None and len(idx) and name in self.core.partitions:
            self.journal.delete(name, idx)
        out.samples = self.core.delete(name, idx)

    def _seal(self, name: str, req: pb.PartitionRequest, out: pb.PartitionReply) -> None:
        if self.journal is not None:
            self.journal.seal(name)
        self.core.seal(name)
        logger.info("[controller] partition sealed partition=%s", name)

    def _reserve(self, name: str, req: pb.PartitionRequest, out: pb.PartitionReply) -> None:
        r = req.reserve
        gs = r.group_size or 1
        if self.journal is not None:
            self.journal.reserve(name, r.count, gs)
        idx = self.core.reserve(name, r.count, group_size=gs)
        out.indexes.extend(idx.tolist())

    def _set_tags(self, name: str, req: pb.PartitionRequest, out: pb.PartitionReply) -> None:
        tags = {t.name: list(t.values) for t in req.set_tags.tags}
        if self.journal is not None:
            self.journal.tags(name, list(req.set_tags.indexes), tags)
        self.core.set_tags(name, list(req.set_tags.indexes), tags)

    def _drop_consumer(self, name: str, req: pb.PartitionRequest, out: pb.PartitionReply) -> None:
        """Forget a consumer (Controller.drop_consumer); its waiting gets fail, and the puts its
        pending samples held back (max_pending) go in (see apply)."""
        consumer = req.drop_consumer.consumer
        if not consumer:
            raise DockValueError("drop_consumer needs the consumer's name")
        part = self.core.catalog.part(name)
        if consumer not in part.consumers:
            out.dropped = False
        else:
            if self.journal is not None:
                self.journal.append(["U", name, consumer])  # written ahead (records.py)
            leases = self.core.drop_consumer(name, consumer)
            out.dropped = leases is not None
            logger.info("[controller] consumer dropped partition=%s consumer=%s leases_ended=%d", name, consumer,
                        len(leases or ()))
        self.waiting.fail(name, DockClosed(
            f"consumer {consumer!r} of partition {name!r} was dropped (drop_consumer) while this get waited; a "
            "new get under that name reads the partition again as a fresh consumer"),
            which=lambda r: r.consumer == consumer)
