"""Values -> wire: a put's columns as runs (`encode_columns`), their bytes into a `Body`; columns of
tensors left on their device for put(device="keep") (`device_column`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np

from dockd._lazy import lazy_torch
from dockd._proto import dockd_pb2 as pb
from dockd.codec import dtypes
from dockd.codec.body import Body, Joined, as_bytes, cat_into
from dockd.codec.dtypes import DTYPES, NAMES
from dockd.errors import DockTypeError, DockValueError

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_torch(globals(), on_load=dtypes.loaded)

_CAT_BELOW = 1 << 20  # runs of smaller values are packed with one concatenation; larger ones go as they are


def batched(values: Any) -> torch.Tensor | None:
    """The column as one tensor whose first dimension is the sample axis, if it is given that way."""
    if isinstance(values, np.ndarray) and values.dtype != object and values.ndim >= 1:
        try:
            values = torch.from_numpy(np.ascontiguousarray(values))
        except TypeError:
            return None  # no torch dtype: the per-value path raises the clear error
    if isinstance(values, torch.Tensor) and values.dim() >= 1 and values.layout == torch.strided and not values.is_quantized:
        return values if values.dtype in NAMES else None
    return None


class Jagged(NamedTuple):
    """A ragged column as one buffer: `values` holds every sample's rows back to back (first
    dimension: the rows, the rest: the trailing shape all samples share), `offsets` the n + 1
    row offsets (int, non-decreasing). Sample i is values[offsets[i]:offsets[i + 1]]. A jagged
    nested tensor (torch.nested, layout=torch.jagged) is the same thing; either is stored as one run."""

    values: Any
    offsets: Any


def jagged(column: str, values: Any) -> Jagged | None:
    """The column as (values, offsets) when it is given as a `Jagged` pair or a jagged nested tensor
    without holes (checked per column, not per value, with numpy on the n + 1 offsets); None for any
    other column."""
    if type(values) is Jagged:
        flat, offsets = values
    elif (parts := _nested_parts(values)) is not None:
        flat, offsets = parts
    else:
        return None
    if not isinstance(flat, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        raise DockTypeError(f"column {column!r}: a Jagged column is (values, offsets), two tensors; got "
                            f"({type(flat).__name__}, {type(offsets).__name__})")
    if flat.dim() < 1 or flat.layout != torch.strided or flat.is_quantized or flat.dtype not in NAMES:
        raise DockTypeError(f"column {column!r}: jagged values must be a dense tensor of at least one dimension "
                            f"with a supported dtype ({sorted(DTYPES)}), got {flat.dtype} {tuple(flat.shape)}")
    _has_data(column, flat)
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.dtype.is_floating_point or offsets.dtype.is_complex \
            or offsets.dtype == torch.bool:
        raise DockValueError(f"column {column!r}: jagged offsets must be a 1-D integer tensor of n + 1 >= 2 "
                             f"entries, got {offsets.dtype} {tuple(offsets.shape)}")
    offsets = offsets.detach().to("cpu", torch.int64)
    o = offsets.numpy()
    first, last = int(o[0]), int(o[-1])
    if first < 0 or last > flat.shape[0] or (o[1:] < o[:-1]).any():
        raise DockValueError(f"column {column!r}: jagged offsets must be non-decreasing within the "
                             f"{flat.shape[0]} rows of the values, from {first} to {last}")
    return Jagged(flat.detach()[first:last] if first or last != flat.shape[0] else flat.detach(), offsets)


def _nested_parts(t: Any) -> tuple[Any, Any] | None:
    """(values, offsets) of a jagged nested tensor without holes (ragged in dimension 1), else None. Read
    off its fields where torch keeps them (`NestedTensor._values`, ...): its public accessors (`values()`,
    `layout`, ...) each go through torch's dispatch, 10-30 us apiece, the most of a jagged put's encoding."""
    if not isinstance(t, torch.Tensor) or type(t) is torch.Tensor:
        return None  # (a plain tensor, or something else: not a jagged nested tensor)
    fields: tuple[Any, Any, Any, Any]
    try:
        fields = t._values, t._offsets, t._lengths, t._ragged_idx  # type: ignore[attr-defined]
    except AttributeError:  # (another tensor subclass, or a torch that keeps them otherwise)
        if not t.is_nested or t.layout != torch.jagged:
            return None
        fields = t.values(), t.offsets(), t.lengths(), t._ragged_idx  # type: ignore[attr-defined]
    values, offsets, lengths, ragged_idx = fields
    return (values, offsets) if lengths is None and ragged_idx == 1 else None


def lengths_of(offsets: torch.Tensor) -> list[int]:
    """Each sample's rows from n + 1 int64 CPU offsets (a ragged run's `lengths`)."""
    o = offsets.numpy()
    return (o[1:] - o[:-1]).tolist()  # (np.diff's wrapper costs more than the subtraction)


def _has_data(column: str, t: torch.Tensor, sample: int | None = None) -> torch.Tensor:
    """`t`, unless it is on the meta device (a shape without data, as models are built before their
    weights load): refused naming the column."""
    if t.is_meta:
        which = f"column {column!r}" + (f" sample {sample}" if sample is not None else "")
        raise DockValueError(f"{which}: a tensor on the meta device holds no data, only a shape ({tuple(t.shape)}); "
                             "fill it first, e.g. torch.zeros_like(t, device='cpu'), or put the tensor that holds "
                             "the values")
    return t


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def _as_tensor(column: str, i: int, v: Any) -> torch.Tensor | None:
    """A value as a dense CPU-able tensor, None for a msgpack value; refuses what cannot be stored."""
    if isinstance(v, np.ndarray) and v.dtype != object:
        try:
            v = torch.from_numpy(np.ascontiguousarray(v))
        except TypeError as e:
            raise DockTypeError(f"column {column!r} sample {i}: numpy dtype {v.dtype} has no torch equivalent ({e})") from None
    if not isinstance(v, torch.Tensor):
        return None
    if v.layout != torch.strided or v.is_quantized:
        raise DockTypeError(f"column {column!r} sample {i}: only dense tensors can be stored, got layout {v.layout}")
    if v.dtype not in NAMES:
        raise DockTypeError(f"column {column!r} sample {i}: dtype {v.dtype} is not supported; supported: {sorted(DTYPES)}")
    return _has_data(column, v, i)


def split_column(name: str, values: Any) -> Sequence[Any]:
    """One value per sample from a column argument given per sample (or a tensor to unbind)."""
    if isinstance(values, torch.Tensor):
        if values.dim() == 0:
            raise DockValueError(
                f"column {name!r}: a single 0-d tensor has no sample axis; pass a list with one value per sample"
            )
        return values.unbind(0)
    if isinstance(values, np.ndarray):
        if values.ndim == 0:
            raise DockValueError(f"column {name!r}: a 0-d array has no sample axis; pass a list of values")
        return list(values)
    if type(values) is list:  # (the common case, without the Sequence ABC's check)
        return values
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        raise DockTypeError(
            f"column {name!r}: expected a list with one value per sample or a tensor/array whose first "
            f"dimension is the sample axis, got {type(values).__name__}"
        )
    return values


def encode_columns(columns: Mapping[str, Any], body: Body, into: Any = None) -> list[pb.ColumnData]:
    """Columns (batched tensors/arrays, or one value per sample) as runs; their bytes go to `body`. With
    `into` (a request's repeated ColumnData field) each column is made in place there (a message
    extended with built columns copies them: ~0.7 us a column)."""
    out = []
    for name, values in columns.items():
        col = pb.ColumnData(name=name) if into is None else into.add(name=name)
        t = batched(values)
        if t is not None:
            _tensor_run(col, [t], body, batched=True)
        elif type(values) is Jagged:
            _jagged_run(col, values, body)
        else:
            _runs(col, name, split_column(name, values), body)
        out.append(col)
    return out


def _jagged_run(col: pb.ColumnData, values: Jagged, body: Body) -> None:
    """A jagged column (see `jagged`): one ragged run over its values buffer, as it is (made contiguous on
    the host): the body's only copy of it is the one into the staging buffer or the socket."""
    flat = _cpu(values.values)
    run = col.runs.add(kind=pb.TENSOR, count=values.offsets.numel() - 1, dtype=NAMES[flat.dtype],
                       shape=[-1, *flat.shape[1:]], lengths=lengths_of(values.offsets))
    data = as_bytes(flat)
    run.offset, run.nbytes = body.add(data), data.nbytes


def device_column(name: str, values: Any, keep: Any) -> tuple[pb.ColumnData, torch.Tensor] | None:
    """put(device="keep"): a column of tensors for which `keep(tensor)` holds, as one run over one
    tensor left where it is (a batched tensor as it is, made contiguous; per-sample tensors of one
    dtype and trailing shape concatenated on their device; a jagged column's values). None: the column
    goes to the body."""
    if type(values) is Jagged:
        if not keep(values.values):
            return None
        col = pb.ColumnData(name=name)
        t = values.values.contiguous()
        col.runs.add(kind=pb.TENSOR, count=values.offsets.numel() - 1, dtype=NAMES[t.dtype], shape=[-1, *t.shape[1:]],
                     lengths=lengths_of(values.offsets), nbytes=t.numel() * t.element_size())
        return col, t
    t = batched(values)
    if t is not None:
        if not keep(t):
            return None
        t = t.detach().contiguous()
        col = pb.ColumnData(name=name)
        col.runs.add(kind=pb.TENSOR, count=t.shape[0], dtype=NAMES[t.dtype], shape=list(t.shape[1:]),
                     nbytes=t.numel() * t.element_size())
        return col, t
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence) or not values:
        return None
    if not all(type(v) is torch.Tensor for v in values):
        return None
    first = values[0]
    if first.dim() == 0 or first.dtype not in NAMES or first.layout != torch.strided or not keep(first):
        return None
    if {(v.dtype, v.device, tuple(v.shape[1:])) for v in values} != {(first.dtype, first.device, tuple(first.shape[1:]))}:
        return None
    col = pb.ColumnData(name=name)
    run = col.runs.add(kind=pb.TENSOR, count=len(values), dtype=NAMES[first.dtype])
    if len({v.shape[0] for v in values}) == 1:
        run.shape.extend(first.shape)
    else:
        run.shape.extend([-1, *first.shape[1:]])
        run.lengths.extend(v.shape[0] for v in values)
    flat = torch.cat([v.detach().reshape(-1) for v in values])
    run.nbytes = flat.numel() * flat.element_size()
    return col, flat


_PLAIN = frozenset((str, int, float, bool, bytes, type(None)))


def _runs(col: pb.ColumnData, name: str, values: Sequence[Any], body: Body) -> None:
    """Split per-sample values into runs: tensors of one dtype and trailing shape, or msgpack values."""
    if _one_ragged_run(col, values, body):
        return
    kinds = set(map(type, values))
    if kinds <= _PLAIN:  # (scalars: one msgpack run, without looking for tensors)
        _msgpack_run(col, name, values if type(values) is list else list(values), 0, body, kinds)
        return
    start = 0
    key: tuple = ()  # (no value's key is (): the first value starts the first group)
    group: list[Any] = []
    for i, v in enumerate(values):
        t = _as_tensor(name, i, v)
        k = ("msgpack",) if t is None else (t.dtype, t.shape[1:] if t.dim() else None)
        if k != key and group:
            _flush(col, name, key, group, start, body)
            group, start = [], i
        key = k
        group.append(v if t is None else t)
    if group:
        _flush(col, name, key, group, start, body)


def _one_ragged_run(col: pb.ColumnData, values: Sequence[Any], body: Body) -> bool:
    """The common case: 1-D tensors of one dtype (token ids, log-probs, masks), checked in one pass
    that reads each value's header once. Their bytes join the body as one `Joined` part. False when
    the column is anything else."""
    tensor = torch.Tensor
    if not values or type(first := values[0]) is not tensor:
        return False
    dtype = first.dtype
    if dtype not in NAMES or first.layout != torch.strided or first.is_quantized:
        return False
    lengths: list[int] = []
    on_cpu = True
    for v in values:
        if type(v) is not tensor or v.dtype is not dtype or v.ndim != 1:
            return False
        lengths.append(v.numel())  # (its length: the value is 1-D)
        on_cpu = on_cpu and v.is_cpu
    run = col.runs.add(kind=pb.TENSOR, count=len(values), dtype=NAMES[dtype], shape=[-1], lengths=lengths)
    if on_cpu:
        nbytes = sum(lengths) * first.element_size()
        run.offset, run.nbytes = body.add(Joined(list(values), lengths, first.dtype, nbytes)), nbytes
    else:  # (accelerator tensors: joined there, then one copy to the host)
        for i, v in enumerate(values):
            _has_data(col.name, v, i)
        data = as_bytes(torch.cat(list(values)).detach().cpu())
        run.offset, run.nbytes = body.add(data), data.nbytes
    return True


def _flush(col: pb.ColumnData, name: str, key: tuple, group: list[Any], start: int, body: Body) -> None:
    if key[0] == "msgpack":
        _msgpack_run(col, name, group, start, body)
    else:
        _tensor_run(col, group, body, batched=False)


def _tensor_run(col: pb.ColumnData, tensors: list[torch.Tensor], body: Body, *, batched: bool) -> None:
    """One run of tensors with one dtype and one trailing shape (or one batched tensor)."""
    if batched:
        t = _cpu(_has_data(col.name, tensors[0]))
        run = col.runs.add(kind=pb.TENSOR, count=t.shape[0], dtype=NAMES[t.dtype], shape=list(t.shape[1:]))
        data = as_bytes(t)
        run.offset, run.nbytes = body.add(data), data.nbytes
        return
    first = tensors[0]
    shapes = {tuple(v.shape) for v in tensors}
    run = col.runs.add(kind=pb.TENSOR, count=len(tensors), dtype=NAMES[first.dtype])
    if len(shapes) == 1:
        run.shape.extend(first.shape)
    else:  # ragged in the first dimension only (the grouping guarantees the rest)
        run.shape.extend([-1, *first.shape[1:]])
        run.lengths.extend(v.shape[0] for v in tensors)
    numels = [v.numel() for v in tensors]
    nbytes = sum(numels) * first.element_size()
    if nbytes < _CAT_BELOW * len(tensors) and len(tensors) > 1:
        flat = torch.empty(sum(numels), dtype=first.dtype)  # one copy instead of one buffer each
        cat_into([v.detach().cpu().reshape(-1) for v in tensors], numels, flat)
        parts = [as_bytes(flat)]
    else:
        parts = [as_bytes(_cpu(v)) for v in tensors]
    run.offset, run.nbytes = body.add(*parts), nbytes


def _msgpack_default(obj: Any) -> Any:
    """What msgpack cannot pack as it is. Only types that come back as themselves are
    accepted: a tuple or set would come back as a list, so it is refused, not converted."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, set, frozenset)):
        raise TypeError(f"{type(obj).__name__} would come back as a list; pass a list")
    if isinstance(obj, (list, dict, str, bytes, int, float)):  # subclasses (strict_types): their plain base type
        base: type = next(t for t in (bool, int, float, str, bytes, list, dict) if isinstance(obj, t))
        return base(obj)
    raise TypeError(type(obj).__name__)


_packers = threading.local()  # one Packer per thread (a Packer keeps a buffer: not shared between threads)


def _msgpack_run(col: pb.ColumnData, name: str, values: list[Any], start: int, body: Body,
                 kinds: set[type] | None = None) -> None:
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, default=_msgpack_default, strict_types=True)
    whole = _packed_whole(packer, values, set(map(type, values)) if kinds is None else kinds)
    if whole is not None:
        packed, lengths = whole
        run = col.runs.add(kind=pb.MSGPACK, count=len(values), lengths=lengths)
        run.offset, run.nbytes = body.add(packed, checked=True), packed.nbytes
        return
    blobs = []
    for i, v in enumerate(values):
        try:
            blobs.append(packer.pack(v))
        except (TypeError, ValueError, OverflowError) as e:
            raise DockTypeError(
                f"column {name!r} sample {start + i}: cannot store a value of type {type(v).__name__} ({e}); use "
                "tensors, numpy arrays, or str/int/float/bool/None/bytes and lists/dicts of those"
            ) from None
    data = b"".join(blobs)
    run = col.runs.add(kind=pb.MSGPACK, count=len(values), lengths=[len(b) for b in blobs])
    run.offset, run.nbytes = body.add(memoryview(data), checked=True), len(data)


def _packed_whole(packer: msgpack.Packer, values: list[Any], kinds: set[type]) -> tuple[memoryview, list[int]] | None:
    """A column of only floats or only strs (rewards, uids) packed in one call: the list's values back to
    back (its array header cut off), and each value's packed length, known from the value (a float: 9
    bytes; a str: its UTF-8 bytes (its length, when all are ASCII) and a header of 1, 2, 3 or 5). None
    for any other column (`kinds`: the values' types), or a str with no UTF-8 form (the per-value
    packing names the sample)."""
    if kinds == {float}:
        lengths = [9] * len(values)
    elif kinds == {str}:
        try:
            sizes = list(map(len, values)) if all(map(str.isascii, values)) else [len(v.encode()) for v in values]
        except UnicodeEncodeError:
            return None
        lengths = [n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65536 else 5) for n in sizes]
    else:
        return None
    data = packer.pack(values)
    return memoryview(data)[len(data) - sum(lengths):], lengths
