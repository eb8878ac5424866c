"""A streaming dataset over a dock partition, for trainers that read with a DataLoader.

`StreamingDataset` is a `torch.utils.data.IterableDataset` that yields one batch
per get as samples become ready, and ends once the partition is sealed
(`Dock.seal`) and nothing is left for its consumer. Each process (and each
DataLoader worker) reads with its own connection as the same consumer, so
workers share the samples out between them: no sample reaches two of them.
Use it with ``DataLoader(dataset, batch_size=None, num_workers=k)``: batching
is the dock's.

With `dp_rank` / `dp_size` every step is a rank-aware get (see `Dock.get`):
under a DataLoader with k workers, worker w of rank r reads as rank
``r * k + w`` of ``dp_size * k``, so the ranks (and their workers) together
take each sample once, balanced by `balance_by` when given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.utils.data

from dockd.client.batch import Batch
from dockd.errors import DockDrained, DockValueError

__all__ = ["StreamingDataset"]


class StreamingDataset(torch.utils.data.IterableDataset):
    """Batches of a partition as they become ready; ends when it is sealed and drained.

    Args:
        address: the dock's "host:port".
        consumer: the consumer name the batches are taken for.
        columns: the columns to read.
        batch_size: samples per batch (the last batches of a sealed partition may be smaller).
        partition: the partition to read.
        dp_rank: this data-parallel rank (rank-aware gets, with dp_size).
        dp_size: the number of data-parallel ranks.
        balance_by: with dp ranks: balance each step's shares by these tags or columns.
        groups: hand out whole groups only.
        where: tag filter (see `Dock.get`).
        order_by: tag order (see `Dock.get`).
        timeout: seconds one batch may take to become ready before DockTimeout (None: no limit).
        collate: turns a `Batch` into what is yielded; default a dict with "indexes" and one list
            of values per column.
        connect_kwargs: passed to `dockd.connect` (e.g. token_file).
        prefetch: batches' worth of leases each iterator takes ahead (`Dock.get(prefetch=...)`): one
            acquire per `prefetch` batches; 0 or 1: one per batch. Rank-aware iterators take none.
    """

    def __init__(self, address: str, consumer: str, columns: Sequence[str], batch_size: int, *, partition: str,
                 dp_rank: int | None = None, dp_size: int | None = None, balance_by: str | Sequence[str] | None = None,
                 groups: bool = False, where: Mapping[str, Any] | None = None, order_by: str | None = None,
                 timeout: float | None = None, collate: Callable[[Batch], Any] | None = None,
                 connect_kwargs: Mapping[str, Any] | None = None, prefetch: int = 4) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise DockValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if (dp_rank is None) != (dp_size is None):
            raise DockValueError("give dp_rank and dp_size together (or neither)")
        if dp_rank is not None and dp_size is not None and not 0 <= dp_rank < dp_size:
            raise DockValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if balance_by and dp_size is None:
            raise DockValueError("balance_by balances the shares of data-parallel ranks: give dp_rank and dp_size")
        self.address, self.consumer, self.columns = address, consumer, list(columns)
        self.batch_size, self.partition = batch_size, partition
        self.dp_rank, self.dp_size, self.balance_by = dp_rank, dp_size, balance_by
        self.groups, self.where, self.order_by, self.timeout = groups, where, order_by, timeout
        self.collate = collate or self._as_dict
        self.connect_kwargs = dict(connect_kwargs or {})
        self.prefetch = prefetch

    def _as_dict(self, batch: Batch) -> dict[str, Any]:
        return {"indexes": list(batch.indexes), **{c: batch[c] for c in self.columns}}

    def _ranks(self) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if self.dp_size is None:
            return {}
        assert self.dp_rank is not None  # (given together with dp_size)
        return {"dp_rank": self.dp_rank * workers + worker, "dp_size": self.dp_size * workers,
                "balance_by": self.balance_by}

    def __iter__(self):
        import dockd

        ranks = self._ranks()
        with dockd.connect(self.address, **self.connect_kwargs) as dock:
            while True:
                try:
                    batch = dock.get(self.consumer, self.columns, self.batch_size, partition=self.partition,
                                     timeout=self.timeout, groups=self.groups, where=self.where,
                                     order_by=self.order_by, prefetch=self.prefetch, **ranks)
                except DockDrained:
                    return
                yield self.collate(batch)
