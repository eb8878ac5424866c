"""A put checked before the warehouse stores it, in two passes made by the put pipeline
(`dockd.warehouse.put`): its header before any room is spent on it (`check_put`: names, counts,
indexes and every run's shape against its byte count), then, once its bytes are in, the runs against
the bytes they point into (`check_body`: each run within its body or device buffer, msgpack values
that decode). `check_columns` makes both for columns alone (a weights put)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgpack

from dockd._proto import dockd_pb2 as pb
from dockd.codec import ITEMSIZE
from dockd.errors import DockProtocolError, DockValueError


def check_put(req: pb.PutRequest) -> int:
    """Check a put's header (everything but where its runs lie in bytes yet to arrive); the number
    of samples. The one place a put's header is validated."""
    if not req.partition:
        raise DockValueError("partition must be a non-empty string")
    n = _check_runs(req.columns, len(req.device_buffers))
    if req.indexes:
        if len(req.indexes) != n:
            raise DockValueError(f"{len(req.indexes)} indexes given for {n} values per column")
        if min(req.indexes) < 0:
            raise DockValueError(f"sample index {min(req.indexes)} is negative; indexes are the ones a put of new "
                                 "samples returned (0, 1, ...)")
        if req.new_count:
            raise DockValueError("a put gives either indexes (existing samples) or new samples, not both")
    else:
        gs = req.group_size or 1
        if req.new_count != n:
            raise DockValueError(f"new_count={req.new_count} does not match {n} values per column")
        if n % gs:
            raise DockValueError(f"{n} new samples is not a multiple of group_size={gs}")
    return n


def check_body(columns: Sequence[pb.ColumnData], body, body_size: int, device_sizes: Sequence[int] = ()) -> None:
    """The runs of columns whose shapes were checked (`check_put`) against the bytes they point into:
    each lies within the body (`body_size` bytes) or its device buffer (sizes `device_sizes`), and every
    msgpack run in the body holds `count` whole msgpack values of the lengths it gives (checked once,
    when stored, so that readers never meet a value they cannot decode)."""
    mv = None
    for c in columns[:]:  # ([:]: a list, see dockd.net.wire)
        for run in c.runs[:]:
            end = run.offset + run.nbytes
            if run.device_buffer:
                if run.device_buffer > len(device_sizes):
                    raise DockProtocolError(f"a run in device buffer {run.device_buffer} of {len(device_sizes)}")
                _within(run, end, device_sizes[run.device_buffer - 1])
                continue
            _within(run, end, body_size)
            if run.kind == pb.MSGPACK:
                if mv is None:  # (a bodiless put's runs hold 0 bytes)
                    mv = memoryview(body if body is not None else b"").cast("B")
                _check_msgpack(c.name, run, mv[run.offset:end])


def check_columns(columns: Sequence[pb.ColumnData], body_size: int, device_sizes: Sequence[int] = ()) -> int:
    """Validate columns against the body (or device buffers, sizes `device_sizes`) they point
    into, their msgpack values not decoded; returns the number of samples.

    Raises DockValueError for a request that is wrong, DockProtocolError for runs that
    do not describe their bytes."""
    n = _check_runs(columns, len(device_sizes))
    for c in columns[:]:
        for run in c.runs[:]:
            _within(run, run.offset + run.nbytes,
                    device_sizes[run.device_buffer - 1] if run.device_buffer else body_size)
    return n


def _within(run: pb.Run, end: int, size: int) -> None:
    if end > size:
        raise DockProtocolError(f"a run at offset {run.offset} with {run.nbytes} bytes runs past the {size}-byte "
                                f"{'device buffer' if run.device_buffer else 'body'}")


def _check_runs(columns: Sequence[pb.ColumnData], device_buffers: int) -> int:
    """Columns' names and runs (each run's shape against its byte count, in a device buffer of the
    `device_buffers` a put names, or in its body); the number of values each column holds."""
    if not columns:
        raise DockValueError("a put needs at least one column")
    columns = columns[:]  # (a list: see dockd.net.wire)
    names = [c.name for c in columns]
    if len(set(names)) != len(names) or not all(names):
        raise DockValueError(f"column names must be non-empty and distinct, got {names}")
    counts = []
    for c in columns:
        n = 0
        for run in c.runs[:]:
            if run.device_buffer:
                if run.device_buffer > device_buffers:
                    raise DockProtocolError(f"a run in device buffer {run.device_buffer} of {device_buffers}")
                if run.segment:
                    raise DockProtocolError("a run is either in a device buffer or in a segment")
            check_run(run)
            n += run.count
        counts.append(n)
    n = counts[0]
    if n == 0 or counts.count(n) != len(counts):
        got = dict(zip(names, counts))
        raise DockValueError(f"every column needs the same positive number of values, got {got}")
    return n


def check_run(run: pb.Run) -> None:
    """A run's kind, dtype and shape against its byte count (not yet where its bytes lie)."""
    if run.kind == pb.MSGPACK:
        if len(run.lengths) != run.count or sum(run.lengths[:]) != run.nbytes:  # ([:]: a list, see dockd.net.wire)
            raise DockProtocolError(f"a msgpack run of {run.count} values does not add up to its {run.nbytes} bytes")
        return
    if run.kind != pb.TENSOR:
        raise DockProtocolError(f"unknown value kind {run.kind}")
    size = ITEMSIZE.get(run.dtype)
    if size is None:
        raise DockProtocolError(f"unknown dtype {run.dtype!r}")
    shape = list(run.shape)
    if shape and shape[0] == -1:
        trail = shape[1:]
        if any(d < 0 for d in trail) or len(run.lengths) != run.count:
            raise DockProtocolError(f"a ragged run of {run.count} values has {len(run.lengths)} lengths")
        elems = sum(run.lengths[:]) * math.prod(trail)
    else:
        if any(d < 0 for d in shape) or run.lengths:
            raise DockProtocolError(f"bad shape {shape} for a run of uniform values")
        elems = math.prod(shape) * run.count
    if elems * size != run.nbytes:
        raise DockProtocolError(f"a run of {run.count} x {shape} {run.dtype} does not match its {run.nbytes} bytes")


def _check_msgpack(column: str, run: pb.Run, data: memoryview) -> None:
    """A msgpack run's bytes hold `count` whole values of the lengths it gives."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(run.nbytes, 1))
    unpacker.feed(data)
    skip, tell = unpacker.skip, unpacker.tell
    end = 0
    try:
        for n in run.lengths[:]:
            skip()
            end += n
            if tell() != end:
                raise ValueError(f"a value of {tell() - end + n} bytes where the run says {n}")
    except Exception as e:  # msgpack raises ValueError, StackError, OutOfData, ...
        raise DockValueError(f"column {column!r} holds a value that is not valid msgpack "
                             f"({type(e).__name__}: {e}); values of Python objects are encoded by "
                             "dockd's client") from None
