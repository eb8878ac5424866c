"""A `transfer_queue`-compatible module backed by dockd: run verl's TransferQueue path on dockd.

verl 0.9's TransferQueue trainer (``trainer.v1``) talks to the ``transfer_queue``
package through its key-value interface. This module implements that
interface on a dock, so switching is configuration::

    from dockd.trainer_plugins.verl import use_dockd_transfer_queue
    runtime_env = use_dockd_transfer_queue("10.0.0.1:7450")   # before verl imports transfer_queue
    ray.init(runtime_env=runtime_env)                         # Ray workers switch too

after which ``import transfer_queue as tq`` resolves here in the driver and in
every Ray worker. Without an address (and without ``DOCKD_ADDRESS``), called after
``ray.init()``, it uses the dock running on the Ray cluster, launching one with
`dockd.ray.launch` if there is none.

Why a compatible client and not a TQ storage backend: a backend registered
through TQ's ``StorageManagerFactory`` keeps TQ's controller in the path of
every call and only moves the bytes; measured here (examples/tq_switch_bench.py,
2 cores, loopback) TQ's metadata-only round trip alone costs 11-14 ms per
64-key put+clear, while dockd's whole put+get of the same 64 samples costs
4 ms (17 ms at 8 MiB, where TQ's put+get costs 46 ms). Only replacing the
controller as well removes that floor.

Supported: ``init``, ``close``, ``kv_put``, ``kv_batch_put``, ``kv_batch_get``,
``kv_batch_get_by_meta``, ``kv_list``, ``kv_clear`` and their ``async_``
twins (``data_parser=`` included), ``KVBatchMeta``, ``BatchMeta``, the
low-level ``get_client()`` (the calls verl's ``tqbridge`` makes; see
`DockTQClient`), ``async_kv_batch_meta2batch_meta``, ``save_checkpoint`` /
``load_checkpoint`` (on `dockd.Dock.save` / ``load``), ``StreamingDataset`` /
``StreamingDataLoader`` (``fetch_batch_fn=`` included), ``get_metrics_endpoint``
(when told the endpoint), and the client's sampler-driven calls (``get_meta``,
consumption and production status, ``reset_consumption``, ``set_custom_meta``)
with TransferQueue's samplers: ``SequentialSampler`` (the default),
``GRPOGroupNSampler``, ``RankAwareSampler`` and ``SeqlenBalancedSampler``,
named by ``conf.controller.sampler`` at `init` (see `DockTQClient.get_meta`).

Layout: TQ partition ``p`` keeps its samples in dock partition ``"tq/p/g{n}"``,
one dock sample per key, one column per field (non-tensor fields as
msgpack-encoded ``"nt/<field>"`` columns). Which key is which sample, where
each field lives and the keys' tags form an append-only log in dock
partition ``"tq-meta/p"``; every process replays it incrementally under its
own consumer name, so any process sees every other process's writes. A key
put with tags only (verl's prompt-status keys) has no dock sample until a
put gives it fields (or ``kv_retrieve_meta`` names it). ``kv_clear`` deletes
the cleared keys' samples (`dockd.Dock.delete`); when it leaves a partition
without keys, its data partition is freed and the next put starts a new
generation ``g{n+1}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dockd
import dockd.balance
from dockd.trainer_plugins import _codec, require

logger = logging.getLogger(__name__)

__version__ = "0.1.10+dockd"
ENV_ADDRESS = "DOCKD_ADDRESS"
ENV_ENABLE = "DOCKD_TRANSFER_QUEUE"
ENV_METRICS = "DOCKD_METRICS_ENDPOINT"
NT = "nt/"
LOG_COLUMN = "entry"
LOCK_TIMEOUT_S = 60.0  # longest wait for a partition's sampler lock


@dataclasses.dataclass
class KVBatchMeta:
    """Same fields as ``transfer_queue.KVBatchMeta``."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have same length, but got {len(self.keys)} and {len(self.tags)}")
        if len(self.keys) != len(set(self.keys)):
            raise ValueError("Got duplicated keys.")

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class BatchMeta:
    """Metadata of a batch of samples (the low-level ``transfer_queue.BatchMeta`` surface).

    Same constructor as TransferQueue's: ``global_indexes`` and ``partition_ids`` are
    required (``BatchMeta()`` raises TypeError, as in TransferQueue; `BatchMeta.empty()`
    builds an empty one). On dockd a global index is the sample's index in the dock
    partition holding the TQ partition's data; ``_custom_backend_meta`` carries each
    sample's key (``"_key"``).
    """

    def __init__(
        self,
        global_indexes: list[int],
        partition_ids: list[str],
        field_schema: dict[str, dict[str, Any]] | None = None,
        production_status: Any = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: list[dict[str, Any]] | None = None,
        _custom_backend_meta: list[dict[str, Any]] | None = None,
    ) -> None:
        self.global_indexes = [int(i) for i in global_indexes]
        self.partition_ids = list(partition_ids)
        if len(self.global_indexes) != len(self.partition_ids):
            raise ValueError(
                f"Length mismatch: global_indexes has {len(self.global_indexes)}, "
                f"partition_ids has {len(self.partition_ids)}"
            )
        n = len(self.global_indexes)
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        self.production_status = (
            np.array(production_status, dtype=np.int8) if production_status is not None else np.zeros(n, np.int8)
        )
        self.extra_info = dict(extra_info or {})
        self.custom_meta = [dict(d) for d in custom_meta] if custom_meta else [{} for _ in range(n)]
        self._custom_backend_meta = (
            [dict(d) for d in _custom_backend_meta] if _custom_backend_meta else [{} for _ in range(n)]
        )
        for name, what in (("production_status", self.production_status), ("custom_meta", self.custom_meta),
                           ("_custom_backend_meta", self._custom_backend_meta)):
            if len(what) != n:
                raise ValueError(f"{name} length {len(what)} != batch_size {n}")

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls(global_indexes=[], partition_ids=[], extra_info=extra_info)

    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return len(self.global_indexes)

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        return self.size > 0 and bool(np.all(self.production_status == 1))

    @property
    def keys(self) -> list[str]:
        """The TQ keys of the samples (dockd extension)."""
        return [m.get("_key") for m in self._custom_backend_meta]  # type: ignore[misc]

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        out = self.copy()
        out.field_schema = {f: dict(self.field_schema[f]) for f in field_names if f in self.field_schema}
        return out

    def select_samples(self, sample_indices: list[int]) -> BatchMeta:
        return BatchMeta(
            [self.global_indexes[i] for i in sample_indices],
            [self.partition_ids[i] for i in sample_indices],
            self.field_schema,
            self.production_status[list(sample_indices)],
            self.extra_info,
            [self.custom_meta[i] for i in sample_indices],
            [self._custom_backend_meta[i] for i in sample_indices],
        )

    def chunk(self, chunks: int) -> list[BatchMeta]:
        bounds = np.linspace(0, self.size, chunks + 1).astype(int)
        return [self.select_samples(list(range(bounds[i], bounds[i + 1]))) for i in range(chunks)]

    def copy(self) -> BatchMeta:
        return self.select_samples(list(range(self.size)))

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return [dict(d) for d in self.custom_meta]

    def update_custom_meta(self, custom_meta: list[dict[str, Any]] | None) -> None:
        """Merge one dict per sample into ``custom_meta`` (`DockTQClient.set_custom_meta` stores it)."""
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"The length of custom_meta list {len(custom_meta)} must match the batch size: {self.size}"
            )
        for mine, new in zip(self.custom_meta, custom_meta):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One BatchMeta per partition, in order of first appearance."""
        pids = list(dict.fromkeys(self.partition_ids))
        return [self.select_samples([i for i, p in enumerate(self.partition_ids) if p == pid]) for pid in pids]

    def __repr__(self) -> str:
        return (f"BatchMeta(size={self.size}, partition_ids={sorted(set(self.partition_ids))}, "
                f"fields={self.field_names}, extra_info={self.extra_info})")


@dataclasses.dataclass(slots=True)
class _Key:
    index: int | None  # None: the key holds tags only, no sample was assigned to it yet
    gen: int
    fields: dict[str, tuple[int, bool]]  # field -> (warehouse id, is_tensor)
    tags: dict[str, Any]


class _Partition:
    """One TQ partition's replayed view of the metadata log."""

    def __init__(self) -> None:
        self.keys: dict[str, _Key] = {}
        self.gen = 0
        self.consumed: dict[str, set[int]] = {}  # task -> indexes (current generation) it took
        self.resets: dict[str | None, int] = {}  # task (None: every task) -> reset_consumption count
        # sampler choices (current generation): task -> (dp_rank, batch_index) -> indexes; kept across
        # reset_consumption, as TransferQueue's sampler cache is
        self.shares: dict[str, dict[tuple[Any, Any], list[int]]] = {}
        # task -> indexes chosen for another rank that it has not taken yet (no other choice takes them)
        self.aside: dict[str, set[int]] = {}

    def consumer(self, task: str) -> str:
        """The dock consumer name of `task`: a new one after each reset_consumption, so that the
        dock hands the task every sample again."""
        every, own = self.resets.get(None, 0), self.resets.get(task, 0)
        return task if every == own == 0 else f"{task}#reset{every}.{own}"

    def placed(self) -> list[tuple[str, _Key]]:
        """The keys holding a sample of the current generation, by index."""
        out = [(k, r) for k, r in self.keys.items() if r.index is not None and r.gen == self.gen]
        out.sort(key=lambda kr: kr[1].index)  # type: ignore[arg-type, return-value]
        return out


class _Client:
    def __init__(self, address: str) -> None:
        self.dock = dockd.connect(address)
        self.address = address
        self.viewer = f"tqview-{uuid.uuid4().hex[:12]}"
        self.parts: dict[str, _Partition] = {}
        self.lock = threading.RLock()
        self.lockable: set[str] = set()  # partitions whose sampler lock exists

    # -- the metadata log ---------------------------------------------------------
    def _log(self, pid: str, entry: dict[str, Any]) -> None:
        self.dock.put({LOG_COLUMN: [_codec.encode(entry)]}, partition=f"tq-meta/{pid}")

    def sync(self, pid: str, wait: float = 0.0) -> _Partition:
        """Apply the partition's new key-log entries; with `wait`, block up to that many seconds
        for one when there is none yet (woken by the entry's put, not by a timer)."""
        with self.lock:
            part = self.parts.setdefault(pid, _Partition())
            timeout = wait
            while True:
                try:
                    batch = self.dock.get(
                        self.viewer, [LOG_COLUMN], 1 << 20, partition=f"tq-meta/{pid}", allow_partial=True,
                        timeout=timeout,
                    )
                except dockd.DockTimeout:
                    return part
                timeout = 0
                for blob in batch[LOG_COLUMN]:
                    self._apply(part, _codec.decode(blob))

    @staticmethod
    def _apply(part: _Partition, e: dict[str, Any]) -> None:
        op = e["op"]
        if op == "put":
            for i, key in enumerate(e["keys"]):
                rec = part.keys.get(key)
                index = e["indexes"][i] if e["indexes"] is not None else None
                if rec is None:  # a new key; without an index it holds tags only (no sample yet)
                    rec = part.keys[key] = _Key(index=index, gen=e["gen"], fields={}, tags={})
                elif index is not None and rec.index is None:  # a tag-only key gets its sample
                    rec.index, rec.gen = index, e["gen"]
                elif index is not None and (rec.index != index or rec.gen != e["gen"]):
                    # another sample for the same key (two first puts raced): the later one wins
                    rec = part.keys[key] = _Key(index=index, gen=e["gen"], fields={}, tags=rec.tags)
                for f, kind in e["fields"].items():
                    rec.fields[f] = (e["wid"], kind)
                if e["tags"] is not None and e["tags"][i] is not None:
                    rec.tags.update(e["tags"][i])
        elif op == "clear":
            for key in e["keys"]:
                part.keys.pop(key, None)
        elif op == "rotate":
            if e["gen"] > part.gen:
                part.gen = e["gen"]
                part.consumed.clear()
                part.shares.clear()
                part.aside.clear()
        elif op == "consume":
            if e["gen"] == part.gen:
                part.consumed.setdefault(e["task"], set()).update(e["indexes"])
                part.aside.get(e["task"], set()).difference_update(e["indexes"])
        elif op == "share":  # a sampler's choice for ranks of one batch_index (written under the sampler lock)
            if e["gen"] == part.gen:
                task = e["task"]
                mine = part.shares.setdefault(task, {})
                taken = part.consumed.get(task, set())
                for rank, indexes in e["shares"]:
                    mine.setdefault((rank, e["batch_index"]), list(indexes))
                    if rank != e["rank"]:
                        part.aside.setdefault(task, set()).update(i for i in indexes if i not in taken)
        elif op == "reset":
            task = e["task"]
            part.resets[task] = part.resets.get(task, 0) + 1
            if task is None:
                part.consumed.clear()
                part.aside.clear()
            else:
                part.consumed.pop(task, None)
                part.aside.pop(task, None)
        elif op == "retag":  # set_custom_meta: the tags are replaced, not merged
            for key, tags in zip(e["keys"], e["tags"]):
                if key in part.keys:
                    part.keys[key].tags = dict(tags)
        else:  # pragma: no cover - written by a newer dockd
            logger.warning("[tq] unknown log entry op=%s ignored", op)

    # -- the KV interface -----------------------------------------------------------
    def put(
        self,
        keys: list[str],
        pid: str,
        fields: Any,
        tags: list[dict[str, Any]] | None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> KVBatchMeta:
        if fields is None and tags is None:
            raise ValueError("kv_batch_put needs fields or tags")
        if data_parser is not None and fields is not None:
            fields = _parse_fields(fields, data_parser)
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"tags has {len(tags)} entries for {len(keys)} keys")
        with self.lock:
            part = self.sync(pid)
            columns: dict[str, Any] = {}
            kinds: dict[str, bool] = {}
            if fields is not None:
                for name, values in _field_items(fields, len(keys)):
                    if isinstance(values, torch.Tensor) and not values.is_nested:
                        columns[name] = values.detach().to("cpu")
                        kinds[name] = True
                    elif isinstance(values, torch.Tensor):
                        columns[name] = [v.detach().to("cpu") for v in values.unbind(0)]
                        kinds[name] = True
                    else:
                        columns[NT + name] = [_codec.encode(v) for v in values]
                        kinds[name] = False
            indexes: list[int] | None = None  # None: tags only, no key gets a sample
            if columns:
                data = self._data(pid, part.gen)
                known = [part.keys.get(k) for k in keys]
                stale = [k for k, r in zip(keys, known) if r is not None and r.index is not None and r.gen != part.gen]
                if stale:  # pragma: no cover - a generation only ends once no key is left
                    raise ValueError(f"keys {stale[:5]} of partition {pid!r} belong to an older generation")
                fresh = [i for i, r in enumerate(known) if r is None or r.index is None]
                if len(fresh) == len(keys):
                    indexes = self.dock.put(columns, partition=data)
                else:
                    indexes = [r.index if r is not None else None for r in known]  # type: ignore[misc]
                    if fresh:  # new and tag-only keys next to keys holding data: one sample each first
                        for i, idx in zip(fresh, self.dock.reserve(data, len(fresh))):
                            indexes[i] = idx
                    self.dock.put(columns, partition=data, indexes=indexes)
            entry = {
                "op": "put",
                "keys": list(keys),
                "indexes": indexes,
                "gen": part.gen,
                "fields": kinds,
                "wid": int(self.dock.home),
                "tags": list(tags) if tags is not None else None,
            }
            self._log(pid, entry)
            self._apply(part, entry)
            self.sync(pid)
            return KVBatchMeta(
                keys=list(keys),
                tags=[dict(part.keys[k].tags) for k in keys],
                partition_id=pid,
                fields=sorted(set().union(*(part.keys[k].fields for k in keys))),
            )

    def get(self, keys: list[str], pid: str, select_fields: list[str] | None) -> Any:
        tensordict = require("tensordict", extra="verl", what="dockd transfer_queue.kv_batch_get")
        with self.lock:
            part = self.sync(pid)
            recs = [part.keys.get(k) for k in keys]
            if any(r is None for r in recs):
                missing = [k for k, r in zip(keys, recs) if r is None][:5]
                raise ValueError(f"keys or partition were not found! partition={pid!r} missing={missing}")
            if select_fields is None:  # the fields every key holds (none for tag-only keys)
                held = [set(r.fields) for r in recs]  # type: ignore[union-attr]
                names = sorted(set.intersection(*held)) if held else []
            else:
                names = list(select_fields)
            for r, k in zip(recs, keys):
                lacking = [f for f in names if f not in r.fields]  # type: ignore[union-attr]
                if lacking:
                    raise ValueError(f"key {k!r} of partition {pid!r} has no fields {lacking}")
            if not names:
                return tensordict.TensorDict({}, batch_size=[len(keys)])
            gens = {r.gen for r in recs}  # type: ignore[union-attr]
            if len(gens) != 1:
                raise ValueError(f"keys of partition {pid!r} span generations {sorted(gens)}; get them separately")
        cols = [f if recs[0].fields[f][1] else NT + f for f in names]  # type: ignore[union-attr]
        lease = dockd.Lease(
            0,
            self._data(pid, gens.pop()),
            cols,
            [r.index for r in recs],  # type: ignore[union-attr]
            np.array([[r.fields[f][0] for r in recs] for f in names], dtype=np.int64),  # type: ignore[union-attr]
        )
        if not keys:
            values: dict[str, list[Any]] = {c: [] for c in cols}
        else:
            try:
                values = self.dock.fetch(lease)
            except dockd.DockError:  # the log's locations are stale (a loaded checkpoint): ask the controller
                read = self.dock.read(lease.partition, lease.indexes, cols)
                values = {c: read[c] for c in cols}
        out: dict[str, Any] = {}
        for f, c in zip(names, cols):
            if c.startswith(NT):
                out[f] = tensordict.NonTensorStack.from_list([_codec.decode(v) for v in values[c]])
            else:
                vals = values[c]
                if len({tuple(v.shape) for v in vals}) <= 1 and vals:
                    out[f] = torch.stack(vals)
                else:
                    out[f] = torch.nested.nested_tensor(vals, layout=torch.jagged)
        return tensordict.TensorDict(out, batch_size=[len(keys)])

    def meta(self, pid: str, keys: list[str], create: bool = False) -> BatchMeta:
        """The BatchMeta of `keys` (with `create`, keys without data get reserved samples)."""
        with self.lock:
            part = self.sync(pid)
            missing = [k for k in keys if k not in part.keys]
            if missing and not create:
                raise ValueError(f"keys or partition were not found! partition={pid!r} missing={missing[:5]}")
            # new keys, and keys that hold tags only, get a sample reserved (a BatchMeta names samples)
            unplaced = list(dict.fromkeys(k for k in keys if k not in part.keys or part.keys[k].index is None))
            if unplaced:
                indexes = self.dock.reserve(self._data(pid, part.gen), len(unplaced))
                entry = {"op": "put", "keys": unplaced, "indexes": indexes, "gen": part.gen, "fields": {},
                         "wid": int(self.dock.home), "tags": None}
                self._log(pid, entry)
                self._apply(part, entry)
            recs = [part.keys[k] for k in keys]
            names = sorted(set.intersection(*(set(r.fields) for r in recs))) if recs else []
            schema = {f: {"is_non_tensor": not recs[0].fields[f][1]} for f in names}
            return BatchMeta(
                [r.index for r in recs],
                [pid] * len(keys),
                field_schema=schema,
                production_status=[1 if r.fields else 0 for r in recs],
                custom_meta=[dict(r.tags) for r in recs],
                _custom_backend_meta=[{"_key": k, "_gen": r.gen} for k, r in zip(keys, recs)],
            )

    def keys_for(self, pid: str, indexes: list[int], wait: float = 5.0) -> list[str]:
        """The keys of samples `indexes` of the partition's current generation."""
        deadline = time.monotonic() + wait
        left = 0.0
        while True:
            with self.lock:
                # (a put logs its keys right after its data: wait for the log, at most 0.2 s per hold of the lock)
                part = self.sync(pid, wait=min(left, 0.2))
                by_index = {r.index: k for k, r in part.keys.items() if r.gen == part.gen and r.index is not None}
                keys = [by_index.get(int(i)) for i in indexes]
            if all(k is not None for k in keys):
                return keys  # type: ignore[return-value]
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i, k in zip(indexes, keys) if k is None][:5]
                raise RuntimeError(f"Some global_indexes have no corresponding keys! partition={pid!r} {missing}")

    def list_keys(self, pid: str | None) -> dict[str, dict[str, Any]]:
        if pid is not None:
            pids = [pid]
        else:
            pids = sorted(
                p.removeprefix("tq-meta/") for p in self.dock.stats()["partitions"] if p.startswith("tq-meta/")
            )
        out: dict[str, dict[str, Any]] = {}
        with self.lock:
            for p in pids:
                part = self.sync(p)
                out[p] = {k: dict(r.tags) for k, r in part.keys.items()}
        return out

    def clear(self, keys: list[str], pid: str) -> None:
        with self.lock:
            part = self.sync(pid)
            data = self._data(pid, part.gen)
            held = [r.index for r in (part.keys.get(k) for k in keys)
                    if r is not None and r.index is not None and r.gen == part.gen]
            entry: dict[str, Any] = {"op": "clear", "keys": list(keys)}
            self._log(pid, entry)
            self._apply(part, entry)
            if held:  # free the cleared keys' data now (the partition may never run empty)
                try:
                    self.dock.delete(data, sorted(set(held)))
                except dockd.DockNotFound:
                    pass
            self.sync(pid)
            if not part.keys:  # nothing left: free the data, next puts start a new generation
                try:
                    self.dock.clear(self._data(pid, part.gen))
                except dockd.DockNotFound:
                    pass
                entry = {"op": "rotate", "gen": part.gen + 1}
                self._log(pid, entry)
                self._apply(part, entry)

    @staticmethod
    def _data(pid: str, gen: int) -> str:
        return f"tq/{pid}/g{gen}"

    def partitions(self) -> list[str]:
        return sorted(p.removeprefix("tq-meta/") for p in self.dock.stats()["partitions"] if p.startswith("tq-meta/"))

    # -- consumption (TransferQueue's sampler-driven calls) ------------------------------
    def took(self, pid: str, task: str, gen: int, indexes: list[int]) -> None:
        """Record that `task` took samples `indexes` (for its consumption status)."""
        entry = {"op": "consume", "task": task, "gen": gen, "indexes": [int(i) for i in indexes]}
        with self.lock:
            self._log(pid, entry)
            self._apply(self.sync(pid), entry)

    def take(self, pid: str, task: str, fields: list[str], count: int, wait: float) -> BatchMeta:
        """Take `count` samples holding all `fields` that `task` has not taken, oldest first (TQ's
        SequentialSampler); an empty BatchMeta when they are not there within `wait` seconds."""
        deadline = time.monotonic() + wait
        while True:
            with self.lock:
                part = self.sync(pid)
                kinds: dict[str, bool] = {}
                for rec in part.keys.values():
                    for f, (_, is_tensor) in rec.fields.items():
                        kinds.setdefault(f, is_tensor)
                consumer, gen = part.consumer(task), part.gen
            if all(f in kinds for f in fields):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return BatchMeta.empty()
            self.sync(pid, wait=min(left, 0.2))  # a field nobody wrote yet: wait for the log
        cols = [f if kinds[f] else NT + f for f in fields]
        try:
            lease = self.dock.acquire(consumer, cols, count, partition=self._data(pid, gen), inline=False,
                                      timeout=max(0.0, deadline - time.monotonic()))
        except (dockd.DockTimeout, dockd.DockNotFound, dockd.DockDrained):
            return BatchMeta.empty()
        self.dock.confirm(lease)
        self.took(pid, task, gen, list(lease.indexes))
        keys = self.keys_for(pid, list(lease.indexes))
        return self.meta(pid, keys).select_fields(fields)

    @contextlib.contextmanager
    def exclusive(self, pid: str) -> Iterator[None]:
        """Hold partition `pid`'s sampler lock, shared by every process: one sample in dock
        partition ``"tq-lock/<pid>"`` that consumer ``"lock"`` leases (a holder that dies lets the
        lease expire). The process whose reserve gets index 0 writes that sample, so there is one."""
        name = f"tq-lock/{pid}"
        if pid not in self.lockable:
            if self.dock.reserve(name, 1) == [0]:
                self.dock.put({"token": [b"1"]}, partition=name, indexes=[0])
            self.lockable.add(pid)
        lease = self.dock.acquire("lock", ["token"], 1, partition=name, timeout=LOCK_TIMEOUT_S)
        try:
            yield
        finally:
            self.dock.release(lease)

    def ready(self, part: _Partition, task: str, fields: list[str]) -> list[int]:
        """TQ's ready indexes: samples holding every field, not taken by `task` nor set aside for one of
        its ranks, ascending."""
        skip = part.consumed.get(task, set()) | part.aside.get(task, set())
        return sorted(r.index for _, r in part.placed()
                      if r.index not in skip and all(f in r.fields for f in fields))  # type: ignore[misc]

    def sample(self, pid: str, task: str, fields: list[str], batch_size: int, sampler: BaseSampler,
               config: dict[str, Any], polling: bool, wait: float) -> BatchMeta:
        """`get_meta` with `sampler` other than the sequential one: choose as TransferQueue's sampler
        does on the ready samples of the key log, under the partition's sampler lock, and record the
        choice and what was taken in the log. An empty BatchMeta when nothing can be chosen (in
        `polling` mode at once, else after up to `wait` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            chosen = self._sample_once(pid, task, fields, batch_size, sampler, config)
            if chosen:
                return self.meta(pid, self.keys_for(pid, chosen)).select_fields(fields)
            left = deadline - time.monotonic()
            if polling or left <= 0:
                return BatchMeta.empty()
            self.sync(pid, wait=min(left, 0.2))

    def _sample_once(self, pid: str, task: str, fields: list[str], batch_size: int, sampler: BaseSampler,
                     config: dict[str, Any]) -> list[int]:
        rank, index = config.get("dp_rank", None), config.get("batch_index", None)
        if isinstance(sampler, RankAwareSampler):
            if rank is None or index is None:
                raise SamplingError("RankAwareSampler needs sampling_config with dp_rank and batch_index")
            if rank < 0:
                raise SamplingError(f"dp_rank {rank} must be greater than or equal to 0")
        if isinstance(sampler, SeqlenBalancedSampler):
            rank = 0 if rank is None else rank
            index = 0 if index is None else index
        for attempt in (0, 1):  # a choice made before is read without the lock; a new one is made under it
            with self.exclusive(pid) if attempt else contextlib.nullcontext():
                with self.lock:
                    part = self.sync(pid)
                    gen = part.gen
                    cached = part.shares.get(task, {}).get((rank, index)) if rank is not None else None
                    if cached is None and attempt:
                        cached = self._choose(pid, part, task, fields, batch_size, sampler, rank, index)
                        if cached is None:
                            return []
                if cached is not None:
                    if not set(cached) <= part.consumed.get(task, set()):
                        self.took(pid, task, gen, cached)
                    return cached
        return []  # pragma: no cover - the second attempt always returns

    def _choose(self, pid: str, part: _Partition, task: str, fields: list[str], batch_size: int, sampler: BaseSampler,
                rank: Any, index: Any) -> list[int] | None:
        """A new choice (self.lock and the sampler lock held), logged as a "share" entry."""
        ready = self.ready(part, task, fields)
        if len(ready) < batch_size:  # TransferQueue's controller asks its sampler only from batch_size on
            return None
        if isinstance(sampler, SeqlenBalancedSampler):
            if batch_size % sampler.n_samples_per_prompt:
                raise SamplingError(f"batch_size ({batch_size}) per rank must be a multiple of "
                                    f"n_samples_per_prompt ({sampler.n_samples_per_prompt})")
            found = _groups(ready, batch_size * sampler.dp_size, sampler.n_samples_per_prompt)
            if not found:
                return None
            tags = {r.index: r.tags for _, r in part.placed()}
            weights = [_length(tags.get(i, {})) for i in found]
            ranks = dockd.balance.balance(weights, sampler.dp_size, group_size=sampler.n_samples_per_prompt)
            shares = [[r, [found[j] for j in pos.tolist()]] for r, pos in enumerate(ranks)]
        elif isinstance(sampler, GRPOGroupNSampler):
            found = _groups(ready, batch_size, sampler.n_samples_per_prompt)
            if not found:
                return None
            shares = [[rank, found]]
        else:  # RankAwareSampler
            shares = [[rank, ready[:batch_size]]]
        mine = next(ix for r, ix in shares if r == rank) if any(r == rank for r, _ in shares) else []
        if rank is not None:  # (GRPO without dp_rank remembers nothing, as TransferQueue's)
            entry = {"op": "share", "task": task, "gen": part.gen, "rank": rank, "batch_index": index,
                     "shares": shares}
            self._log(pid, entry)
            self._apply(part, entry)
        return mine or None

    def everything(self, pid: str, fields: list[str]) -> BatchMeta:
        """TQ's force_fetch: every sample of the partition, ready or not, nothing taken."""
        with self.lock:
            placed = self.sync(pid).placed()
        if not placed:
            return BatchMeta.empty()
        kinds: dict[str, bool] = {}
        for _, rec in placed:
            for f, (_, is_tensor) in rec.fields.items():
                kinds.setdefault(f, is_tensor)
        return BatchMeta(
            [r.index for _, r in placed],  # type: ignore[misc]
            [pid] * len(placed),
            field_schema={f: {"is_non_tensor": not kinds[f]} for f in fields if f in kinds},
            production_status=[1 if all(f in r.fields for f in fields) else 0 for _, r in placed],
            custom_meta=[dict(r.tags) for _, r in placed],
            _custom_backend_meta=[{"_key": k, "_gen": r.gen} for k, r in placed],
        )

    def exists(self, pid: str) -> bool:
        with self.lock:
            if self.sync(pid).keys:
                return True
        return f"tq-meta/{pid}" in self.dock.stats()["partitions"]

    def consumption(self, pid: str, task: str) -> tuple[Any, Any]:
        if not self.exists(pid):
            return None, None
        with self.lock:
            part = self.sync(pid)
            placed = part.placed()
            taken = part.consumed.get(task, set())
            status = [1 if r.index in taken else 0 for _, r in placed]
        return (torch.tensor([r.index for _, r in placed], dtype=torch.long), torch.tensor(status, dtype=torch.int8))

    def production(self, pid: str, fields: list[str]) -> tuple[Any, Any]:
        if not self.exists(pid):
            return None, None
        with self.lock:
            placed = self.sync(pid).placed()
        status = [[1 if f in r.fields else 0 for f in fields] for _, r in placed]
        return (torch.tensor([r.index for _, r in placed], dtype=torch.long),
                torch.tensor(status, dtype=torch.int8).reshape(len(placed), len(fields)))

    def reset(self, pid: str, task: str | None) -> None:
        if not self.exists(pid):  # as TransferQueue: nothing to reset (and no partition created)
            logger.warning("[tq] reset_consumption of partition %r, which does not exist: nothing done", pid)
            return
        entry = {"op": "reset", "task": task}
        with self.lock:
            self._log(pid, entry)
            self._apply(self.sync(pid), entry)

    def retag(self, pid: str, keys: list[str], tags: list[dict[str, Any]]) -> None:
        entry = {"op": "retag", "keys": list(keys), "tags": [dict(t) for t in tags]}
        with self.lock:
            self._log(pid, entry)
            self._apply(self.sync(pid), entry)

    # -- checkpoints ------------------------------------------------------------------
    def save(self, directory: str) -> dict[str, Any]:
        """Save every TQ partition (its key log and its data) under `directory` with Dock.save."""
        present = set(self.dock.stats()["partitions"])
        saved: dict[str, Any] = {}
        with self.lock:
            for i, pid in enumerate(self.partitions()):
                part = self.sync(pid)
                entry: dict[str, Any] = {"meta": f"p{i}-meta", "data": None, "gen": part.gen}
                self.dock.save(f"tq-meta/{pid}", os.path.join(directory, entry["meta"]))
                if self._data(pid, part.gen) in present:
                    entry["data"] = f"p{i}-data"
                    self.dock.save(self._data(pid, part.gen), os.path.join(directory, entry["data"]))
                saved[pid] = entry
        return saved

    def load(self, directory: str, saved: dict[str, Any]) -> None:
        """Replace the TQ partitions named in `saved` by the ones saved under `directory`."""
        with self.lock:
            present = list(self.dock.stats()["partitions"])
            for pid, entry in saved.items():
                for name in present:
                    if name == f"tq-meta/{pid}" or name.startswith(f"tq/{pid}/g"):
                        try:
                            self.dock.clear(name)
                        except dockd.DockNotFound:
                            pass
                self.dock.load(os.path.join(directory, entry["meta"]), partition=f"tq-meta/{pid}")
                if entry["data"] is not None:
                    self.dock.load(os.path.join(directory, entry["data"]), partition=self._data(pid, entry["gen"]))
            # replay every log from its start under a fresh name (the saved logs carry old progress)
            self.viewer = f"tqview-{uuid.uuid4().hex[:12]}"
            self.parts.clear()

    def close(self) -> None:
        self.dock.close()


def _parse_fields(fields: Any, data_parser: Callable[[Any], Any]) -> dict[str, Any]:
    """Run a TQ ``data_parser`` on a plain dict of the fields, as TransferQueue does: a batched
    tensor per regular tensor field, a list per nested-tensor or non-tensor field."""
    plain: dict[str, Any] = {}
    nested: set[str] = set()
    for name, values in fields.items():
        if isinstance(values, torch.Tensor) and values.is_nested:
            plain[name] = list(values.unbind(0))
            nested.add(name)
        elif isinstance(values, torch.Tensor):
            plain[name] = values
        elif hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # NonTensorStack
            plain[name] = values.tolist()
        else:
            plain[name] = list(values)
    before = {k: (len(v) if isinstance(v, list) else v.shape[0]) for k, v in plain.items()}
    returned = data_parser(plain)
    if isinstance(returned, dict):
        plain = returned
    after = {k: (len(v) if isinstance(v, list) else v.shape[0]) for k, v in plain.items()}
    if before != after:
        raise ValueError(
            f"data_parser must keep the fields and their number of values; before {before}, after {after}"
        )
    for name in nested:
        if all(isinstance(v, torch.Tensor) for v in plain[name]):
            plain[name] = torch.nested.nested_tensor(plain[name], layout=torch.jagged)
    return plain


def _groups(ready: list[int], count: int, n: int) -> list[int]:
    """TQ's GRPOGroupNSampler choice: scanning the ascending `ready` indexes, runs of `n` consecutive
    indexes, until `count` samples; [] when there are not that many runs."""
    if count % n:
        raise SamplingError(f"batch_size ({count}) must be a multiple of n_samples_per_prompt ({n})")
    found: list[int] = []
    i = 0
    while i <= len(ready) - n and len(found) < count:
        if ready[i + n - 1] - ready[i] == n - 1:  # ascending and distinct: n consecutive indexes
            found.extend(ready[i:i + n])
            i += n
        else:
            i += 1
    return found if len(found) == count else []


def _length(tags: dict[str, Any]) -> float:
    """A sample's weight for SeqlenBalancedSampler: its ``total_lengths`` tag, 1 without one."""
    try:
        value = float(tags.get("total_lengths", 1))
    except (TypeError, ValueError):
        return 1.0
    return value if value >= 0 and np.isfinite(value) else 1.0


def _field_items(fields: Any, n: int) -> list[tuple[str, Any]]:
    items = list(fields.items())
    out: list[tuple[str, Any]] = []
    for name, values in items:
        if isinstance(values, torch.Tensor):
            if values.shape[0] != n:
                raise ValueError(f"field {name!r} has {values.shape[0]} rows for {n} keys")
            out.append((name, values))
        elif hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # NonTensorStack / NonTensorData
            data = values.tolist()
            out.append((name, data if isinstance(data, list) and len(data) == n else [data] * n))
        else:
            seq = list(values)
            if len(seq) != n:
                raise ValueError(f"field {name!r} has {len(seq)} values for {n} keys")
            out.append((name, seq))
    return out


# -- samplers -----------------------------------------------------------------------------
class SamplingError(ValueError, RuntimeError):
    """A get_meta the sampler refuses (a batch_size that is not a multiple of the group size, a
    RankAwareSampler call without dp_rank). A RuntimeError too, as TransferQueue's client reports
    its controller's errors."""


class BaseSampler:
    """``transfer_queue.BaseSampler``'s place: a sampler here names how `DockTQClient.get_meta`
    chooses, with its settings; the choosing is done by the client on the partition's key log
    (so every process of a job chooses alike), not by a ``sample`` method."""

    def __init__(self) -> None:
        pass

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class SequentialSampler(BaseSampler):
    """TransferQueue's default: the oldest ready samples the task has not taken."""


class GRPOGroupNSampler(BaseSampler):
    """Whole groups of `n_samples_per_prompt` samples at consecutive indexes, all ready (TQ's
    GRPOGroupNSampler: a prompt's responses are put one after another)."""

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = int(n_samples_per_prompt)


class RankAwareSampler(BaseSampler):
    """Every caller with the same ``sampling_config`` ``dp_rank`` and ``batch_index`` gets the same
    samples (the ranks of one data-parallel group); each dp_rank's batches are its own."""


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """GRPO groups for all `dp_size` ranks of a ``batch_index`` at once, split so that the ranks'
    sums of the samples' ``total_lengths`` tag (default 1) are balanced, groups kept whole;
    ``batch_size`` is per rank."""

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = int(dp_size)


_SAMPLERS: dict[str, type[BaseSampler]] = {
    c.__name__: c for c in (SequentialSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler)
}


def _as_sampler(sampler: Any) -> BaseSampler:
    """A ``conf.controller.sampler`` (a name, a class or an instance; TransferQueue's own classes
    too, recognised by name and read for their settings) as one of this module's samplers."""
    if sampler is None:
        return SequentialSampler()
    if isinstance(sampler, str):
        name = sampler
    elif isinstance(sampler, type):
        name = sampler.__name__
    else:
        name = type(sampler).__name__
    cls = _SAMPLERS.get(name)
    if cls is None:
        raise ValueError(
            f"Could not find sampler {name}: dockd's transfer_queue client samples like TransferQueue's "
            f"{', '.join(_SAMPLERS)} (a custom sampler's sample() is not run here)"
        )
    if isinstance(sampler, (str, type)):
        return cls()
    kwargs = {k: getattr(sampler, k) for k in ("n_samples_per_prompt", "dp_size") if hasattr(sampler, k)}
    return cls(**kwargs)


# -- module-level API (the transfer_queue surface) ---------------------------------------
_client: _Client | None = None
_client_lock = threading.Lock()
_polling_mode = False  # conf.controller.polling_mode at init (TransferQueue's default: False)
_sampler: BaseSampler = SequentialSampler()  # conf.controller.sampler at init


def _controller_conf(conf: Any) -> tuple[bool, BaseSampler]:
    """(polling_mode, sampler) from a TransferQueue-style config's ``controller`` section."""
    ctrl = conf.get("controller", None) if conf is not None and hasattr(conf, "get") else None
    if ctrl is None:
        return False, SequentialSampler()
    return bool(ctrl.get("polling_mode", False)), _as_sampler(ctrl.get("sampler", None))


def _get() -> _Client:
    global _client
    with _client_lock:
        if _client is None:
            address = os.environ.get(ENV_ADDRESS)
            if not address:
                raise RuntimeError(
                    "dockd transfer_queue is not initialised: call transfer_queue.init() with "
                    f"conf.dockd.address set, or set {ENV_ADDRESS} to the dock's host:port"
                )
            _client = _Client(address)
        return _client


def init(conf: Any = None, *, address: str | None = None) -> Any:
    """Connect to the dock. Address: `address`, else ``conf.dockd.address``, else ``DOCKD_ADDRESS``.

    ``conf.controller.polling_mode`` and ``conf.controller.sampler`` are read as TransferQueue
    reads them (see `DockTQClient.get_meta`)."""
    global _client, _polling_mode, _sampler
    if conf is not None:
        _polling_mode, _sampler = _controller_conf(conf)
    if address is None and conf is not None:
        dockd_conf = conf.get("dockd", None) if hasattr(conf, "get") else None
        if dockd_conf is not None:
            address = dockd_conf.get("address", None)
            if dockd_conf.get("metrics_endpoint", None):
                os.environ[ENV_METRICS] = str(dockd_conf.get("metrics_endpoint"))
    if address:
        os.environ[ENV_ADDRESS] = address
    with _client_lock:
        if _client is not None and address and _client.address != address:
            _client.close()
            _client = None
    _get()
    return conf


def close() -> None:
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None


def _keys(keys: list[str] | str) -> list[str]:
    return [keys] if isinstance(keys, str) else list(keys)


def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    if isinstance(fields, dict):
        fields = {k: (v.unsqueeze(0) if isinstance(v, torch.Tensor) else [v]) for k, v in fields.items()}
    return _get().put([key], partition_id, fields, [tag] if tag is not None else None, data_parser)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    return _get().put(_keys(keys), partition_id, fields, tags, data_parser)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> Any:
    sel = [select_fields] if isinstance(select_fields, str) else select_fields
    return _get().get(_keys(keys), partition_id, sel)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    if select_fields is None:
        select_fields = meta.fields
    return kv_batch_get(meta.keys, meta.partition_id or "", select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return _get().list_keys(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    _get().clear(_keys(keys), partition_id)


async def async_kv_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_put, *args, **kwargs)


async def async_kv_batch_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_batch_put, *args, **kwargs)


async def async_kv_batch_get(*args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(kv_batch_get, *args, **kwargs)


async def async_kv_batch_get_by_meta(*args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(kv_batch_get_by_meta, *args, **kwargs)


async def async_kv_list(*args: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
    return await asyncio.to_thread(kv_list, *args, **kwargs)


async def async_kv_clear(*args: Any, **kwargs: Any) -> None:
    return await asyncio.to_thread(kv_clear, *args, **kwargs)


# -- metrics --------------------------------------------------------------------------------
def get_metrics_endpoint() -> str:
    """The dock's Prometheus endpoint (``host:port``), as configured.

    dockd daemons serve metrics when started with ``dockd serve --metrics-port N`` (see
    docs/operations.md); a client cannot discover that port, so name it: ``conf.dockd.
    metrics_endpoint`` at `init`, or the ``DOCKD_METRICS_ENDPOINT`` environment variable.
    Raises RuntimeError when neither is set (TransferQueue returns None when its metrics
    are disabled; verl logs the error and registers no endpoint either way).
    """
    endpoint = os.environ.get(ENV_METRICS)
    if not endpoint:
        raise RuntimeError(
            "dockd transfer_queue does not know the dock's metrics endpoint: start the daemons with "
            "`dockd serve --metrics-port PORT` (docs/operations.md) and pass the endpoint as "
            f"conf.dockd.metrics_endpoint='host:PORT' to transfer_queue.init(), or set {ENV_METRICS}=host:PORT"
        )
    return endpoint


# -- checkpoints ----------------------------------------------------------------------------
_METADATA_FILE = "metadata.json"


def save_checkpoint(
    checkpoint_dir: str | os.PathLike,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Save every TQ partition (keys, tags, fields, data, consumer progress) into `checkpoint_dir`.

    Each TQ partition's key log and data go through `dockd.Dock.save` (each daemon writes its
    own files), plus ``metadata.json`` with `metadata` under ``"user_metadata"``. Like
    TransferQueue, the directory is replaced atomically (written as ``<dir>.tmp``, then renamed)
    and must be reachable by every dock daemon under the same name (one host, or a shared
    filesystem). dockd keeps its data in memory, so ``include_storage=False`` is ignored with a
    warning, as TransferQueue does for its in-memory SimpleStorage.
    """
    if not include_storage:
        logger.warning("[tq] include_storage=False has no effect on dockd (in-memory data); saving the data too")
    client = _get()
    final = Path(os.path.abspath(os.fspath(checkpoint_dir)))
    tmp = final.parent / f"{final.name}.tmp"
    old = final.parent / f"{final.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        saved = client.save(str(tmp))
        with open(tmp / _METADATA_FILE, "w") as f:
            json.dump({"storage_saved": True, "user_metadata": metadata or {}, "dockd_partitions": saved}, f, indent=2)
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists() and not final.exists():
            old.rename(final)
        raise
    logger.info("[tq] checkpoint saved to %s (partitions=%s)", final, sorted(saved))


def load_checkpoint(checkpoint_dir: str | os.PathLike) -> None:
    """Restore the TQ partitions saved by `save_checkpoint`, replacing partitions of the same names.

    Call it before other processes use those partitions (verl calls it when resuming): a process
    that already read a replaced partition keeps its old view of the keys.
    """
    final = Path(os.path.abspath(os.fspath(checkpoint_dir)))
    old = final.parent / f"{final.name}.old"
    if not final.exists() and old.exists():
        old.rename(final)
    if not final.exists():
        raise FileNotFoundError(f"Checkpoint directory not found: {final}")
    meta_path = final / _METADATA_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{_METADATA_FILE} not found in {final}")
    with open(meta_path) as f:
        meta = json.load(f)
    if "dockd_partitions" not in meta:
        raise ValueError(f"{final} is not a checkpoint written by dockd's transfer_queue.save_checkpoint")
    _get().load(str(final), meta["dockd_partitions"])
    logger.info("[tq] checkpoint loaded from %s", final)


# -- the low-level client ---------------------------------------------------------------------
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
        polling = _polling_mode if self.polling_mode is None else self.polling_mode
        wait = 0.0 if polling else float(os.environ.get("TQ_CONTROLLER_GET_METADATA_TIMEOUT", "1"))
        sampler = self.sampler or _sampler
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
    return DockTQClient(_get())


async def async_kv_batch_meta2batch_meta(meta: KVBatchMeta) -> BatchMeta:
    """verl's KVBatchMeta -> BatchMeta conversion (``verl.utils.transferqueue_utils`` has the same)."""
    client = get_client()
    batch_meta = await client.async_kv_retrieve_meta(keys=meta.keys, partition_id=meta.partition_id, create=False)
    if meta.fields is not None:
        batch_meta = batch_meta.select_fields([meta.fields] if isinstance(meta.fields, str) else list(meta.fields))
    batch_meta.extra_info = dict(meta.extra_info or {})
    return batch_meta


# -- streaming --------------------------------------------------------------------------------
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
        dockd_conf = config.get("dockd", None) if hasattr(config, "get") else None
        if dockd_conf is not None:
            address = dockd_conf.get("address", None)
        self.address = address or os.environ.get(ENV_ADDRESS)
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
        kinds: dict[str, bool] = {}
        for rec in part.keys.values():
            for f, (_, is_tensor) in rec.fields.items():
                kinds.setdefault(f, is_tensor)
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
        if self.fetch_batch_fn is not None or not isinstance(self.sampler or _sampler, SequentialSampler):
            yield from self._iter_fetch_fn(client)
            return
        try:
            while True:
                if self.batch_index < len(self.buffer):
                    td, meta = self.buffer[self.batch_index]
                    self.batch_index += 1
                    yield from self.process_batch_fn(td, meta, micro_batch_size=self.micro_batch_size)
                    continue
                # no key holding every field yet: wait for the key log to change
                found = self._columns(client) or self._columns(client, wait=self.poll_interval)
                if found is None:
                    continue
                cols, gen, consumer = found
                data_partition = client._data(self.partition_id, gen)
                try:
                    batch = client.dock.get(consumer, cols, self.batch_size, partition=data_partition,
                                            timeout=self.poll_interval)
                except dockd.DockDrained:
                    return
                except (dockd.DockTimeout, dockd.DockNotFound):
                    if not self.should_check_consumption_status:
                        continue
                    try:  # finite mode: the last batch may be smaller
                        batch = client.dock.get(consumer, cols, self.batch_size, partition=data_partition,
                                                allow_partial=True, timeout=0)
                    except (dockd.DockTimeout, dockd.DockNotFound, dockd.DockDrained):
                        if self._finished(client, data_partition):
                            return
                        continue
                idx = list(batch.indexes)
                client.took(self.partition_id, self.task_name, gen, idx)  # for the consumption status
                keys = client.keys_for(self.partition_id, idx)
                out: dict[str, Any] = {}
                for f, c in zip(self.data_fields, cols):
                    if c.startswith(NT):
                        out[f] = tensordict.NonTensorStack.from_list([_codec.decode(v) for v in batch[c]])
                    else:
                        vals = batch[c]
                        same = len({tuple(v.shape) for v in vals}) <= 1
                        out[f] = torch.stack(vals) if same else torch.nested.nested_tensor(vals, layout=torch.jagged)
                td = tensordict.TensorDict(out, batch_size=[len(idx)])
                meta = client.meta(self.partition_id, keys).select_fields(self.data_fields)
                self.buffer.append((td, meta))
        finally:
            client.close()

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


def install(address: str | None = None) -> dict[str, Any]:
    """Make ``import transfer_queue`` resolve to this module here and in Ray workers.

    Returns a Ray ``runtime_env`` to pass to ``ray.init`` (or to the job's actors when Ray
    is already initialised). Call before verl imports ``transfer_queue`` (verl imports it
    at module import time in the modules that use it).

    Args:
        address: the dock's ``host:port``. Default: ``DOCKD_ADDRESS``, else, when Ray is
            initialised in this process, the dock running on Ray (`dockd.ray.find`) or a
            newly launched one (`dockd.ray.launch`).
    """
    if address:
        os.environ[ENV_ADDRESS] = address
    if not os.environ.get(ENV_ADDRESS):
        from dockd import ray as dock_ray

        if dock_ray.ray_initialized():
            os.environ[ENV_ADDRESS] = dock_ray.find_or_launch()
            logger.info("[tq] no dock address configured; using the dock on Ray address=%s",
                        os.environ[ENV_ADDRESS])
    if not os.environ.get(ENV_ADDRESS):
        raise ValueError(
            f"use_dockd_transfer_queue needs the dock address: pass it, set {ENV_ADDRESS}, "
            "or call ray.init() first so that the dock on the Ray cluster is found (or launched)"
        )
    existing = sys.modules.get("transfer_queue")
    if existing is not None and existing is not sys.modules[__name__]:
        logger.warning("[tq] replacing the already imported transfer_queue module %r with dockd's", existing)
    sys.modules["transfer_queue"] = sys.modules[__name__]
    os.environ[ENV_ENABLE] = "1"
    return {
        "env_vars": {ENV_ADDRESS: os.environ[ENV_ADDRESS], ENV_ENABLE: "1"},
        "worker_process_setup_hook": f"{__name__}._ray_worker_setup",
    }


def _ray_worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: alias ``transfer_queue`` to this module in a worker."""
    if os.environ.get(ENV_ENABLE) == "1":
        sys.modules["transfer_queue"] = sys.modules[__name__]


def uninstall() -> None:
    if sys.modules.get("transfer_queue") is sys.modules[__name__]:
        del sys.modules["transfer_queue"]
    os.environ.pop(ENV_ENABLE, None)
    close()


__all__ = [
    "BaseSampler",
    "BatchMeta",
    "DockTQClient",
    "GRPOGroupNSampler",
    "GetMetaTimeout",
    "KVBatchMeta",
    "RankAwareSampler",
    "SamplingError",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StreamingDataLoader",
    "StreamingDataset",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_meta2batch_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "chunk_batch_fn",
    "close",
    "default_fetch_batch_fn",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "install",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
    "uninstall",
]
