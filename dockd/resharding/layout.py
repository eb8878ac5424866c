"""Parameter specs, parallel layouts and the slice arithmetic between them.

Everything here is pure (no collectives, no device memory), so it can be
unit-tested directly.

Rank order
----------
Global ranks are laid out Megatron-style, tensor parallel fastest, then data
parallel, then pipeline parallel::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Within one pipeline stage the ``tp * dp`` ranks are also cut into expert
parallel groups of ``ep`` consecutive ranks (expert tensor parallel is 1 in
training: every expert is held whole by one EP rank).

The generation layout has ``pp == 1`` and ``ep == 1``; its TP rank is
``rank % gen.tp`` and every rank holds every expert, sliced along its TP dim.

Sharding of one parameter
-------------------------
A parameter split by TP along ``tp_dim`` may be *fused*: ``fused=(q, k, v)``
says the dim is the concatenation of three blocks, each of which is split
separately.  TP rank ``r`` of ``T`` holds ``cat_b(block_b[r*n_b/T:(r+1)*n_b/T])``.
Column-parallel weights use ``tp_dim=0``, row-parallel weights ``tp_dim=1``,
vocab-parallel embeddings ``tp_dim=0``; norms, row-parallel biases and routers
are replicated (``tp_dim=None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import LayoutError

__all__ = [
    "DEFAULT_GATHER_CHUNK_BYTES",
    "ParallelLayout",
    "ParamSpec",
    "RankCoords",
    "Segment",
    "gather_chunk_rows",
    "generation_local_shape",
    "plan_reslice",
    "training_local_shape",
    "validate_layouts",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class ParamSpec:
    """One parameter of the model, described by its *full* (unsharded) shape."""

    name: str
    """Key of the parameter in the update-weights dict and in the result."""
    shape: tuple[int, ...]
    """Full logical shape; for expert parameters the shape of ONE expert."""
    dtype: torch.dtype
    """Element type; generation buckets are grouped by it."""
    tp_dim: int | None = None
    """Dim split by tensor parallel (0 = column parallel, 1 = row parallel for
    ``[out, in]`` weights); ``None`` = replicated on every TP rank."""
    fused: tuple[int, ...] = ()
    """Sizes of fused blocks along ``tp_dim`` (e.g. ``(q, k, v)`` rows of a
    QKV weight or ``(ffn, ffn)`` of a gate/up weight); each block is split by
    TP on its own.  Empty = one block."""
    stage: int = 0
    """Training pipeline stage that owns the parameter."""
    experts: int = 0
    """Number of MoE experts (0 for dense parameters).  The full tensor is
    ``[experts, *shape]``; training shards experts over EP, generation keeps
    every expert and splits each along ``tp_dim``."""

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "fused", tuple(int(s) for s in self.fused))
        where = f"ParamSpec {self.name!r}"
        if not self.name:
            raise LayoutError("ParamSpec.name must be a non-empty string")
        if not shape or any(s <= 0 for s in shape):
            raise LayoutError(f"{where}: shape must be non-empty with positive sizes, got {shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"{where}: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(shape):
            raise LayoutError(
                f"{where}: tp_dim={self.tp_dim} is out of range for shape {shape}; "
                f"use 0..{len(shape) - 1}, or None for a replicated parameter"
            )
        if self.fused:
            if self.tp_dim is None:
                raise LayoutError(f"{where}: fused={self.fused} needs a tp_dim to split along")
            if any(s <= 0 for s in self.fused) or sum(self.fused) != shape[self.tp_dim]:
                raise LayoutError(
                    f"{where}: fused block sizes {self.fused} must be positive and sum to "
                    f"shape[{self.tp_dim}]={shape[self.tp_dim]}"
                )
        if self.stage < 0:
            raise LayoutError(f"{where}: stage must be >= 0, got {self.stage}")
        if self.experts < 0:
            raise LayoutError(f"{where}: experts must be >= 0, got {self.experts}")

    @property
    def blocks(self) -> tuple[int, ...]:
        """Block sizes along ``tp_dim`` (one block when not fused)."""
        if self.tp_dim is None:
            return ()
        return self.fused or (self.shape[self.tp_dim],)

    @property
    def numel(self) -> int:
        """Elements of the full parameter (all experts)."""
        n = max(self.experts, 1)
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelLayout:
    """A parallel layout.  Data parallel is implied by the world size."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (must be 1 for the generation layout)."""
    ep: int = 1
    """Expert-parallel size (must be 1 for the generation layout)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"ParallelLayout.{name} must be a positive int, got {value!r}")

    def dp(self, world_size: int) -> int:
        if world_size % (self.tp * self.pp):
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp={self.tp * self.pp} "
                f"(tp={self.tp}, pp={self.pp}); pick sizes whose product divides the world"
            )
        return world_size // (self.tp * self.pp)

    def coords(self, rank: int, world_size: int) -> RankCoords:
        dp = self.dp(world_size)
        if not 0 <= rank < world_size:
            raise LayoutError(f"rank {rank} is outside the world of size {world_size}")
        per_stage = self.tp * dp
        local = rank % per_stage
        return RankCoords(
            rank=rank,
            tp_rank=rank % self.tp,
            dp_rank=local // self.tp,
            pp_rank=rank // per_stage,
            ep_rank=local % self.ep,
        )

    def tp_groups(self, world_size: int) -> list[list[int]]:
        self.dp(world_size)
        return [list(range(s, s + self.tp)) for s in range(0, world_size, self.tp)]

    def pp_groups(self, world_size: int) -> list[list[int]]:
        per_stage = self.tp * self.dp(world_size)
        return [[local + s * per_stage for s in range(self.pp)] for local in range(per_stage)]

    def ep_groups(self, world_size: int) -> list[list[int]]:
        if (self.tp * self.dp(world_size)) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide the ranks per stage (tp*dp)")
        return [list(range(s, s + self.ep)) for s in range(0, world_size, self.ep)]


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Coordinates of one rank in a training layout."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int


@dataclass(frozen=True, slots=True)
class Segment:
    """Copy ``length`` slices along the TP dim from source shard ``src`` at
    ``src_start`` to the destination at ``dst_start``."""

    src: int
    src_start: int
    dst_start: int
    length: int


def plan_reslice(blocks: tuple[int, ...], src_tp: int, dst_tp: int, dst_rank: int) -> list[Segment]:
    """How to build TP shard ``dst_rank`` of ``dst_tp`` from the ``src_tp`` shards.

    Works for shrinking and growing TP and for fused blocks: every block is
    cut into ``src_tp`` source chunks and ``dst_tp`` destination chunks, and the
    destination chunk is assembled from the source chunks it overlaps.
    Adjacent runs are merged, so a non-fused shrink is one segment per source.
    """
    segments: list[Segment] = []
    src_base = 0
    dst_base = 0
    for n in blocks:
        if n % src_tp or n % dst_tp:
            raise LayoutError(f"block of size {n} is not divisible by tp={src_tp} and tp={dst_tp}")
        src_chunk, dst_chunk = n // src_tp, n // dst_tp
        x = dst_rank * dst_chunk
        end = x + dst_chunk
        while x < end:
            src = x // src_chunk
            within = x % src_chunk
            run = min(end - x, src_chunk - within)
            seg = Segment(src, src_base + within, dst_base + x - dst_rank * dst_chunk, run)
            last = segments[-1] if segments else None
            if (
                last is not None
                and last.src == seg.src
                and last.src_start + last.length == seg.src_start
                and last.dst_start + last.length == seg.dst_start
            ):
                segments[-1] = Segment(last.src, last.src_start, last.dst_start, last.length + run)
            else:
                segments.append(seg)
            x += run
        src_base += src_chunk
        dst_base += dst_chunk
    return segments


DEFAULT_GATHER_CHUNK_BYTES = 256 << 20
"""Default bound on one all-gather temporary (see ``ReshardConfig``)."""


def gather_chunk_rows(spec: ParamSpec, train: ParallelLayout, limit: int | None) -> int:
    """Leading rows of a training shard gathered per all-gather so that the
    ``[tp, rows, ...]`` temporary stays within ``limit`` bytes (at least one)."""
    shape = _split_shape(spec, train.tp)
    rows = shape[0]
    if limit is None:
        return rows
    row_bytes = spec.dtype.itemsize
    for s in shape[1:]:
        row_bytes *= s
    return max(1, min(rows, limit // (train.tp * row_bytes)))


def _split_shape(spec: ParamSpec, tp: int) -> tuple[int, ...]:
    if spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] //= tp
    return tuple(shape)


def training_local_shape(spec: ParamSpec, train: ParallelLayout) -> tuple[int, ...]:
    """Shape of this parameter on one rank of its training stage."""
    if spec.experts:
        return (spec.experts // train.ep, *spec.shape)
    return _split_shape(spec, train.tp)


def generation_local_shape(spec: ParamSpec, gen: ParallelLayout) -> tuple[int, ...]:
    """Shape of this parameter on every rank in generation."""
    if spec.experts:
        return (spec.experts, *_split_shape(spec, gen.tp))
    return _split_shape(spec, gen.tp)


@dataclass(slots=True)
class _Problems:
    items: list[str] = field(default_factory=list)

    def add(self, msg: str) -> None:
        self.items.append(msg)


def validate_layouts(
    specs: list[ParamSpec], train: ParallelLayout, gen: ParallelLayout, world_size: int
) -> None:
    """Check that ``specs`` can be resharded from ``train`` to ``gen``.

    Raises :class:`LayoutError` listing every problem found.
    """
    problems = _Problems()
    if gen.pp != 1 or gen.ep != 1:
        problems.add(
            f"generation layout must have pp=1 and ep=1 (experts are split by TP in "
            f"generation), got pp={gen.pp}, ep={gen.ep}"
        )
    dp = train.dp(world_size)
    per_stage = train.tp * dp
    if world_size % gen.tp:
        problems.add(f"generation tp={gen.tp} does not divide the world size {world_size}")
    if per_stage % train.ep:
        problems.add(f"training ep={train.ep} must divide tp*dp={per_stage} (ranks per stage)")
    names: set[str] = set()
    for spec in specs:
        where = f"param {spec.name!r}"
        if spec.name in names:
            problems.add(f"{where}: duplicate name")
        names.add(spec.name)
        if spec.stage >= train.pp:
            problems.add(f"{where}: stage {spec.stage} >= training pp={train.pp}")
        if spec.experts and spec.experts % train.ep:
            problems.add(f"{where}: experts={spec.experts} not divisible by training ep={train.ep}")
        for block in spec.blocks:
            tps = (gen.tp,) if spec.experts else (train.tp, gen.tp)
            for tp in tps:
                if block % tp:
                    problems.add(
                        f"{where}: block of size {block} along dim {spec.tp_dim} is not "
                        f"divisible by tp={tp}"
                    )
    if not specs:
        problems.add("no parameter specs given")
    if problems.items:
        raise LayoutError("invalid resharding layout:\n  - " + "\n  - ".join(problems.items))


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
