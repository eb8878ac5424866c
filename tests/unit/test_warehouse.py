"""The warehouse's pure logic: storage, capacity accounting, validation."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockFull, DockNotFound, DockValueError
from dockd.warehouse.core import Warehouse


def encoded(values: list, name: str = "x"):
    body = codec.Body()
    cols = codec.encode_columns({name: values}, body)
    buf = pa.py_buffer(b"".join(bytes(b) for b in body.buffers))
    return cols, buf


def test_store_fetch_free_and_accounting():
    w = Warehouse(1 << 20)
    cols, buf = encoded([torch.arange(4), torch.ones(2, 3)])
    assert w.reserve(buf.size)
    w.store("p", [0, 1], cols, buf, buf.size)
    assert (w.used, w.reserved) == (buf.size, 0)
    (name, vals), = w.fetch("p", [("x", [1, 0])])
    body = bytearray(buf.to_pybytes())
    for s in vals:  # stored values are zero-copy slices of the put's body
        assert s.data.address == buf.address + s.meta.offset
    got = [codec.decode_value(s.meta, body) for s in vals]
    assert torch.equal(got[0], torch.ones(2, 3)) and torch.equal(got[1], torch.arange(4))
    assert w.free("p") == buf.size and w.used == 0
    with pytest.raises(DockNotFound):
        w.fetch("p", [("x", [0])])


def test_capacity_reservations_and_never_fitting_puts():
    w = Warehouse(100)
    assert w.reserve(60)
    assert not w.reserve(50)
    w.unreserve(60)
    assert w.reserve(100)
    with pytest.raises(DockFull, match="can never fit"):
        w.check_fits(101)


def test_duplicate_columns_and_unstore():
    w = Warehouse(1 << 20)
    cols, buf = encoded([torch.zeros(1)])
    w.reserve(buf.size)
    w.store("p", [3], cols, buf, buf.size)
    with pytest.raises(DockValueError, match="already written"):
        w.check_absent("p", [3], ["x"])
    w.unstore("p", [3], ["x"], buf.size)
    assert w.used == 0 and not w.has("p", [("x", [3])])


@pytest.mark.parametrize(
    "req, match",
    [
        (pb.PutRequest(partition="", columns=[pb.ColumnData(name="x", values=[pb.Value()])], new_count=1), "partition"),
        (pb.PutRequest(partition="p", new_count=1), "at least one column"),
        (pb.PutRequest(partition="p", columns=[pb.ColumnData(name="x", values=[pb.Value()]), pb.ColumnData(name="y")], new_count=1), "same positive number"),
        (pb.PutRequest(partition="p", columns=[pb.ColumnData(name="x", values=[pb.Value()] * 3)], new_count=3, group_size=2), "multiple of group_size"),
        (pb.PutRequest(partition="p", columns=[pb.ColumnData(name="x", values=[pb.Value()] * 2)], indexes=[1]), "1 indexes given for 2"),
    ],
)
def test_put_header_validation(req, match):
    with pytest.raises(DockValueError, match=match):
        Warehouse.validate_put(req)
