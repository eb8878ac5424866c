"""Peer: a Ray-actor replay buffer written the way MindSpeed-RL's TransferDock works.

What the public MindSpeed-RL code does, and what this reproduces:

- one threaded Ray actor per job holds everything;
- each column is a Python list of ragged 1-D CPU tensors, one per sample;
- readiness is one int32 "written" vector per column, and each consumer has
  one int32 "taken" vector;
- ``get_experience(consumer, columns, count)`` samples *randomly* among the
  ready, untaken rows and returns nothing when fewer than ``count`` are
  ready; the caller polls every 0.1 s;
- the tensors travel back to the caller as the actor method's return value,
  that is, serialized through Ray's object store.

Deviation, so puts are measured like dockd's acknowledged puts: each put is
``ray.get``-ed before the next (MindSpeed-RL fires and forgets).
One dock holds one partition (MindSpeed-RL builds a dock per iteration);
``clear`` drops a partition's dock state.

Four-column case: a fresh actor with four columns, each fed as separate
per-sample 4 KiB tensors.

GRPO-shaped case: a fresh actor whose columns are the eight GRPO columns
(the first one is killed; MindSpeed-RL builds its dock with the columns of
the algorithm), fed per-column lists of per-sample values (ragged 1-D
tensors, floats, strings) and read back the same way, every column per get.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..common import BenchConfig
from . import PEERS_INSTALL_HINT
from .workload import COLUMN, PeerAdapter, run_workload

logger = logging.getLogger(__name__)

NAME = "peer_ray_buffer"
TITLE = "Peer: Ray-actor replay buffer (MindSpeed-RL TransferDock style)"

POLL_INTERVAL_S = 0.1
GET_TIMEOUT_S = 60.0


def requirements() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return f"Ray is not installed; install the peers with: {PEERS_INSTALL_HINT}"
    return None


class TransferDockState:
    """The actor's state: per-partition column lists plus written/taken vectors."""

    def __init__(self, columns: list[str], seed: int = 0) -> None:
        import torch

        self._torch = torch
        self.columns = list(columns)
        self.lock = threading.Lock()
        self.gen = torch.Generator().manual_seed(seed)
        self.parts: dict[str, dict[str, Any]] = {}

    def _part(self, partition: str) -> dict[str, Any]:
        p = self.parts.get(partition)
        if p is None:
            torch = self._torch
            p = {
                "data": {c: [] for c in self.columns},
                "written": {c: torch.zeros(0, dtype=torch.int32) for c in self.columns},
                "taken": {},
            }
            self.parts[partition] = p
        return p

    def put_experience(self, partition: str, data: dict[str, list[Any]]) -> list[int]:
        """Append samples (per-column lists of 1-D tensors); return their indexes."""
        torch = self._torch
        with self.lock:
            p = self._part(partition)
            n = len(next(iter(data.values())))
            start = len(p["data"][self.columns[0]])
            for c in self.columns:
                values = data.get(c)
                p["data"][c].extend(values if values is not None else [None] * n)
                flag = torch.ones(n, dtype=torch.int32) if values is not None else torch.zeros(n, dtype=torch.int32)
                p["written"][c] = torch.cat([p["written"][c], flag])
            return list(range(start, start + n))

    def get_experience(
        self, partition: str, consumer: str, columns: list[str], count: int
    ) -> tuple[list[int], dict[str, list[Any]]] | None:
        """Random sample of ``count`` ready, untaken rows, or ``None`` when too few are ready."""
        torch = self._torch
        with self.lock:
            p = self._part(partition)
            total = len(p["data"][self.columns[0]])
            taken = p["taken"].get(consumer)
            if taken is None or taken.numel() < total:
                grown = torch.zeros(total, dtype=torch.int32)
                if taken is not None:
                    grown[: taken.numel()] = taken
                taken = grown
                p["taken"][consumer] = taken
            ready = torch.ones(total, dtype=torch.int32)
            for c in columns:
                ready &= p["written"][c]
            ready &= 1 - taken
            candidates = torch.nonzero(ready, as_tuple=True)[0]
            if candidates.numel() < count:
                return None
            pick = candidates[torch.randperm(candidates.numel(), generator=self.gen)[:count]]
            pick = pick.sort().values
            taken[pick] = 1
            idx = pick.tolist()
            return idx, {c: [p["data"][c][i] for i in idx] for c in columns}

    def clear(self, partition: str) -> None:
        with self.lock:
            self.parts.pop(partition, None)


class RayBufferAdapter(PeerAdapter):
    system = "ray-actor"
    path = None

    def __init__(self) -> None:
        self.actor: Any = None
        self.columns: list[str] = []

    def start(self) -> dict[str, Any]:
        import ray

        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self._new_actor([COLUMN])
        return {"ray": ray.__version__, "actor": "1 threaded actor (max_concurrency=4)", "columns": [COLUMN]}

    def _new_actor(self, columns: list[str]) -> None:
        """One actor whose dock has ``columns`` (the previous one, if any, is killed first)."""
        import ray

        if self.actor is not None:
            ray.kill(self.actor)
        actor_cls = ray.remote(num_cpus=1, max_concurrency=4)(TransferDockState)
        self.actor = actor_cls.remote(list(columns))
        self.columns = list(columns)
        ray.get(self.actor.clear.remote("__ping__"))

    def prepare(self, batch: Any) -> Any:
        # Separate 1-D tensors, one per sample, as a rollout worker hands them over.
        # (Views of one batch tensor would each serialize the whole batch's storage.)
        return [row.clone() for row in batch.unbind(0)]

    def put(self, partition: str, batch: Any) -> None:
        import ray

        ray.get(self.actor.put_experience.remote(partition, {COLUMN: batch}))

    def get(self, partition: str, consumer: str, count: int) -> Any:
        import ray

        deadline = time.monotonic() + GET_TIMEOUT_S
        while True:
            out = ray.get(self.actor.get_experience.remote(partition, consumer, [COLUMN], count))
            if out is not None:
                _, cols = out
                return cols[COLUMN]
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray-actor buffer: {count} samples not ready within {GET_TIMEOUT_S} s")
            time.sleep(POLL_INTERVAL_S)

    def prepare_columns(self, columns: dict[str, Any]) -> Any:
        import torch

        # a dense [B, S] column as separate per-sample tensors, as prepare() does
        return {c: self.prepare(v) if isinstance(v, torch.Tensor) else v for c, v in columns.items()}

    def put_columns(self, partition: str, batch: Any) -> None:
        import ray

        if set(batch) != set(self.columns):
            self._new_actor(list(batch))
        ray.get(self.actor.put_experience.remote(partition, batch))

    def get_columns(self, partition: str, consumer: str, columns: list[str], count: int) -> dict[str, Any]:
        import ray

        deadline = time.monotonic() + GET_TIMEOUT_S
        while True:
            out = ray.get(self.actor.get_experience.remote(partition, consumer, list(columns), count))
            if out is not None:
                return out[1]
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray-actor buffer: {count} samples not ready within {GET_TIMEOUT_S} s")
            time.sleep(POLL_INTERVAL_S)

    def clear(self, partition: str) -> None:
        import ray

        ray.get(self.actor.clear.remote(partition))

    def close(self) -> None:
        import ray

        try:
            if self.actor is not None:
                ray.kill(self.actor)
        finally:
            ray.shutdown()


def run(config: BenchConfig) -> dict[str, Any]:
    return run_workload(RayBufferAdapter(), config, NAME)
