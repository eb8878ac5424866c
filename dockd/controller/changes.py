"""A partition's listing as changes since a cursor (``dock.list(p, since=cursor)``).

A partition counts its changes once someone lists them (`_Partition.track_changes`): each write,
tag, delete or unwrite of samples is one change, and `changed[i]` holds the count at sample i's
last one. A cursor names the partition's epoch (which incarnation of it, in which controller
process) and the count it was handed out at; the answer to it is each sample changed since,
listed (live and within `where`, with its tags) or deleted (it left the listing), and a new
cursor. A cursor of another epoch (the partition was cleared and made again, the controller
restarted, a checkpoint was loaded) is answered in full: every listed sample, ``full`` set, so the
caller replaces its view. An answer of more than `limit` samples comes in pages (``more`` set):
the cursor of a page continues the same pass from the next index, and that of the last page
starts the next pass at the count the first page was taken at (a sample changed meanwhile is
listed again, never missed).

Cursor text: ``"<epoch>:<since>:<pass>:<after>"``; ``since`` -1 is a full pass. The empty
cursor asks for a full answer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dockd.controller import selection
from dockd.controller.catalog import Catalog
from dockd.errors import DockValueError


@dataclasses.dataclass(slots=True)
class Changes:
    indexes: np.ndarray  # samples listed (changed or, in a full answer, every one), smallest first
    tags: dict[str, np.ndarray]  # each tag's value per listed sample
    deleted: np.ndarray  # samples changed since the cursor that are no longer listed
    cursor: str  # what to ask with next
    full: bool  # the first page of the whole listing: replace the view by it (and its further pages)
    more: bool  # a page: ask again with `cursor` for the rest


def _parse(cursor: str) -> tuple[str, int, int, int] | None:
    if not cursor:
        return None
    parts = cursor.split(":")
    try:
        if len(parts) != 4:
            raise ValueError
        epoch, since, pass_, after = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        raise DockValueError(f"since={cursor!r} is not a cursor dock.list handed out (its 'cursor'); pass "
                             "since='' to list the partition from the start") from None
    return epoch, since, pass_, after


def list_changes(cat: Catalog, partition: str, since: str, *, where: selection.Where | None = None,
                 limit: int = 1000) -> Changes:
    """The changes of `partition` since cursor `since` ("": from the start), at most `limit`."""
    part = cat.part(partition)
    changed = part.track_changes()
    parsed = _parse(since)
    if parsed is None or parsed[0] != part.epoch:
        base, pass_, after = -1, part.seq, 0
    else:
        _, base, pass_, after = parsed
        if after == 0:  # a new pass
            pass_ = part.seq
    n = part.size
    after = min(after, n)
    live = part.live()
    if base < 0:  # a full pass: the listed samples only
        cand = after + np.flatnonzero(live[after:])
    else:
        cand = after + np.flatnonzero(changed[after:n] > base)
    more = len(cand) > limit
    cand = cand[:limit]
    keep = live[cand]
    if where and len(cand):
        keep &= selection.within(part, cand, where)
    idx = cand[keep]
    if more:
        cursor = f"{part.epoch}:{base}:{pass_}:{int(cand[-1]) + 1}"
    else:
        cursor = f"{part.epoch}:{pass_}:{pass_}:0"
    return Changes(indexes=idx, tags={name: arr[idx] for name, arr in part.tags.items()},
                   deleted=cand[~keep] if base >= 0 else cand[:0], cursor=cursor, full=base < 0 and after == 0,
                   more=more)
