"""The connection to the dock behind dockd's transfer_queue: the key log, the KV calls, checkpoints.

`_Client` keeps a replayed view (`keylog._Partition`) of every TQ partition it touched, brings it
up to date from the partition's key log before each call, and writes its own entries to the log
before applying them locally. ``kv_clear`` deletes the cleared keys' samples
(`dockd.Dock.delete`); when it leaves a partition without keys, its data partition is freed and
the next put starts a new generation ``g{n+1}``. Consumption and sampling are its other half
(`dockd.trainer_plugins.verl.tq.consume`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

import dockd
from dockd.trainer_plugins import _codec, require
from dockd.trainer_plugins.verl.tq.consume import _Consumption
from dockd.trainer_plugins.verl.tq.fields import (
    _parse_fields,
    to_columns,
    to_tensordict,
)
from dockd.trainer_plugins.verl.tq.keylog import (
    LOG_COLUMN,
    NT,
    _Partition,
    data_partition,
    meta_partition,
    sample_indexes,
)
from dockd.trainer_plugins.verl.tq.meta import BatchMeta, KVBatchMeta


class _Client(_Consumption):
    def __init__(self, address: str) -> None:
        self.dock = dockd.connect(address)
        self.address = address
        self.viewer = f"tqview-{uuid.uuid4().hex[:12]}"
        self.parts: dict[str, _Partition] = {}
        self.lock = threading.RLock()
        self.lockable: set[str] = set()  # partitions whose sampler lock exists

    # -- the metadata log ---------------------------------------------------------
    def _log(self, pid: str, entry: dict[str, Any]) -> None:
        self.dock.put({LOG_COLUMN: [_codec.encode(entry)]}, partition=meta_partition(pid))

    def sync(self, pid: str, wait: float = 0.0) -> _Partition:
        """Apply the partition's new key-log entries; with `wait`, block up to that many seconds
        for one when there is none yet (woken by the entry's put, not by a timer)."""
        with self.lock:
            part = self.parts.setdefault(pid, _Partition())
            timeout = wait
            while True:
                try:
                    batch = self.dock.get(
                        self.viewer, [LOG_COLUMN], 1 << 20, partition=meta_partition(pid), allow_partial=True,
                        timeout=timeout,
                    )
                except dockd.DockTimeout:
                    return part
                timeout = 0
                for blob in batch[LOG_COLUMN]:
                    part.apply(_codec.decode(blob))

    @staticmethod
    def _data(pid: str, gen: int) -> str:
        return data_partition(pid, gen)

    def partitions(self) -> list[str]:
        return sorted(p.removeprefix("tq-meta/") for p in self.dock.stats()["partitions"] if p.startswith("tq-meta/"))

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
            columns, kinds = to_columns(fields, len(keys)) if fields is not None else ({}, {})
            indexes = self._place(pid, part, keys, columns) if columns else None  # None: tags only
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
            part.apply(entry)
            self.sync(pid)
            return KVBatchMeta(
                keys=list(keys),
                tags=[dict(part.keys[k].tags) for k in keys],
                partition_id=pid,
                fields=sorted(set().union(*(part.keys[k].fields for k in keys))),
            )

    def _place(self, pid: str, part: _Partition, keys: list[str], columns: dict[str, Any]) -> list[int]:
        """Write `columns` onto the keys' samples (self.lock held): new keys and keys holding tags
        only get new samples; the indexes of the keys' samples."""
        data = self._data(pid, part.gen)
        known = [part.keys.get(k) for k in keys]
        stale = [k for k, r in zip(keys, known) if r is not None and r.index is not None and r.gen != part.gen]
        if stale:  # pragma: no cover - a generation only ends once no key is left
            raise ValueError(f"keys {stale[:5]} of partition {pid!r} belong to an older generation")
        fresh = [i for i, r in enumerate(known) if r is None or r.index is None]
        if len(fresh) == len(keys):
            return self.dock.put(columns, partition=data)
        indexes = [r.index if r is not None else None for r in known]
        if fresh:  # new and tag-only keys next to keys holding data: one sample each first
            for i, idx in zip(fresh, self.dock.reserve(data, len(fresh))):
                indexes[i] = idx
        self.dock.put(columns, partition=data, indexes=indexes)
        return indexes  # type: ignore[return-value]

    def get(self, keys: list[str], pid: str, select_fields: list[str] | None) -> Any:
        tensordict = require("tensordict", extra="verl", what="dockd transfer_queue.kv_batch_get")
        with self.lock:
            part = self.sync(pid)
            found = [part.keys.get(k) for k in keys]
            if any(r is None for r in found):
                missing = [k for k, r in zip(keys, found) if r is None][:5]
                raise ValueError(f"keys or partition were not found! partition={pid!r} missing={missing}")
            recs = [r for r in found if r is not None]  # every one of them, as checked above
            if select_fields is None:  # the fields every key holds (none for tag-only keys)
                held = [set(r.fields) for r in recs]
                names = sorted(set.intersection(*held)) if held else []
            else:
                names = list(select_fields)
            for r, k in zip(recs, keys):
                lacking = [f for f in names if f not in r.fields]
                if lacking:
                    raise ValueError(f"key {k!r} of partition {pid!r} has no fields {lacking}")
            if not names:
                return tensordict.TensorDict({}, batch_size=[len(keys)])
            gens = {r.gen for r in recs}
            if len(gens) != 1:
                raise ValueError(f"keys of partition {pid!r} span generations {sorted(gens)}; get them separately")
        cols = [f if recs[0].fields[f][1] else NT + f for f in names]
        lease = dockd.Lease(
            0,
            self._data(pid, gens.pop()),
            cols,
            sample_indexes(recs),  # (each holds every field in `names`, so a sample)
            np.array([[r.fields[f][0] for r in recs] for f in names], dtype=np.int64),
        )
        values: dockd.Batch | dict[str, list[Any]]
        if not keys:
            values = {c: [] for c in cols}
        else:
            try:  # (a Batch: a ragged column that came as one run is one jagged tensor, no tensor per value)
                values = self.dock.fetch(lease, batch=True)
            except dockd.DockError:  # the log's locations are stale (a loaded checkpoint): ask the controller
                values = self.dock.read(lease.partition, lease.indexes, cols)
        return to_tensordict(tensordict, names, cols, values, len(keys))

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
                part.apply(entry)
            recs = [part.keys[k] for k in keys]
            names = sorted(set.intersection(*(set(r.fields) for r in recs))) if recs else []
            schema = {f: {"is_non_tensor": not recs[0].fields[f][1]} for f in names}
            return BatchMeta(
                sample_indexes(recs),  # (the unplaced ones were just given a sample)
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
        """{partition: {key: tags}}: each partition's kept listing (`_Partition.listing`), read-only
        and shared, brought up to date by the key log's new entries only."""
        pids = [pid] if pid is not None else self.partitions()
        with self.lock:
            return {p: self.sync(p).listing() for p in pids}

    def clear(self, keys: list[str], pid: str) -> None:
        with self.lock:
            part = self.sync(pid)
            data = self._data(pid, part.gen)
            held = [r.index for r in (part.keys.get(k) for k in keys)
                    if r is not None and r.index is not None and r.gen == part.gen]
            entry: dict[str, Any] = {"op": "clear", "keys": list(keys)}
            self._log(pid, entry)
            part.apply(entry)
            if held:  # free the cleared keys' data now (the partition may never run empty)
                with contextlib.suppress(dockd.DockNotFound):
                    self.dock.delete(data, sorted(set(held)))
            self.sync(pid)
            if not part.keys:  # nothing left: free the data, next puts start a new generation
                with contextlib.suppress(dockd.DockNotFound):
                    self.dock.clear(self._data(pid, part.gen))
                entry = {"op": "rotate", "gen": part.gen + 1}
                self._log(pid, entry)
                part.apply(entry)

    # -- checkpoints ------------------------------------------------------------------
    def save(self, directory: str) -> dict[str, Any]:
        """Save every TQ partition (its key log and its data) under `directory` with Dock.save."""
        present = set(self.dock.stats()["partitions"])
        saved: dict[str, Any] = {}
        with self.lock:
            for i, pid in enumerate(self.partitions()):
                part = self.sync(pid)
                entry: dict[str, Any] = {"meta": f"p{i}-meta", "data": None, "gen": part.gen}
                self.dock.save(meta_partition(pid), os.path.join(directory, entry["meta"]))
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
                    if name == meta_partition(pid) or name.startswith(f"tq/{pid}/g"):
                        with contextlib.suppress(dockd.DockNotFound):
                            self.dock.clear(name)
                self.dock.load(os.path.join(directory, entry["meta"]), partition=meta_partition(pid))
                if entry["data"] is not None:
                    self.dock.load(os.path.join(directory, entry["data"]), partition=self._data(pid, entry["gen"]))
            # replay every log from its start under a fresh name (the saved logs carry old progress)
            self.viewer = f"tqview-{uuid.uuid4().hex[:12]}"
            self.parts.clear()

    def close(self) -> None:
        self.dock.close()
