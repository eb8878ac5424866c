"""The host swap on its own, and AllGatherSwap in a one-rank gloo world in process."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dockd.resharding import (
    AllGatherSwap,
    BackendError,
    LayoutError,
    ParallelLayout,
    ReshardConfig,
    ReshardState,
    ReshardStateError,
    detect_device,
)
from dockd.resharding.device import DeviceInfo
from dockd.resharding.reference import build_full_weights, generation_shard, toy_transformer_specs, training_shards
from dockd.resharding.swap import ByteAccountant, HostPool, UpdateWeightSwapper


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _weights() -> dict[str, torch.Tensor]:
    flat = torch.randn(96)
    return {
        "a": flat.narrow(0, 0, 64).view(8, 8),   # two views of one storage
        "b": flat.narrow(0, 64, 32),
        "c": torch.randn(5, 3).to(torch.bfloat16),
        "p": torch.nn.Parameter(torch.randn(7)),
    }


def test_swapper_frees_and_restores_storages_bit_exactly() -> None:
    w = _weights()
    original = {k: _bits(v) for k, v in w.items()}
    acct = ByteAccountant(0)
    swapper = UpdateWeightSwapper(w, DeviceInfo("cpu"), acct, chunk_bytes=40)
    assert len(swapper.slots) == 3  # a and b share a storage
    assert swapper.total_bytes == 96 * 4 + 15 * 2 + 7 * 4
    acct.current = acct.peak = swapper.total_bytes

    pool_ptr = None
    for _ in range(3):
        assert swapper.swap_out() == swapper.total_bytes
        assert acct.current == 0
        assert all(v.untyped_storage().nbytes() == 0 for v in w.values())
        assert swapper.pool is not None and not swapper.pool.pinned
        pool_ptr = pool_ptr or swapper.pool.buffer.data_ptr()
        assert swapper.pool.buffer.data_ptr() == pool_ptr  # one pool, reused
        swapper.swap_in()  # chunk_bytes=40 forces several chunks per storage
        assert acct.current == swapper.total_bytes
        for k, v in w.items():
            assert torch.equal(_bits(v), original[k]), k
    assert w["a"].untyped_storage().data_ptr() == w["b"].untyped_storage().data_ptr()
    assert isinstance(w["p"], torch.nn.Parameter)


def test_swapper_lifecycle_errors() -> None:
    w = {"x": torch.randn(4)}
    swapper = UpdateWeightSwapper(w, DeviceInfo("cpu"), ByteAccountant(16), chunk_bytes=1 << 20)
    with pytest.raises(ReshardStateError, match="already resident"):
        swapper.swap_in()
    swapper.swap_out()
    with pytest.raises(ReshardStateError, match="already swapped out"):
        swapper.swap_out()
    with pytest.raises(ReshardStateError, match="cannot release the host pool"):
        swapper.release_pool()
    assert swapper.start_prefetch() == 16  # CPU: a blocking copy
    assert swapper.resident and not swapper.prefetching


def test_swapper_rejects_storages_it_cannot_free() -> None:
    with pytest.raises(LayoutError, match="non-resizable storage"):
        UpdateWeightSwapper({"np": torch.from_numpy(np.ones(4, dtype=np.float32))}, DeviceInfo("cpu"),
                            ByteAccountant(), chunk_bytes=1024)


def test_host_pool_falls_back_when_pinning_fails(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("pinning works here")
    from dockd.resharding import device as device_mod

    device_mod._logged.discard("pin-failed")
    with caplog.at_level("WARNING", logger="dockd.resharding"):
        pools = [HostPool(64, DeviceInfo("cuda", 0)) for _ in range(2)]
    assert all(not p.pinned and p.buffer.numel() == 64 for p in pools)
    msgs = [r.getMessage() for r in caplog.records if "falling back to pageable" in r.getMessage()]
    assert len(msgs) == 1  # logged once, not per pool


def test_host_pool_on_cpu_falls_back_without_warnings() -> None:
    # pytest turns warnings into errors, so trying pin_memory here would fail.
    pool = HostPool(1024, DeviceInfo("cpu"))
    assert not pool.pinned and pool.buffer.numel() == 1024 and not pool.buffer.is_pinned()


def test_detect_device_on_this_machine() -> None:
    info = detect_device()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert info.type == want
    assert info.backend == {"cpu": "gloo", "cuda": "nccl"}[want]


def test_config_validation() -> None:
    with pytest.raises(LayoutError, match="mode must be 'swap' or 'resident'"):
        ReshardConfig(mode="naive")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="chunk_bytes must be positive"):
        ReshardConfig(chunk_bytes=0)


def test_needs_an_initialised_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    specs = toy_transformer_specs(hidden=8, ffn=16, layers=1, vocab=16)
    shards = training_shards(build_full_weights(specs), specs, ParallelLayout(), 1, 0)
    with pytest.raises(BackendError, match="not initialised"):
        AllGatherSwap(specs, shards, train=ParallelLayout(), gen=ParallelLayout())


@pytest.fixture
def one_rank_world() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_single_rank_cycle_and_state_errors(one_rank_world: None) -> None:
    specs = toy_transformer_specs(hidden=8, ffn=16, layers=2, vocab=16, experts=2, moe_ffn=4)
    full = build_full_weights(specs, seed=3)
    shards = training_shards(full, specs, ParallelLayout(), 1, 0)
    # a transposed (non-contiguous) weight, as a tied or transposed parameter can be
    name = "layers.0.attn.o_proj.weight"
    shards[name] = shards[name].t().contiguous().t()
    assert not shards[name].is_contiguous()
    original = {k: _bits(v) for k, v in shards.items()}
    ags = AllGatherSwap(specs, shards, train=ParallelLayout(), gen=ParallelLayout())
    start = ags.device_bytes
    with pytest.raises(ReshardStateError, match="call enter_generation\\(\\) first"):
        ags.exit_generation()
    weights = ags.enter_generation()
    assert ags.state is ReshardState.GENERATION
    for s in specs:
        assert torch.equal(weights[s.name], generation_shard(full[s.name], s, ParallelLayout(), 0))
    assert ags.device_bytes == ags.generation_bytes
    with pytest.raises(ReshardStateError, match="call exit_generation\\(\\) first"):
        ags.enter_generation()
    ags.close()  # closing during generation brings the weights back
    assert ags.state is ReshardState.CLOSED and ags.device_bytes == start
    assert all(torch.equal(_bits(v), original[k]) for k, v in shards.items())
    with pytest.raises(ReshardStateError, match="was closed"):
        ags.enter_generation()
    ags.close()  # idempotent


def test_rejects_wrong_update_weights(one_rank_world: None) -> None:
    specs = toy_transformer_specs(hidden=8, ffn=16, layers=1, vocab=16)
    shards = training_shards(build_full_weights(specs), specs, ParallelLayout(), 1, 0)
    missing = dict(shards)
    missing.pop("lm_head.weight")
    with pytest.raises(LayoutError, match="missing=\\['lm_head.weight'\\]"):
        AllGatherSwap(specs, missing, train=ParallelLayout(), gen=ParallelLayout())
    bad = dict(shards)
    bad["embed.weight"] = torch.zeros(3, 3)
    with pytest.raises(LayoutError, match="'embed.weight' on rank 0 is \\(3, 3\\)"):
        AllGatherSwap(specs, bad, train=ParallelLayout(), gen=ParallelLayout())


def test_resident_mode_keeps_update_weights_on_device(one_rank_world: None) -> None:
    specs = toy_transformer_specs(hidden=8, ffn=16, layers=1, vocab=16)
    shards = training_shards(build_full_weights(specs), specs, ParallelLayout(), 1, 0)
    with AllGatherSwap(specs, shards, train=ParallelLayout(), gen=ParallelLayout(),
                       config=ReshardConfig(mode="resident")) as ags:
        ags.enter_generation()
        assert ags.device_bytes == ags.update_bytes + ags.generation_bytes
        assert all(t.untyped_storage().nbytes() > 0 for t in shards.values())
        assert ags.last_report is not None and ags.last_report.swapped_out_bytes == 0
        ags.prefetch_update_weights()  # no-op in resident mode
        ags.exit_generation()
        assert ags.device_bytes == ags.update_bytes and ags.host_bytes == 0


def test_rejects_groups_that_disagree_with_the_layout(one_rank_world: None) -> None:
    from dockd.resharding import ReshardGroups

    specs = toy_transformer_specs(hidden=8, ffn=16, layers=1, vocab=16)
    shards = training_shards(build_full_weights(specs), specs, ParallelLayout(), 1, 0)
    groups = ReshardGroups(tp_ranks=[0], pp_ranks=[0], ep_ranks=[3])
    with pytest.raises(LayoutError, match="ep group \\[3\\] does not match training ep=1 for rank 0"):
        AllGatherSwap(specs, shards, train=ParallelLayout(), gen=ParallelLayout(), groups=groups)
    # well-formed user groups are used as given
    ok = ReshardGroups(tp_ranks=[0], pp_ranks=[0], ep_ranks=[0])
    with AllGatherSwap(specs, shards, train=ParallelLayout(), gen=ParallelLayout(), groups=ok) as ags:
        assert ags.groups is ok
        ags.enter_generation()
        ags.exit_generation()


def test_detects_update_weights_moved_to_new_storage(one_rank_world: None) -> None:
    specs = toy_transformer_specs(hidden=8, ffn=16, layers=1, vocab=16)
    params = {k: torch.nn.Parameter(v) for k, v in
              training_shards(build_full_weights(specs), specs, ParallelLayout(), 1, 0).items()}
    with AllGatherSwap(specs, params, train=ParallelLayout(), gen=ParallelLayout()) as ags:
        ags.enter_generation()
        ags.exit_generation()
        with torch.no_grad():
            params["embed.weight"].mul_(2)  # in place: fine
        ags.enter_generation()
        ags.exit_generation()
        params["embed.weight"].data = torch.zeros_like(params["embed.weight"])  # re-pointed
        with pytest.raises(LayoutError, match="'embed.weight' now lives in a different storage"):
            ags.enter_generation()
