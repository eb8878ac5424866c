"""The partition calls (`PartitionCalls`, `Dock.read`) on a spread partition (``--shards NAME=S``).

A spread partition is S ordinary partitions, its shards, each on its own controller
(dockd.owners); its indexes number them as one (dockd.client.spread: shard k's sample i is
``i * S + k``). Each call here acts on the shards, one after the other, and takes and gives the
spread partition's indexes:

- options, the trainer's version, a consumer's drop, a seal and a clear go to every shard
  (`each`). A shard that fails (its controller down) does not stop the others: the call raises
  the first failure once they are done, and can be repeated (each of these is safe to do twice).
- deletes, tags and reads are split by shard (`Spread.inward`); a reserve is the home shard's; a
  listing merges the shards' by index (``since=``: under a cursor made of one cursor per shard).
- save and load are refused (a checkpoint holds one partition): each shard is saved on its own.

A shard is made by its first put or by create_partition, so some may not exist yet: a call that
needs none of them (a drop, a clear, a listing) passes those over, and raises DockNotFound only
when none exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.client.spread import Spread
from dockd.errors import DockError, DockNotFound, DockValueError

T = TypeVar("T")

Op = Callable[..., pb.PartitionReply]
"""One partition request to the controller that owns a partition: ``op(partition, **request)``
(PartitionCalls._partition_op)."""

MISSING = "-"
"""A shard's part of a composite change cursor when the shard did not exist at that listing."""
CURSOR_SEP = "|"
"""What joins the shards' change cursors into the spread partition's."""


def each(spread: Spread, call: Callable[[int, str], T], *, shards: Sequence[int] | None = None,
         missing_ok: bool = False) -> list[T | None]:
    """`call(k, shard name)` for every shard k (or those in `shards`), in order: the results, None for a
    shard that failed. All are tried before the first failure is raised. `missing_ok`: a shard that
    does not exist (DockNotFound) gives None without failing the call."""
    out: list[T | None] = []
    failure: DockError | None = None
    for k in range(spread.count) if shards is None else shards:
        try:
            out.append(call(k, spread.shard(k)))
        except DockNotFound as e:
            if not missing_ok:
                failure = failure or e
            out.append(None)
        except DockError as e:
            failure = failure or e
            out.append(None)
    if failure is not None:
        raise failure
    return out


def some(spread: Spread, results: list[T | None]) -> list[T]:
    """The shards' results of an `each(missing_ok=True)`; DockNotFound when no shard exists."""
    out = [r for r in results if r is not None]
    if not out:
        raise DockNotFound(f"partition {spread.name!r} does not exist (none of its {spread.count} shards does: "
                           "already cleared, or never written)")
    return out


def create(spread: Spread, op: Op, create: pb.CreatePartition) -> None:
    """The same options on every shard, but max_pending: ceil(max_pending / S) each."""
    mine = pb.CreatePartition()
    mine.CopyFrom(create)
    mine.max_pending = -(-create.max_pending // spread.count)
    each(spread, lambda k, name: op(name, create=mine))


def set_version(spread: Spread, op: Op, version: int) -> int:
    """The trainer's version on every shard (each must exist, as a partition's must: create_partition
    makes them all); the samples it retired, summed."""
    replies = each(spread, lambda k, name: op(name, set_version=pb.SetVersion(version=version)))
    return sum(r.samples for r in replies if r is not None)


def drop_consumer(spread: Spread, op: Op, consumer: str) -> bool:
    """Whether any shard had the consumer."""
    replies = each(spread, lambda k, name: op(name, drop_consumer=pb.DropConsumer(consumer=consumer)),
                   missing_ok=True)
    return any(r.dropped for r in some(spread, replies))


def seal(spread: Spread, op: Op) -> None:
    each(spread, lambda k, name: op(name, seal=True))


def clear(spread: Spread, clear_one: Callable[[str], int]) -> int:
    """Every shard cleared; their sample counts, summed."""
    return sum(some(spread, each(spread, lambda k, name: clear_one(name), missing_ok=True)))


def _by_shard(spread: Spread, idx: Sequence[int], call: Callable[[str, list[int], list[int]], T]) -> list[T | None]:
    """`call(shard name, places in idx, the shard's own indexes)` for each shard that `idx` names."""
    parts = spread.inward(idx)
    return each(spread, lambda k, name: call(name, *parts[k]), shards=list(parts))


def delete(spread: Spread, op: Op, idx: Sequence[int]) -> int:
    """Each shard's samples deleted there; how many were not deleted before, summed."""
    return sum(n for n in _by_shard(spread, idx, lambda name, where, local: op(
        name, delete=pb.DeleteSamples(indexes=local)).samples) if n is not None)


def set_tags(spread: Spread, op: Op, idx: Sequence[int], tags: list[pb.Tag]) -> None:
    """Each shard's samples tagged there (a tag with one value per sample split with them)."""
    def one(name: str, where: list[int], local: list[int]) -> None:
        mine = [t if len(t.values) == 1 else pb.Tag(name=t.name, values=[t.values[i] for i in where]) for t in tags]
        op(name, set_tags=pb.SetTags(indexes=local, tags=mine))

    _by_shard(spread, idx, one)


def reserve(spread: Spread, op: Op, k: int, count: int, group_size: int) -> list[int]:
    """New indexes from shard k (this client's home shard: where its puts of new samples go)."""
    reply = op(spread.shard(k), reserve=pb.ReserveSamples(count=count, group_size=group_size))
    return spread.outward(k, reply.indexes)


def refuse_checkpoint(spread: Spread, call: str) -> DockValueError:
    """What save and load raise: a checkpoint holds one partition, so each shard is saved on its own."""
    shard = f"owners.shard_name({spread.name!r}, k, {spread.count})"
    each_k = (f"dock.save({shard}, f'{{path}}/shard-{{k}}')" if call == "save"
              else f"dock.load(f'{{path}}/shard-{{k}}', partition={shard})")
    return DockValueError(
        f"dock.{call}: partition {spread.name!r} is spread over {spread.count} shards (--shards), and a checkpoint "
        f"holds one partition: {call} each shard on its own (dockd.owners.shard_name), e.g. for k in "
        f"range({spread.count}): {each_k}")


# -- listings -------------------------------------------------------------------------------------
def _merged(spread: Spread, replies: Sequence[pb.PartitionReply | None], limit: int | None) -> pb.PartitionReply:
    """The shards' listings as one reply: the spread partition's indexes, smallest first, at most `limit`;
    a tag that a shard has none of is 0 for its samples (as for a sample the tag was never set on);
    the trainer's version the newest of the shards'."""
    there = [(k, r) for k, r in enumerate(replies) if r is not None]
    idx = np.concatenate([np.asarray(r.indexes, dtype=np.int64) * spread.count + k for k, r in there] or
                         [np.zeros(0, np.int64)])
    order = np.argsort(idx, kind="stable")[:limit]
    out = pb.PartitionReply(indexes=idx[order].tolist(), version=max(r.version for _, r in there))
    names = list(dict.fromkeys(t.name for _, r in there for t in r.tags))
    for name in names:
        cols = []
        for _, r in there:
            values = next((t.values for t in r.tags if t.name == name), None)
            cols.append(np.asarray(values, np.int64) if values is not None else np.zeros(len(r.indexes), np.int64))
        out.tags.append(pb.Tag(name=name, values=np.concatenate(cols)[order].tolist()))
    return out


def list_samples(spread: Spread, op: Op, ls: pb.ListSamples) -> pb.PartitionReply:
    """list (no since): each shard's listing from its own first index at or past `ls.start` (shard k's
    ceil((start - k) / S)), merged by spread index and cut to the limit."""
    def one(k: int, name: str) -> pb.PartitionReply:
        mine = pb.ListSamples()
        mine.CopyFrom(ls)
        mine.start = max(0, -(-(ls.start - k) // spread.count))
        return op(name, list=mine)

    replies = each(spread, one, missing_ok=True)
    some(spread, replies)
    return _merged(spread, replies, ls.limit)


def _cursors(spread: Spread, since: str) -> list[str]:
    """Each shard's cursor in a spread partition's change cursor ("" for all: from the start)."""
    if not since:
        return [""] * spread.count
    parts = since.split(CURSOR_SEP)
    if len(parts) != spread.count or not all(parts):
        raise DockValueError(f"since={since!r} is not a cursor dock.list handed out for partition {spread.name!r} "
                             f"(spread over {spread.count} shards, its cursor is theirs joined by {CURSOR_SEP!r}); "
                             "pass since='' to list it from the start")
    return parts


def list_changes(spread: Spread, op: Op, ls: pb.ListSamples) -> pb.PartitionReply:
    """list(since=...): each shard's changes since its own cursor, merged; the cursor is the shards'
    joined by "|" ("-" for one that did not exist yet). The limit is shared out among the shards (at
    least one each); "more" when any has more. The answer is "full" when any shard's is (its cursor is
    of another incarnation of it, or the shard is gone): the shards that answered with changes are
    then asked again from the start, so that the answer is the whole listing. A shard that did not
    exist at the last listing and does now lists all its samples as changes."""
    before = _cursors(spread, ls.since)
    share = [max(1, ls.limit // spread.count + (k < ls.limit % spread.count)) for k in range(spread.count)]

    def ask(k: int, name: str) -> pb.PartitionReply:
        mine = pb.ListSamples()
        mine.CopyFrom(ls)
        mine.limit, mine.since = share[k], "" if before[k] == MISSING else before[k]
        return op(name, list=mine)

    replies = each(spread, ask, missing_ok=True)
    some(spread, replies)
    replaces = [(r.full and was != MISSING) if r is not None else was not in ("", MISSING)
                for r, was in zip(replies, before)]
    full = any(replaces)
    if full:  # the caller replaces its view: every shard's answer must be its whole listing
        again = [k for k, r in enumerate(replies) if r is not None and not r.full]
        before = [("" if k in again else was) for k, was in enumerate(before)]
        for k, r in zip(again, each(spread, ask, shards=again, missing_ok=True)):
            replies[k] = r
    out = _merged(spread, replies, None)
    deleted = [np.asarray(r.deleted, dtype=np.int64) * spread.count + k for k, r in enumerate(replies) if r is not None]
    out.deleted.extend(np.sort(np.concatenate(deleted)).tolist() if deleted else [])
    out.cursor = CURSOR_SEP.join(r.cursor if r is not None else MISSING for r in replies)
    out.full = full
    out.more = any(r.more for r in replies if r is not None)
    return out


# -- reads ----------------------------------------------------------------------------------------
def read(spread: Spread, idx: list[int], read_one: Callable[[str, list[int]], dict[str, Any]]) -> dict[str, Any]:
    """Dock.read's values (column -> values in the order of `idx`) from each shard's `read_one(shard,
    its own indexes)`. Samples of one shard come as that shard's read gave them; of several, each
    column is joined into one list of the values (a copy of the list, not of the tensors)."""
    parts = spread.inward(idx)
    if len(parts) == 1:
        (k, (_, local)), = parts.items()
        return read_one(spread.shard(k), local)
    out: dict[str, list[Any]] = {}
    for k, (where, local) in parts.items():
        for column, values in read_one(spread.shard(k), local).items():
            joined = out.setdefault(column, [None] * len(idx))
            for at, v in zip(where, values if isinstance(values, list) else values.values()):
                joined[at] = v
    return out
