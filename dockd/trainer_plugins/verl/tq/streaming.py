"""``StreamingDataset`` / ``StreamingDataLoader`` on dockd, and TransferQueue's default batch functions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import dockd
from dockd.config import env
from dockd.trainer_plugins import require
from dockd.trainer_plugins.verl.tq import runtime
from dockd.trainer_plugins.verl.tq.client import DockTQClient
from dockd.trainer_plugins.verl.tq.fields import to_tensordict
from dockd.trainer_plugins.verl.tq.keylog import NT, field_kinds
from dockd.trainer_plugins.verl.tq.meta import BatchMeta
from dockd.trainer_plugins.verl.tq.runtime import ENV_ADDRESS
from dockd.trainer_plugins.verl.tq.samplers import SequentialSampler, _as_sampler
from dockd.trainer_plugins.verl.tq.store import _Client


def default_fetch_batch_fn(tq_client: Any, data_fields: list[str], batch_size: int, partition_id: str,
                           task_name: str, sampling_config: dict[str, Any], batch_index: int) -> tuple[Any, BatchMeta]:
    """TransferQueue's default ``fetch_batch_fn``: ``get_meta`` (with ``batch_index`` and
    ``partition_id`` added to `sampling_config`), then ``get_data``; ``(None, meta)`` when empty."""
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    meta = tq_client.get_meta(data_fields=data_fields, batch_size=batch_size, partition_id=partition_id,
                              task_name=task_name, sampling_config=config)
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: Any, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[tuple[Any, BatchMeta]]:
    """TransferQueue's default ``process_batch_fn``: micro-batches of `micro_batch_size` rows."""
    n = int(td.batch_size[0])
    out = []
    for start in range(0, n, micro_batch_size):
        rows = list(range(start, min(start + micro_batch_size, n)))
        out.append((td[start: rows[-1] + 1], batch_meta.select_samples(rows)))
    return out


PREFETCH = 4
"""Batches' worth of leases a StreamingDataset takes ahead (Dock.get(prefetch=...)): one acquire per 4 batches."""


class StreamingDataset(torch.utils.data.IterableDataset):
    """``transfer_queue.StreamingDataset`` on dockd: yields ``(TensorDict, BatchMeta)`` micro-batches.

    Same constructor as TransferQueue's. Each iteration step gets `batch_size` samples of TQ
    partition `partition_id` that hold all `data_fields` for consumer `task_name` (one
    ``dockd.Dock.get``; each sample goes to one reader of the task), then yields them in
    micro-batches of `micro_batch_size` through `process_batch_fn` (default `chunk_batch_fn`).
    Without `should_check_consumption_status` it streams forever (as in TransferQueue); with it,
    it ends once every key of the partition has been taken by `task_name`. It also ends when the
    dock partition holding the data is sealed (`dockd.Dock.seal`) and drained.

    With `fetch_batch_fn`, each batch comes from ``fetch_batch_fn(tq_client=..., data_fields=...,
    batch_size=..., partition_id=..., task_name=..., sampling_config=..., batch_index=...)`` as in
    TransferQueue, where `tq_client` is a `DockTQClient` (so TransferQueue's
    ``default_fetch_batch_fn``, ``get_meta`` then ``get_data``, works); it returns ``(TensorDict,
    BatchMeta)``, or ``(None, ...)`` when there is nothing yet (the dataset then waits
    `poll_interval`). ``config.controller.polling_mode`` and ``config.controller.sampler`` set that
    client's polling mode and sampler (default: as at `init`). With a sampler other than
    ``SequentialSampler`` the dataset fetches that way even without `fetch_batch_fn`
    (`default_fetch_batch_fn`, as TransferQueue), so with ``RankAwareSampler`` the ranks that share a
    `dp_rank` receive identical batches.

    Differences from TransferQueue: `config` only needs the dock address (``config.dockd.address``;
    default ``DOCKD_ADDRESS``); with the default ``SequentialSampler`` and no `fetch_batch_fn`, ranks
    that share a `dp_rank` do *not* receive identical samples (every reader takes its own; the
    dataset reads the dock directly): configure ``RankAwareSampler``, read once per data-parallel
    group and broadcast, or use ``dockd.Dock.get(..., mp_group=...)``.
    """

    def __init__(
        self,
        config: Any,
        batch_size: int,
        micro_batch_size: int,
        data_fields: list[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: Callable[..., Any] | None = None,
        process_batch_fn: Callable[..., Any] | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if len(data_fields) < 1:
            raise ValueError(f"data_fields must be a list with at least one field name, got {data_fields}")
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        address = None
        dockd_conf = runtime._dockd_conf(config)
        if dockd_conf is not None:
            address = dockd_conf.get("address", None)
        self.address = address or env(ENV_ADDRESS)
        if not self.address:
            raise ValueError(f"StreamingDataset needs the dock address: config.dockd.address or {ENV_ADDRESS}")
        self.config = config
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.data_fields, self.partition_id, self.task_name = list(data_fields), partition_id, task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.process_batch_fn = process_batch_fn or chunk_batch_fn
        self.fetch_batch_fn = fetch_batch_fn
        ctrl = config.get("controller", None) if hasattr(config, "get") else None
        self.polling_mode = None if ctrl is None else bool(ctrl.get("polling_mode", False))
        self.sampler = None if ctrl is None or ctrl.get("sampler", None) is None else _as_sampler(ctrl.get("sampler"))
        self.poll_interval = poll_interval
        self.buffer: list[tuple[Any, BatchMeta]] = []
        self.batch_index = 0

    def _columns(self, client: _Client, wait: float = 0.0) -> tuple[list[str], int, str] | None:
        part = client.sync(self.partition_id, wait=wait)
        kinds = field_kinds(part.keys.values())
        if any(f not in kinds for f in self.data_fields):
            return None  # not produced yet
        return [f if kinds[f] else NT + f for f in self.data_fields], part.gen, part.consumer(self.task_name)

    def _finished(self, client: _Client, data_partition: str) -> bool:
        part = client.sync(self.partition_id)
        stats = client.dock.stats()["partitions"].get(data_partition)
        if stats is None:
            return not part.keys
        taken = stats["consumers"].get(part.consumer(self.task_name), {}).get("taken", 0)
        # keys that hold tags only (verl's prompt-status keys) are never streamed
        streamable = sum(1 for r in part.keys.values() if all(f in r.fields for f in self.data_fields))
        return streamable > 0 and taken >= streamable

    def __iter__(self) -> Iterator[tuple[Any, BatchMeta]]:
        tensordict = require("tensordict", extra="verl", what="dockd transfer_queue.StreamingDataset")
        client = _Client(self.address)
        if self.fetch_batch_fn is not None or not isinstance(self.sampler or runtime._sampler, SequentialSampler):
            yield from self._iter_fetch_fn(client)
            return
        try:
            while True:
                if self.batch_index < len(self.buffer):
                    td, meta = self.buffer[self.batch_index]
                    self.batch_index += 1
                    yield from self.process_batch_fn(td, meta, micro_batch_size=self.micro_batch_size)
                    continue
                if not self._read_batch(client, tensordict):
                    return
        finally:
            client.close()

    def _read_batch(self, client: _Client, tensordict: Any) -> bool:
        """Read the next batch straight from the dock into the buffer, if there is one within
        `poll_interval`; False once the stream has ended."""
        # no key holding every field yet: wait for the key log to change
        found = self._columns(client) or self._columns(client, wait=self.poll_interval)
        if found is None:
            return True
        cols, gen, consumer = found
        data_partition = client._data(self.partition_id, gen)
        try:
            batch = client.dock.get(consumer, cols, self.batch_size, partition=data_partition,
                                    timeout=self.poll_interval, prefetch=PREFETCH)
        except dockd.DockDrained:
            return False
        except (dockd.DockTimeout, dockd.DockNotFound):
            if not self.should_check_consumption_status:
                return True
            try:  # finite mode: the last batch may be smaller
                batch = client.dock.get(consumer, cols, self.batch_size, partition=data_partition,
                                        allow_partial=True, timeout=0)
            except (dockd.DockTimeout, dockd.DockNotFound, dockd.DockDrained):
                return not self._finished(client, data_partition)
        idx = list(batch.indexes)
        client.took(self.partition_id, self.task_name, gen, idx)  # for the consumption status
        keys = client.keys_for(self.partition_id, idx)
        td = to_tensordict(tensordict, self.data_fields, cols, batch, len(idx))
        meta = client.meta(self.partition_id, keys).select_fields(self.data_fields)
        self.buffer.append((td, meta))
        return True

    def _iter_fetch_fn(self, client: _Client) -> Iterator[tuple[Any, BatchMeta]]:
        """TransferQueue's loop around a user `fetch_batch_fn`, on a `DockTQClient`."""
        tq_client = DockTQClient(client, polling_mode=self.polling_mode, sampler=self.sampler)
        sampling_config = {"dp_rank": self.dp_rank, "task_name": self.task_name}
        try:
            while (
                not self.should_check_consumption_status
                or self.batch_index < len(self.buffer)
                or not tq_client.check_consumption_status(self.task_name, self.partition_id)
            ):
                if self.batch_index < len(self.buffer):
                    td, meta = self.buffer[self.batch_index]
                    self.batch_index += 1
                    yield from self.process_batch_fn(td, meta, micro_batch_size=self.micro_batch_size)
                    continue
                fetch = self.fetch_batch_fn or default_fetch_batch_fn
                td, meta = fetch(
                    tq_client=tq_client,
                    data_fields=self.data_fields,
                    batch_size=self.batch_size,
                    partition_id=self.partition_id,
                    task_name=self.task_name,
                    sampling_config=sampling_config,
                    batch_index=self.batch_index,
                )
                if td is not None:
                    self.buffer.append((td, meta))
                else:
                    time.sleep(self.poll_interval)
        finally:
            client.close()

    def reset(self) -> None:
        """Replay the buffered batches from the start (TransferQueue's multi-pass reuse)."""
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Switch to another partition and drop the buffer."""
        self.buffer, self.batch_index, self.partition_id = [], 0, partition_id


def _identity_collate_fn(data: Any) -> Any:
    return data


class StreamingDataLoader(torch.utils.data.DataLoader):
    """``transfer_queue.StreamingDataLoader``: a DataLoader over `StreamingDataset` yielding
    ``(TensorDict, BatchMeta)`` pairs as they are (``batch_size=None``)."""

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[..., Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[..., Any] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        self.dataset: StreamingDataset = dataset
        super().__init__(
            dataset=dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=collate_fn or _identity_collate_fn,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def reset(self) -> None:
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        self.dataset.step(partition_id)

    def get_buffer(self) -> list[tuple[Any, BatchMeta]]:
        return self.dataset.buffer
