"""Values <-> wire: tensors travel as raw bytes, everything else as msgpack.

A column is given as one tensor/array whose first dimension is the sample
axis, or as a sequence with one value per sample. Each sample's value becomes
a `Value` (kind, dtype, shape, offset, nbytes) plus a buffer; `Body` lays the
buffers out back to back, each aligned to `ALIGN` bytes, without copying them.
Nothing is ever pickled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockProtocolError, DockTypeError, DockValueError

ALIGN = 64
_PAD = bytes(ALIGN)

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}
_NAMES = {dt: name for name, dt in DTYPES.items()}
_ITEMSIZE = {name: torch.empty(0, dtype=dt).element_size() for name, dt in DTYPES.items()}


def split_column(name: str, values: Any) -> list[Any]:
    """One value per sample from a column argument."""
    if isinstance(values, torch.Tensor):
        if values.dim() == 0:
            raise DockValueError(
                f"column {name!r}: a single 0-d tensor has no sample axis; pass a list with one value per sample"
            )
        return list(values.unbind(0))
    if isinstance(values, np.ndarray):
        if values.dtype == object:
            return list(values)
        if values.ndim == 0:
            raise DockValueError(f"column {name!r}: a 0-d array has no sample axis; pass a list of values")
        return [_from_numpy(name, v) for v in values]
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        raise DockTypeError(
            f"column {name!r}: expected a list with one value per sample or a tensor/array whose first "
            f"dimension is the sample axis, got {type(values).__name__}"
        )
    return list(values)


def _from_numpy(name: str, arr: np.ndarray) -> torch.Tensor:
    try:
        return torch.from_numpy(np.ascontiguousarray(arr))
    except TypeError as e:
        raise DockTypeError(f"column {name!r}: numpy dtype {arr.dtype} has no torch equivalent ({e})") from None


def _msgpack_default(obj: Any) -> Any:
    """What msgpack cannot pack as it is. Only types that come back as themselves are
    accepted: a tuple or set would come back as a list, so it is refused, not converted."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, set, frozenset)):
        raise TypeError(f"{type(obj).__name__} would come back as a list; pass a list")
    if isinstance(obj, (list, dict, str, bytes, int, float)):  # subclasses (strict_types): their plain base type
        base = next(t for t in (bool, int, float, str, bytes, list, dict) if isinstance(obj, t))
        return base(obj)
    raise TypeError(type(obj).__name__)


def encode_value(column: str, i: int, v: Any) -> tuple[pb.Value, memoryview]:
    """A sample value as (metadata with offset unset, bytes to send)."""
    if isinstance(v, np.ndarray) and v.dtype != object:
        v = _from_numpy(column, v)
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.is_quantized:
            raise DockTypeError(f"column {column!r} sample {i}: only dense tensors can be stored, got layout {v.layout}")
        name = _NAMES.get(v.dtype)
        if name is None:
            raise DockTypeError(f"column {column!r} sample {i}: dtype {v.dtype} is not supported; supported: {sorted(DTYPES)}")
        t = v.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        flat = t.reshape(-1)
        data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        return pb.Value(kind=pb.TENSOR, dtype=name, shape=list(t.shape), nbytes=data.nbytes), data
    try:
        raw = msgpack.packb(v, use_bin_type=True, default=_msgpack_default, strict_types=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise DockTypeError(
            f"column {column!r} sample {i}: cannot store a value of type {type(v).__name__} ({e}); use tensors, "
            "numpy arrays, or str/int/float/bool/None/bytes and lists/dicts of those"
        ) from None
    return pb.Value(kind=pb.MSGPACK, nbytes=len(raw)), memoryview(raw)


class Body:
    """Buffers laid out back to back at ALIGN-byte offsets, kept as a list (no concatenation)."""

    __slots__ = ("buffers", "size")

    def __init__(self) -> None:
        self.buffers: list[memoryview | bytes] = []
        self.size = 0

    def add(self, data: memoryview) -> int:
        pad = -self.size % ALIGN
        if pad:
            self.buffers.append(_PAD[:pad])
            self.size += pad
        off = self.size
        if data.nbytes:
            self.buffers.append(data)
            self.size += data.nbytes
        return off


def batched(values: Any) -> torch.Tensor | None:
    """The column as one tensor whose first dimension is the sample axis, if it is given that way."""
    if isinstance(values, np.ndarray) and values.dtype != object and values.ndim >= 1:
        try:
            values = torch.from_numpy(np.ascontiguousarray(values))
        except TypeError:
            return None  # no torch dtype: the per-value path raises the clear error
    if isinstance(values, torch.Tensor) and values.dim() >= 1 and values.layout == torch.strided and not values.is_quantized:
        return values if values.dtype in _NAMES else None
    return None


def encode_batch(name: str, t: torch.Tensor, body: Body) -> pb.ColumnData | None:
    """A batched tensor column as one buffer (one copy at most, none if contiguous on CPU).

    None when its rows are not whole multiples of ALIGN bytes (they could not all
    be aligned in place): the caller then encodes value by value."""
    n = t.shape[0]
    row = (t.numel() // n if n else 0) * _ITEMSIZE[_NAMES[t.dtype]]
    if n > 1 and row % ALIGN:
        return None
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    base = body.add(data)
    col = pb.ColumnData(name=name)
    dtype, shape = _NAMES[t.dtype], list(t.shape[1:])
    add = col.values.add
    for i in range(n):
        add(kind=pb.TENSOR, dtype=dtype, shape=shape, offset=base + i * row, nbytes=row)
    return col


def encode_columns(columns: dict[str, Any], body: Body) -> list[pb.ColumnData]:
    """Columns given as batched tensors/arrays or as one value per sample."""
    out = []
    for name, values in columns.items():
        t = batched(values)
        col = encode_batch(name, t, body) if t is not None else None
        if col is None:
            col = pb.ColumnData(name=name)
            for i, v in enumerate(split_column(name, values) if t is not None else values):
                meta, data = encode_value(name, i, v)
                meta.offset = body.add(data)
                col.values.append(meta)
        out.append(col)
    return out


def check_value(meta: pb.Value, body_size: int) -> None:
    """Validate a Value against the body it points into (raises DockProtocolError)."""
    if meta.offset + meta.nbytes > body_size:
        raise DockProtocolError(f"value at offset {meta.offset} with {meta.nbytes} bytes runs past the {body_size}-byte body")
    if meta.kind == pb.TENSOR:
        size = _ITEMSIZE.get(meta.dtype)
        if size is None:
            raise DockProtocolError(f"unknown dtype {meta.dtype!r}")
        if any(d < 0 for d in meta.shape) or math.prod(meta.shape) * size != meta.nbytes:
            raise DockProtocolError(f"shape {list(meta.shape)} of {meta.dtype} does not match {meta.nbytes} bytes")
    elif meta.kind != pb.MSGPACK:
        raise DockProtocolError(f"unknown value kind {meta.kind}")


def decode_value(meta: pb.Value, buf, base: int = 0) -> Any:
    """A value from its metadata and the buffer holding bytes [base, ...) of its body or segment.

    `buf` is any writable buffer (a memoryview of the received body, an mmap):
    tensors are zero-copy views of it and keep it alive."""
    off = meta.offset - base
    if meta.kind == pb.MSGPACK:
        return msgpack.unpackb(memoryview(buf)[off : off + meta.nbytes], raw=False, strict_map_key=False)
    dtype = DTYPES[meta.dtype]
    shape = tuple(meta.shape)
    if meta.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype, count=meta.nbytes // _ITEMSIZE[meta.dtype], offset=off)
    return t if len(shape) == 1 else t.view(shape)  # a view costs more than the frombuffer: skip it for 1-D


def decode_run(values: Sequence[pb.Value], buf, base: int = 0) -> list[torch.Tensor] | None:
    """Tensors laid back to back with one dtype and shape, as views of one buffer (one
    frombuffer for the run instead of one per value); None when they are not such a run."""
    first = values[0]
    if len(values) < 4 or first.kind != pb.TENSOR or first.nbytes == 0:
        return None
    step, dtype, shape, seg = first.nbytes, first.dtype, first.shape, first.segment
    off = first.offset
    for v in values:
        if v.offset != off or v.nbytes != step or v.dtype != dtype or v.segment != seg or v.shape != shape:
            return None
        off += step
    t = torch.frombuffer(buf, dtype=DTYPES[dtype], count=len(values) * step // _ITEMSIZE[dtype], offset=first.offset - base)
    return list(t.view(len(values), *shape).unbind(0))

