"""`get_client`'s `DockTQClient`: the parts of TransferQueue's ``TransferQueueClient`` verl uses.

The calls verl's ``tqbridge`` makes (``kv_retrieve_meta``, ``get_data``, ``put``, ...), the
sampler-driven ones (``get_meta``, the statuses, ``reset_consumption``, ``set_custom_meta``; their
work is in `dockd.trainer_plugins.verl.tq.consume`), and each one's ``async_`` form.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import torch

from dockd import config
from dockd.trainer_plugins.verl.tq import runtime
from dockd.trainer_plugins.verl.tq.checkpoint import load_checkpoint, save_checkpoint
from dockd.trainer_plugins.verl.tq.kv import _keys
from dockd.trainer_plugins.verl.tq.meta import BatchMeta, KVBatchMeta
from dockd.trainer_plugins.verl.tq.samplers import SequentialSampler, _as_sampler
from dockd.trainer_plugins.verl.tq.store import _Client


class GetMetaTimeout(TimeoutError, RuntimeError):
    """`DockTQClient.get_meta` found too few samples in time (not in polling mode). A RuntimeError
    too, as TransferQueue's client reports the controller's TimeoutError as a RuntimeError."""


class DockTQClient:
    """What `get_client` returns: the parts of ``TransferQueueClient`` verl's ``tqbridge`` uses.

    ``kv_retrieve_meta`` / ``kv_retrieve_keys`` / ``get_data`` / ``put`` / ``clear_samples`` /
    ``clear_partition`` / ``kv_list``, and the sampler-driven calls with TransferQueue's samplers
    (``get_meta``, ``get_consumption_status`` / ``get_production_status`` and their ``check_`` forms,
    ``reset_consumption``, ``set_custom_meta``), each with its ``async_`` form.
    Consumption is per task and per sample, shared by every process (``get_meta`` and
    `StreamingDataset` record what they take in the partition's key log); ``reset_consumption``
    gives the task a fresh dock consumer. Keys that hold tags only have no sample on dockd, so the
    statuses do not list them (TransferQueue lists them as never produced nor consumed).
    """

    def __init__(self, client: _Client, polling_mode: bool | None = None, sampler: Any = None) -> None:
        self._client = client
        self.client_id = client.viewer
        self.polling_mode = polling_mode  # None: as configured at init (conf.controller.polling_mode)
        self.sampler = None if sampler is None else _as_sampler(sampler)  # None: as at init

    def kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        keys = _keys(keys)
        if not keys:
            raise ValueError("Received an empty list as keys.")
        return self._client.meta(partition_id, keys, create=create)

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        idx = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
        if not idx:
            raise ValueError("Received an empty list as `global_indexes`.")
        return self._client.keys_for(partition_id, idx)

    def get_data(self, metadata: BatchMeta) -> Any:
        pid = _one_partition(metadata)
        keys = metadata.keys if all(metadata.keys) else self._client.keys_for(pid, metadata.global_indexes)
        return self._client.get(keys, pid, metadata.field_names)

    def put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        n = int(data.batch_size[0])
        if metadata is None:
            if partition_id is None:
                raise ValueError("put needs metadata or partition_id")
            keys = [f"auto-{uuid.uuid4().hex}" for _ in range(n)]
            pid = partition_id
        else:
            pid = _one_partition(metadata)
            keys = metadata.keys if all(metadata.keys) else self._client.keys_for(pid, metadata.global_indexes)
            if len(keys) != n:
                raise ValueError(f"put: data has {n} rows for a BatchMeta of {len(keys)} samples")
        self._client.put(keys, pid, data, None, data_parser)
        out = self._client.meta(pid, keys)
        if metadata is not None:
            out.extra_info = dict(metadata.extra_info)
            out.custom_meta = [dict(d) for d in metadata.custom_meta]
        return out

    # -- the sampler-driven calls ------------------------------------------------------
    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """TransferQueue's ``get_meta``, choosing as the sampler named at `init` does.

        ``mode="fetch"``: takes for `task_name` `batch_size` samples holding every one of `data_fields`
        that the task has not taken yet (each sample once per task, across processes), and marks them
        consumed. Which ones, by ``conf.controller.sampler``:

        - ``SequentialSampler`` (the default): the oldest; `sampling_config` is ignored.
        - ``GRPOGroupNSampler(n_samples_per_prompt=n)``: whole groups, runs of n consecutive indexes
          (a prompt's responses put one after another), oldest first; `batch_size` a multiple of n.
          With ``sampling_config["dp_rank"]`` the choice is remembered per ``(dp_rank, batch_index)``
          and a repeated call gets it again.
        - ``RankAwareSampler``: ``sampling_config`` needs ``dp_rank`` and ``batch_index``; every caller
          with the same pair (the ranks of one data-parallel group) gets the same samples, the first
          to ask choosing the oldest; different dp_ranks get different samples.
        - ``SeqlenBalancedSampler(n_samples_per_prompt=n, dp_size=k)``: the first rank to ask for a
          ``batch_index`` chooses whole groups for all k ranks (`batch_size` each) and splits them with
          `dockd.balance.balance` so that the ranks' sums of the samples' ``total_lengths`` tag
          (default 1) are balanced, groups kept whole; each rank then gets its share. The shares of
          ranks that have not asked yet are set aside: no other batch takes them.

        Choices are made under a lock per partition shared by every process (`_Client.exclusive`) and
        kept in the partition's key log, so they hold across processes; they outlive
        ``reset_consumption``, as TransferQueue's sampler cache does. When nothing can be chosen: in
        polling mode (``conf.controller.polling_mode`` at `init`) an empty BatchMeta at once, otherwise
        it waits up to ``TQ_CONTROLLER_GET_METADATA_TIMEOUT`` seconds (default 1, as TransferQueue),
        then raises `GetMetaTimeout` (a TimeoutError and a RuntimeError). A remembered choice is
        returned at once in either mode (TransferQueue, not polling, first waits for `batch_size` new
        ready samples). ``mode="force_fetch"``: every sample of the partition, ready or not, taking
        nothing. ``mode="insert"``: `batch_size` new samples (keys ``auto-...``) to `put` into.
        """
        if mode == "force_fetch":
            return self._client.everything(partition_id, list(data_fields or []))
        if mode == "insert":
            if batch_size is None or batch_size < 1:
                raise ValueError("must provide batch_size for inserting new data")
            keys = [f"auto-{uuid.uuid4().hex}" for _ in range(int(batch_size))]
            return self._client.meta(partition_id, keys, create=True)
        if mode != "fetch":
            raise ValueError(f"Invalid mode: {mode}")
        if task_name is None:
            raise ValueError("get_meta(mode='fetch') needs task_name")
        if batch_size is None or batch_size < 1:
            raise ValueError(f"get_meta needs a positive batch_size, got {batch_size!r}")
        polling = runtime._polling_mode if self.polling_mode is None else self.polling_mode
        wait = 0.0 if polling else float(config.env("TQ_CONTROLLER_GET_METADATA_TIMEOUT", "1"))
        sampler = self.sampler or runtime._sampler
        if isinstance(sampler, SequentialSampler):
            meta = self._client.take(partition_id, task_name, list(data_fields), int(batch_size), wait)
        else:
            meta = self._client.sample(partition_id, task_name, list(data_fields), int(batch_size), sampler,
                                       dict(sampling_config or {}), polling, wait)
        if meta.size == 0 and not polling:
            raise GetMetaTimeout(
                f"Timeout while waiting for sufficient data for task {task_name}: {batch_size} samples holding "
                f"{list(data_fields)} in partition {partition_id!r} ({sampler!r}) were not there within {wait:g} s "
                "(set conf.controller.polling_mode=True to get an empty BatchMeta instead)"
            )
        return meta

    def get_consumption_status(self, task_name: str, partition_id: str) -> tuple[Any, Any]:
        """(global indexes, int8 status: 1 taken by `task_name`); (None, None) for an unknown partition.
        Keys holding tags only have no sample on dockd and are not listed."""
        return self._client.consumption(partition_id, task_name)

    def get_production_status(self, data_fields: list[str], partition_id: str) -> tuple[Any, Any]:
        """(global indexes, int8 matrix samples x `data_fields`: 1 where written)."""
        return self._client.production(partition_id, list(data_fields))

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        _, status = self.get_consumption_status(task_name, partition_id)
        return status is not None and status.numel() > 0 and bool(torch.all(status == 1))

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        _, status = self.get_production_status(data_fields, partition_id)
        return status is not None and bool(torch.all(status == 1))

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Let `task_name` (None: every task) take every sample of the partition again."""
        self._client.reset(partition_id, task_name)
        return True

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Replace the tags of the metadata's samples by its ``custom_meta`` (as TransferQueue)."""
        if not metadata.size:
            return
        for pid in sorted(set(metadata.partition_ids)):
            rows = [i for i, p in enumerate(metadata.partition_ids) if p == pid]
            sub = metadata.select_samples(rows)
            keys = sub.keys if all(sub.keys) else self._client.keys_for(pid, sub.global_indexes)
            self._client.retag(pid, keys, sub.custom_meta)

    def clear_samples(self, metadata: BatchMeta) -> None:
        if metadata.size:
            pid = _one_partition(metadata)
            self._client.clear(self._client.keys_for(pid, metadata.global_indexes), pid)

    def clear_partition(self, partition_id: str) -> None:
        keys = list(self._client.list_keys(partition_id)[partition_id])
        self._client.clear(keys, partition_id)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return self._client.list_keys(partition_id)

    def get_partition_list(self) -> list[str]:
        return self._client.partitions()

    def close(self) -> None:  # the module's connection is closed by transfer_queue.close()
        pass

    def initialize_storage_manager(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the dock's warehouses are the storage (accepted so TransferQueue's
        callers run unchanged)."""

    # TransferQueue keeps its controller's state and its storage units' data in two checkpoints;
    # one dock checkpoint holds keys, tags, data and consumer progress together, so each of these
    # saves (or restores) all of it at the place it names (a directory).
    def save_controller_checkpoint(self, path: str) -> None:
        save_checkpoint(path)

    def load_controller_checkpoint(self, path: str) -> None:
        load_checkpoint(path)

    def save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        save_checkpoint(checkpoint_dir)

    def load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        load_checkpoint(checkpoint_dir)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        base = name.removeprefix("async_")
        if base != name and base in _CLIENT_SYNC:
            sync = getattr(self, base)

            async def call(*args: Any, **kwargs: Any) -> Any:
                return await asyncio.to_thread(sync, *args, **kwargs)

            call.__name__ = name
            return call
        raise AttributeError(
            f"TransferQueueClient has no attribute {name!r} on dockd's transfer_queue client (it has "
            f"{', '.join(sorted(_CLIENT_SYNC))} and their async_ forms)"
        )


_CLIENT_SYNC = frozenset(
    {"kv_retrieve_meta", "kv_retrieve_keys", "get_data", "put", "clear_samples", "clear_partition", "kv_list",
     "get_partition_list", "get_meta", "get_consumption_status", "get_production_status",
     "check_consumption_status", "check_production_status", "reset_consumption", "set_custom_meta",
     "save_controller_checkpoint", "load_controller_checkpoint", "save_storage_checkpoint", "load_storage_checkpoint"}
)


def _one_partition(meta: BatchMeta) -> str:
    pids = set(meta.partition_ids)
    if len(pids) != 1:
        raise ValueError(f"a BatchMeta spanning partitions {sorted(pids)} must be split first (chunk_by_partition)")
    return pids.pop()


def get_client() -> DockTQClient:
    """The low-level client (see `DockTQClient`); `init` must have been called (or DOCKD_ADDRESS set)."""
    return DockTQClient(runtime._get())


async def async_kv_batch_meta2batch_meta(meta: KVBatchMeta) -> BatchMeta:
    """verl's KVBatchMeta -> BatchMeta conversion (``verl.utils.transferqueue_utils`` has the same)."""
    client = get_client()
    batch_meta = await client.async_kv_retrieve_meta(keys=meta.keys, partition_id=meta.partition_id, create=False)
    if meta.fields is not None:
        batch_meta = batch_meta.select_fields([meta.fields] if isinstance(meta.fields, str) else list(meta.fields))
    batch_meta.extra_info = dict(meta.extra_info or {})
    return batch_meta
