"""Delta versions (dockd.weights.delta): sparse where smaller, dense otherwise, rebuilt bit-exactly."""

from __future__ import annotations

import pytest
import torch

from dockd.errors import DockValueError
from dockd.weights import delta
from dockd.weights.buckets import Unpacker, pack_all, raw_bytes


def step(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = out.view(-1)
    pos = torch.randperm(flat.numel(), generator=g)[: int(frac * flat.numel())]
    flat[pos] = torch.randn(len(pos), generator=g).to(t.dtype)
    return out


def test_kinds_and_sizes():
    base = torch.randn(1000).bfloat16()
    kind, parts = delta.encode("w", step(base, 0.02, 1), base)
    assert kind == delta.SPARSE and [n for n, _ in parts] == ["w" + delta.IDX, "w" + delta.VAL]
    assert sum(p.nbytes for _, p in parts) <= 20 * (4 + 2)  # the changed values and their index
    assert delta.encode("w", base.clone(), base) == (delta.SAME, [])
    assert delta.encode("w", step(base, 0.9, 2), base)[0] == delta.DENSE  # too many changes
    assert delta.encode("w", base, None)[0] == delta.DENSE  # new
    assert delta.encode("w", base.float(), base)[0] == delta.DENSE  # another dtype


def test_bits_not_values_are_compared():
    base = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])
    assert delta.changed(new, base).tolist() == [0]
    odd = torch.zeros(4, dtype=torch.complex128)  # 16-byte elements: compared as rows of bytes
    new = odd.clone()
    new[2] = 1j
    assert delta.changed(new, odd).tolist() == [2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_rebuild_bit_exact_through_buckets(dtype):
    g = torch.Generator().manual_seed(0)
    base = {f"t{i}": (torch.randn(300 + i, generator=g) * 3).to(dtype) for i in range(6)}
    new = {k: step(v, f, i) for i, ((k, v), f) in enumerate(zip(base.items(), [0, 0.01, 0.5, 0, 0.02, 1.0]))}
    new["fresh"] = torch.arange(5)
    kinds, named = {}, []
    for k, v in new.items():
        kinds[k], parts = delta.encode(k, v, base.get(k))
        named += parts
    buckets, pieces = pack_all(named, 4096)
    un = Unpacker(pieces, len(buckets))
    rb = delta.Rebuilder(list(new), kinds, base)
    out = {}
    for b in reversed(range(len(buckets))):  # any arrival order; out comes in the version's order
        for part, t in un.feed(b, buckets[b]):
            out.update(rb.feed(part, t))
    out.update(rb.flush())
    assert rb.done and list(out) == list(new)
    for k, v in new.items():
        assert out[k].dtype == v.dtype and torch.equal(raw_bytes(out[k]), raw_bytes(v)), k


def test_decode_refuses_what_it_cannot_rebuild():
    with pytest.raises(DockValueError, match="base version"):
        delta.decode("w", delta.SPARSE, None, {})
    with pytest.raises(DockValueError, match="unknown delta kind"):
        delta.decode("w", "xor", torch.zeros(1), {})
