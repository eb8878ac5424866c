"""dockd as verl's checkpoint engine: importing this module registers the backend ``"dockd"`` in
verl's ``CheckpointEngineRegistry`` (verl 0.9).

The trainer's master rank publishes each update as a version of the model in the dock
(`dockd.weights`): buckets put to its own node's warehouse, then the ready fence. Rollout ranks
read the version through the dock; a version is visible only once complete, the dock keeps
the newest `keep`, and `get_weights` reads the newest complete one again without waiting (the
local cache of ``CheckpointEngineWithCache``). Configure verl with::

    actor_rollout_ref.rollout.checkpoint_engine.backend=dockd
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=dockd.trainer_plugins.verl.checkpoint_engine
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dockd.model=policy    # optional

The dock is found from ``address=`` (an engine kwarg), else ``DOCKD_ADDRESS``, else the dock
`dockd.ray` runs on the Ray cluster (`dockd.ray.launch()`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import torch

import dockd
from dockd.config import env
from dockd.errors import DockValueError
from dockd.weights import DEFAULT_HOLD_S, DEFAULT_KEEP, Publisher, Settings, WeightsReader

try:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWithCache
except ImportError as e:  # pragma: no cover - exercised only without verl
    raise ImportError("dockd.trainer_plugins.verl.checkpoint_engine needs verl 0.9 "
                      "(pip install -e '.[verl]' from the dockd checkout)") from e

logger = logging.getLogger(__name__)

ENV_ADDRESS = "DOCKD_ADDRESS"
DEVICES = ("cpu", "cuda", "npu")


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise DockValueError(f"rollout_dtype must be a torch dtype or its name (e.g. 'bfloat16'), got {value!r}")
    return dt


def connect(address: str | None) -> dockd.Dock:
    """The dock: `address`, else $DOCKD_ADDRESS, else the one `dockd.ray` runs on this Ray cluster."""
    address = address or env(ENV_ADDRESS) or None
    if address is not None:
        return dockd.connect(address)
    from dockd import ray as dockd_ray

    return dockd_ray.connect()


async def _items(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """A sync or async iterable of (name, tensor), walked on the event loop (producing a weight may be
    collective over the trainer's ranks)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _check_device(device: str) -> None:
    """A device the rollout cannot use fails here, naming what is missing (not at the first weight)."""
    if device == "npu":
        try:
            import torch_npu  # noqa: F401 - registers torch.npu
        except ImportError:
            raise DockValueError("device='npu' needs torch_npu (Ascend); install it or use 'cpu'") from None
    if device != "cpu" and not getattr(torch, device).is_available():
        raise DockValueError(f"device={device!r}: no {device} device is available in this process")


@CheckpointEngineRegistry.register("dockd")
class DockdCheckpointEngine(CheckpointEngineWithCache):
    """verl checkpoint engine over a dockd dock (`CheckpointEngineWithCache`).

    Args:
        bucket_size: bytes per bucket (verl passes update_weights_bucket_megabytes << 20).
        is_master: the trainer rank that publishes (verl passes rank 0); other trainer ranks only
            walk the weights generator, rollout ranks read.
        device: where received tensors go: "cpu" (views of what was read), "cuda" or "npu".
        rollout_dtype: floating weights are published in this dtype (None: as they are).
        model: the model's name in the dock (one publisher per name).
        keep: versions kept; hold: seconds a rollout that has not read a version holds it back.
        address: the dock's controller (default $DOCKD_ADDRESS, else `dockd.ray`).
        timeout: seconds a put may wait for room, and a rollout for the version it asks for (None: no bound).
        delta: publish each update as the difference to the one before (sparse where smaller), but
            every `full_every`-th; rollouts rebuild the weights bit-exactly.
        fanout: warehouses each holder relays a version to (1: a chain).
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, device: str = "cpu",
                 rollout_dtype: torch.dtype | str | None = torch.bfloat16, model: str = "verl",
                 keep: int = DEFAULT_KEEP, hold: float = DEFAULT_HOLD_S, address: str | None = None,
                 timeout: float | None = None, delta: bool = False, full_every: int = 16, fanout: int = 1) -> None:
        if device not in DEVICES:
            raise DockValueError(f"device must be one of {DEVICES}, got {device!r}")
        _check_device(device)
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.device = device
        self.rollout_dtype = _dtype(rollout_dtype)
        self.model, self.address = model, address
        self.timeout = timeout
        self.settings = Settings(bucket_size=self.bucket_size, keep=keep, hold=hold, timeout=timeout,
                                 dtype=self.rollout_dtype, fanout=fanout)
        self.delta, self.full_every = delta, full_every
        self.publisher: Publisher | None = None
        self.dock: dockd.Dock | None = None
        self.reader: WeightsReader | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self.version: int | None = None  # the version last published (master) or received (rollout)

    # -- topology ---------------------------------------------------------------------------------
    def _dock(self) -> dockd.Dock:
        if self.dock is None:
            self.dock = connect(self.address)
        return self.dock

    def prepare(self) -> dict[str, Any]:
        dock = self._dock()
        return {"address": dock.address, "warehouse": dock.home, "is_master": self.is_master}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The master trainer rank is rank 0 (it publishes), the others -1 (they only walk the
        generator), rollout ranks 1..n (they read). No group is formed: the dock is the medium."""
        masters = [i for i in range(actor_wg_world_size) if metadata[i].get("is_master")]
        if len(masters) != 1:
            raise DockValueError(f"exactly one trainer rank publishes (is_master=True); got {len(masters)} of "
                                 f"{actor_wg_world_size}")
        master = metadata[masters[0]]
        world = rollout_world_size + 1
        actor: dict[str, list[Any]] = {"rank": [0 if i == masters[0] else -1 for i in range(actor_wg_world_size)],
                 "world_size": [world] * actor_wg_world_size, "master_metadata": [master] * actor_wg_world_size}
        rollout: dict[str, list[Any]] = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master_metadata": [master] * rollout_world_size}
        return actor, rollout

    # (verl's engines all narrow the base class's **kwargs, and its annotations of the receiving side
    # say coroutine where its engines, and its callers, use async generators)
    def init_process_group(self, rank: int, world_size: int,  # type: ignore[override]
                           master_metadata: dict[str, Any]) -> None:
        self.rank, self.world_size = rank, world_size
        if self.dock is None and self.address is None and not env(ENV_ADDRESS):
            self.address = master_metadata["address"]  # (a rollout without a setting of its own: the master's dock)
        if rank > 0 and self.reader is None:
            self.reader = WeightsReader(self._dock(), self.model)

    def finalize(self) -> None:
        """Nothing to free: buckets live in the dock (the master's bucket buffer goes with its send)."""

    # -- the trainer ------------------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        if self.rank is not None and self.rank < 0 or (self.rank is None and not self.is_master):
            async for _ in _items(weights):  # (producing the weights is collective over the trainer ranks)
                pass
            return {}
        if self.publisher is None:
            self.publisher = Publisher(self._dock(), self.model, delta=self.delta, full_every=self.full_every,
                                       **dataclasses.asdict(self.settings))
        publisher = self.publisher
        version = global_steps if global_steps is not None else (None if self.version is None else self.version + 1)
        pub = await asyncio.to_thread(publisher.begin, version)
        async for name, tensor in _items(weights):
            await asyncio.to_thread(pub.add, name, tensor)
        done = await asyncio.to_thread(publisher.finish, pub)
        self.version = done.version
        logger.info("[verl] published model=%s version=%d buckets=%d bytes=%d in %.2fs", self.model, done.version,
                    done.buckets, done.stored, done.seconds)
        return {"dockd/publish_s": done.seconds, "dockd/bytes": float(done.stored),
                "dockd/delta": float(done.base is not None)}

    # -- the rollout ------------------------------------------------------------------------------
    def _reader(self) -> WeightsReader:
        if self.reader is None:
            self.reader = WeightsReader(self._dock(), self.model)
        return self.reader

    async def receive_weights(  # type: ignore[override]
            self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """(name, tensor) of version `global_steps` (waiting for it), or of the newest version newer
        than the last one received (the newest there is, the first time)."""
        reader = self._reader()
        if global_steps is not None:
            opening = asyncio.to_thread(reader.open, global_steps, timeout=self.timeout)
        elif self.version is not None:
            opening = asyncio.to_thread(reader.open, after=self.version, timeout=self.timeout)
        else:
            opening = asyncio.to_thread(reader.open, timeout=self.timeout)
        reading = await opening
        async for item in self._tensors(reading):
            yield item
        self.version = reading.version

    async def get_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:  # type: ignore[override]
        """(name, tensor) of the newest complete version in the dock, without waiting for a new one
        (waiting only while there is none at all)."""
        reading = await asyncio.to_thread(self._reader().open, timeout=self.timeout)
        async for item in self._tensors(reading):
            yield item

    async def _tensors(self, reading: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
        buckets: Iterator[tuple[int, torch.Tensor]] = reading.buckets()
        while True:
            got = await asyncio.to_thread(next, buckets, None)
            if got is None:
                break
            b, data = got
            for name, tensor in reading.tensors_of(b, data):
                yield name, tensor if self.device == "cpu" else tensor.to(self.device, non_blocking=True)
        if self.device != "cpu":
            getattr(torch, self.device).synchronize()
