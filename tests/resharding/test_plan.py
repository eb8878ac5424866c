"""The generation buckets' layout and the phase clock, on their own (no processes)."""

from __future__ import annotations

import torch

from dockd.resharding import ParallelLayout, ParamSpec, generation_local_shape
from dockd.resharding.device import device_of
from dockd.resharding.plan import BUCKET_ALIGN_BYTES, plan_buckets
from dockd.resharding.report import PhaseClock


def _specs() -> list[ParamSpec]:
    return [
        ParamSpec(name="s0.a", shape=(6, 5), dtype=torch.float32, tp_dim=0),
        ParamSpec(name="s0.b", shape=(3,), dtype=torch.bfloat16),
        ParamSpec(name="s0.c", shape=(7,), dtype=torch.float32),
        ParamSpec(name="s1.a", shape=(4, 4), dtype=torch.float32, tp_dim=1, stage=1),
        ParamSpec(name="s1.e", shape=(2, 6), dtype=torch.bfloat16, tp_dim=1, stage=1, experts=4),
    ]


def test_weights_are_aligned_stage_by_stage_and_each_stage_is_one_region_per_dtype() -> None:
    specs, gen = _specs(), ParallelLayout(tp=2)
    plan = plan_buckets(specs, ParallelLayout(tp=2, pp=2), gen)
    for spec in specs:
        p = plan.placements[spec.name]
        assert p.dtype == spec.dtype and p.shape == generation_local_shape(spec, gen)
        assert p.numel == torch.Size(p.shape).numel()
        assert (p.offset * spec.dtype.itemsize) % BUCKET_ALIGN_BYTES == 0
    ends = {d: max(p.offset + p.numel for p in plan.placements.values() if p.dtype == d) for d in plan.numel}
    assert plan.numel == ends
    assert plan.nbytes == sum(n * d.itemsize for d, n in plan.numel.items())
    # stage 0 comes first in every bucket; a stage's region covers exactly its own weights
    assert [(s, d) for s, d, _, _ in plan.stage_regions()] == [
        (0, torch.bfloat16), (0, torch.float32), (1, torch.bfloat16), (1, torch.float32)]
    for stage, dtype, offset, numel in plan.stage_regions():
        mine = [p for s in specs if s.stage == stage and s.dtype == dtype for p in [plan.placements[s.name]]]
        assert offset <= min(p.offset for p in mine)  # (the first weight may start after alignment padding)
        assert offset + numel == max(p.offset + p.numel for p in mine)
        others = [plan.placements[s.name] for s in specs if s.stage != stage and s.dtype == dtype]
        assert all(p.offset + p.numel <= offset or p.offset >= offset + numel for p in others)


def test_allocate_gives_views_into_the_buckets() -> None:
    plan = plan_buckets(_specs(), ParallelLayout(tp=2, pp=2), ParallelLayout(tp=2))
    buckets, views = plan.allocate(torch.device("cpu"))
    assert {d: b.numel() for d, b in buckets.items()} == plan.numel
    for name, view in views.items():
        p = plan.placements[name]
        assert tuple(view.shape) == p.shape
        assert view.data_ptr() == buckets[p.dtype].data_ptr() + p.offset * p.dtype.itemsize


def test_phase_clock_sums_repeated_phases() -> None:
    phases: dict[str, float] = {}
    clock = PhaseClock(device_of([torch.zeros(1)]), phases)
    clock.lap("gather")
    clock.lap("broadcast")
    clock.lap("gather")
    clock.issued("prefetch_issue")
    assert set(phases) == {"gather", "broadcast", "prefetch_issue"}
    assert all(v >= 0 for v in phases.values())
