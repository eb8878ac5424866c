"""Bucket plans (dockd.weights.buckets): packing named tensors into buckets and back, bit-exactly."""

from __future__ import annotations

import pytest
import torch

from dockd.errors import DockTypeError, DockValueError
from dockd.weights.buckets import ALIGN, Packer, Piece, Unpacker, pack_all, raw_bytes


def model_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(50, 16, generator=g).bfloat16()),
        ("norm", torch.randn(16, generator=g)),
        ("big", torch.randn(3000, generator=g)),          # 12,000 bytes: split across buckets of 4096
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
        ("mask", torch.rand(33, generator=g) > 0.5),
        ("ids", torch.arange(7, dtype=torch.int32)),
        ("strided", torch.randn(8, 6, generator=g).t()),  # not contiguous
    ]


def test_round_trip_bit_exact_in_any_order():
    named = model_tensors()
    buckets, pieces = pack_all(named, 4096)
    assert all(b.numel() <= 4096 for b in buckets)
    assert {p.bucket for p in pieces} == set(range(len(buckets)))
    assert all(p.offset % ALIGN == 0 for p in pieces)
    for order in (range(len(buckets)), reversed(range(len(buckets)))):
        un = Unpacker(pieces)
        out = {}
        for b in order:
            out.update(un.feed(b, buckets[b]))
        assert un.done
        assert list(out) != [] and set(out) == {n for n, _ in named}
        for name, t in named:
            got = out[name]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(raw_bytes(got), raw_bytes(t)), name


def test_big_tensor_is_split_and_small_ones_are_not():
    named = model_tensors()
    _, pieces = pack_all(named, 4096)
    big = [p for p in pieces if p.name == "big"]
    assert len(big) == 3 and [p.start for p in big] == [0, 4096, 8192] and all(p.total == 12000 for p in big)
    assert all(len([p for p in pieces if p.name == n]) == 1 for n, _ in named if n != "big")


def test_piece_index_round_trips_through_lists():
    _, pieces = pack_all(model_tensors(), 4096)
    assert [Piece.unpack(p.pack()) for p in pieces] == pieces
    with pytest.raises(DockValueError, match="malformed"):
        Piece.unpack(["x", "float32"])


def test_packer_refuses_bad_input():
    with pytest.raises(DockValueError, match="bucket_size"):
        Packer(100)
    p = Packer(4096)
    list(p.add("a", torch.ones(3)))
    with pytest.raises(DockValueError, match="given twice"):
        list(p.add("a", torch.ones(3)))
    with pytest.raises(DockTypeError, match="not a torch.Tensor"):
        list(p.add("b", [1, 2]))


def test_empty_model_is_one_empty_bucket():
    buckets, pieces = pack_all([], 4096)
    assert len(buckets) == 1 and buckets[0].numel() == 0 and pieces == []
    buckets, pieces = pack_all([("z", torch.empty(0))], 4096)
    assert len(buckets) == 1 and len(pieces) == 1
    out = dict(Unpacker(pieces).feed(0, buckets[0]))
    assert out["z"].shape == (0,)


def test_unpacker_checks_buckets():
    buckets, pieces = pack_all(model_tensors(), 4096)
    un = Unpacker(pieces)
    with pytest.raises(DockValueError, match="not in this version"):
        list(un.feed(99, buckets[0]))
    with pytest.raises(DockValueError, match="holds"):
        list(un.feed(0, buckets[0][:10]))
