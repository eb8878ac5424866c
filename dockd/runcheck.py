"""A put checked before the warehouse stores it: its header (`check_put`, the one place a put is
validated) and its runs against the bytes they describe (`check_columns`: the one check of a put's
columns), made by the put pipeline (`dockd.warehouse.put`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgpack

from dockd._proto import dockd_pb2 as pb
from dockd.codec import ITEMSIZE
from dockd.errors import DockProtocolError, DockValueError


def check_put(req: pb.PutRequest, body_size: int | None = None, device_sizes: Sequence[int] | None = None) -> int:
    """Check a put's header (and its runs against the body, when its size is known); the
    number of samples. The one place a put is validated."""
    if not req.partition:
        raise DockValueError("partition must be a non-empty string")
    if body_size is None:  # before the body is in: only the shape of the request
        if not req.columns:
            raise DockValueError("a put needs at least one column")
        counts = {c.name: sum(r.count for r in c.runs[:]) for c in req.columns[:]}
        n: int = next(iter(counts.values()))
        if n == 0 or any(v != n for v in counts.values()):
            raise DockValueError(f"every column needs the same positive number of values, got {counts}")
    else:
        n = check_columns(req.columns, body_size,
                          [d.nbytes for d in req.device_buffers] if device_sizes is None else device_sizes)
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


def check_columns(columns: Sequence[pb.ColumnData], body_size: int, device_sizes: Sequence[int] = ()) -> int:
    """Validate columns against the body (or device buffers, sizes `device_sizes`) they point
    into; returns the number of samples.

    Raises DockValueError for a request that is wrong, DockProtocolError for runs that
    do not describe their bytes."""
    if not columns:
        raise DockValueError("a put needs at least one column")
    columns = columns[:]  # (a list: see dockd.net.wire)
    names = [c.name for c in columns]
    if len(set(names)) != len(names) or not all(names):
        raise DockValueError(f"column names must be non-empty and distinct, got {names}")
    counts = {}
    for c in columns:
        n = 0
        for run in c.runs[:]:
            if run.device_buffer:
                if run.device_buffer > len(device_sizes):
                    raise DockProtocolError(f"a run in device buffer {run.device_buffer} of {len(device_sizes)}")
                if run.segment:
                    raise DockProtocolError("a run is either in a device buffer or in a segment")
                check_run(run, device_sizes[run.device_buffer - 1])
            else:
                check_run(run, body_size)
            n += run.count
        counts[c.name] = n
    n = next(iter(counts.values()))
    if n == 0 or any(v != n for v in counts.values()):
        raise DockValueError(f"every column needs the same positive number of values, got {counts}")
    return n


def check_run(run: pb.Run, body_size: int) -> None:
    if run.offset + run.nbytes > body_size:
        raise DockProtocolError(f"a run at offset {run.offset} with {run.nbytes} bytes runs past the {body_size}-byte body")
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


def check_msgpack(columns: Sequence[pb.ColumnData], body) -> None:
    """Every msgpack run of a put holds `count` whole msgpack values of the lengths it gives
    (checked once, when stored, so that readers never meet a value they cannot decode)."""
    mv = memoryview(body).cast("B") if body is not None else None
    for c in columns[:]:
        for run in c.runs[:]:
            if run.kind != pb.MSGPACK or run.device_buffer:
                continue
            assert mv is not None  # (a run not in a device buffer is in the body)
            unpacker = msgpack.Unpacker(max_buffer_size=max(run.nbytes, 1))
            unpacker.feed(mv[run.offset : run.offset + run.nbytes])
            try:
                for n in run.lengths[:]:
                    start = unpacker.tell()
                    unpacker.skip()
                    if unpacker.tell() - start != n:
                        raise ValueError(f"a value of {unpacker.tell() - start} bytes where the run says {n}")
            except Exception as e:  # msgpack raises ValueError, StackError, OutOfData, ...
                raise DockValueError(f"column {c.name!r} holds a value that is not valid msgpack "
                                     f"({type(e).__name__}: {e}); values of Python objects are encoded by "
                                     "dockd's client") from None
