"""A put's checks: its header, before any room is spent on it (`check_put`), then its runs against
its bytes (`check_body`)."""

from __future__ import annotations

import msgpack
import pytest

from dockd import runcheck
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockProtocolError, DockValueError


def _put(*runs: pb.Run, names: tuple[str, ...] = ("x",), device_buffers: int = 0) -> pb.PutRequest:
    req = pb.PutRequest(partition="p", new_count=runs[0].count)
    for name in names:
        req.columns.add(name=name).runs.extend(runs)
    req.device_buffers.extend(pb.DeviceBuffer() for _ in range(device_buffers))
    return req


@pytest.mark.parametrize("req, exc, match", [
    (_put(pb.Run(kind=pb.TENSOR, count=1, dtype="float13", shape=[1], nbytes=2)), DockProtocolError, "dtype"),
    (_put(pb.Run(kind=pb.TENSOR, count=1, dtype="float32", shape=[5], nbytes=16)), DockProtocolError, "match"),
    (_put(pb.Run(kind=pb.MSGPACK, count=2, lengths=[1, 2], nbytes=4)), DockProtocolError, "add up"),
    (_put(pb.Run(kind=pb.MSGPACK, count=1, lengths=[1], nbytes=1), names=("x", "x")), DockValueError, "distinct"),
    (_put(pb.Run(kind=pb.TENSOR, count=1, dtype="int8", shape=[1], nbytes=1, device_buffer=2), device_buffers=1),
     DockProtocolError, "device buffer 2 of 1"),
])
def test_a_header_whose_runs_do_not_describe_their_bytes_is_refused_before_the_body(req, exc, match):
    """(Checked only once the body was in, after its room was spent, these passed the header check.)"""
    with pytest.raises(exc, match=match):
        runcheck.check_put(req)


def test_the_body_check_finds_runs_past_their_bytes_and_values_that_do_not_decode():
    good = msgpack.packb(1000) + msgpack.packb("ab")
    req = _put(pb.Run(kind=pb.MSGPACK, count=2, lengths=[3, 3], nbytes=6),
               pb.Run(kind=pb.TENSOR, count=2, dtype="int8", shape=[1], offset=8, nbytes=2, device_buffer=1),
               device_buffers=1)
    req.new_count = 4
    assert runcheck.check_put(req) == 4
    runcheck.check_body(req.columns, good, len(good), [10])
    with pytest.raises(DockProtocolError, match="runs past the 9-byte device buffer"):
        runcheck.check_body(req.columns, good, len(good), [9])
    with pytest.raises(DockProtocolError, match="runs past the 5-byte body"):
        runcheck.check_body(req.columns, good[:5], 5, [10])
    with pytest.raises(DockValueError, match="column 'x' holds a value that is not valid msgpack"):
        runcheck.check_body(req.columns, b"\xc1" + good[1:], len(good), [10])
