"""A data dir's put files, written and read back in process: a put whose body is written into its
room before its commit (format 2) and one whose header does not fit in front of it (written whole
instead, format 1) come back bit-exact through the same adoption a restart runs."""

from __future__ import annotations

import numpy as np
import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.warehouse.admission import Admission
from dockd.warehouse.core import Warehouse
from dockd.warehouse.datadir import DataDir, Room
from dockd.warehouse.segments import Segments

DOCK = {"token": "", "controller": "127.0.0.1:1"}


class _Tokens:
    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def done(self, token: int, indexes: list[int]) -> None:
        self.seen[token] = indexes


def _put(n: int, values: int) -> tuple[list[pb.ColumnData], bytes]:
    body = np.arange(n * values, dtype=np.float32).tobytes()
    col = pb.ColumnData(name="x", runs=[pb.Run(dtype="float32", shape=[values], count=n, nbytes=len(body))])
    return [col], body


def _adopted(path: str) -> Warehouse:
    wh = Warehouse(1 << 30)
    again = DataDir(path, DOCK)
    again.open()
    wh.keeper = again
    again.adopt(wh, Admission(wh, Segments(keep_bytes=0), lambda: 0), _Tokens())
    return wh


@pytest.mark.parametrize("fits", [True, False])
def test_a_body_written_before_the_commit_comes_back(tmp_path, fits):
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    cols, body = _put(4, 1000)
    room = dd.room("p", cols, len(body), 4)
    assert room is not None
    if not fits:  # a room too small for the header in front of the body: the put is written whole over it
        room = Room(room.path, len(body) + 16, len(body))
    dd.prewrite(room, body)
    assert room.crc_body is not None
    path = dd.stored("p", np.array([5, 6, 7, 8]), cols, body, len(body), 1, 99, room)
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(12)[8:], "little") == (2 if fits else 1)
    wh = _adopted(dd.path)
    (name, slices), = wh.fetch("p", [("x", [5, 6, 7, 8])])
    got = b"".join(bytes(batch.host(*batch.span(r0, r1))) for batch, r0, r1 in slices)
    assert name == "x" and got == body
