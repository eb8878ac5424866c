"""`PartitionCalls`: the `Dock` calls about partitions and their samples, each one request to the
controller that owns the partition: make one or set its options, announce the trainer's version,
list, delete, reserve and tag samples, drop a consumer, seal, save and load, clear. On a spread
partition (``--shards``) each acts on its shards instead (dockd.client.spread_calls)."""

from __future__ import annotations

import builtins
import os
from collections.abc import Mapping, Sequence
from typing import Any

from dockd._proto import dockd_pb2 as pb
from dockd.client import spread_calls, spread_io, validate
from dockd.client.confirm import Confirms
from dockd.client.router import Router
from dockd.client.spread import Spread
from dockd.client.spread import of as spread_of
from dockd.errors import DockValueError


class PartitionCalls:
    """The partition calls of `Dock` (its base: `Dock` sets `_confirms`, whose `ctrl_call` sends them,
    and `_router`, whose `shards` name the spread partitions)."""

    _confirms: Confirms
    _router: Router

    def _spread(self, partition: str) -> Spread | None:
        """`partition` as a spread partition (one of the dock's --shards), or None: an ordinary one."""
        return spread_of(self._router.shards, partition)

    def _ctrl_call(self, frame: pb.Frame, **kw: Any) -> tuple:
        return self._confirms.ctrl_call(frame, **kw)

    def clear(self, partition: str) -> int:
        """Free a partition's data on every warehouse and forget its metadata; returns its sample count.
        A spread partition: every shard (a shard whose controller is down raises once the others are
        cleared; clear again)."""
        validate.check_partition(partition)
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.clear(spread, self.clear)
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
        (lease) of a consumer opens the slots; see docs/rl.md.

        A spread partition (--shards NAME=S): every shard gets these options, max_pending as
        ceil(max_pending / S) each (a put waits on its own shard's pending samples); a shard whose
        controller is down raises once the others are set (call it again)."""
        create = validate.create_partition(group_size, retire_when_consumed_by, max_staleness, retire_stale, max_pending)
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.create(spread, self._partition_op, create)
        self._partition_op(partition, create=create)

    def set_version(self, partition: str, version: int) -> int:
        """Announce the trainer's current policy version for a partition. Gets with a staleness
        bound then hand out only samples of version >= version - max_staleness; with
        retire_stale, the samples this makes too stale are deleted. Returns how many were.
        A spread partition: every shard (the sum; one whose controller is down raises once the others
        are set: call it again)."""
        version = validate.whole("version", version, 0)
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.set_version(spread, self._partition_op, version)
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
        with the new cursor for the rest. Not with consumer or start.

        A spread partition: its shards' listings merged, as the spread partition's indexes, the
        trainer's version the newest of the shards'. With since=, the cursor is one per shard joined
        by "|", and the limit is shared out among the shards (at least 1 each)."""
        ls = validate.list_samples(consumer, where, limit, start, since)
        spread = self._spread(partition)
        if spread is None:
            r = self._partition_op(partition, list=ls)
        elif since is None:
            r = spread_calls.list_samples(spread, self._partition_op, ls)
        else:
            r = spread_calls.list_changes(spread, self._partition_op, ls)
        tags = {t.name: list(t.values) for t in r.tags}
        idx = list(r.indexes)
        out = {"indexes": idx, "versions": tags.get("version", [0] * len(idx)), "tags": tags, "version": r.version}
        if since is not None:
            out.update(deleted=list(r.deleted), cursor=r.cursor, full=r.full, more=r.more)
        return out

    def delete(self, partition: str, indexes: Sequence[int]) -> int:
        """Delete samples: all their columns are freed on every warehouse, and no consumer gets
        them again (gets waiting for them stop waiting). Deleting a group's samples drops the group
        (DAPO-style filtering). Returns how many were not deleted before. A spread partition: each
        shard deletes its own (an index that does not exist fails its shard's part only)."""
        idx = validate.int_list("indexes", indexes)
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.delete(spread, self._partition_op, idx)
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
        the partition had that consumer; raises DockNotFound when the partition does not exist.
        A spread partition: every shard (whether any had it; one whose controller is down raises once
        the others dropped it: call it again)."""
        if not isinstance(consumer, str) or not consumer:
            raise DockValueError(f"consumer must be a non-empty string such as 'actor_train', got {consumer!r}")
        validate.text(consumer, "consumer name")
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.drop_consumer(spread, self._partition_op, consumer)
        return self._partition_op(partition, drop_consumer=pb.DropConsumer(consumer=consumer)).dropped

    def seal(self, partition: str) -> None:
        """No new samples from now on (columns of existing ones can still be written). Gets that
        can no longer be met then take what is left, and raise DockDrained when nothing is: the
        end of a stream (see dockd.data.StreamingDataset). A spread partition: every shard (one
        whose controller is down raises once the others are sealed: call it again)."""
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.seal(spread, self._partition_op)
        self._partition_op(partition, seal=True)

    # (builtins.list: in this class `list` is the method Dock.list)
    def reserve(self, partition: str, count: int, *, group_size: int = 1) -> builtins.list[int]:
        """Hand out `count` new sample indexes ahead of writing them (a rollout fills them later with
        put(..., indexes=...)); a multiple of `group_size`. Gets see them once their columns are put.
        A spread partition: from this client's home shard (where its puts of new samples go)."""
        validate.positive_count("count", count)
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.reserve(spread, self._partition_op, spread_io.home_shard(self._router, spread.count),
                                        count, group_size)
        return list(self._partition_op(partition, reserve=pb.ReserveSamples(count=count, group_size=group_size)).indexes)

    def set_tags(self, partition: str, indexes: Sequence[int], tags: Mapping[str, int | Sequence[int]]) -> None:
        """Set integer tags of samples (one value for all, or one per sample), e.g. to age the
        samples a partial rollout left unfinished: ``dock.set_tags("p", idx, {"age": 1})``.
        A spread partition: each shard tags its own."""
        idx = validate.int_list("indexes", indexes)
        if not tags:
            raise DockValueError("tags is empty; give e.g. {'age': 1}")
        tag_list = validate.tag_list(tags, len(idx))
        spread = self._spread(partition)
        if spread is not None:
            return spread_calls.set_tags(spread, self._partition_op, idx, tag_list)
        self._partition_op(partition, set_tags=pb.SetTags(indexes=idx, tags=tag_list))

    def save(self, partition: str, path: str | os.PathLike) -> dict[str, int]:
        """Checkpoint a partition into directory `path`: its data, indexes, groups, tags, options and
        consumer progress. Each warehouse writes the samples it holds to its own Arrow IPC file
        (`warehouse-<id>.arrow`), in parallel, and the controller writes the metadata
        (`partition.msgpack`): nothing funnels through this client. `path` must be reachable by
        every daemon of the dock under the same name (one host, or a shared filesystem).
        Samples leased but not confirmed count as not taken. Puts made while a save runs may or
        may not be in it. Returns {"samples": ..., "bytes": ...}. A spread partition is refused
        (DockValueError): save each of its shards (dockd.owners.shard_name) on its own."""
        spread = self._spread(partition)
        if spread is not None:
            raise spread_calls.refuse_checkpoint(spread, "save")
        r = self._partition_op(partition, save=pb.SavePartition(path=validate.abs_dir(path)))
        return {"samples": r.samples, "bytes": r.nbytes}

    def load(self, path: str | os.PathLike, *, partition: str) -> dict[str, int]:
        """Restore a partition saved with `save` as `partition` (which must not exist). Each file
        is loaded by the warehouse of the same id when it is live, else by another one.
        Returns {"samples": ..., "bytes": ...}. A spread partition is refused (DockValueError): load
        each of its shards' checkpoints as that shard (dockd.owners.shard_name)."""
        spread = self._spread(partition)
        if spread is not None:
            raise spread_calls.refuse_checkpoint(spread, "load")
        r = self._partition_op(partition, load=pb.LoadPartition(path=validate.abs_dir(path)))
        return {"samples": r.samples, "bytes": r.nbytes}
