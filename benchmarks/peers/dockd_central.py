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
"""

from __future__ import annotations

import logging
from typing import Any

from .. import _dockd
from ..common import BenchConfig
from .workload import COLUMN, PeerAdapter, run_workload

logger = logging.getLogger(__name__)

NAME = "peer_dockd_central"
TITLE = "Peer workload: dockd, one central warehouse"

GET_TIMEOUT_S = 120.0


def requirements() -> str | None:
    return _dockd.requirements()


class DockdCentralAdapter(PeerAdapter):
    system = "dockd-central"

    def __init__(self, cluster: Any, path: str) -> None:
        self.cluster = cluster
        self.path = path
        self.dock: Any = None

    def start(self) -> dict[str, Any]:
        self.dock = _dockd.connect(self.cluster.address, self.path)
        return {**_dockd.describe(self.cluster, 1), "path": self.path,
                "transport_in_use": _dockd.transport_in_use(self.dock)}

    def put(self, partition: str, batch: Any) -> None:
        self.dock.put({COLUMN: batch}, partition=partition)

    def get(self, partition: str, consumer: str, count: int) -> Any:
        return self.dock.get(consumer, [COLUMN], count, partition=partition, timeout=GET_TIMEOUT_S)[COLUMN]

    def put_columns(self, partition: str, batch: Any) -> None:
        self.dock.put(batch, partition=partition)

    def get_columns(self, partition: str, consumer: str, columns: list[str], count: int) -> dict[str, Any]:
        got = self.dock.get(consumer, columns, count, partition=partition, timeout=GET_TIMEOUT_S)
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
    finally:
        cluster.close()
    note = None if len(paths) > 1 else "this client has one path only, so 'auto' is the socket path"
    return {"rows": rows, "layouts": layouts, "note": note}
