"""Cross-node device reads on NCCL: a reader that reaches the warehouse over TCP (as one on another
node does) gets device-tier data on its GPU over a device link made with dockd's NCCL bindings.

The reader uses a second GPU when there is one; with one GPU both ends of the link share it
(NCCL_MULTI_RANK_GPU_ENABLE=1, which NCCL 2.2x+ asks for before it puts two ranks on one GPU).
On an Ascend machine the same path runs on HCCL (npu devices).
"""

from __future__ import annotations

import pytest
import torch

import dockd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA torch"),
    pytest.mark.timeout(300),
]


def test_remote_device_get_over_an_nccl_link(monkeypatch):
    x = torch.randn(256, 1024, device="cuda:0").bfloat16()
    rag = [torch.arange(n, dtype=torch.int64, device="cuda:0") for n in (1, 5, 1000, 3)] * 16
    monkeypatch.setenv("DOCKD_DEVICE_LINK_TIMEOUT", "120")
    ndev = torch.cuda.device_count()
    if ndev < 2:
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # the warehouse inherits it
    dev = torch.device("cuda", min(1, ndev - 1))
    with dockd.start_local(1, extra_args=["--device-capacity", "64MiB"]) as c, dockd.connect(c.address) as w:
        w.put({"x": x, "r": rag}, partition="p", device="keep")
        w.put({"x": x + 1, "r": rag}, partition="q", device="keep")
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
        with dockd.connect(c.address) as r:
            for part, want in (("p", x), ("q", x + 1)):  # the first opens the link, the second reuses it
                b = r.get("gpu", ["x", "r"], 256 if part == "p" else 64, partition=part, device=dev, timeout=120)
                got = b.stacked("x")
                assert got.device == dev
                assert torch.equal(got.cpu(), want[: len(got)].cpu())
                assert all(g.device == dev and torch.equal(g.cpu(), e.cpu())
                           for g, e in zip(b["r"], rag))
            assert len(r._links._links) == 1 and not r._links._off, r._links._off
