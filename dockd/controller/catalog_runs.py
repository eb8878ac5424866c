"""The catalog's side of commits applied as runs (`dockd.controller.commit_runs` cuts a warehouse's batch
into runs and journals them): a run of commits of new samples (`commit_run`), or of columns of existing
samples (`write_run`), changes the catalog once, as its commits applied one by one would."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dockd.controller.catalog import Catalog, existing, record, unwritten
from dockd.errors import DockValueError


def commit_run(catalog: Catalog, partition: str, columns: Sequence[str], *, warehouse: int, group_size: int,
               counts: Sequence[int], nbytes: int, put_ids: Sequence[int], tokens: Sequence[int]) -> list[range]:
    """A run of commits applied as one (see `dockd.controller.commit_runs`): record that `warehouse` holds
    `columns` of new samples, `counts[k]` of them for the k-th commit
    (put id `put_ids[k]`, writer token `tokens[k]`, 0 for none); returns each commit's indexes, which
    follow one another. Raises, changing nothing but what a first commit alone would (a partition
    made, a column named), when one commit of them would be refused alone."""
    _check_names(partition, columns)
    total = 0
    for n in counts:
        if n < 1 or n % group_size:
            raise DockValueError(f"a put of new samples needs a positive multiple of group_size={group_size} "
                                 f"values, got {n}")
        total += n
    part = catalog._for_new(partition, total, group_size)
    bits = [part.bit(c) for c in columns]
    idx = catalog._allocate(part, total)
    record(part, columns, bits, idx, warehouse, nbytes)
    out: list[range] = []
    start = int(idx[0])
    for n in counts:
        out.append(range(start, start + n))
        start += n
    _remember(catalog, partition, columns, warehouse, out, put_ids, tokens)
    return out


def write_run(catalog: Catalog, partition: str, columns: Sequence[str], *, warehouse: int,
              indexes: Sequence[np.ndarray], nbytes: int, put_ids: Sequence[int], tokens: Sequence[int]) -> None:
    """A run of commits of columns of existing samples applied as one (see `dockd.controller.commit_runs`):
    the k-th wrote `columns` of samples `indexes[k]` (put id `put_ids[k]`, writer token `tokens[k]`).
    Raises, changing nothing but the columns named, when one of them would be refused alone, or when
    two of them name the same sample (alone, the second would be refused)."""
    _check_names(partition, columns)
    idx = np.concatenate(indexes) if len(indexes) > 1 else indexes[0]
    part = existing(catalog.partitions.get(partition), partition)
    bits = unwritten(part, partition, columns, idx)
    record(part, columns, bits, idx, warehouse, nbytes)
    _remember(catalog, partition, columns, warehouse, indexes, put_ids, tokens)


def _remember(catalog: Catalog, partition: str, columns: Sequence[str], warehouse: int,
              kept: Sequence[np.ndarray | range], put_ids: Sequence[int], tokens: Sequence[int]) -> None:
    """The run's commits remembered for their re-sends, as `Catalog.remember` and `tokens.add` of each one
    would (put id or token 0: none), each kind in one go."""
    ids = [(put_id, k) for put_id, k in zip(put_ids, kept) if put_id]
    if ids:
        catalog.remember_all(warehouse, ids)
    cols = tuple(columns)
    seen = [(token, (partition, cols, k)) for token, k in zip(tokens, kept) if token]
    if seen:
        catalog.tokens.add_all(seen)


def _check_names(partition: str, columns: Sequence[str]) -> None:
    """What a commit alone checks first (a run refused here is applied commit by commit, each with its error)."""
    if not partition:
        raise DockValueError("partition must be a non-empty string")
    if not columns or len(set(columns)) != len(columns):
        raise DockValueError(f"a put needs at least one column, each named once: got {list(columns)}")
