"""Blocks of new sample indexes granted to warehouses (`--commit-window`): the registry and what the
catalog does for them. Pure: no journal, no sockets (`block_service` is the controller's side on the wire).

A warehouse whose puts are answered before their commit takes their indexes from a block the
partition's controller granted it: `count` new samples reserved (no column written), owned by that
warehouse. A put's commit then writes columns of some of them (`CommitRequest.block`): valid only
from the block's owner and inside the block. Block ids grow and are never reused, across restarts
too (`Blocks.next_id` goes into snapshots; a replayed grant moves it past its id).

A block is dropped when its partition is cleared or sealed (a seal takes the blocks back from their
owners first), when its owner leaves or restarts, when a rejoining owner no longer names it, when
it is written in full, or when its owner commits to a block granted after it (`passed`);
dropping deletes the samples of it that no column was written for (holes: their indexes are never
handed out again). A commit of a block that is gone, or of samples deleted meanwhile, is `CLEARED`:
nothing is recorded, and the warehouse frees what it stored. Except: a commit whose block went while each
of its samples outlived the drop with a column written (its writer wrote one by explicit index as soon as
the put was answered) applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from dockd.controller.catalog import Catalog, indexes_of
from dockd.errors import DockValueError

APPLY, AGAIN, CLEARED = "apply", "again", "cleared"
"""What `judge` says of a block commit: write its columns; answer it with the indexes it got already (a
re-send whose put id was forgotten, its writer token not); or answer it `cleared` (its samples are gone)."""


@dataclasses.dataclass(slots=True, frozen=True)
class Block:
    id: int
    partition: str
    owner: int  # the warehouse it was granted to
    start: int  # its indexes: [start, start + count)
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


class Blocks:
    """The blocks granted and not dropped, by id; `next_id` is the id the next grant gets."""

    def __init__(self) -> None:
        self.by_id: dict[int, Block] = {}
        self.next_id = 1
        self.owned: dict[tuple[int, str], list[int]] = {}  # (owner, partition) -> its blocks' ids, in grant order

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, block_id: int) -> Block | None:
        return self.by_id.get(block_id)

    def add(self, block: Block) -> None:
        self.by_id[block.id] = block
        self.next_id = max(self.next_id, block.id + 1)
        ids = self.owned.setdefault((block.owner, block.partition), [])
        ids.append(block.id)
        if len(ids) > 1 and ids[-2] > block.id:  # (a snapshot's or a replay's order: kept sorted)
            ids.sort()

    def holds(self, block_id: int, warehouse: int, partition: str, indexes: Sequence[int]) -> bool:
        """Whether a commit of samples `indexes` of `partition` by `warehouse` names a block it holds and only
        samples of it: where `owned` gives the block (not None, and no error)."""
        b = self.by_id.get(block_id)
        return (b is not None and b.owner == warehouse and b.partition == partition and len(indexes) > 0
                and b.start <= min(indexes) and max(indexes) < b.start + b.count)

    def of_partition(self, partition: str) -> list[Block]:
        return [b for b in self.by_id.values() if b.partition == partition]

    def of_owner(self, warehouse: int, partition: str | None = None) -> list[Block]:
        return [b for b in self.by_id.values()
                if b.owner == warehouse and (partition is None or b.partition == partition)]

    def pop(self, ids: Iterable[int]) -> list[Block]:
        """Drop these blocks from the registry (unknown ids are skipped); returns those dropped."""
        out = [b for i in ids if (b := self.by_id.pop(i, None)) is not None]
        for b in out:
            key = (b.owner, b.partition)
            owned = self.owned[key]
            owned.remove(b.id)
            if not owned:
                del self.owned[key]
        return out

    def forget_partition(self, partition: str) -> None:
        """A cleared partition's blocks go with it (their samples are gone already)."""
        self.pop([b.id for b in self.of_partition(partition)])

    def export(self) -> dict:
        """The registry as a snapshot holds it."""
        return {"next": self.next_id, "blocks": [[b.id, b.partition, b.owner, b.start, b.count]
                                                 for b in self.by_id.values()]}

    def load(self, d: dict | None) -> None:
        """Fill from `export`'s dict (None: a snapshot from before blocks, which holds none)."""
        if not d:
            return
        for bid, partition, owner, start, count in d["blocks"]:
            self.add(Block(bid, partition, owner, start, count))
        self.next_id = max(self.next_id, d["next"])


def grant(cat: Catalog, blocks: Blocks, partition: str, owner: int, count: int, group_size: int,
          block_id: int = 0) -> Block:
    """Reserve `count` new samples of `partition` (made if need be) as a block owned by warehouse `owner`
    (`block_id` 0: the next id; a replayed grant gives its own). Raises as `Catalog.reserve` does (a wrong
    group size, a sealed partition, the dock full), granting nothing."""
    idx = cat.reserve(partition, count, group_size=group_size)
    block = Block(block_id or blocks.next_id, partition, owner, int(idx[0]), count)
    blocks.add(block)
    return block


def unwritten(cat: Catalog, block: Block) -> np.ndarray:
    """The samples of `block` that no column was written for and that are not deleted."""
    part = cat.partitions.get(block.partition)
    if part is None:
        return np.empty(0, dtype=np.int64)
    stop = min(block.stop, part.size)
    sel = np.arange(block.start, stop, dtype=np.int64)
    return sel[(part.ready[block.start:stop] == 0) & ~part.gone[block.start:stop]]


def written_out(part, block: Block) -> bool:
    """Whether every sample of `block` has a column written or is deleted (`part`: its partition, or None)."""
    if part is None or part.size < block.stop:
        return False
    return bool(((part.ready[block.start:block.stop] != 0) | part.gone[block.start:block.stop]).all())


def drop(cat: Catalog, blocks: Blocks, ids: Iterable[int]) -> tuple[list[Block], int]:
    """Drop blocks (unknown ids skipped), deleting their unwritten samples; returns the blocks dropped and
    how many samples were deleted. Never raises: a journal replays it as it was decided."""
    dropped = blocks.pop(ids)
    n = 0
    for block in dropped:
        rest = unwritten(cat, block)
        if len(rest):
            n += cat.delete(block.partition, rest)
    return dropped, n


def passed(blocks: Blocks, named: Iterable[tuple[int, int, str]]) -> list[int]:
    """The blocks whose owner moved past them, given the commits just applied or judged (each as the block it
    names, the warehouse that sent it, its partition): the blocks of that warehouse and partition granted
    before the newest block it committed to. Droppable whatever is left unwritten of them: holes, never a
    put still on its way. A warehouse hands a partition's indexes out of its blocks in the order they were
    granted, one block at a time (`dockd.warehouse.blocks`: taking from a block gives up every block before
    it), and sends its puts' commits in the order they took their indexes, over one link, the re-sends of a
    rejoin in that order too; so each commit of an earlier block was applied before this one. Without this
    a block with a hole (a put that did not fit its rest, or failed to store) stayed until its owner
    rejoined or the partition was sealed: a stream never sealed grew the registry, and each snapshot, by
    a block per 16 puts or so for as long as its warehouse lived. Commits naming a block that is not theirs
    (another owner's, another partition's) name nothing here: `owned` refuses them."""
    newest: dict[tuple[int, str], int] = {}
    for block_id, warehouse, partition in named:
        b = blocks.by_id.get(block_id)
        if b is not None and b.owner == warehouse and b.partition == partition:
            key = (warehouse, partition)
            if block_id > newest.get(key, 0):
                newest[key] = block_id
    out: list[int] = []
    for key, last in newest.items():
        for block_id in blocks.owned.get(key, ()):
            if block_id >= last:
                break
            out.append(block_id)
    return out


def owned(blocks: Blocks, block_id: int, warehouse: int, partition: str, indexes: Sequence[int]) -> Block | None:
    """The block a commit by `warehouse` of samples `indexes` of `partition` names, or None when it was dropped.
    Raises DockValueError for a commit that is wrong whatever happened meanwhile: another warehouse's block,
    another partition's, no indexes, indexes outside the block."""
    block = blocks.get(block_id)
    if block is None:  # dropped: its partition cleared or sealed, or its owner restarted or gone
        return None
    if block.owner != warehouse:
        raise DockValueError(f"block {block_id} of partition {block.partition!r} was granted to warehouse "
                             f"{block.owner}, not to warehouse {warehouse}: only its owner commits puts from it")
    if block.partition != partition:
        raise DockValueError(f"block {block_id} is of partition {block.partition!r}, not of {partition!r}")
    if not len(indexes):
        raise DockValueError(f"a commit of block {block_id} names no indexes")
    if min(indexes) < block.start or max(indexes) >= block.stop:
        outside = [i for i in indexes if not block.start <= i < block.stop]
        raise DockValueError(f"indexes {outside[:8]} are outside block {block_id} of partition {partition!r} "
                             f"(indexes {block.start}..{block.stop - 1})")
    return block


def judge(cat: Catalog, blocks: Blocks, block_id: int, warehouse: int, partition: str, indexes: Sequence[int],
          token: int = 0, columns: Sequence[str] = ()) -> tuple[str, np.ndarray]:
    """What a commit of block `block_id` by `warehouse` writing `columns` of samples `indexes` comes to (its
    put id not applied before): (APPLY, no indexes), (AGAIN, the indexes it got), or (CLEARED, the samples of
    it to delete: those not deleted yet, when its block is still there). Raises as `owned` does.

    Idempotent: a commit sent again after it was applied (a restarted warehouse's data dir sends those it
    has no answer recorded for; its put id and writer token may be forgotten by then) is AGAIN when its
    columns are written on this warehouse for every sample of it not gone, its block dropped since or not:
    samples of it consumed and deleted since are not a reason to delete the rest, nor is "already written"
    one for the warehouse to free them."""
    part = cat.partitions.get(partition)
    block = owned(blocks, block_id, warehouse, partition, indexes)
    if part is None:
        return CLEARED, _NONE  # (a clear drops the partition's blocks too)
    seen = cat.tokens.get(token) if token else None
    if block is not None and seen is None and not part.deleted \
            and not (columns and _written_on(part, columns[:1], indexes[0], warehouse)):
        return APPLY, _NONE  # (the common case: one column of its first sample unwritten, nothing else to look up)
    idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
    if seen is not None and seen[0] == partition and np.array_equal(indexes_of(seen[2]), idx):
        return AGAIN, idx  # the writer's put was committed before: this very commit
    if not len(idx) or idx.min() < 0 or idx.max() >= part.size:
        return CLEARED, _NONE  # (not samples of the partition: nothing of them to delete)
    live = np.unique(idx[~part.gone[idx]])
    if len(live) and columns and _written_on(part, columns, live, warehouse):
        return AGAIN, idx
    if not len(live):
        return CLEARED, _NONE  # (all gone: nothing to delete)
    if block is None:
        # Dropping a block deletes the samples of it that no column was written for. Where each of these outlived
        # the drop with a column written since its put was answered (before its commit: a writer adds columns by
        # explicit index at once), the put was acknowledged, and it applies; where some were deleted it cannot
        # apply whole: cleared, the rest left as they are.
        whole = seen is None and len(live) == len(np.unique(idx)) and bool(part.ready[live].all())
        return (APPLY if whole else CLEARED), _NONE
    if seen is not None or len(live) < len(np.unique(idx)):
        return CLEARED, live  # its put was committed elsewhere (a re-send), or some of its samples were deleted
    return APPLY, _NONE


def _written_on(part, columns: Sequence[str], idx: np.ndarray | int, warehouse: int) -> bool:
    """Whether every column of `columns` is written on `warehouse` for every sample of `idx` (or sample `idx`)."""
    one = isinstance(idx, int)
    for c in columns:
        b, loc = part.columns.get(c), part.loc.get(c)
        if b is None or loc is None:
            return False
        if one:
            if int(loc[idx]) != warehouse or not int(part.ready[idx]) >> b & 1:
                return False
        elif not (loc[idx] == warehouse).all() or not ((part.ready[idx] >> np.uint64(b)) & np.uint64(1)).all():
            return False
    return True


_NONE = np.empty(0, dtype=np.int64)
