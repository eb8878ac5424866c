"""Driver passes metadata, workers move the data: a verl dispatch mode over dockd.

verl's default ``DP_COMPUTE_PROTO`` makes the driver chunk a whole ``DataProto``
and ship each chunk through Ray to a worker, then gather every output back.
With ``DOCK_DISPATCH`` the driver sends each worker a few dozen bytes (a
`DockShard`: dock address, partition, consumer, columns, how many samples);
each worker fetches its own shard straight from the warehouses, runs the
method on a ``DataProto``, writes its outputs back into the same samples, and
returns only their indexes (a `DockResult`)::

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

Workers sharing one consumer name get disjoint samples, so the shards never
overlap and nothing is read twice.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dockd
from dockd.trainer_plugins import require
from dockd.trainer_plugins.verl.dataproto import get_data_proto_with_indexes, put_data_proto

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
    """Hand out whole groups only (shares are then rounded to the group size by the dock)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the method on every worker."""

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ValueError(f"DockRequest.count must be > 0, got {self.count}")
        if not self.batch_keys and not self.non_tensor_batch_keys:
            raise ValueError("DockRequest needs batch_keys or non_tensor_batch_keys to fetch")


@dataclass(frozen=True, kw_only=True, slots=True)
class DockShard:
    """One worker's part of a `DockRequest`."""

    request: DockRequest
    rank: int
    count: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DockResult:
    """What a ``DOCK_DISPATCH`` method returns: where its outputs are, not the outputs."""

    partition: str
    indexes: list[int]
    output_keys: tuple[str, ...] = ()
    per_worker: tuple[int, ...] = ()
    """How many samples each worker processed (collected results only)."""


def shard_counts(total: int, world_size: int) -> list[int]:
    """Split `total` samples over `world_size` workers as evenly as possible."""
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def dispatch_dock_shards(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """verl dispatch_fn: turn the one `DockRequest` argument into one `DockShard` per worker."""
    requests = [a for a in args if isinstance(a, DockRequest)] + [v for v in kwargs.values() if isinstance(v, DockRequest)]
    if len(requests) != 1:
        raise TypeError(
            f"a DOCK_DISPATCH method takes exactly one DockRequest argument, got {len(requests)}; "
            "pass DockRequest(address=..., partition=..., consumer=..., count=..., batch_keys=...)"
        )
    request = requests[0]
    world = worker_group.world_size
    counts = shard_counts(request.count, world)

    def spread(value: Any) -> list[Any]:
        if isinstance(value, DockRequest):
            return [DockShard(request=value, rank=r, count=counts[r]) for r in range(world)]
        return [value] * world

    return tuple(spread(a) for a in args), {k: spread(v) for k, v in kwargs.items()}


def collect_dock_results(worker_group: Any, output: list[Any]) -> DockResult:
    """verl collect_fn: merge the workers' `DockResult`s (indexes only, no payload)."""
    results = [o for o in output if isinstance(o, DockResult)]
    if len(results) != len(output):
        bad = next(o for o in output if not isinstance(o, DockResult))
        raise TypeError(f"a DOCK_DISPATCH method must return a DockResult (use @dock_io), got {type(bad).__name__}")
    indexes = [i for r in results for i in r.indexes]
    keys = results[0].output_keys if results else ()
    partition = results[0].partition if results else ""
    return DockResult(partition=partition, indexes=indexes, output_keys=keys, per_worker=tuple(len(r.indexes) for r in results))


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
            return DockResult(partition=req.output_partition or req.partition, indexes=[])
        dock = worker_dock(req.address)
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
            return DockResult(partition=req.partition, indexes=indexes)
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
        return DockResult(partition=target, indexes=list(written), output_keys=keys)

    return wrapper
