"""Wire -> values: a reply's runs back into per-sample values (`decode_reply`, `decode_run`), or kept as
`Runs` and turned into one tensor for a whole column (`Runs.stacked`, `Runs.padded`) or cut to some of its
values without a copy (`Runs.cut`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from dockd._lazy import lazy_torch
from dockd._proto import dockd_pb2 as pb
from dockd.codec import dtypes
from dockd.codec.dtypes import DTYPES, ITEMSIZE
from dockd.errors import DockProtocolError

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_torch(globals(), on_load=dtypes.loaded)


def decode_run(run: pb.Run, buf, base: int = 0) -> list[Any]:
    """A run's values, from the buffer holding bytes [base, ...) of its body or segment.

    Tensors are zero-copy views of `buf` (one `frombuffer` per run) and keep it alive."""
    off = run.offset - base
    if run.kind == pb.MSGPACK:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(run.nbytes, 1))
        unpacker.feed(memoryview(buf)[off : off + run.nbytes])
        try:
            return [unpacker.unpack() for _ in range(run.count)]
        except Exception as e:  # msgpack raises ValueError, StackError, OutOfData, ...
            raise DockProtocolError(f"a stored value is not valid msgpack ({type(e).__name__}: {e})") from None
    dtype = DTYPES[run.dtype]
    shape = list(run.shape)
    ragged = bool(shape) and shape[0] == -1
    if run.nbytes == 0:
        dev = buf.device if isinstance(buf, torch.Tensor) else None
        if ragged:
            return [torch.empty((n, *shape[1:]), dtype=dtype, device=dev) for n in run.lengths[:]]
        return [torch.empty(shape, dtype=dtype, device=dev) for _ in range(run.count)]
    flat = _view(buf, dtype, run.nbytes // ITEMSIZE[run.dtype], off)
    if not ragged:
        if run.count == 1:
            return [flat.view(shape) if len(shape) != 1 else flat]
        return list(flat.view(run.count, *shape).unbind(0))
    trail = shape[1:]
    unit = math.prod(trail)
    parts = flat.split([n * unit for n in run.lengths[:]] if unit != 1 else run.lengths[:])
    return [p.view(-1, *trail) for p in parts] if trail else list(parts)


def _view(buf, dtype: torch.dtype, count: int, off: int) -> torch.Tensor:
    """`count` elements at byte `off` of a received buffer, or of a uint8 tensor (device-tier bytes)."""
    if isinstance(buf, torch.Tensor):
        return buf[off : off + count * torch.empty(0, dtype=dtype).element_size()].view(dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=off)


def spans(columns: Sequence[pb.ColumnData], where: str) -> dict[int, tuple[int, int]]:
    """For each buffer k > 0 the runs point into (`where`: "segment" or "device_buffer"), the
    byte range [lo, hi) its runs use."""
    out: dict[int, tuple[int, int]] = {}
    for c in columns:
        for r in c.runs:
            k = getattr(r, where)
            if k:
                lo, hi = out.get(k, (r.offset, r.offset + r.nbytes))
                out[k] = (min(lo, r.offset), max(hi, r.offset + r.nbytes))
    return out


def buffer_key(run: pb.Run) -> int:
    """Where a run's bytes are among a reply's buffers: 0 the body, k a passed segment, -k device buffer k."""
    return -run.device_buffer if run.device_buffer else run.segment


def decode_column(col: pb.ColumnData, buffers: Mapping[int, tuple[Any, int]]) -> list[Any]:
    """A column's values from its runs; `buffers` maps a run's segment (0: the body) to (buffer, base)."""
    return Runs.of(col, buffers).values()


def decode_reply(columns: Sequence[pb.ColumnData], buffers: Mapping[int, tuple[Any, int]], *,
                 lazy: bool = False) -> list[Any]:
    """A reply's column values, decoding what `encode_columns` wrote: `buffers` maps each buffer key
    (`buffer_key`: 0 the body, k a passed segment, -k device buffer k) to (buffer, base); a
    client's transport builds it from what the reply carried (dockd.net.transport). With `lazy`,
    each column stays `Runs` until its values are asked for."""
    try:
        columns = columns[:]  # (a list: see dockd.net.wire)
        if lazy:
            return [Runs.of(c, buffers) for c in columns]
        return [decode_column(c, buffers) for c in columns]
    except KeyError as e:
        raise DockProtocolError(f"a run refers to descriptor {e} that was not passed") from None


class Runs:
    """A received column, not yet split into one object per value: its runs and the buffers
    they live in. `values()` makes the list; `stacked()` and `padded()` build one tensor for
    the whole column without a Python object per value."""

    __slots__ = ("runs", "count")

    def __init__(self, runs: list[tuple[pb.Run, Any, int]]) -> None:
        self.runs = runs
        self.count = sum([r.count for r, _, _ in runs])

    @classmethod
    def of(cls, col: pb.ColumnData, buffers: Mapping[int, tuple[Any, int]]) -> Runs:
        return cls([(run, *buffers[buffer_key(run)]) for run in col.runs[:]])

    def __len__(self) -> int:
        return self.count

    def values(self) -> list[Any]:
        if len(self.runs) == 1:
            return decode_run(*self.runs[0])
        out: list[Any] = []
        for run, buf, base in self.runs:
            out.extend(decode_run(run, buf, base))
        return out

    def cut(self, a: int, b: int) -> Runs | None:
        """Values [a, b) as runs of their own over the same bytes (views: nothing decoded or copied);
        None when a run they touch does not say each value's size."""
        runs, start = [], 0
        for run, buf, base in self.runs:
            lo, hi = max(a - start, 0), min(b - start, run.count)
            start += run.count
            if lo < hi:
                part = cut_run(run, lo, hi)
                if part is None:
                    return None
                runs.append((part, buf, base))
        return Runs(runs)

    def _flat(self) -> tuple[torch.Tensor, list[int], list[int]] | None:
        """(all values' elements back to back, each value's first dimension, the common trailing
        shape) when the column is tensors of one dtype and trailing shape; else None."""
        if not self.runs or any(r.kind != pb.TENSOR for r, _, _ in self.runs):
            return None
        dtypes = {r.dtype for r, _, _ in self.runs}
        trails = {tuple(r.shape[1:]) for r, _, _ in self.runs}
        if len(dtypes) != 1 or len(trails) != 1 or any(not r.shape for r, _, _ in self.runs):
            return None
        dtype = DTYPES[dtypes.pop()]
        trail = list(trails.pop())
        flats: list[torch.Tensor] = []
        lengths: list[int] = []
        for run, buf, base in self.runs:
            n = run.nbytes // ITEMSIZE[run.dtype]
            flats.append(_view(buf, dtype, n, run.offset - base) if n else torch.empty(0, dtype=dtype))
            lengths.extend(run.lengths[:] if run.shape[0] == -1 else [run.shape[0]] * run.count)
        return (flats[0] if len(flats) == 1 else torch.cat(flats)), lengths, trail

    def stacked(self) -> torch.Tensor | None:
        """The column as one [n, *shape] tensor, a zero-copy view, when it came as one run of equal
        shapes; else None (Batch.stacked stacks the values, or says why it cannot)."""
        if len(self.runs) == 1:
            run, buf, base = self.runs[0]
            if run.kind == pb.TENSOR and run.shape and run.shape[0] != -1 and run.nbytes:
                flat = _view(buf, DTYPES[run.dtype], run.nbytes // ITEMSIZE[run.dtype], run.offset - base)
                return flat.view(run.count, *run.shape)
        return None

    def jagged(self) -> torch.Tensor | None:
        """The column as a jagged nested tensor (one values buffer plus offsets); None when it is not
        tensors of one dtype and trailing shape. Its values are a view of the received bytes (a mapped
        segment on the same host, else the reply's body) when the column came as one run; runs of
        several puts or warehouses are concatenated into one buffer (a copy)."""
        rows = self.packed()
        return None if rows is None else jagged_of(*rows)

    def packed(self) -> tuple[torch.Tensor, list[int]] | None:
        """The column's rows back to back ([rows, *trailing]) and each sample's number of rows; None when it
        is not tensors of one dtype and trailing shape. The rows are a view as `jagged`'s values are."""
        flat = self._flat()
        if flat is None:
            return None
        data, lengths, trail = flat
        return (data.view(-1, *trail) if trail else data), lengths

    def padded(self, pad_value: float | int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[n, max_len, *trailing] padded on the right, and the lengths; None when the column is
        not tensors of one dtype and trailing shape. The received bytes are copied once into the
        padded tensor, by one masked assignment (no tensor per value)."""
        flat = self._flat()
        if flat is None:
            return None
        data, lengths, trail = flat
        return padded_of(data.view(-1, *trail) if trail else data, lengths, pad_value)


def cut_run(run: pb.Run, lo: int, hi: int) -> pb.Run | None:
    """Values [lo, hi) of a run as a run of their own over the same bytes; None when the run does not say
    each value's size."""
    if lo == 0 and hi == run.count:
        return run
    shape = run.shape[:]
    ragged = run.kind == pb.MSGPACK or (bool(shape) and shape[0] == -1)
    if run.kind == pb.MSGPACK:
        unit = 1  # (lengths: each value's bytes)
    elif run.dtype not in ITEMSIZE:
        return None
    else:  # a ragged tensor's lengths count rows of its trailing shape
        unit = math.prod(shape[1:] if ragged else shape) * ITEMSIZE[run.dtype]
    if not ragged:
        skip, size = lo * unit, (hi - lo) * unit
        lengths: list[int] = []
    else:
        lengths = run.lengths[:]
        if len(lengths) != run.count:
            return None
        skip, size = sum(lengths[:lo]) * unit, sum(lengths[lo:hi]) * unit
        lengths = lengths[lo:hi]
    return pb.Run(kind=run.kind, count=hi - lo, dtype=run.dtype, shape=shape, lengths=lengths,
                  offset=run.offset + skip, nbytes=size, segment=run.segment, device_buffer=run.device_buffer)


def jagged_of(values: torch.Tensor, lengths: list[int], offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A jagged nested tensor over `values` (rows back to back) with samples of `lengths` rows (`offsets`:
    theirs, made already)."""
    lo, hi = min(lengths, default=0), max(lengths, default=0)
    return _nested(values, offsets_of(lengths, values.device) if offsets is None else offsets, lo, hi)


def offsets_of(lengths: Sequence[int], device: Any) -> torch.Tensor:
    """The n + 1 int64 offsets of samples of `lengths` rows, on `device`."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return torch.from_numpy(offsets).to(device)


_NESTED: list[Any] = []  # torch's NestedTensor class, once looked up (empty: not yet; [None]: not there)


def _nested(values: torch.Tensor, offsets: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """What torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=lo, max_seqlen=hi) makes, built
    as its eager path ends up building it (NestedTensor over the two tensors, the sequence lengths cached the
    way torch caches them) without the dispatch on the way, which costs ~70 us a column (3x the tensor's
    making); torch's own function where that class is not found or will not take the arguments."""
    if not _NESTED:
        try:
            from torch.nested._internal import nested_tensor
        except ImportError:
            _NESTED.append(None)
        else:
            _NESTED.append(getattr(nested_tensor, "NestedTensor", None))
    cls = _NESTED[0]
    if cls is not None and not values.requires_grad:
        try:
            return cls(values, offsets, _metadata_cache={"min_seqlen": torch.empty(lo, 0), "max_seqlen": torch.empty(hi, 0)})
        except (TypeError, AttributeError, RuntimeError):
            _NESTED[0] = None
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=lo, max_seqlen=hi)


def padded_of(values: torch.Tensor, lengths: list[int], pad_value: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `lengths` back to back in `values`, as [n, max_len, *trailing] padded on the right
    (bit-exact for every dtype), and the int64 lengths."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    width = max(lengths, default=0)
    out = torch.full((len(lengths), width, *values.shape[1:]), pad_value, dtype=values.dtype, device=values.device)
    rows = values.reshape(values.shape[0], -1)  # (as bytes: index_put has no kernel for some dtypes)
    if rows.numel():
        mask = (torch.arange(width) < lens[:, None]).to(values.device)
        out.view(len(lengths), width, -1).view(torch.uint8)[mask] = rows.contiguous().view(torch.uint8)
    return out, lens
