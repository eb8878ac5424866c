"""The generation layout on pull: which bytes of a version a tensor-parallel rank needs (pure).

A rollout rank of generation TP size `G` needs, of each tensor split by TP, the slice of its TP
rank (`dockd.resharding.layout.plan_reslice` from one full tensor, TP 1, to `G`: one segment per
fused block along the split dim), and of each replicated tensor all of it. Along dim `d` of a
row-major tensor, a segment of `n` indexes starting at `s` is `outer` runs of `n * inner` bytes,
`size[d] * inner` bytes apart (`outer` = product of the dims before `d`, `inner` = bytes per index
of `d`): one strided range. `plan` turns every tensor's segments into such ranges of its bucket
(cut where a tensor larger than a bucket continues in the next), each with where its bytes go in
the rank's local tensor, so a reader asks its warehouse for exactly those bytes (`WeightsRead`)
and never fetches a whole tensor to cut it.

Which tensors are split, and how, is given per name as a `dockd.resharding.ParamSpec` (its
`tp_dim`, `fused` blocks and `experts`), or by a function of (name, shape) that returns one (or
None: replicated).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import torch

from dockd.errors import DockValueError
from dockd.resharding.layout import ParamSpec, plan_reslice
from dockd.weights.buckets import Piece, dtype_of

Layout: TypeAlias = Mapping[str, ParamSpec] | Callable[[str, tuple[int, ...]], ParamSpec | None]


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """`count` runs of `length` bytes: the i-th at `offset + i * stride` in bucket `bucket`, going to
    `dst + i * dst_stride` in the local tensor's bytes."""

    bucket: int
    offset: int
    length: int
    count: int
    stride: int
    dst: int
    dst_stride: int

    @property
    def nbytes(self) -> int:
        return self.count * self.length


@dataclasses.dataclass(frozen=True, slots=True)
class Slice:
    """One tensor as this rank holds it: its local shape and the ranges its bytes come from."""

    name: str
    dtype: str
    shape: tuple[int, ...]        # local
    full: tuple[int, ...]         # as published
    ranges: tuple[Range, ...]

    @property
    def last_bucket(self) -> int:
        return max((r.bucket for r in self.ranges), default=0)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)


def spec_of(layout: Layout | None, name: str, shape: tuple[int, ...]) -> ParamSpec | None:
    if layout is None:
        return None
    return layout.get(name) if isinstance(layout, Mapping) else layout(name, shape)


def plan(pieces: Sequence[Piece], layout: Layout | None, tp_size: int, tp_rank: int) -> list[Slice]:
    """Every tensor of a version as TP rank `tp_rank` of `tp_size` holds it, in publication order."""
    if not isinstance(tp_size, int) or tp_size < 1 or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise DockValueError(f"tp_rank must be in 0..tp_size-1 and tp_size >= 1, got rank {tp_rank} of {tp_size}")
    by_name: dict[str, list[Piece]] = {}
    for p in pieces:
        by_name.setdefault(p.name, []).append(p)
    out = []
    for name, parts in by_name.items():
        p0 = parts[0]
        spec = spec_of(layout, name, p0.shape)
        out.append(_slice(name, parts, spec, tp_size, tp_rank))
    return out


def _slice(name: str, parts: list[Piece], spec: ParamSpec | None, tp: int, rank: int) -> Slice:
    p0 = parts[0]
    full, size = p0.shape, p0.size
    item = dtype_of(p0.dtype).itemsize
    if spec is None or spec.tp_dim is None or tp == 1:
        return Slice(name, p0.dtype, full, full, tuple(_cut(parts, 0, size, 1, size, 0, size)))
    dim = spec.tp_dim + (1 if spec.experts else 0)
    want = ((spec.experts,) if spec.experts else ()) + tuple(spec.shape)
    if tuple(want) != tuple(full):
        raise DockValueError(f"weight {name!r} was published with shape {full}; its layout says {want}")
    if math.prod(full) * item != size:
        raise DockValueError(f"weight {name!r}: {size} bytes do not match shape {full} of {p0.dtype}")
    outer = math.prod(full[:dim])
    inner = math.prod(full[dim + 1 :]) * item
    local = list(full)
    local[dim] //= tp
    ranges: list[Range] = []
    for seg in plan_reslice(spec.blocks, 1, tp, rank):
        ranges += _cut(parts, seg.src_start * inner, seg.length * inner, outer, full[dim] * inner,
                       seg.dst_start * inner, local[dim] * inner)
    return Slice(name, p0.dtype, tuple(local), full, tuple(ranges))


def _cut(parts: list[Piece], off: int, length: int, count: int, stride: int, dst: int,
         dst_stride: int) -> list[Range]:
    """A strided range of a tensor's bytes as ranges of the buckets holding them (a tensor larger than
    a bucket is in several; a run that crosses from one into the next is cut in two)."""
    out: list[Range] = []
    if length == 0 or count == 0:
        return out
    for p in parts:
        a, b = p.start, p.start + p.nbytes  # this chunk's span of the tensor's bytes
        # runs i whose bytes [off + i*stride, + length) meet [a, b)
        lo = max(0, -(-(a - off - length + 1) // stride)) if stride else 0
        hi = min(count, (b - off - 1) // stride + 1) if stride else count
        i = lo
        while i < hi:
            s = off + i * stride
            if s >= a and s + length <= b:  # whole runs in this chunk: as many as fit, one range
                last = min(hi, (b - off - length) // stride + 1) if stride else hi
                n = max(1, last - i)
                out.append(Range(p.bucket, p.offset + s - a, length, n, stride, dst + i * dst_stride, dst_stride))
                i += n
                continue
            x0, x1 = max(s, a), min(s + length, b)  # a run cut by the chunk's edge: its part in here
            out.append(Range(p.bucket, p.offset + x0 - a, x1 - x0, 1, x1 - x0, dst + i * dst_stride + x0 - s, 0))
            i += 1
    return out


def assemble(sl: Slice, body: torch.Tensor, at: int, into: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The local tensor of `sl` from the reply body's bytes at `at` (its ranges back to back, in order);
    returns it and where the next tensor's bytes start."""
    dt = dtype_of(sl.dtype)
    n = math.prod(sl.shape) * dt.itemsize
    out = into if into is not None else torch.empty(n, dtype=torch.uint8)
    for r in sl.ranges:
        src = body[at : at + r.nbytes].view(r.count, r.length)
        if r.count == 1:
            out[r.dst : r.dst + r.length].copy_(src[0])
        else:
            out.as_strided((r.count, r.length), (r.dst_stride, 1), r.dst).copy_(src)
        at += r.nbytes
    t = out.view(dt).view(sl.shape) if n else torch.empty(sl.shape, dtype=dt)
    return t, at


def reference(tensor: torch.Tensor, spec: ParamSpec | None, tp: int, rank: int) -> torch.Tensor:
    """What TP rank `rank` of `tp` holds of a full tensor, computed directly (chunked per fused block
    with torch): the check the ranges are tested against."""
    if spec is None or spec.tp_dim is None or tp == 1:
        return tensor
    dim = spec.tp_dim + (1 if spec.experts else 0)
    blocks = torch.split(tensor, list(spec.blocks), dim=dim)
    return torch.cat([torch.chunk(b, tp, dim=dim)[rank] for b in blocks], dim=dim)
