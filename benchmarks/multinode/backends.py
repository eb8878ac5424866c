"""How a node agent's stage workers reach the buffer: dockd (central or distributed) or the Ray actor.

Both backends offer the same four calls to the stage threads: ``put`` new
samples, ``get`` samples for a consumer (blocking until ready), ``clear`` a
partition, ``stats``. dockd: one ``Dock`` per stage worker (separate connections,
as separate worker processes would have); the layout is only the ``warehouse=``
choice: node 0's warehouse for everyone (central), or the default, which is
the warehouse on the writer's own node (distributed). Ray: one driver per
node connected to the raylet in its own namespace, the buffer actor
(``benchmarks.peers.ray_buffer.TransferDockState``) pinned to node 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .workload import COLUMNS

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "dockd-multinode"
RAY_ACTOR = "transfer_dock"
RAY_NODE0_RESOURCE = "dock_node0"
RAY_POLL_S = 0.1  # MindSpeed-RL's consumers poll the TransferDock this often when too few samples are ready


class DockdBackend:
    layout_kinds = ("central", "distributed")

    def __init__(self, controller: str, *, warehouse: int | None, node: int, slots: list[str],
                 prefer_local: bool = False) -> None:
        import dockd

        self.prefer_local = prefer_local
        self.docks: dict[str, Any] = {}
        try:
            for slot in slots:
                self.docks[slot] = dockd.connect(controller, warehouse=warehouse, name=f"node{node}-{slot}")
        except BaseException:
            self.close()
            raise
        self.homes = {slot: d.home for slot, d in self.docks.items()}

    def describe(self) -> dict[str, Any]:
        return {"homes": self.homes, "prefer_local": self.prefer_local}

    def put(self, slot: str, partition: str, columns: dict[str, Any]) -> list[int]:
        return self.docks[slot].put(columns, partition=partition)

    def get(self, slot: str, partition: str, consumer: str, columns: tuple[str, ...], count: int,
            timeout: float) -> tuple[list[int], dict[str, list[Any]]]:
        batch = self.docks[slot].get(consumer, list(columns), count, partition=partition, timeout=timeout,
                                     **({"prefer_local": True} if self.prefer_local else {}))
        return batch.indexes, {c: batch[c] for c in columns}

    def stats(self) -> dict[str, Any]:
        s = self.docks["rollout"].stats()
        return {"warehouses": {str(k): v for k, v in s["warehouses"].items()}, "partitions": s["partitions"]}

    def clear(self, partition: str) -> int:
        return self.docks["rollout"].clear(partition)

    def close(self) -> None:
        for d in self.docks.values():
            try:
                d.close()
            except Exception as e:  # closing must not hide the error that led here
                logger.warning("[agent] closing a dock failed: %s", e)
        self.docks = {}


class RayBackend:
    layout_kinds = ("ray",)

    def __init__(self, head: str, *, node_ip: str, create_actor: bool, max_concurrency: int,
                 timeout: float) -> None:
        import ray

        from ..peers.ray_buffer import TransferDockState

        self.ray = ray
        ray.init(address=head, _node_ip_address=node_ip, namespace=RAY_NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING, configure_logging=False)
        self.created = create_actor
        if create_actor:
            cls = ray.remote(num_cpus=1, max_concurrency=max_concurrency,
                             resources={RAY_NODE0_RESOURCE: 1})(TransferDockState)
            self.actor = cls.options(name=RAY_ACTOR, lifetime="detached").remote(list(COLUMNS))
            ray.get(self.actor.clear.remote("__ping__"), timeout=timeout)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    self.actor = ray.get_actor(RAY_ACTOR, namespace=RAY_NAMESPACE)
                    break
                except ValueError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"the Ray buffer actor {RAY_ACTOR!r} did not appear within {timeout:g}s") from None
                    time.sleep(0.2)
        self.node_id = ray.get_runtime_context().get_node_id()

    def describe(self) -> dict[str, Any]:
        return {"ray_node_id": self.node_id, "created_actor": self.created}

    def put(self, slot: str, partition: str, columns: dict[str, Any]) -> list[int]:
        # one 1-D tensor per sample, as a rollout worker hands them to the TransferDock (views of one batch
        # tensor would each serialize the whole batch's storage)
        rows = {c: [r.clone() for r in t.unbind(0)] for c, t in columns.items()}
        return self.ray.get(self.actor.put_experience.remote(partition, rows))

    def get(self, slot: str, partition: str, consumer: str, columns: tuple[str, ...], count: int,
            timeout: float) -> tuple[list[int], dict[str, list[Any]]]:
        deadline = time.monotonic() + timeout
        while True:
            out = self.ray.get(self.actor.get_experience.remote(partition, consumer, list(columns), count))
            if out is not None:
                idx, values = out
                return list(idx), values
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray buffer: {count} samples for {consumer} not ready within {timeout:g}s")
            time.sleep(RAY_POLL_S)

    def stats(self) -> dict[str, Any]:
        return {}

    def clear(self, partition: str) -> int:
        self.ray.get(self.actor.clear.remote(partition))
        return 0

    def close(self) -> None:
        try:
            if self.created:
                self.ray.kill(self.actor)
        except Exception as e:
            logger.warning("[agent] could not kill the Ray buffer actor: %s", e)
        finally:
            self.ray.shutdown()
