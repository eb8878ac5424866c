"""Jagged columns: a jagged nested tensor (or a Jagged (values, offsets) pair) is one ragged run over its
values buffer, checked per column, and comes back as one jagged nested tensor, bit-exact."""

from __future__ import annotations

import warnings

import pytest
import torch

from dockd import codec, runcheck
from dockd._proto import dockd_pb2 as pb
from dockd.codec.decode import padded_of
from dockd.errors import DockTypeError, DockValueError

warnings.filterwarnings("ignore", message="The given buffer is not writable")


def rows_of(dtype: torch.dtype, lengths: list[int], trail: tuple[int, ...]) -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(lengths):
        if dtype == torch.bool:
            out.append(torch.arange(n * max(1, int(torch.tensor(trail).prod()))).view(n, *trail).remainder(2 + i) == 0)
        elif dtype.is_floating_point or dtype.is_complex:
            out.append((torch.randn(n, *trail) * 100).to(dtype))
        else:
            out.append(torch.arange(n * (int(torch.tensor(trail).prod()) if trail else 1)).view(n, *trail).to(dtype))
    return out


def encoded(column) -> tuple[pb.ColumnData, bytearray]:
    body = codec.Body()
    split = codec.jagged("c", column)
    assert split is not None
    (col,) = codec.encode_columns({"c": split}, body)
    runcheck.check_columns([col], body.size)
    return col, bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers)) or bytearray(1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("trail", [(), (2,), (3, 2)])
@pytest.mark.parametrize("dtype", sorted(codec.DTYPES, key=str))
def test_a_jagged_nested_tensor_is_one_run_and_comes_back_bit_exact_as_a_view(dtype, trail):
    dt = codec.DTYPES[dtype]
    lengths = [3, 0, 5, 1, 0]
    rows = rows_of(dt, lengths, trail)
    nt = torch.nested.nested_tensor_from_jagged(torch.cat(rows), torch.tensor([0, 3, 3, 8, 9, 9]))
    col, buf = encoded(nt)
    assert len(col.runs) == 1 and list(col.runs[0].shape) == [-1, *trail] and list(col.runs[0].lengths) == lengths
    runs = codec.Runs.of(col, {0: (buf, 0)})
    out = runs.jagged()
    assert out.layout == torch.jagged and out.offsets().tolist() == [0, 3, 3, 8, 9, 9]
    assert all(same_bits(a, b) for a, b in zip(out.unbind(), rows, strict=True))
    start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()  # a view of the received bytes, not a copy
    assert start <= out.values().data_ptr() < start + len(buf)
    padded, lens = runs.padded(pad_value=0)
    assert lens.tolist() == lengths and padded.shape == (5, 5, *trail)
    for row, r, n in zip(padded, rows, lengths):
        assert same_bits(row[:n], r) and not row[n:].contiguous().view(torch.uint8).any()


def test_a_jagged_pair_may_start_past_the_first_row_and_is_sliced_to_its_offsets():
    values = torch.arange(10, dtype=torch.int32)
    col, buf = encoded(codec.Jagged(values, torch.tensor([2, 4, 9])))
    out = codec.Runs.of(col, {0: (buf, 0)}).jagged()
    assert [t.tolist() for t in out.unbind()] == [[2, 3], [4, 5, 6, 7, 8]]
    assert col.runs[0].nbytes == 7 * 4  # rows outside the offsets are not sent


def test_jagged_runs_of_several_puts_are_joined_into_one_buffer():
    a, b = [torch.arange(n, dtype=torch.float32) for n in (2, 3)], [torch.arange(n, dtype=torch.float32) for n in (0, 4)]
    (ca, ba), (cb, bb) = encoded(torch.nested.as_nested_tensor(a, layout=torch.jagged)), \
        encoded(torch.nested.as_nested_tensor(b, layout=torch.jagged))
    runs = codec.Runs([(ca.runs[0], ba, 0), (cb.runs[0], bb, 0)])
    out = runs.jagged()
    assert out.offsets().tolist() == [0, 2, 5, 5, 9]
    assert all(torch.equal(x, y) for x, y in zip(out.unbind(), a + b))


@pytest.mark.parametrize("pair, error, match", [
    (codec.Jagged(torch.arange(4), torch.tensor([0, 3, 2])), DockValueError, "non-decreasing"),
    (codec.Jagged(torch.arange(4), torch.tensor([0, 5])), DockValueError, "within the 4 rows"),
    (codec.Jagged(torch.arange(4), torch.tensor([0.0, 4.0])), DockValueError, "integer"),
    (codec.Jagged(torch.arange(4), torch.tensor([0])), DockValueError, "n \\+ 1 >= 2"),
    (codec.Jagged([0, 1], torch.tensor([0, 2])), DockTypeError, "two tensors"),
    (codec.Jagged(torch.tensor(3), torch.tensor([0, 1])), DockTypeError, "at least one dimension"),
    (codec.Jagged(torch.empty(4, device="meta"), torch.tensor([0, 4])), DockValueError, "meta device"),
])
def test_a_bad_jagged_column_is_refused_naming_it(pair, error, match):
    with pytest.raises(error, match=match) as info:
        codec.jagged("resp", pair)
    assert "'resp'" in str(info.value)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_other_columns_are_not_jagged():
    assert codec.jagged("c", torch.zeros(3, 4)) is None
    assert codec.jagged("c", [torch.zeros(3), torch.zeros(2)]) is None
    strided_nested = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(2)])  # (the per-value path takes it)
    assert codec.jagged("c", strided_nested) is None


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.int64, torch.float8_e4m3fn])
def test_padded_of_is_bit_exact_for_every_kind_of_dtype(dtype):
    rows = rows_of(dtype, [2, 0, 4], (2,))
    padded, lens = padded_of(torch.cat(rows), [2, 0, 4], pad_value=1)
    assert lens.tolist() == [2, 0, 4] and padded.shape == (3, 4, 2) and padded.dtype == dtype
    for row, r in zip(padded, rows):
        assert same_bits(row[: len(r)], r)
        assert same_bits(row[len(r):], torch.ones(4 - len(r), 2).to(dtype))



@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_with_holes_or_ragged_elsewhere_is_not_one_run():
    values, offsets = torch.arange(10.0), torch.tensor([0, 4, 10])
    holes = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor([2, 3]))  # rows 0-1, 4-6
    assert codec.jagged("c", holes) is None  # (taken value by value: the holes are not sent)
    ragged_second = torch.nested.nested_tensor_from_jagged(torch.arange(12.0).view(6, 2), torch.tensor([0, 2, 6]))
    assert codec.jagged("c", ragged_second.transpose(1, 2)) is None  # ragged in dimension 2
    nt = torch.nested.nested_tensor_from_jagged(values, offsets)  # its fields, as its public accessors give them
    j = codec.jagged("c", nt)
    assert j is not None and j.values.data_ptr() == nt.values().data_ptr() and torch.equal(j.offsets, nt.offsets())


@pytest.mark.parametrize("fast", [True, False])
def test_jagged_of_builds_what_torchs_own_function_builds(monkeypatch, fast):
    from dockd.codec import decode

    if not fast:  # (torch's public function: where NestedTensor is not found or refuses the arguments)
        monkeypatch.setattr(decode, "_NESTED", [None])
    values = torch.arange(18, dtype=torch.bfloat16).view(9, 2)
    out = decode.jagged_of(values, [3, 0, 5, 1])
    ref = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3, 3, 8, 9]), min_seqlen=0, max_seqlen=5)
    assert out.values().data_ptr() == values.data_ptr()  # (a view: nothing copied)
    assert out.shape[0] == 4 and out.offsets().tolist() == [0, 3, 3, 8, 9]
    assert (out._min_seqlen, out._max_seqlen) == (0, 5) == (ref._min_seqlen, ref._max_seqlen)
    assert torch.equal(out.to_padded_tensor(-1.0), ref.to_padded_tensor(-1.0))
    assert all(torch.equal(a, b) for a, b in zip((out * 2).unbind(), (ref * 2).unbind(), strict=True))
