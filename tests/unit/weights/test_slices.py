"""TP slices of a version (dockd.weights.slices): the ranges a rank asks for give exactly its shard,
checked against torch's own chunking, for column/row parallel, fused and expert weights, in buckets
small enough to split tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dockd.errors import DockValueError
from dockd.resharding.layout import ParamSpec
from dockd.weights.buckets import pack_all
from dockd.weights.slices import assemble, plan, reference

H, F = 16, 24


def model() -> tuple[dict[str, torch.Tensor], dict[str, ParamSpec]]:
    g = torch.Generator().manual_seed(0)
    t = {
        "embed": torch.randn(64, H, generator=g).bfloat16(),   # vocab parallel
        "qkv": torch.randn(3 * H, H, generator=g),             # fused column parallel (q, k, v)
        "o": torch.randn(H, H, generator=g).bfloat16(),        # row parallel
        "up": torch.randn(2 * F, H, 2, generator=g),           # fused gate/up, a third dim
        "experts": torch.randn(4, F, H, generator=g),          # 4 experts, each split along its dim 0
        "norm": torch.randn(H, generator=g),                   # replicated
    }
    specs = {
        "embed": ParamSpec(name="embed", shape=(64, H), dtype=torch.bfloat16, tp_dim=0),
        "qkv": ParamSpec(name="qkv", shape=(3 * H, H), dtype=torch.float32, tp_dim=0, fused=(H, H, H)),
        "o": ParamSpec(name="o", shape=(H, H), dtype=torch.bfloat16, tp_dim=1),
        "up": ParamSpec(name="up", shape=(2 * F, H, 2), dtype=torch.float32, tp_dim=0, fused=(F, F)),
        "experts": ParamSpec(name="experts", shape=(F, H), dtype=torch.float32, tp_dim=0, experts=4),
    }
    return t, specs


def serve(buckets: list[torch.Tensor], ranges) -> torch.Tensor:
    """What a warehouse answers a read of `ranges` with: their bytes back to back."""
    out = []
    for r in ranges:
        src = buckets[r.bucket].numpy()
        for i in range(r.count):
            out.append(src[r.offset + i * r.stride : r.offset + i * r.stride + r.length])
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0, dtype=np.uint8))


@pytest.mark.parametrize("bucket_size", [1 << 20, 4096])  # (4096: the bigger tensors are split across buckets)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_gets_exactly_its_shard(bucket_size, tp):
    tensors, specs = model()
    buckets, pieces = pack_all(tensors.items(), bucket_size)
    total = 0
    for rank in range(tp):
        slices = plan(pieces, specs, tp, rank)
        assert [s.name for s in slices] == list(tensors)
        body = serve(buckets, [r for s in slices for r in s.ranges])
        at = 0
        for s in slices:
            got, at = assemble(s, body, at)
            want = reference(tensors[s.name], specs.get(s.name), tp, rank)
            assert got.shape == want.shape and torch.equal(got, want), (s.name, rank)
        assert at == len(body)
        total += len(body)
    split = sum(t.nbytes for k, t in tensors.items() if k in specs)
    assert total == split + tp * tensors["norm"].nbytes  # each byte of a split tensor read once over the ranks


def test_a_layout_by_function_and_bad_layouts():
    tensors, specs = model()
    buckets, pieces = pack_all(tensors.items(), 1 << 20)
    by_rule = plan(pieces, lambda name, shape: specs.get(name), 2, 1)
    assert by_rule == plan(pieces, specs, 2, 1)
    wrong = {"o": ParamSpec(name="o", shape=(H, 2 * H), dtype=torch.bfloat16, tp_dim=1)}
    with pytest.raises(DockValueError, match="published with shape"):
        plan(pieces, wrong, 2, 0)
    with pytest.raises(DockValueError, match="tp_rank"):
        plan(pieces, specs, 2, 2)
