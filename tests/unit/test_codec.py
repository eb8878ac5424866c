"""Values to wire buffers and back, bit-exact, without pickle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockProtocolError, DockTypeError, DockValueError


def roundtrip(values: list):
    body = codec.Body()
    (col,) = codec.encode_columns({"c": values}, body)
    raw = b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers)
    assert len(raw) == body.size
    for v in col.values:
        assert v.offset % codec.ALIGN == 0
        codec.check_value(v, body.size)
    buf = bytearray(raw) or bytearray(1)
    return [codec.decode_value(v, buf) for v in col.values]


@pytest.mark.parametrize("dtype", sorted(codec.DTYPES, key=str))
def test_every_dtype_roundtrips_bit_exact(dtype):
    dt = codec.DTYPES[dtype]
    src = (torch.randn(3, 5) * 100).to(dt) if dt.is_floating_point or dt.is_complex else torch.arange(15).reshape(3, 5).to(dt)
    (out,) = roundtrip([src])
    assert out.dtype == dt and out.shape == src.shape
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))


def test_non_contiguous_zero_dim_empty_and_numpy():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    values = [base.t(), base[:, ::2], torch.tensor(3.5), torch.empty(0, 7), np.arange(5, dtype=np.int16)]
    out = roundtrip(values)
    assert torch.equal(out[0], base.t()) and torch.equal(out[1], base[:, ::2])
    assert out[2].shape == () and out[2].item() == 3.5
    assert out[3].shape == (0, 7)
    assert out[4].dtype == torch.int16 and out[4].tolist() == [0, 1, 2, 3, 4]


def test_python_values_use_msgpack():
    values = ["text", 3, 2.5, True, None, [1, "a"], {"k": [1, 2], 3: "int key"}, b"raw", np.int64(7)]
    out = roundtrip(values)
    assert out[:8] == ["text", 3, 2.5, True, None, [1, "a"], {"k": [1, 2], 3: "int key"}, b"raw"]
    assert out[8] == 7


def test_unsupported_values_are_rejected_clearly():
    with pytest.raises(DockTypeError, match="column 'c' sample 0: cannot store a value of type object"):
        roundtrip([object()])
    with pytest.raises(DockTypeError, match="only dense tensors"):
        roundtrip([torch.eye(3).to_sparse()])


def test_split_column_forms():
    assert len(codec.split_column("x", torch.zeros(4, 2))) == 4
    assert len(codec.split_column("x", np.zeros((3, 2)))) == 3
    assert codec.split_column("x", np.array(["a", {"b": 1}], dtype=object)) == ["a", {"b": 1}]
    with pytest.raises(DockValueError, match="no sample axis"):
        codec.split_column("x", torch.tensor(1.0))
    with pytest.raises(DockTypeError, match="one value per sample"):
        codec.split_column("x", "abc")


def test_check_value_rejects_inconsistent_metadata():
    with pytest.raises(DockProtocolError, match="runs past"):
        codec.check_value(pb.Value(kind=pb.TENSOR, dtype="float32", shape=[4], offset=64, nbytes=16), 70)
    with pytest.raises(DockProtocolError, match="does not match"):
        codec.check_value(pb.Value(kind=pb.TENSOR, dtype="float32", shape=[5], offset=0, nbytes=16), 64)
    with pytest.raises(DockProtocolError, match="unknown dtype"):
        codec.check_value(pb.Value(kind=pb.TENSOR, dtype="float13", shape=[1], nbytes=2), 64)


def test_batched_columns_are_one_buffer_and_come_back_as_views_of_one():
    src = torch.randn(8, 32).to(torch.bfloat16)  # 64-byte rows: laid out in place
    body = codec.Body()
    (col,) = codec.encode_columns({"c": src}, body)
    assert len(body.buffers) == 1 and body.size == src.numel() * 2
    assert [v.offset for v in col.values] == [64 * i for i in range(8)]
    buf = bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers))
    run = codec.decode_run(col.values, buf)
    assert run is not None and all(torch.equal(r.view(torch.int16), s.view(torch.int16)) for r, s in zip(run, src))
    assert run[0].untyped_storage().data_ptr() == run[7].untyped_storage().data_ptr()
    # rows that cannot all be aligned in place fall back to one buffer per value
    odd = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    body = codec.Body()
    (col,) = codec.encode_columns({"c": odd}, body)
    assert all(v.offset % codec.ALIGN == 0 for v in col.values) and len(col.values) == 5
    buf = bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers))
    assert codec.decode_run(col.values, buf) is None
    assert [codec.decode_value(v, buf).tolist() for v in col.values] == odd.tolist()
