"""dockd on the peer workload, configured as one central warehouse.

``dockd.start_local(num_warehouses=1)``: one daemon hosts the controller and
the only warehouse, the layout of a central replay buffer, so the comparison
with TransferQueue and the Ray-actor buffer is layout for layout. Measured
twice: with the client's default same-host path (``auto``) and forced onto
the socket path when the client offers that choice.

GRPO-shaped case: ``dock.put({column: values})`` with every column a list of
per-sample values (ragged 1-D tensors, floats, strings), as
``benchmarks.columnar`` does; a get takes every column and reads each one
as its per-sample list (``batch[column]``).

Every case gets without ``prefetch``, one acquire per get (the rows the
targets compare). The four-column case is then run once more on the default
path with ``get(prefetch=PREFETCH)``, as a streaming consumer would take its
batches (one acquire per PREFETCH gets, the values of all of them inline with
it): rows with ``path == "auto+prefetch4"``, never the ones a target reads.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import _dockd
from ..common import BenchConfig
from .workload import COLUMN, PeerAdapter, run_wide, run_workload

logger = logging.getLogger(__name__)

NAME = "peer_dockd_central"
TITLE = "Peer workload: dockd, one central warehouse"

GET_TIMEOUT_S = 120.0
PREFETCH = 4
"""Gets per acquire of the four-column case's second dockd row (``get(prefetch=PREFETCH)``)."""


def requirements() -> str | None:
    return _dockd.requirements()


class DockdCentralAdapter(PeerAdapter):
    system = "dockd-central"

    def __init__(self, cluster: Any, path: str, prefetch: int = 0) -> None:
        self.cluster = cluster
        self.transport = path
        self.prefetch = prefetch  # the multi-column gets' get(prefetch=...); 0: one acquire per get
        self.path = path if not prefetch else f"{path}+prefetch{prefetch}"  # (the rows' label)
        self.dock: Any = None

    def start(self) -> dict[str, Any]:
        self.dock = _dockd.connect(self.cluster.address, self.transport)
        return {**_dockd.describe(self.cluster, 1), "path": self.transport, "prefetch": self.prefetch,
                "transport_in_use": _dockd.transport_in_use(self.dock)}

    def put(self, partition: str, batch: Any) -> None:
        self.dock.put({COLUMN: batch}, partition=partition)

    def get(self, partition: str, consumer: str, count: int) -> Any:
        return self.dock.get(consumer, [COLUMN], count, partition=partition, timeout=GET_TIMEOUT_S)[COLUMN]

    def put_columns(self, partition: str, batch: Any) -> None:
        self.dock.put(batch, partition=partition)

    def get_columns(self, partition: str, consumer: str, columns: list[str], count: int) -> dict[str, Any]:
        got = self.dock.get(consumer, columns, count, partition=partition, timeout=GET_TIMEOUT_S,
                            **({"prefetch": self.prefetch} if self.prefetch else {}))
        return {c: got[c] for c in columns}

    def clear(self, partition: str) -> None:
        self.dock.clear(partition)

    def close(self) -> None:
        if self.dock is not None:
            self.dock.close()


def run(config: BenchConfig) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    layouts: dict[str, Any] = {}
    paths = ["auto"] + (["socket"] if _dockd.path_unavailable("shm") is None else [])
    cluster = _dockd.start(1)
    try:
        for path in paths:
            out = run_workload(DockdCentralAdapter(cluster, path), config, NAME)
            rows += out["rows"]
            layouts[path] = out["layout"]
        streaming = DockdCentralAdapter(cluster, "auto", prefetch=PREFETCH)
        out = run_wide(streaming, config, NAME)
        rows += out["rows"]
        layouts[streaming.path] = out["layout"]
    finally:
        cluster.close()
    note = None if len(paths) > 1 else "this client has one path only, so 'auto' is the socket path"
    return {"rows": rows, "layouts": layouts, "note": note}
