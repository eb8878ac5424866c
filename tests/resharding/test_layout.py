"""Pure tests of specs, layouts, slice plans and the memory model (no processes)."""

from __future__ import annotations

import itertools

import pytest
import torch

import dockd.resharding as rs
from dockd.resharding import LayoutError, ParallelLayout, ParamSpec, plan_reslice, predict_memory, validate_layouts
from dockd.resharding.reference import generation_shard, toy_transformer_specs, training_shard


def test_public_api_is_importable() -> None:
    for name in rs.__all__:
        assert getattr(rs, name) is not None, name
    assert issubclass(rs.LayoutError, ValueError)
    assert issubclass(rs.ReshardStateError, rs.ReshardError)


@pytest.mark.parametrize(
    "blocks,src_tp,dst_tp",
    [
        ((16,), 2, 1), ((16,), 1, 2), ((16,), 4, 2), ((16,), 2, 4), ((24,), 3, 2),
        ((8, 4, 4), 2, 1), ((8, 4, 4), 1, 2), ((8, 4, 4), 4, 2), ((8, 4, 4), 2, 4),
        ((12, 12), 2, 3), ((12, 12), 3, 2), ((16,), 4, 4),
    ],
)
def test_plan_reslice_rebuilds_the_reference_shard(blocks: tuple[int, ...], src_tp: int, dst_tp: int) -> None:
    total = sum(blocks)
    for tp_dim in (0, 1):
        shape = (total, 3) if tp_dim == 0 else (3, total)
        fused = blocks if len(blocks) > 1 else ()
        spec = ParamSpec(name="w", shape=shape, dtype=torch.float32, tp_dim=tp_dim, fused=fused)
        full = torch.randn(shape)
        src_layout = ParallelLayout(tp=src_tp)
        sources = [training_shard(full, spec, src_layout, src_tp, r) for r in range(src_tp)]
        for dst_rank in range(dst_tp):
            want = generation_shard(full, spec, ParallelLayout(tp=dst_tp), dst_rank)
            got = torch.full_like(want, float("nan"))
            for seg in plan_reslice(spec.blocks, src_tp, dst_tp, dst_rank):
                got.narrow(tp_dim, seg.dst_start, seg.length).copy_(
                    sources[seg.src].narrow(tp_dim, seg.src_start, seg.length)
                )
            assert torch.equal(got, want), (blocks, src_tp, dst_tp, dst_rank, tp_dim)


def test_plan_reslice_merges_runs_of_an_unfused_shrink() -> None:
    segs = plan_reslice((16,), 4, 1, 0)
    assert [(s.src, s.src_start, s.dst_start, s.length) for s in segs] == [(r, 0, 4 * r, 4) for r in range(4)]
    # fused blocks cannot be merged across block boundaries
    assert len(plan_reslice((8, 4, 4), 2, 1, 0)) == 6
    assert len(plan_reslice((16,), 1, 4, 3)) == 1


def test_plan_reslice_rejects_indivisible_blocks() -> None:
    with pytest.raises(LayoutError, match="not divisible"):
        plan_reslice((10,), 4, 1, 0)


def test_coords_and_groups_follow_tp_dp_pp_order() -> None:
    layout = ParallelLayout(tp=2, pp=2, ep=2)
    assert layout.dp(8) == 2
    c = layout.coords(7, 8)
    assert (c.tp_rank, c.dp_rank, c.pp_rank, c.ep_rank) == (1, 1, 1, 1)
    c = layout.coords(5, 8)
    assert (c.tp_rank, c.dp_rank, c.pp_rank, c.ep_rank) == (1, 0, 1, 1)
    assert layout.tp_groups(8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups(8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.ep_groups(8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(LayoutError, match="not divisible by tp\\*pp"):
        layout.dp(6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(shape=(8, 4), tp_dim=2), "tp_dim=2 is out of range"),
        (dict(shape=(8, 4), tp_dim=0, fused=(3, 4)), "must be positive and sum to"),
        (dict(shape=(8, 4), fused=(4, 4)), "needs a tp_dim"),
        (dict(shape=(8, 0)), "positive sizes"),
        (dict(shape=(8,), stage=-1), "stage must be >= 0"),
    ],
)
def test_param_spec_validation_says_what_is_wrong(kwargs: dict, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        ParamSpec(name="w", dtype=torch.float32, **kwargs)


def test_parallel_layout_rejects_non_positive_sizes() -> None:
    with pytest.raises(LayoutError, match="ParallelLayout.tp must be a positive int"):
        ParallelLayout(tp=0)


@pytest.mark.parametrize(
    "train,gen,world,match",
    [
        (ParallelLayout(tp=2), ParallelLayout(tp=1, pp=2), 4, "must have pp=1 and ep=1"),
        (ParallelLayout(tp=2), ParallelLayout(tp=4), 6, "generation tp=4 does not divide the world size 6"),
        (ParallelLayout(tp=2), ParallelLayout(tp=3), 6, "block of size 16"),
        (ParallelLayout(tp=2), ParallelLayout(tp=1), 2, "stage 1 >= training pp=1"),
        (ParallelLayout(tp=1, ep=2), ParallelLayout(tp=1), 2, "experts=3 not divisible by training ep=2"),
    ],
)
def test_validate_layouts_lists_problems(train: ParallelLayout, gen: ParallelLayout, world: int, match: str) -> None:
    specs = [ParamSpec(name="w", shape=(16, 4), dtype=torch.float32, tp_dim=0)]
    if "stage 1" in match:
        specs.append(ParamSpec(name="late", shape=(4,), dtype=torch.float32, stage=1))
    if "experts=3" in match:
        specs.append(ParamSpec(name="e", shape=(4, 4), dtype=torch.float32, tp_dim=0, experts=3))
    with pytest.raises(LayoutError, match=match):
        validate_layouts(specs, train, gen, world)


def test_validate_layouts_accepts_the_tested_configurations() -> None:
    specs = toy_transformer_specs(hidden=16, ffn=32, layers=2, vocab=64, kv_hidden=8, experts=4, moe_ffn=8, pp=2)
    for train, gen, world in [
        (ParallelLayout(tp=2, pp=2, ep=2), ParallelLayout(tp=2), 4),
        (ParallelLayout(tp=2, pp=2, ep=2), ParallelLayout(tp=1), 4),
        (ParallelLayout(tp=4, pp=2, ep=4), ParallelLayout(tp=2), 8),
        (ParallelLayout(tp=1, pp=2, ep=2), ParallelLayout(tp=4), 4),  # gen TP wider than a stage
    ]:
        validate_layouts(specs, train, gen, world)


def test_memory_model_matches_hand_count() -> None:
    f32 = torch.float32
    specs = [
        ParamSpec(name="col", shape=(64, 16), dtype=f32, tp_dim=0, stage=0),     # 4096 B
        ParamSpec(name="norm", shape=(16,), dtype=f32, stage=0),                 # 64 B
        ParamSpec(name="row", shape=(16, 64), dtype=f32, tp_dim=1, stage=1),     # 4096 B
        ParamSpec(name="exp", shape=(8, 16), dtype=f32, tp_dim=0, experts=4, stage=1),  # 2048 B
    ]
    train, gen = ParallelLayout(tp=2, pp=2, ep=2), ParallelLayout(tp=2)
    m0 = predict_memory(specs, train, gen, 4, 0)
    m3 = predict_memory(specs, train, gen, 4, 3)
    assert m0.update_bytes == 4096 // 2 + 64
    assert m3.update_bytes == 4096 // 2 + 2048 // 2
    assert m0.generation_bytes == m3.generation_bytes == 4096 // 2 + 64 + 4096 // 2 + 2048 // 2
    assert m0.max_temp_bytes == 4096 and m3.max_temp_bytes == 4096
    assert m3.naive_generation_bytes - m3.swap_generation_bytes == m3.freed_bytes == m3.update_bytes


def test_memory_model_redundancy_is_w_over_tp_pp_for_a_uniform_stack() -> None:
    for tp, pp, gen_tp in itertools.product((1, 2, 4), (1, 2), (1, 2)):
        specs = toy_transformer_specs(hidden=32, ffn=64, layers=4, vocab=128, pp=pp)
        replicated = sum(s.nbytes for s in specs if s.tp_dim is None)
        w = sum(s.nbytes for s in specs)
        world = tp * pp * 2
        freed = sum(predict_memory(specs, ParallelLayout(tp=tp, pp=pp), ParallelLayout(tp=gen_tp), world, r).freed_bytes
                    for r in range(0, world, tp * 2))  # one rank per stage
        # The stages together hold W/TP, plus replicated norms on every TP rank.
        assert freed == (w - replicated) // tp + replicated


def test_gather_chunk_rows_bounds_the_temporary() -> None:
    from dockd.resharding.layout import gather_chunk_rows

    col = ParamSpec(name="c", shape=(64, 16), dtype=torch.float32, tp_dim=0)  # shard 32 rows x 64 B
    row = ParamSpec(name="r", shape=(16, 64), dtype=torch.float32, tp_dim=1)  # shard 16 rows x 128 B
    tp2 = ParallelLayout(tp=2)
    assert gather_chunk_rows(col, tp2, None) == 32
    assert gather_chunk_rows(col, tp2, 256) == 2       # 2 ranks x 2 rows x 64 B
    assert gather_chunk_rows(col, tp2, 1) == 1         # never below one row
    assert gather_chunk_rows(col, tp2, 1 << 30) == 32  # never above the shard
    assert gather_chunk_rows(row, tp2, 1024) == 4
    m = predict_memory([col], tp2, ParallelLayout(tp=1), 2, 0, gather_chunk_bytes=256)
    assert m.max_temp_bytes == 256
    assert predict_memory([col], tp2, ParallelLayout(tp=1), 2, 0, gather_chunk_bytes=None).max_temp_bytes == 4096
