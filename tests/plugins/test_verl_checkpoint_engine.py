"""dockd as verl's checkpoint engine (dockd.trainer_plugins.verl.checkpoint_engine), driven as verl's
own checkpoint-engine tests drive theirs: prepare, build_topology, init_process_group, send and receive,
finalize, several rounds, every received weight compared with the rollout's own copy.

The default test runs the engines in this process (two trainer ranks, three rollout ranks). The slow
ones run them in Ray workers (verl's RayWorkerGroup: 2 trainer ranks with rank 0 the master, 6 rollout
ranks) and through verl's CheckpointEngineManager."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

import dockd

pytest.importorskip("verl")
transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # (verl imports Ray's old state API)
    # Ray's local cluster leaves /dev/null handles and Popen objects to the garbage collector
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def tiny_lm(step: int) -> dict[str, torch.Tensor]:
    """A small causal LM built from a transformers config, its weights moved by `step` (a stand-in for
    training): every process that builds it for the same step gets the same tensors."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        return {k: v + 0.01 * step * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in model.state_dict().items()}


def test_the_backend_is_registered_in_verls_registry() -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from dockd.trainer_plugins.verl.checkpoint_engine import DockdCheckpointEngine

    assert CheckpointEngineRegistry.get("dockd") is DockdCheckpointEngine
    from verl.checkpoint_engine.base import CheckpointEngineWithCache

    assert issubclass(DockdCheckpointEngine, CheckpointEngineWithCache)
    with pytest.raises(dockd.DockValueError, match="device"):
        DockdCheckpointEngine(1 << 20, device="tpu")


async def _send(engine: Any, step: int) -> dict:
    return await engine.send_weights(iter(tiny_lm(step).items()), global_steps=step)


async def _receive(engine: Any, step: int, cached: bool = False) -> dict[str, torch.Tensor]:
    got = engine.get_weights() if cached else engine.receive_weights(global_steps=step)
    return {name: t.clone() async for name, t in got}


@pytest.mark.parametrize("delta", [False, True])
def test_engines_in_process_several_rounds(dock_cluster: dockd.LocalCluster, delta: bool) -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import dockd.trainer_plugins.verl.checkpoint_engine  # noqa: F401 - registers "dockd"

    model = f"lm-{uuid.uuid4().hex[:6]}"
    kw = {"bucket_size": 256 << 10, "model": model, "address": dock_cluster.address, "rollout_dtype": None,
          "delta": delta}
    trainers = [CheckpointEngineRegistry.new("dockd", is_master=(r == 0), **kw) for r in range(2)]
    rollouts = [CheckpointEngineRegistry.new("dockd", **kw) for _ in range(3)]
    for step in range(3):
        metadata = [e.prepare() for e in trainers + rollouts]
        actor_kw, rollout_kw = type(trainers[0]).build_topology(2, 3, metadata)
        for i, e in enumerate(trainers):
            e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
        for i, e in enumerate(rollouts):
            e.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})

        async def round_(step: int) -> list[Any]:
            return await asyncio.gather(*(_send(e, step) for e in trainers), *(_receive(e, step) for e in rollouts))

        results = asyncio.run(round_(step))
        assert results[0]["dockd/bytes"] > 0 and results[1] == {}  # only the master published
        assert results[0]["dockd/delta"] == float(delta and step > 0)
        want = tiny_lm(step)
        for got in results[2:]:
            assert list(got) == list(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        for e in trainers + rollouts:
            e.finalize()
    cached = asyncio.run(_receive(rollouts[0], 0, cached=True))  # the newest, from the cache, without waiting
    assert all(torch.equal(cached[k], v) for k, v in tiny_lm(2).items())
    with dockd.connect(dock_cluster.address) as d:
        assert d.weights_reader(model).versions() == ([0, 1, 2] if delta else [1, 2])  # keep=2 (and a delta's base)


# -- Ray workers, as verl's tests/checkpoint_engine drive theirs -----------------------------------------
def _worker_classes() -> tuple[type, type]:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class TrainerWorker(Worker):
        def __init__(self, engine_kwargs: dict) -> None:
            super().__init__()
            import dockd.trainer_plugins.verl.checkpoint_engine  # noqa: F401

            self.checkpoint_engine = CheckpointEngineRegistry.new("dockd", is_master=self.rank == 0, **engine_kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
            return await self.checkpoint_engine.send_weights(iter(tiny_lm(global_steps).items()),
                                                             global_steps=global_steps)

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    class RolloutWorker(Worker):
        def __init__(self, engine_kwargs: dict) -> None:
            super().__init__()
            import dockd.trainer_plugins.verl.checkpoint_engine  # noqa: F401

            self.checkpoint_engine = CheckpointEngineRegistry.new("dockd", **engine_kwargs)
            self.checked: list[int] = []

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int | None = None) -> int:
            own = tiny_lm(global_steps)  # the rollout's own copy of what the trainer sends
            n = 0
            async for name, t in self.checkpoint_engine.receive_weights(global_steps=global_steps):
                assert t.dtype == own[name].dtype and torch.equal(t, own[name]), name
                n += 1
            assert n == len(own)
            self.checked.append(global_steps)
            return n

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

        # (what CheckpointEngineManager asks of a rollout replica's workers)
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def checked_steps(self) -> list[int]:
            return self.checked

    return TrainerWorker, RolloutWorker


@pytest.fixture(scope="module")
def ray_cluster(dock_cluster: dockd.LocalCluster) -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    env = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "DOCKD_ADDRESS": dock_cluster.address}
    with mock.patch.dict(os.environ, env):
        # the worker classes and tiny_lm travel by value: the workers cannot import this test module
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"DOCKD_ADDRESS": dock_cluster.address}})
        yield ray
        ray.shutdown()


def _groups(ray: Any, model: str) -> tuple[Any, Any]:
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    trainer_cls, rollout_cls = _worker_classes()
    kw = {"bucket_size": 256 << 10, "model": model, "rollout_dtype": None}
    trainer = RayWorkerGroup(resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1),
                             ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(trainer_cls), engine_kwargs=kw))
    rollout = RayWorkerGroup(resource_pool=RayResourcePool(process_on_nodes=[6], use_gpu=False, max_colocate_count=1),
                             ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(rollout_cls), engine_kwargs=kw))
    return trainer, rollout


@pytest.fixture(scope="module")
def worker_groups(ray_cluster: Any) -> tuple[Any, Any]:
    return _groups(ray_cluster, f"lm-{uuid.uuid4().hex[:6]}")


@pytest.mark.slow
def test_ray_workers_2_trainers_6_rollouts_several_rounds(ray_cluster: Any, worker_groups: tuple[Any, Any]) -> None:
    from dockd.trainer_plugins.verl.checkpoint_engine import DockdCheckpointEngine

    ray = ray_cluster
    trainer, rollout = worker_groups
    assert (trainer.world_size, rollout.world_size) == (2, 6)
    n = len(tiny_lm(0))
    for step in range(3):
        metadata = ray.get(trainer.execute_checkpoint_engine(["prepare"] * 2)
                           + rollout.execute_checkpoint_engine(["prepare"] * 6))
        trainer_kw, rollout_kw = DockdCheckpointEngine.build_topology(2, 6, metadata)
        ray.get(trainer.execute_checkpoint_engine(["init_process_group"] * 2, **trainer_kw)
                + rollout.execute_checkpoint_engine(["init_process_group"] * 6, **rollout_kw))
        out = ray.get(trainer.update_weights(global_steps=step) + rollout.update_weights(global_steps=step))
        assert out[0]["dockd/bytes"] > 0 and out[1] == {} and out[2:] == [n] * 6
        ray.get(trainer.execute_checkpoint_engine(["finalize"] * 2) + rollout.execute_checkpoint_engine(["finalize"] * 6))


class _Replica:
    """What CheckpointEngineManager asks of a rollout replica, for replicas with no inference server:
    its workers, and the calls around a weight update (counted)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.calls: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.calls.append("abort")

    async def release_kv_cache(self) -> None:
        self.calls.append("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        self.calls.append("resume_kv_cache")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


@pytest.mark.slow
def test_through_verls_checkpoint_engine_manager(ray_cluster: Any, worker_groups: tuple[Any, Any]) -> None:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    ray = ray_cluster
    trainer, rollout = worker_groups
    replicas = [_Replica(rollout.workers[:3]), _Replica(rollout.workers[3:])]
    config = CheckpointEngineConfig(backend="dockd",
                                    custom_backend_module="dockd.trainer_plugins.verl.checkpoint_engine")
    manager = CheckpointEngineManager(config, trainer, replicas)  # type: ignore[arg-type]
    for step in (10, 11):
        metrics = manager.update_weights(global_steps=step)
        assert metrics["dockd/bytes"] > 0
    assert replicas[0].calls == ["abort", "release_kv_cache", "resume_kv_cache", "resume"] * 2
    checked = ray.get([w.checked_steps.remote() for w in rollout.workers])
    assert all(c[-2:] == [10, 11] for c in checked)  # every rollout rank compared both versions with its own copy
