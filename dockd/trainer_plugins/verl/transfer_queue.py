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

The implementation lives in `dockd.trainer_plugins.verl.tq` (one module per part: metadata types,
samplers, key log, store, consumption, KV API, client, checkpoints, streaming, metrics, the
switch); this module gathers its public surface, which is what ``import transfer_queue`` gives.
"""

from __future__ import annotations

from typing import Any

# The names marked noqa are not in __all__ but stay reachable here as before: the constants,
# `_Client` and `_get` (tests and tools), `_ray_worker_setup` (the Ray setup hook `install` names).
from dockd.trainer_plugins.verl.tq import runtime as _runtime
from dockd.trainer_plugins.verl.tq.checkpoint import load_checkpoint, save_checkpoint
from dockd.trainer_plugins.verl.tq.client import (
    DockTQClient,
    GetMetaTimeout,
    async_kv_batch_meta2batch_meta,
    get_client,
)
from dockd.trainer_plugins.verl.tq.consume import LOCK_TIMEOUT_S  # noqa: F401
from dockd.trainer_plugins.verl.tq.keylog import (
    LOG_COLUMN,  # noqa: F401
    NT,  # noqa: F401
)
from dockd.trainer_plugins.verl.tq.kv import (
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
)
from dockd.trainer_plugins.verl.tq.meta import BatchMeta, KVBatchMeta
from dockd.trainer_plugins.verl.tq.metrics import get_metrics_endpoint
from dockd.trainer_plugins.verl.tq.runtime import (
    ENV_ADDRESS,  # noqa: F401
    ENV_METRICS,  # noqa: F401
    _get,  # noqa: F401
    close,
    init,
)
from dockd.trainer_plugins.verl.tq.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SamplingError,
    SeqlenBalancedSampler,
    SequentialSampler,
)
from dockd.trainer_plugins.verl.tq.store import _Client  # noqa: F401
from dockd.trainer_plugins.verl.tq.streaming import (
    StreamingDataLoader,
    StreamingDataset,
    chunk_batch_fn,
    default_fetch_batch_fn,
)
from dockd.trainer_plugins.verl.tq.switch import (
    ENV_ENABLE,  # noqa: F401
    _ray_worker_setup,  # noqa: F401 (Ray's setup hook)
    install,
    uninstall,
)

__version__ = "0.1.10+dockd"

_STATE = frozenset({"_client", "_polling_mode", "_sampler"})


def __getattr__(name: str) -> Any:
    """The process's connection and the settings read at `init`, read from `tq.runtime` (which
    `init` and `close` rebind), so that ``transfer_queue._sampler`` and the like read as before."""
    if name in _STATE:
        return getattr(_runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
