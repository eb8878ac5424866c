"""verl plugin (verl 0.9): ``DataProto`` <-> dock, a dock dispatch mode, a TransferQueue switch.

    put_data_proto / get_data_proto     a DataProto in and out of a partition, bit-exact
    DOCK_DISPATCH, DockRequest, dock_io  worker-group methods that get only metadata from the
                                         driver and fetch/write their shard themselves
    transfer_queue                       a `transfer_queue`-compatible module backed by dockd
                                         (`use_dockd_transfer_queue()` switches verl over);
                                         its parts are the modules of `.tq`

Importing this package imports neither verl nor tensordict; they are imported on
first use (pip install -e '.[verl]').
"""

from __future__ import annotations

from typing import Any

from dockd.trainer_plugins.verl.dataproto import (
    META_COLUMN,
    NON_TENSOR_PREFIX,
    batch_to_data_proto,
    data_proto_columns,
    get_data_proto,
    get_data_proto_with_indexes,
    put_data_proto,
)
from dockd.trainer_plugins.verl.dispatch import (
    DockRequest,
    DockResult,
    DockShard,
    collect_dock_results,
    dispatch_dock_shards,
    dock_dispatch_mode,
    dock_io,
    shard_counts,
    worker_dock,
)

DOCK_DISPATCH: dict[str, Any] = {"dispatch_fn": dispatch_dock_shards, "collect_fn": collect_dock_results}
"""Pass as ``@register(dispatch_mode=DOCK_DISPATCH)``. The dict form pickles by reference, so
it works in Ray workers that never imported this module; `dock_dispatch_mode()` gives the same
functions registered as ``Dispatch.DOCKD_SHARD`` through verl's ``register_dispatch_mode``."""

__all__ = [
    "DOCK_DISPATCH",
    "META_COLUMN",
    "NON_TENSOR_PREFIX",
    "DockRequest",
    "DockResult",
    "DockShard",
    "batch_to_data_proto",
    "collect_dock_results",
    "data_proto_columns",
    "dispatch_dock_shards",
    "dock_dispatch_mode",
    "dock_io",
    "get_data_proto",
    "get_data_proto_with_indexes",
    "put_data_proto",
    "shard_counts",
    "use_dockd_transfer_queue",
    "worker_dock",
]


def use_dockd_transfer_queue(address: str | None = None) -> Any:
    """Make ``import transfer_queue`` resolve to dockd's compatible module (see `.transfer_queue`).

    `address` defaults to ``DOCKD_ADDRESS``, else, when Ray is initialised in this process,
    to the dock running on Ray (found with `dockd.ray.find`, else started with
    `dockd.ray.launch`). Returns the Ray ``runtime_env`` that switches Ray workers too.
    """
    from dockd.trainer_plugins.verl import transfer_queue

    return transfer_queue.install(address)
