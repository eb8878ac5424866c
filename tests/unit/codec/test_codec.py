"""Values to wire runs and back, bit-exact, without pickle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dockd import codec, runcheck
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockProtocolError, DockTypeError, DockValueError


def encode(values) -> tuple[pb.ColumnData, bytearray]:
    body = codec.Body()
    (col,) = codec.encode_columns({"c": values}, body)
    raw = b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers)
    assert len(raw) == body.size
    for run in col.runs:
        assert run.offset % codec.ALIGN == 0
    runcheck.check_columns([col], body.size)
    return col, bytearray(raw) or bytearray(1)


def roundtrip(values):
    col, buf = encode(values)
    return codec.decode_column(col, {0: (buf, 0)})


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


@pytest.mark.parametrize("values, which", [
    (torch.empty(4, 2, device="meta"), "column 'c':"),                                  # batched
    ([torch.empty(3, device="meta"), torch.empty(5, device="meta")], "column 'c' sample 0:"),  # ragged 1-D
    ([torch.zeros(2, 2), torch.empty(2, 2, device="meta")], "column 'c' sample 1:"),   # per sample
    (["text", torch.empty(2, 2, device="meta")], "column 'c' sample 1:"),             # after msgpack values
])
def test_a_tensor_on_the_meta_device_is_refused_naming_its_column(values, which):
    """Finding 9: torch's NotImplementedError ("Cannot copy out of meta tensor") named no column."""
    with pytest.raises(DockValueError, match=f"{which} a tensor on the meta device holds no data"):
        encode(values)


def test_split_column_forms():
    assert len(codec.split_column("x", torch.zeros(4, 2))) == 4
    assert len(codec.split_column("x", np.zeros((3, 2)))) == 3
    assert codec.split_column("x", np.array(["a", {"b": 1}], dtype=object)) == ["a", {"b": 1}]
    with pytest.raises(DockValueError, match="no sample axis"):
        codec.split_column("x", torch.tensor(1.0))
    with pytest.raises(DockTypeError, match="one value per sample"):
        codec.split_column("x", "abc")


def test_check_columns_rejects_runs_that_do_not_describe_their_bytes():
    def col(**run):
        return [pb.ColumnData(name="x", runs=[pb.Run(**run)])]

    with pytest.raises(DockProtocolError, match="runs past"):
        runcheck.check_columns(col(kind=pb.TENSOR, count=1, dtype="float32", shape=[4], offset=64, nbytes=16), 70)
    with pytest.raises(DockProtocolError, match="does not match"):
        runcheck.check_columns(col(kind=pb.TENSOR, count=1, dtype="float32", shape=[5], offset=0, nbytes=16), 64)
    with pytest.raises(DockProtocolError, match="unknown dtype"):
        runcheck.check_columns(col(kind=pb.TENSOR, count=1, dtype="float13", shape=[1], nbytes=2), 64)
    with pytest.raises(DockProtocolError, match="lengths"):
        runcheck.check_columns(col(kind=pb.TENSOR, count=2, dtype="int8", shape=[-1], lengths=[1], nbytes=1), 64)
    with pytest.raises(DockProtocolError, match="does not add up"):
        runcheck.check_columns(col(kind=pb.MSGPACK, count=2, lengths=[1, 2], nbytes=4), 64)
    with pytest.raises(DockValueError, match="same positive number"):
        runcheck.check_columns([pb.ColumnData(name="x", runs=[pb.Run(kind=pb.MSGPACK, count=1, lengths=[1], nbytes=1)]),
                                pb.ColumnData(name="y")], 64)


def test_a_batched_tensor_is_one_run_and_comes_back_as_views_of_one_buffer():
    src = torch.randn(8, 5).to(torch.bfloat16)  # rows of 10 bytes: no alignment needed any more
    col, buf = encode(src)
    assert len(col.runs) == 1 and list(col.runs[0].shape) == [5] and col.runs[0].count == 8
    out = codec.decode_column(col, {0: (buf, 0)})
    assert all(torch.equal(r.view(torch.int16), s.view(torch.int16)) for r, s in zip(out, src))
    assert out[0].untyped_storage().data_ptr() == out[7].untyped_storage().data_ptr()


def test_ragged_tensors_of_one_dtype_are_one_run_with_lengths():
    values = [torch.arange(n, dtype=torch.int64) for n in (3, 0, 7, 1)] + [torch.ones(2, 4), torch.ones(5, 4)]
    col, buf = encode(values)
    assert [r.count for r in col.runs] == [4, 2]  # int64 1-D, then float32 [*, 4]
    assert list(col.runs[0].shape) == [-1] and list(col.runs[0].lengths) == [3, 0, 7, 1]
    assert list(col.runs[1].shape) == [-1, 4] and list(col.runs[1].lengths) == [2, 5]
    out = codec.decode_column(col, {0: (buf, 0)})
    assert [t.shape for t in out] == [v.shape for v in values]
    assert all(torch.equal(a, b) for a, b in zip(out, values))


def test_a_column_of_1d_tensors_is_one_run_only_when_every_value_has_the_first_ones_dtype():
    """The one-pass check of the common ragged case: a later value of another dtype, another rank,
    a tensor subclass or a Python value sends the column down the general path, values unchanged."""
    cases = [
        [torch.arange(3), torch.arange(2, dtype=torch.int32), torch.arange(4)],
        [torch.arange(3), torch.ones(2, 2, dtype=torch.int64)],
        [torch.arange(3), torch.nn.Parameter(torch.ones(2), requires_grad=False)],
        [torch.arange(3), 5],
    ]
    for values in cases:
        col, buf = encode(values)
        assert len(col.runs) > 1
        out = codec.decode_column(col, {0: (buf, 0)})
        for got, want in zip(out, values):
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want.detach())
            else:
                assert got == want
    col, _ = encode([torch.arange(3), torch.arange(0), torch.arange(5)])
    assert len(col.runs) == 1 and list(col.runs[0].lengths) == [3, 0, 5]


def test_msgpack_values_are_one_run_per_stretch_between_tensors():
    values = ["a", {"k": 1}, torch.ones(2), 3, None]
    col, buf = encode(values)
    assert [(r.kind, r.count) for r in col.runs] == [(pb.MSGPACK, 2), (pb.TENSOR, 1), (pb.MSGPACK, 2)]
    out = codec.decode_column(col, {0: (buf, 0)})
    assert out[:2] == ["a", {"k": 1}] and torch.equal(out[2], torch.ones(2)) and out[3:] == [3, None]


@pytest.mark.parametrize("values", [
    [0.1, -2.5, float("inf"), 1e300, -0.0],
    ["", "a" * 31, "b" * 32, "é" * 127, "c" * 255, "d" * 256, "e" * 65535, "f" * 65536, "uid-0-1", "日本"],
], ids=["floats", "strs"])
def test_a_column_of_only_floats_or_only_strs_is_packed_in_one_call_to_the_bytes_of_one_value_each(values):
    import msgpack

    col, buf = encode(values)
    (run,) = col.runs
    blobs = [msgpack.packb(v, use_bin_type=True) for v in values]
    assert list(run.lengths) == [len(b) for b in blobs]
    assert bytes(buf[run.offset : run.offset + run.nbytes]) == b"".join(blobs)
    assert roundtrip(values) == values


def test_a_str_without_utf8_form_in_a_column_of_strs_is_refused_naming_its_sample():
    with pytest.raises(DockTypeError, match="column 'c' sample 1: cannot store a value of type str"):
        roundtrip(["ok", "bad \udc80"])


def test_a_contiguous_tensor_whose_last_dimension_has_size_one_and_another_stride_roundtrips():
    """torch calls a transposed (1, n) contiguous (a size-1 dimension's stride is free), yet it cannot be
    viewed as bytes along that dimension: the encoding flattens it first."""
    t = torch.arange(4, dtype=torch.float32).reshape(1, 4).t()
    assert t.is_contiguous() and t.stride() == (1, 4)
    (out,) = roundtrip([t])
    assert torch.equal(out, t)
    assert torch.equal(torch.stack(roundtrip(t)), t)


@pytest.mark.parametrize("dtype", sorted(codec.DTYPES, key=str))
def test_as_bytes_gives_a_tensors_bytes_whether_numpy_has_its_dtype_or_not(dtype):
    """as_bytes views a tensor through numpy where numpy has the dtype, through torch's uint8 view where
    it lacks it (bfloat16, float8): the same bytes either way, flattened, for a tensor that requires grad,
    a transposed (1, n) and an empty one too."""
    from dockd.codec.body import as_bytes

    dt = codec.DTYPES[dtype]
    base = (torch.arange(24, dtype=torch.float64) % 7).to(dt).reshape(4, 6)
    cases = [base, base[1:2].t(), torch.empty(0, 3, dtype=dt)]
    if dt.is_floating_point:
        cases.append(base.detach().clone().requires_grad_(True))
    for t in cases:
        want = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        got = as_bytes(t.contiguous() if not t.requires_grad else t)
        assert got.format == "B" and got.ndim == 1 and bytes(got) == want


def test_decode_reply_reads_what_encode_columns_wrote_from_the_buffers_it_is_given():
    """decode_reply is the encoding's inverse over the buffers a transport hands it (key 0: the body)."""
    body = codec.Body()
    cols = codec.encode_columns({"x": torch.arange(6).view(3, 2), "y": ["a", {"b": 1}, None]}, body)
    flat = np.frombuffer(bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers)), dtype=np.uint8)
    x, y = codec.decode_reply(cols, {0: (flat, 0)})
    assert [v.tolist() for v in x] == [[0, 1], [2, 3], [4, 5]] and y == ["a", {"b": 1}, None]
    lazy = codec.decode_reply(cols, {0: (flat, 0)}, lazy=True)
    assert isinstance(lazy[0], codec.Runs) and lazy[0].stacked().tolist() == [[0, 1], [2, 3], [4, 5]]
    cols[0].runs[0].segment = 2  # a run in a buffer the reply did not carry
    with pytest.raises(DockProtocolError, match="not passed"):
        codec.decode_reply(cols, {0: (flat, 0)})


def test_a_body_written_into_one_buffer_is_the_body_its_buffers_hold():
    """Ragged 1-D columns are joined only when the body is written: straight into a same-host put's
    staging buffer (`write_into`, one copy) or once, when its buffers are read; both give the same bytes."""
    grad = [torch.randn(n, requires_grad=True) for n in (5, 0, 3)]
    columns = {
        "ids": [torch.arange(n, dtype=torch.int64) for n in (4, 1, 0)],
        "mask": [torch.tensor([True, False]), torch.tensor([], dtype=torch.bool), torch.tensor([True])],
        "half": [torch.randn(3).to(torch.bfloat16), torch.randn(1).to(torch.bfloat16), torch.randn(2).to(torch.bfloat16)],
        "logp": grad,
        "strided": [torch.arange(10.0)[::2], torch.arange(4.0)[1:], torch.zeros(1)],
        "reward": [1.5, -2.0, 0.0],           # plain scalars: one msgpack run
        "uid": ["a", "bc", ""],
        "mixed": [torch.zeros(0), torch.ones(2, 2), torch.ones(1, 2)],  # not all 1-D: the per-value path
    }
    written, read = codec.Body(), codec.Body()
    cols = codec.encode_columns(columns, written)
    assert codec.encode_columns(columns, read) == cols
    dst = bytearray(written.size + 7)
    written.write_into(memoryview(dst))
    raw = b"".join(bytes(memoryview(b).cast("B")) for b in read.buffers)
    assert bytes(dst[: written.size]) == raw and len(raw) == read.size
    runcheck.check_columns(cols, written.size)
    out = dict(zip(columns, codec.decode_reply(cols, {0: (np.frombuffer(dst, dtype=np.uint8), 0)})))
    for name in ("ids", "mask", "half", "strided"):
        assert [v.dtype for v in out[name]] == [v.dtype for v in columns[name]]
        assert all(torch.equal(a, b) for a, b in zip(out[name], columns[name]))
    assert all(torch.equal(a, b.detach()) for a, b in zip(out["logp"], grad))
    assert out["reward"] == [1.5, -2.0, 0.0] and out["uid"] == ["a", "bc", ""]
    assert [tuple(v.shape) for v in out["mixed"]] == [(0,), (2, 2), (1, 2)]
    assert [r.kind for r in cols[5].runs] == [pb.MSGPACK] and [len(c.runs) for c in cols[:5]] == [1] * 5


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool, torch.bfloat16])
def test_cat_into_joins_values_in_chunks_below_torchs_serial_size_and_values_past_it_alone(dtype, threads,
                                                                                          monkeypatch):
    """With several intra-op threads a column is concatenated in chunks of fewer than _SERIAL_CAT elements
    (torch copies those with one memcpy per value); every split of the lengths, across, at and past a chunk's
    end, gives torch.cat's bytes, and a chunk never starts or ends inside a value. With one thread every
    concatenation is serial: the column goes in one call."""
    big = codec.body._SERIAL_CAT
    real_cat = torch.cat
    chunks: list[list[int]] = []

    def spy(ts, *, out):
        chunks.append([t.numel() for t in ts])
        return real_cat(ts, out=out)

    monkeypatch.setattr(torch, "cat", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for lengths in ([0], [5], [big - 1, 1], [big], [1, big + 9, 3, 0, big // 2, big // 2], [1000] * 100):
        values = [(torch.arange(n) % 7).to(dtype) for n in lengths]
        out = torch.full((sum(lengths),), 1, dtype=dtype)
        chunks.clear()
        codec.cat_into(values, lengths, out)
        assert torch.equal(out, real_cat(values))
        assert [n for c in chunks for n in c] == lengths  # every value once, in order
        if threads == 1:
            assert len(chunks) == 1
        else:
            assert all(sum(c) < big or len(c) == 1 for c in chunks)
