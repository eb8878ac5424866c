"""Where every generation weight lives: one contiguous bucket per dtype for all of them, laid
out stage by stage so that each pipeline stage's weights are one region per dtype (a stage's
region is what the PP broadcast moves)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import ParallelLayout, ParamSpec, generation_local_shape

__all__ = ["BUCKET_ALIGN_BYTES", "BucketPlan", "Placement", "plan_buckets"]

BUCKET_ALIGN_BYTES = 256
"""Every weight starts at a multiple of this many bytes of its bucket."""


@dataclass(slots=True)
class Placement:
    """One generation weight: ``numel`` elements of the ``dtype`` bucket from ``offset``, viewed as ``shape``."""

    dtype: torch.dtype
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(slots=True)
class BucketPlan:
    placements: dict[str, Placement] = field(default_factory=dict)
    """Parameter name -> where its generation weight lives."""
    numel: dict[torch.dtype, int] = field(default_factory=dict)
    """Elements of each dtype's bucket (alignment included)."""
    regions: dict[tuple[int, torch.dtype], tuple[int, int]] = field(default_factory=dict)
    """(stage, dtype) -> (offset, numel) of that stage's part of the bucket."""

    @property
    def nbytes(self) -> int:
        """Bytes of all buckets."""
        return sum(n * d.itemsize for d, n in self.numel.items())

    def stage_regions(self) -> list[tuple[int, torch.dtype, int, int]]:
        """(stage, dtype, offset, numel) of every region, in the order every rank broadcasts them."""
        ordered = sorted(self.regions.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
        return [(stage, dtype, offset, numel) for (stage, dtype), (offset, numel) in ordered]

    def allocate(self, device: torch.device) -> tuple[dict[torch.dtype, torch.Tensor], dict[str, torch.Tensor]]:
        """New (uninitialised) buckets on ``device`` and every weight's view into them."""
        buckets = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in self.numel.items()}
        views = {name: buckets[p.dtype].narrow(0, p.offset, p.numel).view(p.shape)
                 for name, p in self.placements.items()}
        return buckets, views


def plan_buckets(specs: list[ParamSpec], train: ParallelLayout, gen: ParallelLayout) -> BucketPlan:
    """Lay out the generation weights of all ``specs``, stage by stage (``train.pp`` stages)."""
    plan = BucketPlan()
    numel = plan.numel
    for stage in range(train.pp):
        starts = dict(numel)
        for spec in (s for s in specs if s.stage == stage):
            align = max(1, BUCKET_ALIGN_BYTES // spec.dtype.itemsize)
            offset = -(-numel.get(spec.dtype, 0) // align) * align
            shape = generation_local_shape(spec, gen)
            n = 1
            for s in shape:
                n *= s
            plan.placements[spec.name] = Placement(spec.dtype, offset, n, shape)
            numel[spec.dtype] = offset + n
        for dtype, end in numel.items():
            start = starts.get(dtype, 0)
            if end > start:
                plan.regions[(stage, dtype)] = (start, end - start)
    return plan
