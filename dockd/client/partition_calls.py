"""`PartitionCalls`: the `Dock` calls about partitions and their samples, each one request to the
controller that owns the partition: make one or set its options, announce the trainer's version,
list, delete, reserve and tag samples, drop a consumer, seal, save and load, clear."""

from __future__ import annotations

import builtins
import os
from collections.abc import Mapping, Sequence
from typing import Any

from dockd._proto import dockd_pb2 as pb
from dockd.client import validate
from dockd.client.confirm import Confirms
from dockd.errors import DockValueError


class PartitionCalls:
    """The partition calls of `Dock` (its base: `Dock` sets `_confirms`, whose `ctrl_call` sends them)."""

    _confirms: Confirms

    def _ctrl_call(self, frame: pb.Frame, **kw: Any) -> tuple:
        return self._confirms.ctrl_call(frame, **kw)

    def clear(self, partition: str) -> int:
        """Free a partition's data on every warehouse and forget its metadata; returns its sample count."""
        validate.check_partition(partition)
        reply, _, _ = self._ctrl_call(pb.Frame(clear=pb.ClearRequest(partition=partition)), partition=partition)
        return reply.clear_reply.samples

    def _partition_op(self, partition: str, **op) -> pb.PartitionReply:
        validate.check_partition(partition)
        reply, _, _ = self._ctrl_call(pb.Frame(partition=pb.PartitionRequest(partition=partition, **op)),
                                      partition=partition)
        return reply.partition_reply

    def create_partition(self, partition: str, *, group_size: int = 1,
                         retire_when_consumed_by: Sequence[str] = (), max_staleness: int | None = None,
                         retire_stale: bool = False, max_pending: int | None = None) -> None:
        """Make a partition ahead of its first put, or set its options (each call sets all of them).

        retire_when_consumed_by: consumers that must all have confirmed a sample
        before it is deleted by itself (all its columns freed on every
        warehouse): a long-running partition then holds only live samples.
        Samples all of them already took go at once.

        max_staleness: gets hand out only samples whose policy version is >= the trainer's
        version (`set_version`) minus this, oldest version first (a get's own `max_staleness`
        overrides it). Samples staler than that, not yet taken by the partition's consumers, are
        counted in `stats()["partitions"][p]["stale"]`; with retire_stale=True they are deleted
        when set_version makes them stale (counted in "stale_retired").

        max_pending: a put of new samples waits while this many samples of the partition are
        written and not yet handed out to all its consumers (the consumers named by
        retire_when_consumed_by, else every consumer that asked for its samples; before any
        consumer asked, every sample counts), up to the put's timeout, then DockFull. A get
        (lease) of a consumer opens the slots; see docs/rl.md."""
        self._partition_op(partition, create=validate.create_partition(
            group_size, retire_when_consumed_by, max_staleness, retire_stale, max_pending))

    def set_version(self, partition: str, version: int) -> int:
        """Announce the trainer's current policy version for a partition. Gets with a staleness
        bound then hand out only samples of version >= version - max_staleness; with
        retire_stale, the samples this makes too stale are deleted. Returns how many were."""
        version = validate.whole("version", version, 0)
        return self._partition_op(partition, set_version=pb.SetVersion(version=version)).samples

    def list(self, partition: str, consumer: str | None = None, *, where: Mapping[str, Any] | None = None,
             limit: int = 1000, start: int = 0, since: str | None = None) -> dict[str, Any]:
        """The partition's samples (written, not deleted), smallest index first, with their tags and
        policy versions, without taking them for anyone. `consumer`: only those not yet handed to
        it (what it could still get); `where`: as get's; at most `limit` from index `start` on.
        Returns {"indexes": [...], "versions": [...], "tags": {name: [...]}, "version": the
        trainer's version}.

        since: list what changed instead, for a view kept up to date by polling. ``since=""``
        lists every sample; each answer has a "cursor", and ``since=cursor`` then answers only the
        samples written, tagged or deleted after it: "indexes" (with "tags" and "versions") are
        listed now, "deleted" left the listing. "full" is set when the answer is the whole listing
        (no cursor, or one from before the partition was cleared or its controller restarted):
        replace the view by it. "more" is set when more than `limit` samples changed: ask again
        with the new cursor for the rest. Not with consumer or start."""
        r = self._partition_op(partition, list=validate.list_samples(consumer, where, limit, start, since))
        tags = {t.name: list(t.values) for t in r.tags}
        idx = list(r.indexes)
        out = {"indexes": idx, "versions": tags.get("version", [0] * len(idx)), "tags": tags, "version": r.version}
        if since is not None:
            out.update(deleted=list(r.deleted), cursor=r.cursor, full=r.full, more=r.more)
        return out

    def delete(self, partition: str, indexes: Sequence[int]) -> int:
        """Delete samples: all their columns are freed on every warehouse, and no consumer gets
        them again (gets waiting for them stop waiting). Deleting a group's samples drops the group
        (DAPO-style filtering). Returns how many were not deleted before."""
        idx = validate.int_list("indexes", indexes)
        return self._partition_op(partition, delete=pb.DeleteSamples(indexes=idx)).samples

    def drop_consumer(self, partition: str, consumer: str) -> bool:
        """Forget a consumer of a partition: which samples it took, its leases (they end unconfirmed;
        a late confirm of one raises DockLeaseError) and its waiting gets (they raise DockClosed).
        Its samples stop holding puts back at once: a put waiting on max_pending for it goes on
        (unless retire_when_consumed_by names it: those are waited for whether they asked or not).
        For a consumer name nobody runs any more, e.g. one get made under a wrong name.

        The drop is journaled (a controller with a state dir keeps it across restarts). The name
        can be used again: a later get under it starts a fresh consumer, which sees every sample of
        the partition that is not deleted, those the dropped one took included. Returns whether
        the partition had that consumer; raises DockNotFound when the partition does not exist."""
        if not isinstance(consumer, str) or not consumer:
            raise DockValueError(f"consumer must be a non-empty string such as 'actor_train', got {consumer!r}")
        validate.text(consumer, "consumer name")
        return self._partition_op(partition, drop_consumer=pb.DropConsumer(consumer=consumer)).dropped

    def seal(self, partition: str) -> None:
        """No new samples from now on (columns of existing ones can still be written). Gets that
        can no longer be met then take what is left, and raise DockDrained when nothing is: the
        end of a stream (see dockd.data.StreamingDataset)."""
        self._partition_op(partition, seal=True)

    # (builtins.list: in this class `list` is the method Dock.list)
    def reserve(self, partition: str, count: int, *, group_size: int = 1) -> builtins.list[int]:
        """Hand out `count` new sample indexes ahead of writing them (a rollout fills them later with
        put(..., indexes=...)); a multiple of `group_size`. Gets see them once their columns are put."""
        validate.positive_count("count", count)
        return list(self._partition_op(partition, reserve=pb.ReserveSamples(count=count, group_size=group_size)).indexes)

    def set_tags(self, partition: str, indexes: Sequence[int], tags: Mapping[str, int | Sequence[int]]) -> None:
        """Set integer tags of samples (one value for all, or one per sample), e.g. to age the
        samples a partial rollout left unfinished: ``dock.set_tags("p", idx, {"age": 1})``."""
        idx = validate.int_list("indexes", indexes)
        if not tags:
            raise DockValueError("tags is empty; give e.g. {'age': 1}")
        self._partition_op(partition, set_tags=pb.SetTags(indexes=idx, tags=validate.tag_list(tags, len(idx))))

    def save(self, partition: str, path: str | os.PathLike) -> dict[str, int]:
        """Checkpoint a partition into directory `path`: its data, indexes, groups, tags, options and
        consumer progress. Each warehouse writes the samples it holds to its own Arrow IPC file
        (`warehouse-<id>.arrow`), in parallel, and the controller writes the metadata
        (`partition.msgpack`): nothing funnels through this client. `path` must be reachable by
        every daemon of the dock under the same name (one host, or a shared filesystem).
        Samples leased but not confirmed count as not taken. Puts made while a save runs may or
        may not be in it. Returns {"samples": ..., "bytes": ...}."""
        r = self._partition_op(partition, save=pb.SavePartition(path=validate.abs_dir(path)))
        return {"samples": r.samples, "bytes": r.nbytes}

    def load(self, path: str | os.PathLike, *, partition: str) -> dict[str, int]:
        """Restore a partition saved with `save` as `partition` (which must not exist). Each file
        is loaded by the warehouse of the same id when it is live, else by another one.
        Returns {"samples": ..., "bytes": ...}."""
        r = self._partition_op(partition, load=pb.LoadPartition(path=validate.abs_dir(path)))
        return {"samples": r.samples, "bytes": r.nbytes}
