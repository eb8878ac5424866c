"""Consumption and sampling on the key log: the work behind TransferQueue's sampler-driven calls.

`_Consumption` is the half of `store._Client` that ``get_meta`` (`DockTQClient.get_meta`), the
consumption and production statuses, ``reset_consumption`` and ``set_custom_meta`` run on. What a
task took, and which samples a sampler chose for which ranks, are entries of the partition's key
log (``consume``, ``share``), so they hold across processes. A sampler other than the sequential
one chooses under a lock per partition shared by every process (`_Consumption.exclusive`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

import dockd
import dockd.balance
from dockd.trainer_plugins.verl.tq import FACADE
from dockd.trainer_plugins.verl.tq.keylog import NT, _Partition, field_kinds
from dockd.trainer_plugins.verl.tq.meta import BatchMeta
from dockd.trainer_plugins.verl.tq.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SamplingError,
    SeqlenBalancedSampler,
    _groups,
    _length,
)

logger = logging.getLogger(FACADE)

LOCK_TIMEOUT_S = 60.0  # longest wait for a partition's sampler lock


class _Consumption:
    """Mixed into `store._Client`, which provides the connection, the log and the KV calls."""

    dock: Any
    lock: Any  # a threading.RLock
    lockable: set[str]

    if TYPE_CHECKING:  # provided by store._Client
        def sync(self, pid: str, wait: float = 0.0) -> _Partition: ...
        def _log(self, pid: str, entry: dict[str, Any]) -> None: ...
        @staticmethod
        def _data(pid: str, gen: int) -> str: ...
        def meta(self, pid: str, keys: list[str], create: bool = False) -> BatchMeta: ...
        def keys_for(self, pid: str, indexes: list[int], wait: float = 5.0) -> list[str]: ...

    def took(self, pid: str, task: str, gen: int, indexes: list[int]) -> None:
        """Record that `task` took samples `indexes` (for its consumption status)."""
        entry = {"op": "consume", "task": task, "gen": gen, "indexes": [int(i) for i in indexes]}
        with self.lock:
            self._log(pid, entry)
            self.sync(pid).apply(entry)

    def take(self, pid: str, task: str, fields: list[str], count: int, wait: float) -> BatchMeta:
        """Take `count` samples holding all `fields` that `task` has not taken, oldest first (TQ's
        SequentialSampler); an empty BatchMeta when they are not there within `wait` seconds."""
        deadline = time.monotonic() + wait
        while True:
            with self.lock:
                part = self.sync(pid)
                kinds = field_kinds(part.keys.values())
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
        return sorted(r.index for _, r in part.placed()  # (placed: never None; the check narrows the type)
                      if r.index is not None and r.index not in skip and all(f in r.fields for f in fields))

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
        rank, index = config.get("dp_rank"), config.get("batch_index")
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
        shares: list[list[Any]]  # [rank, its indexes] each (a log entry's JSON)
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
        mine: list[int] = next(ix for r, ix in shares if r == rank) if any(r == rank for r, _ in shares) else []
        if rank is not None:  # (GRPO without dp_rank remembers nothing, as TransferQueue's)
            entry = {"op": "share", "task": task, "gen": part.gen, "rank": rank, "batch_index": index,
                     "shares": shares}
            self._log(pid, entry)
            part.apply(entry)
        return mine or None

    def everything(self, pid: str, fields: list[str]) -> BatchMeta:
        """TQ's force_fetch: every sample of the partition, ready or not, nothing taken."""
        with self.lock:
            placed = self.sync(pid).placed()
        if not placed:
            return BatchMeta.empty()
        kinds = field_kinds(r for _, r in placed)
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
            self.sync(pid).apply(entry)

    def retag(self, pid: str, keys: list[str], tags: list[dict[str, Any]]) -> None:
        entry = {"op": "retag", "keys": list(keys), "tags": [dict(t) for t in tags]}
        with self.lock:
            self._log(pid, entry)
            self.sync(pid).apply(entry)
