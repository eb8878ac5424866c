"""Values <-> wire, by column run: tensors travel as raw bytes, everything else as msgpack.

A column is given as one tensor/array whose first dimension is the sample
axis, or as a sequence with one value per sample. On the wire a column is a
list of *runs*: consecutive values stored back to back in one buffer and
described once (`dockd.v1.Run`):

- a batched tensor is one run with one shape for every value;
- a ragged list of tensors of one dtype whose values differ only in their
  first dimension (token ids, log-probs, masks) is one run: the values are
  packed with one concatenation, and the run carries each value's first
  dimension (`lengths`);
- Python values (str, numbers, lists, dicts, None, bytes) are msgpack, one
  run per stretch of them, with each value's byte length.

So a put of 64 samples x 8 columns is about 8 run descriptions and 8
buffers, not 512 of each; the warehouse stores each run as one batch, and a
get turns back into one view per run. Nothing is ever pickled, and a value
that would not come back as itself (a tuple, a set) is refused.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from dockd._lazy import ensure, lazy_torch
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockProtocolError, DockTypeError, DockValueError

if TYPE_CHECKING:
    import torch

ALIGN = 64
_PAD = bytes(ALIGN)
_CAT_BELOW = 1 << 20  # runs of smaller values are packed with one concatenation; larger ones go as they are
# torch's grain size: a concatenation into fewer elements than this copies its inputs one memcpy each on the
# calling thread; into more (with several intra-op threads) each input goes through a generic copy, 1.5-2x
# slower for 64 per-sample tensors of ~1,000 elements. `cat_into` concatenates in chunks below it, unless
# torch runs one intra-op thread: then every concatenation is serial, and one call costs less than several.
_SERIAL_CAT = 32768

# the dtypes a run may have, with their item sizes (torch >= 2.3 has every one of them)
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


class _Dtypes(dict):
    """name -> torch.dtype, filled when this module first uses torch. Indexing a filled entry is a
    plain dict lookup; a miss, and reading the whole mapping, import torch first."""

    def _filled(self) -> _Dtypes:
        if not dict.__len__(self):
            ensure(torch)
        return self

    def __missing__(self, key: str) -> torch.dtype:
        if dict.__len__(self):
            raise KeyError(key)
        return self._filled()[key]

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self._filled(), key)

    def __iter__(self):
        return dict.__iter__(self._filled())

    def __len__(self) -> int:
        return dict.__len__(self._filled())

    def __repr__(self) -> str:
        return dict.__repr__(self._filled())

    def get(self, key, default=None):
        return dict.get(self._filled(), key, default)

    def keys(self):
        return dict.keys(self._filled())

    def values(self):
        return dict.values(self._filled())

    def items(self):
        return dict.items(self._filled())


DTYPES: dict[str, torch.dtype] = _Dtypes()
# torch.dtype -> name; filled with DTYPES. Every use follows a `torch.` in the same function (a value
# was first recognised as a tensor), so it is filled by then.
_NAMES: dict[torch.dtype, str] = {}


def _torch_loaded(module) -> None:
    dtypes = {name: getattr(module, name) for name in ITEMSIZE if hasattr(module, name)}
    _NAMES.update({dt: name for name, dt in dtypes.items()})
    dict.update(DTYPES, dtypes)


if not TYPE_CHECKING:
    torch = lazy_torch(globals(), on_load=_torch_loaded)


def cat_into(tensors: list[torch.Tensor], lengths: Sequence[int], out: torch.Tensor) -> None:
    """Concatenate flat CPU tensors of `out`'s dtype with `lengths` elements each into `out`
    (1-D, sum(lengths) elements), in chunks of fewer than _SERIAL_CAT elements (torch's memcpy path) when
    torch runs several intra-op threads. A tensor of more elements goes alone."""
    with torch.no_grad():
        if torch.get_num_threads() == 1:
            torch.cat(tensors, out=out)
            return
        start = pos = acc = 0
        for i, n in enumerate(lengths):
            if acc and acc + n >= _SERIAL_CAT:
                torch.cat(tensors[start:i], out=out[pos : pos + acc])
                start, pos, acc = i, pos + acc, 0
            acc += n
        torch.cat(tensors[start:], out=out[pos : pos + acc])


class Joined:
    """Per-sample 1-D CPU tensors of one dtype whose bytes go back to back in a body. They are
    concatenated only when the body is written: straight into the destination when it is a
    staging buffer (`Body.write_into`, the put's one copy), else once, when the bytes are read."""

    __slots__ = ("tensors", "lengths", "dtype", "nbytes", "_view")

    def __init__(self, tensors: list, lengths: list[int], dtype, nbytes: int) -> None:
        self.tensors, self.lengths, self.dtype, self.nbytes = tensors, lengths, dtype, nbytes
        self._view: memoryview | None = None

    def view(self) -> memoryview:
        if self._view is None:
            out = torch.empty(sum(self.lengths), dtype=self.dtype)
            cat_into(self.tensors, self.lengths, out)
            self._view = _bytes(out)
        return self._view

    def write_into(self, dst: memoryview) -> None:
        if self._view is not None:
            dst[:] = self._view
            return
        cat_into(self.tensors, self.lengths, torch.frombuffer(dst, dtype=torch.uint8).view(self.dtype))


class Body:
    """Buffers laid out back to back, each run starting at an ALIGN-byte offset; kept as a
    list (no concatenation), written with vectored I/O or into one buffer (`write_into`)."""

    __slots__ = ("_parts", "size", "_joined")

    def __init__(self) -> None:
        self._parts: list[memoryview | bytes | Joined] = []
        self.size = 0
        self._joined = False  # a part is a Joined (not concatenated yet)

    def add(self, *parts: memoryview | Joined) -> int:
        """Append parts contiguously at the next aligned offset; returns that offset."""
        pad = -self.size % ALIGN
        if pad:
            self._parts.append(_PAD[:pad])
            self.size += pad
        off = self.size
        for data in parts:
            if data.nbytes:
                self._parts.append(data)
                self.size += data.nbytes
                self._joined = self._joined or type(data) is Joined
        return off

    def extend(self, data: memoryview) -> None:
        """Append `data` right after the last part (no padding: it continues the run that part is in)."""
        if data.nbytes:
            self._parts.append(data)
            self.size += data.nbytes

    @property
    def buffers(self) -> list[memoryview | bytes]:
        """The body as buffers (values still to be concatenated are, now)."""
        if self._joined:
            self._parts = [p.view() if isinstance(p, Joined) else p for p in self._parts]
            self._joined = False
        return self._parts  # type: ignore[return-value]  # (none is a Joined any more)

    def write_into(self, dst: memoryview) -> None:
        """Write the whole body into `dst` (at least `size` bytes, byte-addressed)."""
        off = 0
        for p in self._parts:
            if isinstance(p, Joined):
                p.write_into(dst[off : off + p.nbytes])
                off += p.nbytes
            else:
                src = memoryview(p).cast("B")
                dst[off : off + src.nbytes] = src
                off += src.nbytes


# -- encoding --------------------------------------------------------------------------------
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


def _bytes(t: torch.Tensor) -> memoryview:
    if not t.numel():
        return memoryview(b"")
    # (an ndarray is a buffer; numpy's stubs declare its __buffer__ only for Python >= 3.12)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


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
    if v.dtype not in _NAMES:
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


def encode_columns(columns: Mapping[str, Any], body: Body) -> list[pb.ColumnData]:
    """Columns (batched tensors/arrays, or one value per sample) as runs; their bytes go to `body`."""
    out = []
    for name, values in columns.items():
        col = pb.ColumnData(name=name)
        t = batched(values)
        if t is not None:
            _tensor_run(col, [t], body, batched=True)
        else:
            _runs(col, name, split_column(name, values), body)
        out.append(col)
    return out


def device_column(name: str, values: Any, keep: Any) -> tuple[pb.ColumnData, torch.Tensor] | None:
    """put(device="keep"): a column of tensors for which `keep(tensor)` holds, as one run over one
    tensor left where it is (a batched tensor as it is, made contiguous; per-sample tensors of one
    dtype and trailing shape concatenated on their device). None: the column goes to the body."""
    t = batched(values)
    if t is not None:
        if not keep(t):
            return None
        t = t.detach().contiguous()
        col = pb.ColumnData(name=name)
        col.runs.add(kind=pb.TENSOR, count=t.shape[0], dtype=_NAMES[t.dtype], shape=list(t.shape[1:]),
                     nbytes=t.numel() * t.element_size())
        return col, t
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence) or not values:
        return None
    if not all(type(v) is torch.Tensor for v in values):
        return None
    first = values[0]
    if first.dim() == 0 or first.dtype not in _NAMES or first.layout != torch.strided or not keep(first):
        return None
    if {(v.dtype, v.device, tuple(v.shape[1:])) for v in values} != {(first.dtype, first.device, tuple(first.shape[1:]))}:
        return None
    col = pb.ColumnData(name=name)
    run = col.runs.add(kind=pb.TENSOR, count=len(values), dtype=_NAMES[first.dtype])
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
    if all(type(v) in _PLAIN for v in values):  # (scalars: one msgpack run, without looking for tensors)
        _msgpack_run(col, name, values if type(values) is list else list(values), 0, body)
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
    if dtype not in _NAMES or first.layout != torch.strided or first.is_quantized:
        return False
    lengths: list[int] = []
    on_cpu = True
    for v in values:
        if type(v) is not tensor or v.dtype is not dtype or v.ndim != 1:
            return False
        lengths.append(v.numel())  # (its length: the value is 1-D)
        on_cpu = on_cpu and v.is_cpu
    run = col.runs.add(kind=pb.TENSOR, count=len(values), dtype=_NAMES[dtype], shape=[-1], lengths=lengths)
    if on_cpu:
        nbytes = sum(lengths) * first.element_size()
        run.offset, run.nbytes = body.add(Joined(list(values), lengths, first.dtype, nbytes)), nbytes
    else:  # (accelerator tensors: joined there, then one copy to the host)
        for i, v in enumerate(values):
            _has_data(col.name, v, i)
        data = _bytes(torch.cat(list(values)).detach().cpu())
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
        run = col.runs.add(kind=pb.TENSOR, count=t.shape[0], dtype=_NAMES[t.dtype], shape=list(t.shape[1:]))
        data = _bytes(t)
        run.offset, run.nbytes = body.add(data), data.nbytes
        return
    first = tensors[0]
    shapes = {tuple(v.shape) for v in tensors}
    run = col.runs.add(kind=pb.TENSOR, count=len(tensors), dtype=_NAMES[first.dtype])
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
        parts = [_bytes(flat)]
    else:
        parts = [_bytes(_cpu(v)) for v in tensors]
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


def _msgpack_run(col: pb.ColumnData, name: str, values: list[Any], start: int, body: Body) -> None:
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, default=_msgpack_default, strict_types=True)
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
    run.offset, run.nbytes = body.add(memoryview(data)), len(data)


# -- decoding --------------------------------------------------------------------------------
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
        self.count = sum(r.count for r, _, _ in runs)

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

    def padded(self, pad_value: float | int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[n, max_len, *trailing] padded on the right, and the lengths; None when the column is
        not tensors of one dtype and trailing shape. The rows are views made by one split of
        the received bytes, copied once into the padded tensor."""
        flat = self._flat()
        if flat is None:
            return None
        data, lengths, trail = flat
        unit = math.prod(trail)
        rows = data.split([n * unit for n in lengths])
        if trail:
            rows = [r.view(-1, *trail) for r in rows]
        lens = torch.tensor(lengths, dtype=torch.int64)
        if not rows:
            return torch.empty((0, 0, *trail), dtype=data.dtype), lens
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_value), lens
