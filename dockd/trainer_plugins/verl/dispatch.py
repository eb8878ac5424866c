"""Driver passes metadata, workers move the data: a verl dispatch mode over dockd.

verl's default ``DP_COMPUTE_PROTO`` makes the driver chunk a whole ``DataProto``
and ship each chunk through Ray to a worker, then gather every output back.
With ``DOCK_DISPATCH`` the driver sends each worker only metadata (a
`DockShard`: dock address, partition, columns and the sample indexes it is to
process, with their warehouse locations); each worker fetches its own shard
straight from the warehouses, runs the method on a ``DataProto``, writes its
outputs back into the same samples, and returns only their indexes (a
`DockResult`)::

    from verl.single_controller.base.decorator import register
    from dockd.trainer_plugins.verl import DOCK_DISPATCH, DockRequest, dock_io

    class RewardWorker(Worker):
        @register(dispatch_mode=DOCK_DISPATCH)
        @dock_io
        def compute_score(self, data: DataProto) -> DataProto:
            ...

    result = worker_group.compute_score(DockRequest(
        address=dock_address, partition="step-3", consumer="reward",
        batch_keys=("responses",), count=256))
    result.indexes   # every sample scored, in worker order

By default (``assign="driver"``) the driver acquires the samples for the
request's consumer (one metadata round trip to the controller, no payload),
slices the indexes over the workers, holds the lease while they work (for up
to `DockRequest.keep_alive`, 10 minutes; if the driver dies it returns at
once), and confirms it when all workers have returned; if the call fails the
lease expires after that and the samples go back to the pool. With ``assign="workers"`` each worker acquires its own share under
the shared consumer name instead. Either way no sample is processed twice.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import dockd
from dockd.trainer_plugins import _codec, require
from dockd.trainer_plugins._lease import metadata_only
from dockd.trainer_plugins.verl.dataproto import (
    batch_to_data_proto,
    data_proto_columns,
    get_data_proto_with_indexes,
    put_data_proto,
)

logger = logging.getLogger(__name__)

DISPATCH_MODE_NAME = "DOCKD_SHARD"


@dataclass(frozen=True, kw_only=True, slots=True)
class DockRequest:
    """What the driver passes to a worker-group method registered with ``DOCK_DISPATCH``."""

    address: str
    """Dock address ``host:port`` every worker connects to."""
    partition: str
    """Partition holding the samples (e.g. the global step)."""
    consumer: str
    """Consumer name shared by all workers of this call: each sample goes to one worker."""
    count: int
    """Samples to process in total; split as evenly as possible over the workers."""
    batch_keys: tuple[str, ...] = ()
    """TensorDict keys to fetch."""
    non_tensor_batch_keys: tuple[str, ...] = ()
    """non_tensor_batch keys to fetch."""
    output_partition: str | None = None
    """Where outputs go; None writes them next to the inputs (same samples, same partition)."""
    timeout: float = 60.0
    """Seconds a worker waits for its shard to be ready."""
    groups: bool = False
    """Hand out whole groups only (shares are split on group boundaries)."""
    assign: str = "driver"
    """Who picks each worker's samples. ``"driver"``: the driver acquires `count` samples
    (metadata only: indexes + warehouse locations), sends each worker its slice of the
    indexes, and confirms once all workers returned; a failed call leaves the lease to
    expire, so the samples return to the pool. ``"workers"``: each worker acquires its own
    share under the shared consumer name (no driver round trip, shares decided by arrival)."""
    keep_alive: float = 600.0
    """assign="driver": seconds the driver holds its lease while the workers run (its lease
    timeout), so slow workers never see their samples handed to others; a failed call's
    samples return after it, or at once if the driver dies."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the method on every worker."""

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ValueError(f"DockRequest.count must be > 0, got {self.count}")
        if not self.batch_keys and not self.non_tensor_batch_keys:
            raise ValueError("DockRequest needs batch_keys or non_tensor_batch_keys to fetch")
        if self.assign not in ("driver", "workers"):
            raise ValueError(f"DockRequest.assign must be 'driver' or 'workers', got {self.assign!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DockShard:
    """One worker's part of a `DockRequest`."""

    request: DockRequest
    rank: int
    count: int
    indexes: tuple[int, ...] | None = None
    """With assign="driver": the sample indexes this worker reads (else it acquires its own)."""
    locations: tuple[tuple[int, ...], ...] | None = None
    """With assign="driver": warehouse id per (column, sample) of `indexes` (None when every
    column came inline)."""
    lease_id: int = 0
    inline: bytes = b""
    """With assign="driver": this worker's slice of the small columns the controller sent
    inline with the driver's acquire, msgpack-encoded (empty when none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DockResult:
    """What a ``DOCK_DISPATCH`` method returns: where its outputs are, not the outputs."""

    partition: str
    indexes: list[int]
    output_keys: tuple[str, ...] = ()
    per_worker: tuple[int, ...] = ()
    """How many samples each worker processed (collected results only)."""
    lease_id: int = 0
    """The driver's lease the samples came from (assign="driver"); confirmed on collect."""


def shard_counts(total: int, world_size: int) -> list[int]:
    """Split `total` samples over `world_size` workers as evenly as possible."""
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def dispatch_dock_shards(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """verl dispatch_fn: turn the one `DockRequest` argument into one `DockShard` per worker."""
    requests = [a for a in args if isinstance(a, DockRequest)] + [
        v for v in kwargs.values() if isinstance(v, DockRequest)
    ]
    if len(requests) != 1:
        raise TypeError(
            f"a DOCK_DISPATCH method takes exactly one DockRequest argument, got {len(requests)}; "
            "pass DockRequest(address=..., partition=..., consumer=..., count=..., batch_keys=...)"
        )
    request = requests[0]
    world = worker_group.world_size
    if request.assign == "driver":
        shards = _driver_shards(request, world)
    else:
        counts = shard_counts(request.count, world)
        shards = [DockShard(request=request, rank=r, count=counts[r]) for r in range(world)]

    def spread(value: Any) -> list[Any]:
        if isinstance(value, DockRequest):
            return shards
        return [value] * world

    return tuple(spread(a) for a in args), {k: spread(v) for k, v in kwargs.items()}


def _driver_shards(request: DockRequest, world: int) -> list[DockShard]:
    """Acquire the request's samples on the driver (metadata only) and slice them per worker."""
    dock = worker_dock(request.address)
    lease = dock.acquire(
        request.consumer,
        data_proto_columns(request.batch_keys, request.non_tensor_batch_keys),
        request.count,
        partition=request.partition,
        timeout=request.timeout,
        groups=request.groups,
        inline=False,  # metadata only: each worker fetches its own shard
        lease_timeout=request.keep_alive,  # slow workers must not see their samples handed out again
    )
    n = len(lease.indexes)
    unit = 1
    if request.groups:  # split on group boundaries: whole groups per worker
        unit = int(dock.stats()["partitions"][request.partition]["group_size"])
    counts = [c * unit for c in shard_counts(n // unit, world)]
    all_locations, inline = metadata_only(dock, lease)  # inline stays empty unless unavoidable
    shards, start = [], 0
    for r, c in enumerate(counts):
        sl = slice(start, start + c)
        locations = tuple(tuple(int(w) for w in row[sl]) for row in all_locations)
        shards.append(
            DockShard(
                request=request,
                rank=r,
                count=c,
                indexes=tuple(int(i) for i in lease.indexes[sl]),
                locations=locations,
                lease_id=lease.id,
                inline=_codec.encode({k: v[sl] for k, v in inline.items()}).numpy().tobytes() if inline else b"",
            )
        )
        start += c
    _pending[lease.id] = (request.address, lease)
    logger.debug("[verl] driver acquired lease=%d samples=%d for %d workers", lease.id, n, world)
    return shards


_pending: dict[int, tuple[str, Any]] = {}
"""Leases the driver acquired and has not confirmed yet: lease id -> (address, lease)."""


def collect_dock_results(worker_group: Any, output: list[Any]) -> DockResult:
    """verl collect_fn: merge the workers' `DockResult`s (indexes only, no payload)."""
    results = [o for o in output if isinstance(o, DockResult)]
    if len(results) != len(output):
        bad = next(o for o in output if not isinstance(o, DockResult))
        raise TypeError(f"a DOCK_DISPATCH method must return a DockResult (use @dock_io), got {type(bad).__name__}")
    for lease_id in {r.lease_id for r in results if r.lease_id}:
        pending = _pending.pop(lease_id, None)
        if pending is not None:  # every worker has read its slice: the samples are taken for good
            address, lease = pending
            worker_dock(address).confirm(lease)
    indexes = [i for r in results for i in r.indexes]
    keys = results[0].output_keys if results else ()
    partition = results[0].partition if results else ""
    return DockResult(
        partition=partition, indexes=indexes, output_keys=keys, per_worker=tuple(len(r.indexes) for r in results)
    )


def _register() -> Any:
    decorator = require(
        "verl.single_controller.base.decorator", extra="verl", what="dockd.trainer_plugins.verl.DOCK_DISPATCH"
    )
    if DISPATCH_MODE_NAME in decorator.Dispatch._registry:
        return decorator.Dispatch._registry[DISPATCH_MODE_NAME]
    decorator.register_dispatch_mode(DISPATCH_MODE_NAME, dispatch_dock_shards, collect_dock_results)
    return decorator.Dispatch._registry[DISPATCH_MODE_NAME]


def dock_dispatch_mode() -> Any:
    """The registered ``Dispatch.DOCKD_SHARD`` member (registers it on first call)."""
    return _register()


_docks: dict[str, Any] = {}
_docks_lock = threading.Lock()


def worker_dock(address: str) -> Any:
    """One `dockd.Dock` per address per worker process, opened on first use."""
    with _docks_lock:
        dock = _docks.get(address)
        if dock is None:
            dock = _docks[address] = dockd.connect(address)
        return dock


def _fetch_slice(dock: Any, shard: DockShard) -> tuple[Any, list[int]]:
    """Read exactly the samples the driver assigned to this worker, straight from the warehouses."""
    req = shard.request
    assert shard.indexes is not None
    columns = data_proto_columns(req.batch_keys, req.non_tensor_batch_keys)
    locations = None if shard.locations is None else np.asarray(shard.locations, dtype=np.int64)
    args = (shard.lease_id, req.partition, columns, list(shard.indexes), locations)
    inline = _codec.decode(shard.inline) if shard.inline else {}
    lease = dockd.Lease(*args, inline=inline) if inline else dockd.Lease(*args)
    batch = dock.fetch(lease, batch=True)  # (a column that came as one run stays its received buffer)
    data = batch_to_data_proto(batch, batch_keys=req.batch_keys, non_tensor_batch_keys=req.non_tensor_batch_keys)
    return data, list(shard.indexes)


def dock_io(func: Callable[..., Any]) -> Callable[..., Any]:
    """Worker-side helper: fetch the shard, call ``func(self, data, **kwargs)``, write its output back.

    ``func`` takes and returns a ``DataProto``. Every batch and non_tensor_batch key of the
    returned ``DataProto`` is written to the samples the shard came from.
    """

    @functools.wraps(func)
    def wrapper(self: Any, shard: DockShard, *args: Any, **kwargs: Any) -> DockResult:
        if not isinstance(shard, DockShard):
            raise TypeError(
                f"{func.__qualname__} is a dock_io method: register it with dispatch_mode=DOCK_DISPATCH "
                f"and call it with a DockRequest, got {type(shard).__name__}"
            )
        req = shard.request
        if shard.count == 0:
            return DockResult(partition=req.output_partition or req.partition, indexes=[], lease_id=shard.lease_id)
        dock = worker_dock(req.address)
        if shard.indexes is not None:
            data, indexes = _fetch_slice(dock, shard)
        else:
            data, indexes = get_data_proto_with_indexes(
                dock,
                consumer=req.consumer,
                count=shard.count,
                partition=req.partition,
                batch_keys=req.batch_keys,
                non_tensor_batch_keys=req.non_tensor_batch_keys,
                timeout=req.timeout,
                groups=req.groups,
            )
        out = func(self, data, *args, **{**req.kwargs, **kwargs})
        if out is None:
            return DockResult(partition=req.partition, indexes=indexes, lease_id=shard.lease_id)
        if len(out) != len(indexes):
            raise ValueError(
                f"{func.__qualname__} returned {len(out)} samples for a shard of {len(indexes)}; "
                "a dock_io method must return one output row per input row"
            )
        target = req.output_partition or req.partition
        keys = tuple(out.batch.keys()) if out.batch is not None else ()
        keys += tuple(out.non_tensor_batch.keys())
        if target == req.partition:
            put_data_proto(dock, out, partition=target, indexes=indexes, with_meta_info=False)
            written = indexes
        else:
            written = put_data_proto(dock, out, partition=target)
        logger.debug("[verl] %s rank=%d samples=%d -> %s", func.__qualname__, shard.rank, len(indexes), target)
        return DockResult(partition=target, indexes=list(written), output_keys=keys, lease_id=shard.lease_id)

    return wrapper
