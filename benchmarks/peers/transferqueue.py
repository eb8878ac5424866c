"""Peer: TransferQueue (PyPI ``transferqueue``), default storage backend, ``polling_mode=True``.

Set up as its documentation does: ``ray.init()``, then
``transfer_queue.init({"controller": {"polling_mode": True}})``, which starts
the Ray controller actor and the default ``SimpleStorage`` backend (ZMQ
storage units; two by default). Put is ``client.put(TensorDict, partition_id=...)``;
get is ``client.get_meta(data_fields, batch_size, partition_id, task_name=consumer)``
followed by ``client.get_data(meta)``. In polling mode ``get_meta`` returns an
empty batch when too few samples are ready, so the adapter polls (the data
is always ready before the gets start, so the first call normally succeeds).

Four-column case: one ``TensorDict`` of four dense ``[B, 4096]`` uint8
columns; a get unbinds each column into per-sample views, as the one-column
get does.

GRPO-shaped case: one ``TensorDict`` per batch with each ragged column as a
jagged nested tensor (``torch.nested.as_nested_tensor(values,
layout=torch.jagged)``, built once, untimed), the reward as a dense float32
``[B]`` tensor and the uid as a ``NonTensorStack`` of strings. That is the
ragged input TransferQueue's own storage manager builds (it packs per-sample
tensors the same way when it assembles a get) and what it hands back: a get
returns the ragged columns as jagged nested tensors, which the consumer
unbinds into per-sample views, the reward as a ``[B]`` tensor, the uids as a
list.

Ray is given 4 logical CPUs: TransferQueue's controller and each storage
unit reserve one, so ``num_cpus=2`` (this machine's core count) would leave
the second storage unit unschedulable and ``init`` would wait forever.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..common import BenchConfig
from . import PEERS_INSTALL_HINT
from .workload import COLUMN, PeerAdapter, run_workload

logger = logging.getLogger(__name__)

NAME = "peer_transferqueue"
TITLE = "Peer: TransferQueue (SimpleStorage, polling_mode=True)"

GET_TIMEOUT_S = 60.0
POLL_SLEEP_S = 0.001


def requirements() -> str | None:
    missing = []
    for mod in ("ray", "transfer_queue", "tensordict"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
        except Exception as exc:  # noqa: BLE001 - a broken install is as good as a missing one here
            missing.append(f"{mod} ({type(exc).__name__}: {exc})")
    if missing:
        return f"TransferQueue peer unavailable (missing: {', '.join(missing)}); install with: {PEERS_INSTALL_HINT}"
    return None


class TransferQueueAdapter(PeerAdapter):
    system = "transferqueue"
    path = None

    def __init__(self) -> None:
        self.client: Any = None
        self.tq: Any = None

    def start(self) -> dict[str, Any]:
        import ray
        import transfer_queue as tq

        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
        conf = tq.init({"controller": {"polling_mode": True}})
        self.tq = tq
        self.client = tq.get_client()
        backend = conf.backend.storage_backend if conf is not None else "SimpleStorage"
        units = conf.backend[backend].get("num_data_storage_units") if conf is not None else None
        return {
            "transferqueue": getattr(tq, "__version__", None),
            "ray": ray.__version__,
            "storage_backend": backend,
            "storage_units": units,
            "polling_mode": True,
        }

    def prepare(self, batch: Any) -> Any:
        from tensordict import TensorDict

        return TensorDict({COLUMN: batch}, batch_size=[batch.shape[0]])

    def put(self, partition: str, batch: Any) -> None:
        self.client.put(batch, partition_id=partition)

    def get(self, partition: str, consumer: str, count: int) -> Any:
        data = self.client.get_data(self._meta(partition, consumer, [COLUMN], count))
        return list(data[COLUMN].unbind(0))  # one tensor per sample (the column may come back nested)

    def prepare_columns(self, columns: dict[str, list[Any]]) -> Any:
        import torch
        from tensordict import NonTensorStack, TensorDict

        out: dict[str, Any] = {}
        n = 0
        for name, values in columns.items():
            n = len(values)
            if isinstance(values, torch.Tensor):  # a dense [B, S] column: taken as it is
                out[name] = values
            elif all(isinstance(v, torch.Tensor) for v in values):
                out[name] = torch.nested.as_nested_tensor(list(values), layout=torch.jagged)
            elif all(isinstance(v, float) for v in values):
                out[name] = torch.tensor(values, dtype=torch.float32)
            else:
                out[name] = NonTensorStack(*values)
        return TensorDict(out, batch_size=[n])

    def put_columns(self, partition: str, batch: Any) -> None:
        self.client.put(batch, partition_id=partition)

    def get_columns(self, partition: str, consumer: str, columns: list[str], count: int) -> dict[str, Any]:
        data = self.client.get_data(self._meta(partition, consumer, columns, count))
        # nested columns are unbound into per-sample views by the touch; a dense [B, S] column is
        # unbound here, as get() does, so every system hands over one tensor per sample
        return {c: _per_sample(data[c]) for c in columns}

    def _meta(self, partition: str, consumer: str, columns: list[str], count: int) -> Any:
        deadline = time.monotonic() + GET_TIMEOUT_S
        while True:
            meta = self.client.get_meta(
                data_fields=columns, batch_size=count, partition_id=partition, task_name=consumer
            )
            if meta.size >= count:
                return meta
            if time.monotonic() > deadline:
                raise TimeoutError(f"TransferQueue: {count} samples not ready within {GET_TIMEOUT_S} s")
            time.sleep(POLL_SLEEP_S)

    def clear(self, partition: str) -> None:
        self.client.clear_partition(partition)

    def close(self) -> None:
        import ray

        try:
            if self.tq is not None:
                self.tq.close()
        finally:
            ray.shutdown()


def _per_sample(values: Any) -> Any:
    """A dense column of two or more dimensions as a list of per-sample views; others as they are."""
    import torch

    if isinstance(values, torch.Tensor) and not values.is_nested and values.dim() >= 2:
        return list(values.unbind(0))
    return values


def run(config: BenchConfig) -> dict[str, Any]:
    return run_workload(TransferQueueAdapter(), config, NAME)
